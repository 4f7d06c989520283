"""Skinny projections split along K (``layers.k_splits``, ``layers.split_k_dot``) against
float64 NumPy, and where ``Linear`` takes that path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx

from mla_jax.model import layers

# The decode projections the rule was measured on (bench_fp8_matmul.py --sweep split_k):
# (rows, K, N) -> slices.
MEASURED = {
    (16, 2048, 576): 8,  # V2-Lite kv_a_proj_with_mqa
    (64, 2048, 576): 8,
    (16, 2048, 2048): 8,  # V2-Lite o_proj
    (64, 2048, 2048): 1,
    (16, 2048, 3072): 1,  # V2-Lite q_proj
    (16, 2048, 10944): 1,  # V2-Lite gate_proj
    (16, 10944, 2048): 1,  # V2-Lite down_proj: no power of two cuts 10944 into 64s >= 256
    (16, 7168, 1536): 16,  # V3 q_a_proj
    (64, 7168, 1536): 16,
    (16, 7168, 576): 16,  # V3 kv_a_proj_with_mqa
    (16, 7168, 2112): 16,  # V3 fused_qkv_a_proj (the fuse trial, 2026-12-05)
    (16, 1536, 24576): 1,  # V3 q_b_proj
    (16, 16384, 7168): 1,  # V3 o_proj
    (128, 7168, 576): 1,  # past the decode rows
}


@pytest.mark.parametrize("shape,splits", MEASURED.items(), ids=str)
def test_k_splits_rule(shape, splits):
    assert layers.k_splits(*shape) == splits


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize(
    "dtype,tolerance",
    # bf16: the output's rounding (measured up to 1.7e-3 over 6 seeds, unsplit alike);
    # float32 with HIGHEST precision: summation order (up to 3.1e-7).
    [(jnp.bfloat16, 3e-3), (jnp.float32, 6e-7)],
    ids=["bf16", "f32"],
)
def test_split_k_dot_matches_numpy(rng, splits, dtype, tolerance):
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    w = rng.standard_normal((1024, 96)).astype(np.float32)
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = layers.split_k_dot(x, w, splits, layers.matmul_precision(dtype))
    assert got.dtype == dtype and got.shape == (16, 96)
    assert rel_err(got, want) < tolerance


def _batched_dots(fn, *args) -> int:
    """The dot_generals with a batch dimension in ``fn``'s jaxpr (a split projection's)."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    return sum(bool(e.params["dimension_numbers"][1][0]) for e in dots)


@pytest.mark.parametrize(
    "rows,dtype,splits",
    [
        (16, jnp.bfloat16, True),
        (64, jnp.bfloat16, True),
        (65, jnp.bfloat16, False),
        (16, jnp.float32, False),
    ],
    ids=["16-bf16", "64-bf16", "65-bf16", "16-f32"],
)
def test_linear_splits_decode_rows_on_gpus(monkeypatch, rng, rows, dtype, splits):
    """On a GPU (stood in for here) a 2-byte projection of up to 64 rows with a narrow output
    runs split and gives the product; more rows or float32 run one matmul."""
    monkeypatch.setattr(layers, "_splits_k_here", lambda: True)
    linear = layers.Linear(4096, 512, dtype, nnx.Rngs(0))
    kernel = rng.standard_normal((4096, 512)).astype(np.float32) / 64
    linear.kernel[...] = jnp.asarray(kernel, dtype)
    # Leading axes as the model passes them: [tokens, hidden] or [batch, tokens, hidden].
    x = jnp.asarray(rng.standard_normal((1, rows, 4096)), dtype)
    assert _batched_dots(lambda x: linear(x), x) == (1 if splits else 0)
    want = np.asarray(x, np.float64) @ np.asarray(linear.kernel[...], np.float64)
    got = linear(x)
    assert got.shape == (1, rows, 512)
    assert rel_err(got, want) < (3e-3 if dtype == jnp.bfloat16 else 6e-7)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off GPUs only")
def test_linear_does_not_split_off_gpus(rng):
    linear = layers.Linear(4096, 512, jnp.bfloat16, nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((16, 4096)), jnp.bfloat16)
    assert _batched_dots(lambda x: linear(x), x) == 0
