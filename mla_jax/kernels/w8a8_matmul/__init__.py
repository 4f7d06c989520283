"""The matmul of few rows (decode's projections, ``[M <= 64, K]``) against an FP8 weight in
HF's ``[N, K]`` layout with DeepSeek's 128 x 128 block scales, on Hopper's FP8 tensor cores
with the activations quantized per token and 128 columns (w8a8, as DeepSeek's inference
runs it), and its pure-jnp reference (``reference.w8a8_matmul``, the same signature). In no
kernel set yet: the model keeps FP8 weights as ``[K, N]`` for the kernels that convert them
into 16 bits (``skinny_matmul``, ``fp8_matmul``, ``grouped_matmul``)."""

from __future__ import annotations

from . import reference
from .pallas_mosaic_gpu import MAX_ROWS, W8A8MatmulConfig, quantize_rows, unsupported, w8a8_matmul

__all__ = [
    "reference",
    "MAX_ROWS",
    "W8A8MatmulConfig",
    "quantize_rows",
    "unsupported",
    "w8a8_matmul",
]
