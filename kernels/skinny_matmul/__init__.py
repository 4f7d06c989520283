"""The matmul of few rows (decode's projections, ``[M <= 64, K] @ [K, N]``) as a Mosaic GPU
kernel that streams the weight through shared memory at the copy bandwidth, and its pure-jnp
reference (``reference.skinny_matmul``, the same signature). Not yet called by the model:
``scripts/bench_skinny_matmul.py`` times it against XLA's dot (cuBLAS) first."""

from __future__ import annotations

from . import reference
from .pallas_mosaic_gpu import MAX_ROWS, SkinnyMatmulConfig, skinny_matmul, unsupported

__all__ = ["reference", "MAX_ROWS", "SkinnyMatmulConfig", "skinny_matmul", "unsupported"]
