"""The matmul of few rows (decode's projections, ``[M <= 64, K] @ [K, N]``, over a bf16
weight or an FP8 one with DeepSeek's block scales) as a Mosaic GPU kernel that streams the
weight through shared memory, and its pure-jnp reference (``reference.skinny_matmul``, the
same signature). The Hopper kernel set runs it over FP8 weights of K from
``fp8_matmul.SKINNY_MIN_K`` at decode's rows (``fp8_matmul.decode_on_mosaic_gpu``), where it
beats the Triton FP8 kernel. Not over bf16 weights: at the engine's decode rows (16 and 64)
it is no faster than XLA's dot (cuBLAS) on most projections, and a V2-Lite decode step ran
1-7% slower with it (``scripts/bench_skinny_matmul.py``; README, Kernels)."""

from __future__ import annotations

from . import reference
from .pallas_mosaic_gpu import MAX_ROWS, SkinnyMatmulConfig, skinny_matmul, unsupported

__all__ = ["reference", "MAX_ROWS", "SkinnyMatmulConfig", "skinny_matmul", "unsupported"]
