"""The pure-jnp reference of ``w8a8_matmul``: the same signature, x quantized as the kernel
quantizes it, both operands dequantized, one float32 dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks, matmul_steps
from .pallas_mosaic_gpu import BLOCK, check, quantize_rows


def w8a8_matmul(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    config=None,
    interpret=None,
) -> jax.Array:
    """``quantized(x) @ dequantize(weight, scale_inv)^T``.

    Args:
      x: ``[M, K]`` bfloat16.
      weight: ``[N, K]`` float8_e4m3fn; scale_inv: ``[N / 128, K / 128]`` float32. With
        ``layer`` (an int32 scalar, may be traced), stacks ``[L, N, K]`` and ``[L, ...]`` of
        which that layer is used.
      config, interpret: the kernel's launch and mode; ignored here.

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32.
    """
    del config, interpret
    check(x, weight, scale_inv, layer)
    weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
    values, scales = quantize_rows(x)
    lhs = values.astype(jnp.float32) * jnp.repeat(scales.T, BLOCK, axis=1)
    rhs = fp8_blocks.dequantize_nk(weight, scale_inv, fp8_blocks.Fp8Blocks(BLOCK, BLOCK))
    out = jnp.dot(lhs, rhs.T, precision=jax.lax.Precision.HIGHEST)
    return out[: x.shape[0]].astype(x.dtype)
