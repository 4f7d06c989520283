"""Ragged causal (or full-context) flash attention with LSE: the Pallas kernel (Triton
lowering), its tile schedule and its pure-jnp reference (``reference.flash_prefill``, the same
signature); the Hopper kernel (Mosaic GPU lowering, ``pallas_mosaic_gpu``) with the same
contract, exported as ``mosaic_gpu_flash_prefill`` (not selected automatically yet). The
Mosaic GPU module loads on first use (importing Mosaic GPU takes about half a second)."""

import importlib

from . import reference
from .pallas_triton import (
    PrefillConfig,
    flash_prefill,
    schedule_query_tiles,
)

_MOSAIC_GPU = {
    "MosaicPrefillConfig": "MosaicPrefillConfig",
    "mosaic_gpu_flash_prefill": "flash_prefill",
    "mosaic_gpu_unsupported": "unsupported",
}

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


def __getattr__(name: str):
    if name == "pallas_mosaic_gpu" or name in _MOSAIC_GPU:
        module = importlib.import_module(".pallas_mosaic_gpu", __name__)
        return module if name == "pallas_mosaic_gpu" else getattr(module, _MOSAIC_GPU[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
