from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import rel_err

from mla_jax.model.config import MLAConfig, RopeConfig
from mla_jax.model.rope import apply_rope, cos_sin_scale, inv_freq, rope_cos_sin

YARNS = [
    RopeConfig(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096),
    RopeConfig(
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=0.707,
        mscale_all_dim=0.707,
        beta_fast=16.0,
        theta=50000.0,
    ),
    RopeConfig(
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=128,
        mscale=1.0,
        mscale_all_dim=0.0,
    ),
]


@pytest.mark.parametrize("rope", YARNS)
def test_yarn_matches_numpy_formulas(rope):
    want = ref.yarn_inv_freq(
        64,
        rope.theta,
        rope.factor,
        rope.original_max_position_embeddings,
        rope.beta_fast,
        rope.beta_slow,
    )
    assert rel_err(inv_freq(rope, 64), want) < 1e-6


@pytest.mark.parametrize("rope", YARNS)
def test_yarn_matches_transformers(rope):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "yarn",
        "rope_theta": rope.theta,
        "factor": rope.factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
        "beta_fast": rope.beta_fast,
        "beta_slow": rope.beta_slow,
        "mscale": rope.mscale,
        "mscale_all_dim": rope.mscale_all_dim,
    }
    hf_cfg = transformers.DeepseekV3Config(
        qk_rope_head_dim=64,
        rope_parameters=params,
        max_position_embeddings=rope.original_max_position_embeddings * int(rope.factor),
    )
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert rel_err(inv_freq(rope, 64), want_freq.numpy()) < 1e-6
    assert cos_sin_scale(rope) == pytest.approx(want_scale, rel=1e-6)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    mla = MLAConfig(
        hidden_size=64,
        num_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=8,
        rope=rope,
    )
    assert mla.softmax_scale == pytest.approx(yarn_apply_mscale(params, 192**-0.5), rel=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_is_a_complex_rotation(rng, interleaved):
    rope = YARNS[1]
    x = rng.standard_normal((9, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, 9)
    cos, sin = rope_cos_sin(rope, 16, jnp.asarray(pos, jnp.int32))
    got = apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved)
    want = ref.rope(x, pos, inv_freq(rope, 16).astype(np.float64), cos_sin_scale(rope), interleaved)
    # float32 angles of positions up to 5000: ~5000 * 6e-8 rad of error
    assert rel_err(got, want) < 1e-4
