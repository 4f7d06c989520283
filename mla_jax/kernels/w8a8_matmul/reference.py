"""The pure-jnp references of ``w8a8_matmul`` and ``grouped_w8a8_matmul``: the same
signatures, x quantized as the kernels quantize it, both operands dequantized, float32
products."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks, matmul_steps
from ..grouped_matmul.pallas_triton import stacked_groups
from ..grouped_matmul.reference import grouped_matmul
from ..quantize_rows.reference import quantize_rows
from .pallas_mosaic_gpu import BLOCK, check, check_grouped


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
    rhs = fp8_blocks.dequantize_nk(weight, scale_inv, fp8_blocks.Fp8Blocks(BLOCK, BLOCK))
    out = jnp.dot(_quantized(x), rhs.T, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def grouped_w8a8_matmul(
    lhs: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    schedule=None,
    config=None,
    interpret=None,
) -> jax.Array:
    """``quantized(lhs[r]) @ dequantize(weight[group_offset + g])^T`` for the rows r of group
    g (``grouped_matmul``'s reference on the quantized rows in float32), 0 for the rows
    after the last group.

    Args:
      lhs: ``[M, K]`` bfloat16, rows sorted by group.
      weight: ``[G', N, K]`` float8_e4m3fn; scale_inv: ``[G', N / 128, K / 128]`` float32
        (leading axes stack: ``[L, E, N, K]`` is ``[L * E, N, K]``).
      group_sizes: ``[G]`` int32, summing to at most M; group_offset: int32 scalar (may be
        traced).
      schedule, config, interpret: the kernel's tile plan, launch and mode; ignored here.

    Returns:
      ``[M, N]`` bfloat16.
    """
    del schedule, config, interpret
    weight, scale_inv = stacked_groups(weight, scale_inv)
    check_grouped(lhs, weight, scale_inv, group_sizes, group_offset)
    out = grouped_matmul(  # float32 rows: weights dequantized into float32, HIGHEST dots
        _quantized(lhs),
        weight,
        group_sizes,
        group_offset=group_offset,
        rhs_scale_inv=scale_inv,
        blocks=fp8_blocks.Fp8Blocks(BLOCK, BLOCK),
    )
    return out.astype(lhs.dtype)


def _quantized(x: jax.Array) -> jax.Array:
    """``x [M, K]`` rounded as the kernels quantize it (``quantize_rows``), float32."""
    values, scales = quantize_rows(x)
    return values.astype(jnp.float32) * jnp.repeat(scales.T, BLOCK, axis=1)
