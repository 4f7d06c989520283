"""Paged absorbed MLA decode: the Pallas kernel (Triton lowering) and its schedule."""

from .pallas_triton import (
    DEFAULT_NUM_SMS,
    DecodeConfig,
    DecodeSchedule,
    default_config,
    max_items,
    mla_decode,
    num_programs,
    padded_heads,
    plan,
)

__all__ = [
    "DEFAULT_NUM_SMS",
    "DecodeConfig",
    "DecodeSchedule",
    "default_config",
    "max_items",
    "mla_decode",
    "num_programs",
    "padded_heads",
    "plan",
]
