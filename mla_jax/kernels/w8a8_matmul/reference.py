"""The pure-jnp reference of ``w8a8_matmul``: the same signature, x quantized as the kernel
quantizes it, both operands dequantized, one float32 dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks
from .pallas_mosaic_gpu import BLOCK, check, quantize_rows


def w8a8_matmul(
    x: jax.Array, weight: jax.Array, scale_inv: jax.Array, *, config=None, interpret=None
) -> jax.Array:
    """``quantized(x) @ dequantize(weight, scale_inv)^T``.

    Args:
      x: ``[M, K]`` bfloat16, M up to ``MAX_ROWS``.
      weight: ``[N, K]`` float8_e4m3fn; scale_inv: ``[N / 128, K / 128]`` float32.
      config, interpret: the kernel's launch and mode; ignored here.

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32.
    """
    del config, interpret
    check(x, weight, scale_inv)
    values, scales = quantize_rows(x)
    lhs = values.astype(jnp.float32) * jnp.repeat(scales.T, BLOCK, axis=1)
    rhs = fp8_blocks.dequantize(weight.T, scale_inv.T, fp8_blocks.Fp8Blocks(BLOCK, BLOCK))
    out = jnp.dot(lhs, rhs, precision=jax.lax.Precision.HIGHEST)
    return out[: x.shape[0]].astype(x.dtype)
