"""The MoE layer against transformers 5.23's DeepseekV2Moe / DeepseekV3MoE blocks, float32.

Tiny random configs (16 experts in 4 groups, 2 groups kept, top 3, 2 shared experts,
``routed_scaling_factor`` 2.5, a random ``e_score_correction_bias`` for v3), the weights copied
from the transformers module through ``hf_expert_slice``; both grouped-matmul paths (the Pallas
kernel in interpret mode and the ragged_dot reference). Tolerance: relative error 5e-7
(float32 rounding of two matmuls and a weighted sum; measured <= 2.1e-7 on both paths over
seeds 0-2 of every case). The routing details must matter: the test checks that dropping
the correction bias, the group limit, the scaling factor or ``norm_topk_prob`` changes the
output by far more than that.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx

from mla_jax.checkpoint.hf_config import config_from_dict
from mla_jax.model.config import ConfigError, MoEConfig, moe_preset
from mla_jax.model.moe import MoE, hf_expert_names, hf_expert_slice, route, routed_experts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

TOL = 5e-7
TOKENS = 24
SMALL = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    first_k_dense_replace=0,
    n_routed_experts=16,
    num_experts_per_tok=3,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)
CASES = {
    "v2-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy")),
    # transformers' v2 router ignores norm_topk_prob (never renormalises): so must we.
    "v2-group-limited-norm-flag": (
        "deepseek_v2",
        dict(topk_method="group_limited_greedy", norm_topk_prob=True),
    ),
    "v2-greedy": ("deepseek_v2", dict(topk_method="greedy")),
    "v3-norm": ("deepseek_v3", dict(norm_topk_prob=True)),
    "v3-no-norm": ("deepseek_v3", dict(norm_topk_prob=False)),
}


def _hf_block(model_type: str, overrides: dict, rng: np.random.Generator):
    """A transformers MoE block with random weights, and its config.json dict."""
    if model_type == "deepseek_v2":
        config = transformers.DeepseekV2Config(**SMALL, **overrides)
        block = hf_v2.DeepseekV2Moe(config)
    else:
        config = transformers.DeepseekV3Config(**SMALL, **overrides)
        block = hf_v3.DeepseekV3MoE(config)
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            fan_in = tensor.shape[-1] if tensor.ndim > 1 else 1
            # The bias is large next to the sigmoid scores' spread: it changes the choice.
            scale = 0.5 if name.endswith("e_score_correction_bias") else fan_in**-0.5
            value = scale * rng.standard_normal(tuple(tensor.shape))
            if name == "gate.weight":
                value *= 4.0  # spread the router logits: no near-ties in the top-k
            tensor.copy_(torch.from_numpy(value))
    return block.eval(), config.to_dict()


def _load(module: MoE, tensors: dict[str, np.ndarray]) -> None:
    """HF tensors (names under ``mlp.``) into the module, the way a loader maps them."""
    cfg = module.cfg
    experts = {
        "gate_up_proj": np.zeros(module.experts.gate_up_proj.shape, np.float32),
        "down_proj": np.zeros(module.experts.down_proj.shape, np.float32),
    }
    for name, value in tensors.items():
        if (where := hf_expert_slice(name, cfg)) is not None:
            assert value.shape == where.hf_shape, name
            experts[where.param][where.index] = value.transpose(where.axes)
        elif name == "gate.weight":
            module.gate.kernel[...] = jnp.asarray(value.T)
        elif name == "gate.e_score_correction_bias":
            module.gate.e_score_correction_bias[...] = jnp.asarray(value)
        else:
            mlp, proj, _ = name.split(".")  # shared_experts.gate_proj.weight
            assert mlp == "shared_experts", name
            getattr(module.shared_experts, proj).kernel[...] = jnp.asarray(value.T)
    module.experts.gate_up_proj[...] = jnp.asarray(experts["gate_up_proj"])
    module.experts.down_proj[...] = jnp.asarray(experts["down_proj"])


def _per_expert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The published checkpoints' layout of transformers' fused expert tensors."""
    out = {k: v for k, v in tensors.items() if not k.startswith("experts.")}
    gate_up, down = tensors["experts.gate_up_proj"], tensors["experts.down_proj"]
    inter = down.shape[2]
    for e in range(down.shape[0]):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        out[f"experts.{e}.down_proj.weight"] = down[e]
    return out


def _setup(case: str, rng: np.random.Generator):
    model_type, overrides = CASES[case]
    block, config_dict = _hf_block(model_type, overrides, rng)
    cfg = config_from_dict(config_dict).moe
    tensors = {k: v.numpy().copy() for k, v in block.state_dict().items()}
    module = MoE(cfg, rngs=nnx.Rngs(0))
    _load(module, _per_expert(tensors))
    x = rng.standard_normal((TOKENS, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None]).numpy()[0]
    return block, module, x, want


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_transformers(case, impl, rng):
    _, module, x, want = _setup(case, rng)
    got = nnx.jit(lambda m, x: m(x, impl=impl))(module, jnp.asarray(x))
    assert got.dtype == jnp.float32 and got.shape == x.shape
    assert rel_err(got, want) < TOL


# Router weights against float64 from the formulas. Both float32 routers (ours and
# transformers') sit up to 3e-6 from it: the logits reach about 12 (the gate is spread x4),
# where float32 rounding of a 32-term dot product moves a softmax weight by a few 1e-6
# relative; measured <= 2.5e-6 for ours over seeds 0-7 of every case.
ROUTE_RTOL = 4e-6


