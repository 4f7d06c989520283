"""The MoE grouped matmul: the Pallas kernel (Triton lowering) and its tile schedule."""

from .pallas_triton import (
    GroupedMatmulConfig,
    TileSchedule,
    default_config,
    grouped_matmul,
    max_tiles,
    plan,
)

__all__ = [
    "GroupedMatmulConfig",
    "TileSchedule",
    "default_config",
    "grouped_matmul",
    "max_tiles",
    "plan",
]
