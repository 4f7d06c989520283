"""The matmul of few rows (decode's projections, ``[M <= 64, K]``) against an FP8 weight in
HF's ``[N, K]`` layout with DeepSeek's 128 x 128 block scales, on Hopper's FP8 tensor cores
with the activations quantized per token and 128 columns (w8a8, as DeepSeek's inference
runs it), and its pure-jnp reference (``reference.w8a8_matmul``, the same signature). The
Hopper kernel set runs it for decode's rows over the projections where it ``pays_off``; the
other FP8 products convert the weight's tiles into 16 bits (``fp8_matmul``)."""

from __future__ import annotations

import jax.numpy as jnp

from . import reference
from .pallas_mosaic_gpu import (
    BLOCK,
    MAX_ROWS,
    W8A8MatmulConfig,
    quantize_rows,
    unsupported,
    w8a8_matmul,
)

__all__ = [
    "reference",
    "BLOCK",
    "MAX_ROWS",
    "MIN_WEIGHT",
    "W8A8MatmulConfig",
    "pays_off",
    "quantize_rows",
    "unsupported",
    "w8a8_matmul",
]

# From this many weight elements up, at decode's rows, w8a8 beats the Triton FP8 kernel: V3's
# o_proj [7168, 16384] took 58.3 against 82.0 us and mlp.gate_proj [18432, 7168] 67.3
# against 94.9 us (64 rows; the bf16 weight: 79.9 and 91.2), while q_a_proj [1536, 7168] took
# 13.1 against 12.3 and the shared experts' gate_proj [2048, 7168] 14.1 against 13.4, where
# x's quantization and the sum of K's slices (two more launches) cost what the weight's
# bytes save (H100, 2026-12-06, a trial of this kernel's design; ``bench_skinny_matmul.py``'s
# FP8 table times the kernel itself). Between the two sizes nothing was measured.
MIN_WEIGHT = 1 << 26


def pays_off(x: jnp.ndarray, weight: jnp.ndarray) -> bool:
    """Whether the Hopper set takes ``x [M, K] @ weight[..., N, K]^T`` to w8a8: decode's rows
    (up to ``MAX_ROWS``) of a bfloat16 x over a weight of ``MIN_WEIGHT`` elements or more."""
    n, k = weight.shape[-2:]
    return x.shape[0] <= MAX_ROWS and x.dtype == jnp.bfloat16 and n * k >= MIN_WEIGHT
