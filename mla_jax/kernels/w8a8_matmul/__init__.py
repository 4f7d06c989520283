"""The matmul of ``x [M, K]`` and an FP8 weight in HF's ``[N, K]`` layout with DeepSeek's
128 x 128 block scales on Hopper's FP8 tensor cores, the activations quantized per token and
128 columns (w8a8, as DeepSeek's inference runs it), and its pure-jnp reference
(``reference.w8a8_matmul``, the same signature); and its grouped form for the MoE layer's
routed experts, ``grouped_w8a8_matmul`` (``grouped_matmul``'s contract over ``[G, N, K]``
FP8 weights). The Hopper kernel set runs it over the projections whose bf16 rows it takes
(``pays_off``); the other FP8 products convert the weight's tiles into 16 bits
(``fp8_matmul``)."""

from __future__ import annotations

import jax.numpy as jnp

from . import reference
from .pallas_mosaic_gpu import (
    BLOCK,
    WARPGROUP_ROWS,
    W8A8MatmulConfig,
    grouped_row_tile,
    grouped_unsupported,
    grouped_w8a8_matmul,
    unsupported,
    w8a8_matmul,
)

__all__ = [
    "reference",
    "BLOCK",
    "WARPGROUP_ROWS",
    "W8A8MatmulConfig",
    "grouped_row_tile",
    "grouped_unsupported",
    "grouped_w8a8_matmul",
    "FEW_ROWS",
    "SHALLOW_DEPTH",
    "pays_off",
    "unsupported",
    "w8a8_matmul",
]


# Where the Triton weight-only kernel runs instead: up to this many rows of a projection
# this shallow (K), w8a8's programs have too few steps to pay for their start. V3's
# q_b_proj (K = 1536) at 1, 8, 16 and 32 rows took 14.7, 15.9, 14.8 and 17.6 us on it
# against w8a8's 19.1, 19.4, 19.8 and 21.2, at 64 rows 33.7 against 18.9 (bf16 weight:
# 27.6); the MLP's down_proj (K = 18432) at 1-8 rows 54.9-59.4 against 51.0-51.6 (H100,
# 2026-12-06, a trial and ``benchmarks/fp8_matmul.json``).
FEW_ROWS = 32
SHALLOW_DEPTH = 2048


def pays_off(x: jnp.ndarray) -> bool:
    """Whether the Hopper set takes ``x [M, K]`` times an FP8 projection to w8a8 (where the
    kernel takes the weight): bfloat16 rows, unless there are at most ``FEW_ROWS`` of them
    and K is at most ``SHALLOW_DEPTH``.

    At 64 rows of V3's o_proj, gate_proj and down_proj it took 0.57-0.59x the bf16 weight's
    time (the Triton FP8 kernel 1.05-1.09x), of q_b_proj 0.68x; at a prefill's 8192 rows
    0.77-0.80x and 0.90x, where ``fp8_matmul.fastest``'s bf16 temporary of the weight for
    cuBLAS took 1.04-1.07x (H100, 2026-12-06, ``benchmarks/fp8_matmul.json``)."""
    m, k = x.shape
    return x.dtype == jnp.bfloat16 and not (m <= FEW_ROWS and k <= SHALLOW_DEPTH)
