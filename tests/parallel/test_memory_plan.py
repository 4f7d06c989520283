"""The memory plan (``mla_jax/parallel/memory_plan.py``, ``generate.py --plan-only``).

- A small MoE model's plan on 8 devices equals the bytes each of 8 fake CPU devices holds
  when its parameters (bf16, and FP8 with block scales) and caches (bf16 and FP8) are
  materialized and placed as the runtime places them (``memory_plan_devices.py``, a fresh
  process).
- DeepSeek-V3's plan, from its published config.json (``tests/data/deepseek-v3``), counts
  the parameters, FP8 bytes and cache bytes that its config's formulas give here (float64),
  671 B parameters as published.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TESTS, run_on_fake_devices

from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization
from mla_jax.checkpoint.hf_config import config_from_dict, load_config
from mla_jax.parallel import memory_plan
from mla_jax.parallel.memory_plan import Layout, Tensor

V3_DIR = os.path.join(TESTS, "data", "deepseek-v3")
DEVICES = 8
# 3 layers (a dense one, then two MoE layers of 16 experts), every split width a multiple of
# 8 devices x 4-wide blocks; a rope dim of 6 gives kv_a_proj_with_mqa's part of the fused
# q_a / kv_a weight (never split) a partial edge block.
SMALL = {
    "model_type": "deepseek_v3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "q_lora_rank": 28,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 10,  # heads x (nope + rope): 32 blocks, split 8 ways
    "qk_rope_head_dim": 6,
    "v_head_dim": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]},
}
BLOCK_SIZE = 4
TOKENS_PER_RANK = 37  # 10 blocks of 4, the last one partly used
LAYOUTS = [[1, 8, False], [2, 4, False], [4, 2, False], [8, 1, False], [2, 4, True], [8, 1, True]]


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    """``memory_plan_devices.py``'s per-device bytes of each layout (8 fake devices)."""
    root = tmp_path_factory.mktemp("memory_plan")
    job = dict(
        config=SMALL, layouts=LAYOUTS, block_size=BLOCK_SIZE, tokens_per_rank=TOKENS_PER_RANK
    )
    (root / "job.json").write_text(json.dumps(job))
    done = run_on_fake_devices(
        "parallel/memory_plan_devices.py", root / "job.json", root / "out", devices=DEVICES
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((root / "out").read_text())
    assert result["devices"] == DEVICES
    return result["layouts"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: Layout(*layout).name)
def test_plan_equals_materialized_bytes(materialized, layout):
    cfg = config_from_dict(SMALL)
    plan_layout = Layout(*layout)
    counted = materialized["/".join(str(int(v)) for v in layout)]
    weights = {
        "bfloat16": memory_plan.parameter_tensors(cfg, jnp.bfloat16),
        "fp8": memory_plan.parameter_tensors(cfg, jnp.bfloat16, cfg.quantization),
    }
    for kind, tensors in weights.items():
        planned = memory_plan.weight_bytes(tensors, plan_layout, cfg.quantization)
        assert counted[kind] == [planned] * DEVICES, kind
    assert counted["fp8"][0] < counted["bfloat16"][0]
    for kv in ("auto", "fp8"):
        planned = memory_plan.cache_bytes(
            cfg,
            plan_layout,
            TOKENS_PER_RANK,
            block_size=BLOCK_SIZE,
            kv_cache_dtype=kv,
            model_dtype=jnp.bfloat16,
        )
        assert counted["cache"][kv] == [planned] * DEVICES, kv
    data_parallel, tensor_parallel, all_ranks = layout
    split = data_parallel * tensor_parallel if all_ranks else tensor_parallel
    assert counted["experts_per_device"] == [SMALL["n_routed_experts"] // split] * DEVICES


def _v3_formulas(d: dict) -> dict[str, np.float64]:
    """DeepSeek-V3's parameters and FP8 checkpoint bytes from its config.json, in float64:
    ``parameters``, and on one device ``fp8`` (as ``--fp8-weights keep`` holds them: FP8
    projections + float32 128 x 128 block scales + the rest in bf16, ``kv_b_proj``
    included, the router's bias in float32) and ``bf16``."""
    f = np.float64
    h, n, vocab = f(d["hidden_size"]), f(d["num_attention_heads"]), f(d["vocab_size"])
    lq, lkv = f(d["q_lora_rank"]), f(d["kv_lora_rank"])
    nope, rope, v = f(d["qk_nope_head_dim"]), f(d["qk_rope_head_dim"]), f(d["v_head_dim"])
    layers, dense = d["num_hidden_layers"], d["first_k_dense_replace"]
    experts, inter = f(d["n_routed_experts"]), f(d["moe_intermediate_size"])
    shared = inter * d["n_shared_experts"]
    bo, bi = d["quantization_config"]["weight_block_size"]

    def scales(out, inp):  # one float32 per block of an HF [out, in] weight
        return f(math.ceil(out / bo) * math.ceil(inp / bi))

    # [out, in] of each projection: attention, a dense MLP, an expert (or the shared ones).
    # kv_b_proj [N (P + V), Lkv] stays in bf16 (dequantized at load: MLAAttention).
    attention = [(lq, h), (n * (nope + rope), lq), (lkv + rope, h), (h, n * v)]
    kv_b_proj = n * (nope + v) * lkv * layers
    mlp = [(f(d["intermediate_size"]), h)] * 2 + [(h, f(d["intermediate_size"]))]
    expert = [(inter, h)] * 2 + [(h, inter)]
    shared_mlp = [(shared, h)] * 2 + [(h, shared)]
    moe_layers, dense_layers = layers - dense, dense
    fp8_matrices = (
        [(m, layers) for m in attention]
        + [(m, dense_layers) for m in mlp]
        + [(m, moe_layers) for m in shared_mlp]
        + [(m, moe_layers * experts) for m in expert]
    )
    fp8_values = sum(out * inp * count for (out, inp), count in fp8_matrices)
    fp8_scales = sum(scales(out, inp) * count for (out, inp), count in fp8_matrices)
    norms = layers * (lq + lkv + 2 * h) + h
    # embedding, lm_head, router, kv_b_proj
    bf16_rest = 2 * vocab * h + norms + moe_layers * h * experts + kv_b_proj
    bias = moe_layers * experts  # e_score_correction_bias, float32
    parameters = fp8_values + bf16_rest + bias
    return {
        "parameters": parameters,
        "fp8": fp8_values + 4 * fp8_scales + 2 * bf16_rest + 4 * bias,
        "bf16": 2 * (fp8_values + bf16_rest) + 4 * bias,
    }


def test_v3_config_is_the_published_one():
    cfg = load_config(V3_DIR)
    assert (cfg.num_layers, cfg.first_k_dense_replace, cfg.moe.n_routed_experts) == (61, 3, 256)
    assert cfg.quantization == FP8BlockQuantization((128, 128))
    assert cfg.layer_runs() == [(0, 3, False), (3, 58, True)]


@pytest.mark.parametrize(
    "layout, moe_runs",
    [
        (None, [40, 18]),  # one device: q_b_proj's 58 layers fill 2.19 GB
        (Layout(1, 8), [58]),
        (Layout(8, 1, True), [40, 18]),  # attention whole on each device, as on one
        (Layout(4, 2, True), [29, 29]),  # o_proj's 58 layers fill 3.4 GB of each device
        (Layout(2, 4, True), [58]),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_v3_fp8_stacks_stay_out_of_the_wrapping_sizes(layout, moe_runs):
    """Kept FP8, DeepSeek-V3's MoE layers run as stacks (``stacked_runs``) none of whose
    1-byte weights fills (2 GiB, 4 GiB] on a device, where the Pallas Triton kernels would
    copy a layer out each call: its placement's shards of every such stack of the whole
    model, checked, and the run split only where a whole one would land there."""
    from flax import nnx
    from jax.sharding import NamedSharding

    from mla_jax.kernels import fp8
    from mla_jax.model.deepseek import DeepseekModel, stacked_runs

    cfg = load_config(V3_DIR)
    blocks = cfg.quantization.weight_block_size
    placement = None
    if layout is not None:

        def placement(path, ndim):
            return NamedSharding(layout.mesh(), layout.partition_spec(list(map(str, path)), ndim))

    def wrapping(runs) -> list[str]:
        model = nnx.eval_shape(
            lambda: DeepseekModel(
                cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=blocks, runs=runs
            )
        )
        found = []
        for path, var in nnx.to_flat_state(nnx.state(model)):
            shape = var.shape
            if placement is not None:
                shape = placement(path, len(shape)).shard_shape(shape)
            if var.dtype.itemsize == 1 and fp8.wraps_triton_bytes(math.prod(shape)):
                found.append("/".join(map(str, path)))
        return found

    runs = stacked_runs(cfg, blocks, placement)
    assert runs[0] == (0, 3, False) and [count for _, count, _ in runs[1:]] == moe_runs
    assert wrapping(runs) == []
    assert (wrapping(cfg.layer_runs()) != []) == (moe_runs != [58])  # unsplit, would they?


@pytest.mark.parametrize(
    "runs, message",
    [
        ([(0, 3, False), (3, 57, True)], "cover 60 of the model's 61 layers"),
        (
            [(0, 4, False), (4, 57, True)],
            "(0, 4, False) is not the next 4 layers from 0, all dense",
        ),
        ([(0, 3, False), (4, 57, True)], "(4, 57, True) is not the next 57 layers from 3, all MoE"),
    ],
)
def test_bad_runs_are_refused(runs, message):
    from flax import nnx

    from mla_jax.model.deepseek import DeepseekModel

    cfg = load_config(V3_DIR)
    with pytest.raises(ValueError, match=re.escape(message)):
        nnx.eval_shape(lambda: DeepseekModel(cfg, rngs=nnx.Rngs(0), runs=runs))


def test_v3_parameters_and_weight_bytes_match_the_config_formulas():
    with open(os.path.join(V3_DIR, "config.json")) as f:
        want = _v3_formulas(json.load(f))
    cfg = load_config(V3_DIR)
    count = memory_plan.parameter_count(cfg)
    assert count == want["parameters"]
    assert abs(count - 671e9) < 0.5e9  # "671B total parameters" (without the MTP module)
    one_device = Layout(1, 1)
    bf16 = memory_plan.parameter_tensors(cfg, jnp.bfloat16)
    fp8 = memory_plan.parameter_tensors(cfg, jnp.bfloat16, cfg.quantization)
    assert memory_plan.weight_bytes(bf16, one_device) == want["bf16"]
    assert memory_plan.weight_bytes(fp8, one_device, cfg.quantization) == want["fp8"]


def test_v3_plan_on_8_gpus():
    cfg = load_config(V3_DIR)
    rows = {(row.layout.name, row.weights): row for row in memory_plan.plan(cfg, 8)}
    # Latent rows of 512 + 64 values: 2 bytes each, or FP8 512 + 4 scales x 4 + 64 x 2.
    for row in rows.values():
        assert row.token_bytes == {"auto": 61 * 576 * 2, "fp8": 61 * (512 + 4 * 4 + 64 * 2)}
        assert row.token_copies == row.layout.tensor_parallel
    tp8 = rows["tp8", "fp8"]
    h200 = math.floor(143771 * 2**20 * 0.9)  # 10 % headroom
    for kv, token in tp8.token_bytes.items():
        assert tp8.requests["8 x H200", kv] == (h200 - tp8.weight_bytes) // (4096 * token)
    # What the README states: FP8 weights fit 8 x H200 (TP 8 or experts over all ranks),
    # bf16 weights fit no layout, and nothing fits 8 x H100.
    fit_h200 = {key for key, row in rows.items() if row.requests["8 x H200", "auto"]}
    assert fit_h200 == {(name, "fp8") for name in ("tp8", "dp2xtp4+ep", "dp4xtp2+ep", "dp8+ep")}
    assert all(row.requests["8 x H100", "auto"] is None for row in rows.values())
    # The runs the model stacks under each layout: split only where kept FP8 needs it
    # (test_v3_fp8_stacks_stay_out_of_the_wrapping_sizes checks why).
    split = {("dp8", "fp8"): (3, 40, 18), ("dp8+ep", "fp8"): (3, 40, 18)}
    split |= {("dp4xtp2", "fp8"): (3, 29, 29), ("dp4xtp2+ep", "fp8"): (3, 29, 29)}
    assert {key: row.runs for key, row in rows.items() if row.runs != (3, 58)} == split
    # The README's table is this plan as generate.py --plan-only prints it.
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = memory_plan.format_plan(list(rows.values()), request_tokens=4096)
    assert "\n" + table + "\n" in readme


def test_fp8_weight_split_off_block_edges_is_refused():
    quantization = FP8BlockQuantization((24, 16))  # 24 outputs x 16 inputs a block
    path = ("layers", "0", "self_attn", "q_b_proj", "weight")
    weight = Tensor(path, (1, 128, 32), np.dtype(jnp.float8_e4m3fn), path)  # [L, out, in]
    scale_path = (*path[:-1], "weight_scale_inv")
    # 128 outputs in 6 blocks of 24: two devices take 3 blocks' scales but 64 outputs each.
    scale = Tensor(scale_path, memory_plan.fp8_scale_shape(path, weight.shape, quantization),
                   np.dtype(np.float32), path)  # fmt: skip
    assert scale.shape == (1, 6, 2)
    with pytest.raises(ValueError, match=r"q_b_proj/weight .* not whole 24 x 16 blocks"):
        memory_plan.weight_bytes([weight, scale], Layout(1, 2), quantization)
    # 4 devices: the 6 scale rows do not split at all.
    with pytest.raises(ValueError, match=r"q_b_proj/weight_scale_inv \[1, 6, 2\] does not split"):
        memory_plan.weight_bytes([weight, scale], Layout(1, 4), quantization)


@pytest.mark.parametrize("field", ["data_parallel", "tensor_parallel"])
def test_layout_refuses_a_bad_size(field):
    sizes = {"data_parallel": 2, "tensor_parallel": 4, field: 0}
    with pytest.raises(ValueError, match=f"^{field} must be an integer >= 1, got 0$"):
        Layout(**sizes)
