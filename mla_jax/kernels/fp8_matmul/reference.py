"""The pure-jnp reference of ``fp8_matmul``: the same signature; the weight dequantized, then
one dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks, matmul_steps
from .pallas_triton import check

# x [M, K] times weight [N, K]: both contracted on K -> [M, N]
_CONTRACT_K = (((1,), (1,)), ((), ()))


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
    """``x @ dequantize(weight, scale_inv)^T``.

    Args:
      x: ``[M, K]`` bfloat16 or float32.
      weight: ``[N, K]`` float8_e4m3fn (HF's layout); scale_inv: its float32 block scales
        (``blocks.scale_shape_nk(N, K)``); blocks: their block sizes (static). With ``layer``
        (an int32 scalar, may be traced), stacks ``[L, N, K]`` and ``[L, ...]`` of which
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
    out = jax.lax.dot_general(
        x, dense, _CONTRACT_K, precision=precision, preferred_element_type=jnp.float32
    )
    return out.astype(x.dtype)


def dequantized_dot(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """``x [M, K] @ dequantize(weight [N, K], scale_inv)^T -> [M, N]`` (``fp8_matmul``'s
    arguments) as XLA runs it best on a GPU for many rows: the weight dequantized into a
    temporary ``[N, K]`` in x's dtype (one elementwise pass, which reads a stack's ``layer``
    in place), then one dot contracting both K axes whose output is x's dtype (cuBLAS
    accumulates in float32; a float32 output converted afterwards costs an extra pass over
    ``[M, N]``). XLA fuses no block-scale prologue into its GEMMs: the temporary exists
    either way, and it is freed after the dot."""
    check(x, weight, scale_inv, blocks, layer)
    weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
    dense = fp8_blocks.dequantize_nk(weight, scale_inv, blocks, x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, dense, _CONTRACT_K, precision=precision)
