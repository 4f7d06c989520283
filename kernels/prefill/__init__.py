"""Ragged causal (or full-context) flash attention with LSE: the Pallas kernel (Triton
lowering), its tile schedule and its pure-jnp reference (``reference.flash_prefill``, the same
signature)."""

from . import reference
from .pallas_triton import (
    PrefillConfig,
    flash_prefill,
    schedule_query_tiles,
)

__all__ = [
    "reference",
    "PrefillConfig",
    "flash_prefill",
    "schedule_query_tiles",
]