def _route_weights64(x: np.ndarray, module: MoE, ids: np.ndarray) -> np.ndarray:
    """The chosen experts' weights in float64 (the v2 softmax is never renormalised)."""
    cfg = module.cfg
    logits = x.astype(np.float64) @ np.asarray(module.gate.kernel[...], np.float64)
    if cfg.scoring_func == "softmax":
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    weights = np.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob and cfg.scoring_func == "sigmoid":
        weights /= weights.sum(axis=1, keepdims=True)
    return weights * cfg.routed_scaling_factor


@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_transformers(case, rng):
    block, module, x, _ = _setup(case, rng)
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(torch.from_numpy(x))
    bias = getattr(module.gate, "e_score_correction_bias", None)
    ids, weights = route(
        jnp.asarray(x), module.gate.kernel[...], None if bias is None else bias[...], module.cfg
    )
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    # Same experts and weights per token; the order within a token is unspecified.
    mine, theirs = np.argsort(ids, axis=1), np.argsort(want_ids.numpy(), axis=1)
    ids_sorted = np.take_along_axis(np.asarray(ids), mine, 1)
    np.testing.assert_array_equal(ids_sorted, np.take_along_axis(want_ids.numpy(), theirs, 1))
    want64 = _route_weights64(x, module, ids_sorted)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), mine, 1), want64, rtol=ROUTE_RTOL, atol=0
    )
    # transformers' weights are the same formula: a check of the oracle, not of us.
    np.testing.assert_allclose(
        np.take_along_axis(want_weights.numpy(), theirs, 1), want64, rtol=ROUTE_RTOL, atol=0
    )


def _forward(module: MoE, x: np.ndarray, cfg: MoEConfig, bias) -> np.ndarray:
    """The module's output under another router config or correction bias."""
    ids, weights = route(jnp.asarray(x), module.gate.kernel[...], bias, cfg)
    routed = routed_experts(
        jnp.asarray(x),
        ids,
        weights,
        module.experts.gate_up_proj[...],
        module.experts.down_proj[...],
    )
    return np.asarray(routed + module.shared_experts(jnp.asarray(x)))


@pytest.mark.parametrize("case", ["v2-group-limited", "v3-norm"])
def test_routing_details_matter(case, rng):
    """Each routing detail changes the output far beyond the tolerance, so the comparison
    with transformers would catch getting it wrong."""
    _, module, x, want = _setup(case, rng)
    cfg = module.cfg
    bias = getattr(module.gate, "e_score_correction_bias", None)
    bias = None if bias is None else bias[...]
    assert rel_err(_forward(module, x, cfg, bias), want) < TOL
    ablations = {
        "no group limit": (
            dataclasses.replace(cfg, topk_method="greedy")
            if cfg.scoring_func == "softmax"
            else dataclasses.replace(cfg, topk_group=cfg.n_group)
        ),
        "routed_scaling_factor 1": dataclasses.replace(cfg, routed_scaling_factor=1.0),
        "norm_topk_prob flipped": dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob),
    }
    for what, changed in ablations.items():
        assert rel_err(_forward(module, x, changed, bias), want) > 100 * TOL, what
    if bias is not None:
        with_bias = route(jnp.asarray(x), module.gate.kernel[...], bias, cfg)[0]
        without = route(jnp.asarray(x), module.gate.kernel[...], jnp.zeros_like(bias), cfg)[0]
        assert (np.sort(with_bias, axis=1) != np.sort(without, axis=1)).any(axis=1).sum() >= 3
        dropped = _forward(module, x, cfg, jnp.zeros_like(bias))
        assert rel_err(dropped, want) > 100 * TOL


def test_both_hf_layouts_load_the_same(rng):
    block, _ = _hf_block("deepseek_v3", {}, rng)
    tensors = {k: v.numpy().copy() for k, v in block.state_dict().items()}
    cfg = config_from_dict(_hf_block("deepseek_v3", {}, rng)[1]).moe
    fused, per_expert = MoE(cfg, rngs=nnx.Rngs(0)), MoE(cfg, rngs=nnx.Rngs(1))
    _load(fused, tensors)
    _load(per_expert, _per_expert(tensors))
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(fused, nnx.Param)),
        nnx.to_flat_state(nnx.state(per_expert, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
    names = hf_expert_names("model.layers.3.mlp", cfg)
    assert len(names) == 3 * cfg.n_routed_experts
    assert names[:3] == [
        f"model.layers.3.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")
    ]
    assert {hf_expert_slice(n, cfg).param for n in names} == {"gate_up_proj", "down_proj"}
    assert hf_expert_slice("model.layers.3.mlp.shared_experts.up_proj.weight", cfg) is None
    with pytest.raises(ValueError, match="expert 16 is out of range"):
        hf_expert_slice("model.layers.3.mlp.experts.16.up_proj.weight", cfg)


V2_LITE = dict(
    SMALL,
    model_type="deepseek_v2",
    hidden_size=2048,
    n_routed_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    scoring_func="softmax",
    first_k_dense_replace=1,
    num_hidden_layers=27,
    rope_theta=10000.0,
)


def test_moe_config_parsed():
    cfg = config_from_dict(V2_LITE)
    assert cfg.moe == moe_preset("deepseek-v2-lite")
    v3 = dict(V2_LITE, model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc")
    v3.update(n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    moe = config_from_dict(v3).moe
    assert (moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group) == (
        "sigmoid",
        "noaux_tc",
        8,
        4,
    )
    assert moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    dense = dict(V2_LITE, first_k_dense_replace=27)
    assert config_from_dict(dense).moe is None


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' does not go with softmax"),
        ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not what deepseek_v2"),
        ({"topk_method": "group_limited_greedy", "n_group": None}, "n_group"),
        ({"topk_method": "group_limited_greedy", "n_group": 5}, "multiple of n_group"),
        ({"num_experts_per_tok": 65}, "exceeds n_routed_experts"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ],
)
def test_bad_moe_config_is_refused(patch, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(dict(V2_LITE, **patch))
