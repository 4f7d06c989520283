"""Rows of activations quantized as DeepSeek's FP8 inference quantizes them (``act_quant``):
e4m3 values and a float32 scale per row and 128 columns, the scale here a power of two. The
w8a8 kernels read x this way. The Pallas kernel (Triton lowering) reads x once; its pure-jnp
reference (``reference.quantize_rows``, the same signature and the same bits) is two XLA
fusions on a GPU, a reduction then the values, which read x twice: at V3's o_proj over 8192
tokens 236 us against the kernel's 144 (H100, 2026-12-06, a trial; the bits equal).
"""

from __future__ import annotations

from . import reference
from .pallas_triton import BLOCK_ROWS, GROUP, check, quantize_rows

__all__ = ["reference", "BLOCK_ROWS", "GROUP", "check", "quantize_rows"]
