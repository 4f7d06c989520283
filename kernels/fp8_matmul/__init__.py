"""The FP8 weight-only matmul of the decoder's projections: the Pallas kernel (Triton
lowering) and its pure-jnp reference (``reference.fp8_matmul``, the same signature)."""

from . import reference
from .pallas_triton import Fp8MatmulConfig, fp8_matmul

__all__ = ["reference", "Fp8MatmulConfig", "fp8_matmul"]
