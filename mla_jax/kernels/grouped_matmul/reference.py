"""The pure-jnp reference of ``grouped_matmul``: the same signature, through
``jax.lax.ragged_dot`` (an FP8 rhs dequantized first)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks
from .pallas_triton import check, stacked_groups


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    rhs_scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
    schedule=None,
    config=None,
    interpret=None,
) -> jax.Array:
    """Grouped matmul over rows sorted by group (``jax.lax.ragged_dot``; fine on CPUs, but on
    GPUs it lowers to a dense matmul over every group, so the Pallas kernel runs there).

    Args:
      lhs: ``[M, K]`` rows sorted by group; rhs: ``[G', K, N]`` (or ``[..., G', K, N]``,
        ``stacked_groups``) in lhs's dtype, or float8_e4m3fn ``[G', N, K]`` (HF's layout)
        with ``rhs_scale_inv [G', N-grid, K-grid]`` and ``blocks`` (``fp8_blocks``): the G
        used matrices are dequantized into lhs's dtype, then multiplied.
      group_sizes: ``[G]`` int32 rows per group, summing to at most M; G <= G'.
      group_offset: group g's rows multiply ``rhs[group_offset + g]`` (int32, may be traced).
      schedule, config, interpret: the Pallas kernel's tile plan, launch parameters and
        mode; ignored here.

    Returns:
      ``out [M, N]`` in lhs's dtype: ``lhs[r] @ rhs[g]`` for the rows r of group g, 0 for the
      rows after the last group.
    """
    del schedule, config, interpret
    rhs, rhs_scale_inv = stacked_groups(rhs, rhs_scale_inv)
    check(lhs, rhs, group_sizes, group_offset, rhs_scale_inv, blocks)
    rhs = jax.lax.dynamic_slice_in_dim(rhs, group_offset, group_sizes.shape[0])
    if blocks is not None:
        scales = jax.lax.dynamic_slice_in_dim(rhs_scale_inv, group_offset, group_sizes.shape[0])
        rhs = fp8_blocks.dequantize_nk(rhs, scales, blocks, lhs.dtype).transpose(0, 2, 1)
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    out = jax.lax.ragged_dot(
        lhs, rhs, group_sizes, precision=precision, preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)
