"""The pure-jnp reference of ``fp8_matmul``: the same signature; the weight dequantized, then
one dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks, matmul_steps
from .pallas_triton import check


def fp8_matmul(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
    config=None,
    interpret=None,
) -> jax.Array:
    """``x @ dequantize(weight, scale_inv)``.

    Args:
      x: ``[M, K]`` bfloat16 or float32.
      weight: ``[K, N]`` float8_e4m3fn; scale_inv: its float32 block scales
        (``blocks.scale_shape(K, N)``); blocks: their block sizes (static). With ``layer``
        (an int32 scalar, may be traced), stacks ``[L, K, N]`` and ``[L, ...]`` of which
        that layer is used.
      config, interpret: the Pallas kernel's launch parameters and mode; ignored here.

    Returns:
      ``[M, N]`` in x's dtype, accumulated in float32 (float32 products for float32 x).
    """
    del config, interpret
    check(x, weight, scale_inv, blocks, layer)
    weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
    dense = fp8_blocks.dequantize_nk(weight, scale_inv, blocks, x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jnp.dot(x, dense.T, precision=precision, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def dequantized_dot(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """``x @ dequantize(weight, scale_inv)`` as XLA runs it best on a GPU for many rows: the
    weight dequantized into a temporary in x's dtype (one elementwise pass, which reads a
    stack's ``layer`` in place), then one dot whose output is x's dtype (cuBLAS accumulates
    in float32; a float32 output converted afterwards costs an extra pass over ``[M, N]``).
    XLA fuses no block-scale prologue into its GEMMs: the temporary exists either way, and
    it is freed after the dot."""
    check(x, weight, scale_inv, blocks, layer)
    weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
    dense = fp8_blocks.dequantize_nk(weight, scale_inv, blocks, x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, dense.T, precision=precision)
