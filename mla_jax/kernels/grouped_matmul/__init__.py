"""The MoE grouped matmul: the Pallas kernels (Triton lowering; Mosaic GPU for a prefill's
rows on Hopper), their tile schedule and the pure-jnp reference (``reference.grouped_matmul``,
the same signature)."""

from __future__ import annotations

import logging

import jax

from .. import fp8_blocks, mosaic_gpu
from . import pallas_mosaic_gpu, reference
from .pallas_triton import (
    GroupedMatmulConfig,
    grouped_matmul,
    schedule_row_tiles,
)

log = logging.getLogger(__name__)


def prefill_on_mosaic_gpu(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    rhs_scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
) -> jax.Array:
    """``grouped_matmul`` (same arguments and result) on the Mosaic GPU kernel where the rows
    are a prefill's (``GroupedMatmulConfig.regime``) and it takes the product, else on the
    Triton kernel (said once). The Hopper kernel set runs FP8 experts through it
    (``kernels.MOSAIC_GPU``); ``scripts/bench_moe.py`` times bf16 experts on it."""
    config = pallas_mosaic_gpu.MosaicGroupedMatmulConfig.for_weight(rhs.shape[-1], blocks)
    if GroupedMatmulConfig.regime(lhs.shape[0], group_sizes.shape[0]) != "prefill":
        reason = "fewer rows a group than a prefill's"
    else:
        reason = pallas_mosaic_gpu.unsupported(lhs, rhs, config, blocks)
    fp8 = dict(rhs_scale_inv=rhs_scale_inv, blocks=blocks)
    if reason is None:
        return pallas_mosaic_gpu.grouped_matmul(
            lhs, rhs, group_sizes, group_offset=group_offset, config=config, **fp8
        )
    mosaic_gpu.log_once(
        log,
        f"grouped_matmul: the Triton kernel for lhs {list(lhs.shape)} x rhs "
        f"{list(rhs.shape[-2:])} ({reason})",
    )
    return grouped_matmul(lhs, rhs, group_sizes, group_offset=group_offset, **fp8)


__all__ = [
    "reference",
    "pallas_mosaic_gpu",
    "GroupedMatmulConfig",
    "grouped_matmul",
    "prefill_on_mosaic_gpu",
    "schedule_row_tiles",
]
