"""The MoE grouped matmul: the Pallas kernels (Triton lowering; Mosaic GPU for a prefill's
rows over bf16 weights on Hopper), their tile schedule and the pure-jnp reference
(``reference.grouped_matmul``, the same signature). FP8 experts on Hopper run on
``w8a8_matmul``'s grouped form."""

from __future__ import annotations

import logging

import jax

from .. import mosaic_gpu
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
) -> jax.Array:
    """``grouped_matmul`` over bf16 weights (same arguments and result) on the Mosaic GPU
    kernel where the rows are a prefill's (``GroupedMatmulConfig.regime``) and it takes the
    product, else on the Triton kernel (said once): ``scripts/bench_moe.py``'s Mosaic GPU
    column. No kernel set runs it: the Triton kernel was faster at V3's prefill shapes."""
    config = pallas_mosaic_gpu.MosaicGroupedMatmulConfig.for_weight(rhs.shape[-1])
    if GroupedMatmulConfig.regime(lhs.shape[0], group_sizes.shape[0]) != "prefill":
        reason = "fewer rows a group than a prefill's"
    else:
        reason = pallas_mosaic_gpu.unsupported(lhs, rhs, config)
    if reason is None:
        return pallas_mosaic_gpu.grouped_matmul(
            lhs, rhs, group_sizes, group_offset=group_offset, config=config
        )
    mosaic_gpu.log_once(
        log,
        f"grouped_matmul: the Triton kernel for lhs {list(lhs.shape)} x rhs "
        f"{list(rhs.shape[-2:])} ({reason})",
    )
    return grouped_matmul(lhs, rhs, group_sizes, group_offset=group_offset)


__all__ = [
    "reference",
    "pallas_mosaic_gpu",
    "GroupedMatmulConfig",
    "grouped_matmul",
    "prefill_on_mosaic_gpu",
    "schedule_row_tiles",
]
