"""Logits and greedy tokens against Hugging Face transformers' DeepseekV2 / DeepseekV3 on
small random configs, float32 on both sides (relative logits error 1e-5: float32 rounding
through a few layers, observed ~1e-6). The dims are odd on purpose (8 and 4 heads, rope 16
and 8, nope 24, v 16): the Pallas kernels must run them on padded tiles, compiled on a GPU.

The FP8 cache (``kv_cache_dtype="fp8"``) against the float32 cache of the same float32
model, teacher-forced so that both see the same tokens, on the dense checkpoints: every
step's logits within FP8_LOGITS_TOL = 0.3 relative L2. Measured (seeds 1-8 x both dense
checkpoints, the engine's scheduler and packed steps over the stacked cache, reference
kernels, CPU, 2026-11-23, a prefill's new tokens attending their stored values): at most
0.275 (seed 8 on v2-lite-legacy, 0.273 before they did; the other 15 runs at most 0.136),
0.104 on average over the runs' worst steps (0.097 before), where a bf16 cache gives at most
0.015. That is e4m3's 3 mantissa bits against bf16's 7 (relative rounding up to 2^-4
instead of 2^-8 per kv_c value), amplified alike by these random networks; the tolerance is
1.1x the largest error measured, 2.2x the next. A lost scale (a gather or a kernel that
forgot it) multiplies a latent by ~2^7 and fails it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import generate_script, rel_err
from teacher_forcing import teacher_forced_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_checkpoints import CHECKPOINTS, greedy_tokens, write_checkpoint  # noqa: E402

from mla_jax import kernels  # noqa: E402
from mla_jax.cache.latent_cache import init_cache  # noqa: E402
from mla_jax.cache.metadata import build_metadata  # noqa: E402
from mla_jax.checkpoint.loader import load_model  # noqa: E402
from mla_jax.engine.engine import EngineConfig  # noqa: E402


@pytest.fixture(params=list(CHECKPOINTS))
def checkpoint(request, tmp_path, rng):
    return write_checkpoint(request.param, tmp_path, int(rng.integers(2**31))), tmp_path


def _last_token_logits(path, prompts: list[list[int]]) -> np.ndarray:
    """``[len(prompts), vocab]``: each prompt's last-token logits from the checkpoint at
    ``path`` loaded here, one step of all the prompts."""
    cfg, model = load_model(path)
    bs, width = 4, 5  # prompts of up to 20 tokens
    num_blocks = len(prompts) * width
    md = build_metadata(
        np.zeros(len(prompts), np.int32),
        np.array([len(p) for p in prompts]),
        np.arange(num_blocks).reshape(len(prompts), width),
        block_size=bs,
        num_blocks=num_blocks,
        workspace_size=64,
    )
    ids = np.zeros(md.positions.shape[0], np.int32)
    ids[md.token_rows()] = np.concatenate(prompts)
    cache = init_cache(cfg.num_layers, num_blocks, bs, cfg.mla.cache_width, jnp.float32)
    logits, _ = model(jnp.asarray(ids), cache, md, impl="reference")
    return np.asarray(logits)[md.request_rows()]


def test_last_token_logits_match(checkpoint, rng):
    hf, path = checkpoint
    prompts = [rng.integers(0, 96, n).tolist() for n in (1, 6, 17)]
    for prompt, got in zip(prompts, _last_token_logits(path, prompts), strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("name", ["v3-moe", "v2-moe"])
def test_fused_experts_load_as_the_per_expert_ones(tmp_path, rng, name):
    """transformers 5 holds routed experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]``
    (gate rows first) and ``mlp.experts.down_proj [E, H, I]``; a checkpoint of its state
    dict as held in memory loads to the model of ``save_pretrained``'s per-expert one: the
    same logits, transformers' logits."""
    from safetensors.torch import save_file

    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    hf = write_checkpoint(name, per_expert, int(rng.integers(2**31)))
    state = {key: value.contiguous() for key, value in hf.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 24, 64)
    assert state["model.layers.2.mlp.experts.down_proj"].shape == (8, 64, 24)
    assert not any(".experts.0." in key for key in state)
    fused.mkdir()
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 13)]
    got = _last_token_logits(fused, prompts)
    np.testing.assert_array_equal(got, _last_token_logits(per_expert, prompts))
    for prompt, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        assert rel_err(logits, want) < 1e-5


@pytest.mark.parametrize("budget,impl", [(8, "reference"), (64, "reference"), (8, "pallas")])
def test_greedy_tokens_match(checkpoint, rng, budget, impl, request):
    """``generate.py --dtype float32`` (chunked prefill when the budget is below the prompt)
    vs transformers' greedy generate; on a GPU the Pallas kernels run compiled."""
    hf, path = checkpoint
    if "moe" in request.node.callspec.params["checkpoint"] and budget == 64:
        pytest.skip("MoE checkpoints: chunked prefill (budget 8) on both kernel sets is enough")
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 21)]
    # No persistent compilation cache: it is process-wide, and other tests count compilations.
    argv = ["--model", str(path), "--dtype", "float32", "--max-new-tokens", "6"]
    argv += ["--no-compilation-cache"]
    argv += ["--block-size", "4", "--workspace-size", "8", "--impl", impl]
    argv += ["--max-num-batched-tokens", str(budget)]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    result = generate_script().main(argv)
    for prompt, output in zip(prompts, result["outputs"], strict=True):
        assert output["generated_ids"] == greedy_tokens(hf, prompt, 6)


