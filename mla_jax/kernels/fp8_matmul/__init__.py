"""The FP8 weight-only matmul of the decoder's projections, ``x [M, K] @ dequantize(weight
[N, K])^T`` (the weight and its block scales in HF's layout): the Pallas kernel (Triton
lowering), its pure-jnp reference (``reference.fp8_matmul``, the same signature) and
``fastest``, what the Triton kernel set runs: by row count (static, at trace time), the path
measured fastest (``scripts/bench_fp8_matmul.py``)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .. import fp8, fp8_blocks, matmul_steps, mosaic_gpu, online_softmax
from . import reference
from .pallas_triton import Fp8MatmulConfig, fp8_matmul

__all__ = [
    "reference",
    "Fp8MatmulConfig",
    "fp8_matmul",
    "fastest",
    "PALLAS_MAX_ROWS",
]

log = logging.getLogger(__name__)

# Up to this many rows (decode) the Pallas kernel streams the fp8 weight once; above it
# (prefill) a bf16 temporary of the weight and cuBLAS win: on an H200 the kernel is 3-5x
# cuBLAS's bf16 time at 8192 rows, the temporary plus cuBLAS about 1.1x, and at 64 rows the
# temporary alone costs 2-3x the bf16 matmul (benchmarks/fp8_matmul.json, of the kernel
# over [K, N] weights, before it read HF's [N, K]; not yet measured again).
PALLAS_MAX_ROWS = 256


def fastest(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
    config: Fp8MatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x [M, K] @ dequantize(weight [N, K], scale_inv)^T -> [M, N]`` (``fp8_matmul``'s
    signature and result): the Pallas kernel up to ``PALLAS_MAX_ROWS`` rows (or with an
    explicit ``config``), else ``reference.dequantized_dot`` (the choice logged once per
    kind). A stack the Triton lowering would index wrongly (``fp8.check_triton_indexable``)
    gives the kernel its ``layer`` sliced out, a copy each call (logged once)."""
    if config is None and x.shape[0] > PALLAS_MAX_ROWS:
        mosaic_gpu.log_once(
            log,
            f"fp8_matmul: over {PALLAS_MAX_ROWS} rows the weight is dequantized into a "
            "temporary and multiplied by XLA's dot (cuBLAS), faster there than the Pallas "
            "kernel",
        )
        return reference.dequantized_dot(x, weight, scale_inv, blocks=blocks, layer=layer)
    if layer is not None and _wraps_in_triton(weight, interpret):
        mosaic_gpu.log_once(
            log,
            f"fp8_matmul: a stacked weight {jnp.dtype(weight.dtype).name}"
            f"{list(weight.shape)} fills (2 GiB, 4 GiB], which the Triton lowering indexes "
            "with wrapping 32-bit offsets: its layer is copied out for the kernel each call",
        )
        weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
        layer = None
    return fp8_matmul(
        x, weight, scale_inv, blocks=blocks, layer=layer, config=config, interpret=interpret
    )


def _wraps_in_triton(weight: jax.Array, interpret: bool | None) -> bool:
    """Whether the compiled Triton kernel would refuse ``weight``
    (``fp8.check_triton_indexable``); interpret mode indexes it right."""
    if interpret is None:
        interpret = online_softmax.interpret_default()
    return not interpret and fp8.wraps_triton_offsets(weight)
