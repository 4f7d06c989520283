"""Ragged causal (or full-context) flash attention with LSE: the Pallas kernel (Triton
lowering), its tile schedule and its pure-jnp reference (``reference.flash_prefill``, the same
signature); the Hopper kernel (Mosaic GPU lowering, ``pallas_mosaic_gpu``) with the same
contract, exported as ``mosaic_gpu_flash_prefill`` (not selected automatically yet)."""

from . import pallas_mosaic_gpu, reference
from .pallas_mosaic_gpu import MosaicPrefillConfig
from .pallas_mosaic_gpu import flash_prefill as mosaic_gpu_flash_prefill
from .pallas_mosaic_gpu import unsupported as mosaic_gpu_unsupported
from .pallas_triton import (
    PrefillConfig,
    flash_prefill,
    schedule_query_tiles,
)

__all__ = [
    "pallas_mosaic_gpu",
    "reference",
    "MosaicPrefillConfig",
    "PrefillConfig",
    "flash_prefill",
    "mosaic_gpu_flash_prefill",
    "mosaic_gpu_unsupported",
    "schedule_query_tiles",
]