@pytest.fixture
def fp8_checkpoint(tmp_path, rng):
    """``fp8_checkpoint.write_fp8_checkpoint`` with blocks of 16 x 8 (edge blocks partial,
    blocks narrower than a kernel's K step): its transformers model, path and fp8 names."""
    from fp8_checkpoint import write_fp8_checkpoint

    from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization

    blocks = FP8BlockQuantization((16, 8))
    hf, names = write_fp8_checkpoint(tmp_path, int(rng.integers(2**31)), blocks)
    return hf, tmp_path, names


@pytest.mark.parametrize("fp8_weights", ["dequantize", "keep"])
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(
    fp8_checkpoint, rng, fp8_weights
):
    """A V3 MoE checkpoint with its projection and expert matrices in float8_e4m3fn with
    block scales, loaded dequantized or kept FP8 (dequantized by the reference matmuls):
    logits equal transformers' run on the dequantized weights."""
    hf, path, names = fp8_checkpoint
    assert len(names) > 10 and any(".experts.3.up_proj" in name for name in names)
    cfg, model = load_model(path, fp8_weights=fp8_weights)
    attention = model.layers[0].self_attn
    kept = fp8_weights == "keep"
    if kept:
        assert attention.fused_qkv_a_proj.weight.dtype == jnp.float8_e4m3fn
    else:
        assert attention.fused_qkv_a_proj.kernel.dtype == jnp.float32
    for part in (attention.W_UK, attention.W_UV):  # kv_b_proj, dequantized at load either way
        assert part.dtype == jnp.float32
    assert (model.layers[1].mlp.experts.gate_up_proj.dtype == jnp.float8_e4m3fn) == kept
    prompt = rng.integers(0, 96, 9).tolist()
    logits, md = _prefill(cfg, model, prompt, "reference")
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    assert rel_err(np.asarray(logits)[md.request_rows()][0], want) < 1e-5


def _prefill(cfg, model, prompt: list[int], impl):
    """The logits and metadata of ``model`` prefilling ``prompt`` (up to 12 tokens) into an
    empty float32 cache of pages of 4."""
    md = build_metadata(
        np.zeros(1, np.int32),
        np.array([len(prompt)]),
        np.arange(3)[None],
        block_size=4,
        num_blocks=3,
        workspace_size=64,
    )
    ids = np.zeros(md.positions.shape[0], np.int32)
    ids[md.token_rows()] = prompt
    cache = init_cache(cfg.num_layers, 3, 4, cfg.mla.cache_width, jnp.float32)
    logits, _ = model(jnp.asarray(ids), cache, md, impl=impl)
    return logits, md


def test_kept_fp8_weights_reach_the_matmul_whole(fp8_checkpoint, rng):
    """The scans over the runs of layers pass the FP8 projections' stacked weights whole:
    every ``fp8_matmul`` call gets a run's ``[L, N, K]`` stack and its layer's index (a
    layer sliced out would be copied before the GPU kernel could read it, every step), and
    its projection's ``tensor_split`` (``test_linear_splits_match_the_rules`` checks each
    against the placement rules)."""
    _, path, _ = fp8_checkpoint
    cfg, model = load_model(path, fp8_weights="keep")
    calls, splits = [], []

    def fp8_matmul(x, weight, scale_inv, *, blocks, layer=None, tensor_split=None):
        calls.append((weight.shape[0], layer is not None))
        splits.append(tensor_split)
        return kernels.REFERENCE.fp8_matmul(x, weight, scale_inv, blocks=blocks, layer=layer)

    _prefill(
        cfg,
        model,
        rng.integers(0, 96, 9).tolist(),
        kernels.REFERENCE._replace(fp8_matmul=fp8_matmul),
    )
    runs = [count for _, count, _ in model.runs]
    assert max(runs) > 1 and {layers for layers, _ in calls} == set(runs)
    assert all(with_layer for _, with_layer in calls)
    assert set(splits) == {None, "columns", "rows"}


