"""The MoE grouped matmul: the Pallas kernel (Triton lowering), its tile schedule and its
pure-jnp reference (``reference.grouped_matmul``, the same signature)."""

from . import reference
from .pallas_triton import (
    GroupedMatmulConfig,
    TileSchedule,
    default_config,
    grouped_matmul,
    max_tiles,
    plan,
)

__all__ = [
    "reference",
    "GroupedMatmulConfig",
    "TileSchedule",
    "default_config",
    "grouped_matmul",
    "max_tiles",
    "plan",
]
