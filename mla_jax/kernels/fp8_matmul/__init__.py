"""The FP8 weight-only matmul of the decoder's projections: the Pallas kernel (Triton
lowering), its pure-jnp reference (``reference.fp8_matmul``, the same signature) and
``fastest``, what the Triton kernel set runs: by row count (static, at trace time), the path
measured fastest (``scripts/bench_fp8_matmul.py``). ``decode_on_mosaic_gpu``, what the Hopper
set runs, takes deep weights at decode's rows to the Mosaic GPU skinny matmul."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .. import fp8, fp8_blocks, matmul_steps, mosaic_gpu, online_softmax, skinny_matmul
from ..grouped_matmul import pallas_mosaic_gpu as grouped_mosaic_gpu
from . import reference
from .pallas_triton import Fp8MatmulConfig, fp8_matmul

__all__ = [
    "reference",
    "Fp8MatmulConfig",
    "fp8_matmul",
    "fastest",
    "decode_on_mosaic_gpu",
    "skinny_pays_off",
    "prefill_on_mosaic_gpu",
    "PALLAS_MAX_ROWS",
    "SKINNY_MIN_K",
]

log = logging.getLogger(__name__)

# Up to this many rows (decode) the Pallas kernel streams the fp8 weight once; above it
# (prefill) a bf16 temporary of the weight and cuBLAS win: on an H200 the kernel is 3-5x
# cuBLAS's bf16 time at 8192 rows, the temporary plus cuBLAS about 1.1x, and at 64 rows the
# temporary alone costs 2-3x the bf16 matmul (benchmarks/fp8_matmul.json).
PALLAS_MAX_ROWS = 256
# From this K up, at decode's rows (up to ``skinny_matmul.MAX_ROWS``), the Mosaic GPU skinny
# matmul beats the Triton kernel over an FP8 weight: V3's o_proj [16384, 7168] and
# down_proj [18432, 7168] took 0.78-0.90x its time at 1, 16 and 64 rows; over K = 7168
# (q_a_proj, the shared experts' gate_proj) it was 1.11-1.23x at 16 and 64 rows
# (H200, 2026-12-04, benchmarks/skinny_matmul_fp8.json).
SKINNY_MIN_K = 16384


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
    """``x @ dequantize(weight, scale_inv)`` (``fp8_matmul``'s signature and result): the
    Pallas kernel up to ``PALLAS_MAX_ROWS`` rows (or with an explicit ``config``), else
    ``reference.dequantized_dot`` (the choice logged once per kind). A stack the Triton
    lowering would index wrongly (``fp8.check_triton_indexable``) gives the kernel its
    ``layer`` sliced out, a copy each call (logged once)."""
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


def skinny_pays_off(rows: int, depth: int) -> bool:
    """Whether ``decode_on_mosaic_gpu`` takes ``rows`` of x times an FP8 weight of ``depth``
    rows (K) to the skinny matmul (where that kernel takes the shape)."""
    return rows <= skinny_matmul.MAX_ROWS and depth >= SKINNY_MIN_K


def decode_on_mosaic_gpu(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """``fastest``'s signature and result; at decode's rows (up to ``skinny_matmul.MAX_ROWS``)
    over a weight of at least ``SKINNY_MIN_K`` rows, where it takes the product, the Mosaic
    GPU skinny matmul (a stack read in place at ``layer``), else ``fastest``; either choice
    for such a product said once."""
    if skinny_pays_off(x.shape[0], weight.shape[-2]):
        shape = list(weight.shape[-2:])
        reason = skinny_matmul.unsupported(x, weight, blocks=blocks)
        if reason is None:
            mosaic_gpu.log_once(
                log,
                f"fp8_matmul: the Mosaic GPU skinny matmul for {shape} at up to "
                f"{skinny_matmul.MAX_ROWS} rows (K from {SKINNY_MIN_K}: faster there than the "
                "Triton kernel)",
            )
            return skinny_matmul.skinny_matmul(
                x, weight, scale_inv=scale_inv, blocks=blocks, layer=layer
            )
        mosaic_gpu.log_once(
            log, f"fp8_matmul: {shape} not on the Mosaic GPU skinny matmul ({reason})"
        )
    return fastest(x, weight, scale_inv, blocks=blocks, layer=layer)


def prefill_on_mosaic_gpu(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """``fastest``'s signature and result; over ``PALLAS_MAX_ROWS`` rows, where it takes the
    product, the Mosaic GPU grouped matmul with one group instead (a stack's ``layer`` its
    group offset: the FP8 weight read in place, no bf16 temporary), else ``fastest`` (said
    once). In no kernel set yet: ``scripts/bench_fp8_matmul.py`` times it at prefill's rows."""
    if x.shape[0] > PALLAS_MAX_ROWS:
        stack, scales, index = matmul_steps.as_stack(weight, scale_inv, layer)
        config = grouped_mosaic_gpu.MosaicGroupedMatmulConfig.for_weight(stack.shape[-1], blocks)
        reason = grouped_mosaic_gpu.unsupported(x, stack, config, blocks)
        if reason is None:
            return grouped_mosaic_gpu.grouped_matmul(
                x,
                stack,
                jnp.full((1,), x.shape[0], jnp.int32),
                group_offset=index[0],
                rhs_scale_inv=scales,
                blocks=blocks,
                config=config,
            )
        mosaic_gpu.log_once(
            log,
            f"fp8_matmul: {list(stack.shape[-2:])} not on the Mosaic GPU grouped matmul ({reason})",
        )
    return fastest(x, weight, scale_inv, blocks=blocks, layer=layer)