def test_kept_fp8_runs_split_off_the_wrapping_sizes(fp8_checkpoint, rng, monkeypatch, caplog):
    """With the sizes where Triton's offsets wrap moved to this checkpoint's scale (two MoE
    layers' stack of its largest FP8 weight lands there, one layer's does not), its run of
    two MoE layers loads as two runs of one (``stacked_runs``, said in the log), every HF
    layer in its place: greedy tokens through the engine (windows of 4 decode steps, the
    split runs' cache layers) equal transformers' on the dequantized weights, and
    ``save_checkpoint`` writes the same FP8 tensors back."""
    from flax import nnx

    from mla_jax.checkpoint.fp8_weights import dequantize, read_safetensors, scale_name
    from mla_jax.checkpoint.loader import save_checkpoint
    from mla_jax.kernels import fp8
    from mla_jax.model.deepseek import stacked_layers

    hf, path, names = fp8_checkpoint
    cfg, _ = load_model(path, fp8_weights="keep")
    assert cfg.layer_runs() == [(0, 1, False), (1, 2, True)]
    layer = nnx.eval_shape(
        lambda: stacked_layers(
            cfg, 1, moe=True, param_dtype=jnp.float32, rngs=nnx.Rngs(0), fp8_blocks=(16, 8)
        )
    )
    largest = max(v.size for v in jax.tree.leaves(nnx.state(layer)) if v.dtype.itemsize == 1)
    monkeypatch.setattr(fp8, "TRITON_WRAPPING_BYTES", (largest, 2 * largest))
    _, model = load_model(path, fp8_weights="keep")
    assert model.runs == ((0, 1, False), (1, 1, True), (2, 1, True))
    assert "layers 1-2 (MoE) stacked as runs of 1, 1 layers" in caplog.text
    save_checkpoint(model, path / "saved")
    kept = [name for name in names if "kv_b_proj" not in name]  # (dequantized at load)
    assert any(".layers.2.mlp.experts." in name for name in kept)
    for name in kept:
        np.testing.assert_array_equal(
            read_safetensors(path / "saved" / "model.safetensors", name).view(np.uint8),
            read_safetensors(path / "model.safetensors", name).view(np.uint8),
            err_msg=name,
        )
    # kv_b_proj, loaded as its per-head parts W_UK and W_UV, is put back together whole.
    kv_b = [name for name in names if name.endswith("kv_b_proj.weight")]
    assert len(kv_b) == cfg.num_layers
    for name in kv_b:
        original = read_safetensors(path / "model.safetensors", name)
        scale = read_safetensors(path / "model.safetensors", scale_name(name))
        np.testing.assert_array_equal(
            read_safetensors(path / "saved" / "model.safetensors", name),
            dequantize(original, scale, cfg.quantization),
            err_msg=name,
        )
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 21)]
    argv = ["--model", str(path), "--dtype", "float32", "--max-new-tokens", "6"]
    argv += ["--no-compilation-cache", "--fp8-weights", "keep", "--decode-window", "4"]
    argv += ["--block-size", "4", "--workspace-size", "8", "--impl", "reference"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    result = generate_script().main(argv)
    for prompt, output in zip(prompts, result["outputs"], strict=True):
        assert output["generated_ids"] == greedy_tokens(hf, prompt, 6)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_kept_fp8_weights_greedy_tokens_match(fp8_checkpoint, rng, impl):
    """``generate.py --dtype float32 --fp8-weights keep`` (chunked prefill, then decodes)
    vs transformers' greedy generate on the dequantized weights; ``pallas``: the FP8 matmul
    and grouped matmul kernels dequantize tile by tile (interpreted on a CPU)."""
    hf, path, _ = fp8_checkpoint
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 21)]
    argv = ["--model", str(path), "--dtype", "float32", "--max-new-tokens", "6"]
    argv += ["--no-compilation-cache", "--fp8-weights", "keep"]
    argv += ["--block-size", "4", "--workspace-size", "8", "--impl", impl]
    argv += ["--max-num-batched-tokens", "8"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    result = generate_script().main(argv)
    for prompt, output in zip(prompts, result["outputs"], strict=True):
        assert output["generated_ids"] == greedy_tokens(hf, prompt, 6)


FP8_LOGITS_TOL = 0.3


# Dense checkpoints only: in the MoE ones a rounding of the cache can flip a token's expert
# choice, a jump in the logits that is the router's and not the cache's (a bf16 cache alone
# moved the v2-moe logits by 0.25), and the cache path is the same.
@pytest.mark.parametrize("checkpoint", ["v3", "v2-lite-legacy"], indirect=True)
def test_fp8_cache_logits_track_float32(checkpoint, rng):
    """Chunked prefill (budget 8: the long prompt's later chunks gather FP8 context) and
    decodes over the FP8 cache vs the float32 cache, step by step; the kernels compiled on
    a GPU, the references elsewhere (test_fp8_cache.py runs the Pallas kernels
    interpreted)."""
    _, path = checkpoint
    _, model = load_model(path)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 21)]
    forced = [rng.integers(0, 96, 8).tolist() for _ in prompts]
    kw = dict(block_size=4, num_blocks=16, max_num_batched_tokens=8, workspace_size=8)
    runs = {
        dtype: teacher_forced_logits(
            model, EngineConfig(kv_cache_dtype=dtype, **kw), prompts, forced
        )[0]
        for dtype in ("float32", "fp8")
    }
    for want, got in zip(runs["float32"], runs["fp8"], strict=True):
        errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
        assert max(errors) < FP8_LOGITS_TOL, errors
