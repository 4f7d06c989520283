"""Ragged causal (or full-context) flash attention with LSE: the Pallas kernel (Triton
lowering), its tile schedule and its pure-jnp reference (``reference.flash_prefill``, the same
signature)."""

from . import reference
from .pallas_triton import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    flash_prefill,
    schedule_query_tiles,
)

__all__ = [
    "reference",
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_NUM_STAGES",
    "DEFAULT_NUM_WARPS",
    "flash_prefill",
    "schedule_query_tiles",
]
