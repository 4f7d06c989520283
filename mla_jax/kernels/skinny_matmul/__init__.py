"""The matmul of few rows (decode's projections, ``[M <= 64, K] @ [K, N]``, over a bf16
weight or an FP8 one with DeepSeek's block scales) as a Mosaic GPU kernel that streams the
weight through shared memory, and its pure-jnp reference (``reference.skinny_matmul``, the
same signature). In no kernel set: over bf16 weights, at the engine's decode rows (16 and 64)
it is no faster than XLA's dot (cuBLAS) on most projections, and a V2-Lite decode step ran
1-7% slower with it; over FP8 weights (``[K, N]``) w8a8 beats it on every V3 projection it
takes (``w8a8_matmul``, which reads the model's HF-layout ``[N, K]`` weights;
``scripts/bench_skinny_matmul.py``; README, Kernels)."""

from __future__ import annotations

from . import reference
from .pallas_mosaic_gpu import MAX_ROWS, SkinnyMatmulConfig, skinny_matmul, unsupported

__all__ = ["reference", "MAX_ROWS", "SkinnyMatmulConfig", "skinny_matmul", "unsupported"]
