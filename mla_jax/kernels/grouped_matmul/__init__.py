"""The MoE grouped matmul: the Pallas kernel (Triton lowering), its tile schedule and its
pure-jnp reference (``reference.grouped_matmul``, the same signature)."""

from . import reference
from .pallas_triton import (
    GroupedMatmulConfig,
    grouped_matmul,
    schedule_row_tiles,
)

__all__ = [
    "reference",
    "GroupedMatmulConfig",
    "grouped_matmul",
    "schedule_row_tiles",
]
