"""Ragged causal (or full-context) flash attention with LSE: the Pallas kernel (Triton
lowering), its tile schedule and its pure-jnp reference (``reference.flash_prefill``, the same
signature); the Hopper kernel (Mosaic GPU lowering, ``pallas_mosaic_gpu``) with the same
contract."""

from . import pallas_mosaic_gpu, reference
from .pallas_triton import (
    PrefillConfig,
    flash_prefill,
    schedule_query_tiles,
)

__all__ = [
    "pallas_mosaic_gpu",
    "reference",
    "PrefillConfig",
    "flash_prefill",
    "schedule_query_tiles",
]
