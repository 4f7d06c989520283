"""The matmul of few rows (decode's projections, ``[M <= 64, K] @ [K, N]``) as a Mosaic GPU
kernel that streams the weight through shared memory at the copy bandwidth, and its pure-jnp
reference (``reference.skinny_matmul``, the same signature). Not called by the model: at the
engine's decode rows (16 and 64) it is no faster than XLA's dot (cuBLAS) on most
projections, and a V2-Lite decode step ran 1-7% slower with it
(``scripts/bench_skinny_matmul.py``; README, Kernels)."""

from __future__ import annotations

from . import reference
from .pallas_mosaic_gpu import MAX_ROWS, SkinnyMatmulConfig, skinny_matmul, unsupported

__all__ = ["reference", "MAX_ROWS", "SkinnyMatmulConfig", "skinny_matmul", "unsupported"]
