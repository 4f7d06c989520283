"""Paged absorbed MLA decode: the Pallas kernel (Triton lowering), its schedule and its
pure-jnp reference (``reference.mla_decode``, the same signature)."""

from . import reference
from .pallas_triton import (
    DEFAULT_NUM_SMS,
    DecodeConfig,
    DecodeSchedule,
    device_num_sms,
    max_items,
    mla_decode,
    num_programs,
    padded_heads,
    schedule_splits,
    truncate_schedule,
)

__all__ = [
    "reference",
    "DEFAULT_NUM_SMS",
    "DecodeConfig",
    "DecodeSchedule",
    "device_num_sms",
    "max_items",
    "mla_decode",
    "num_programs",
    "padded_heads",
    "schedule_splits",
    "truncate_schedule",
]
