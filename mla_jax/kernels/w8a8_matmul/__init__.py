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
    quantize_rows,
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
    "pays_off",
    "quantize_rows",
    "unsupported",
    "w8a8_matmul",
]


def pays_off(x: jnp.ndarray) -> bool:
    """Whether the Hopper set takes ``x [M, K]`` times an FP8 projection to w8a8 (where the
    kernel takes the weight): bfloat16 rows, any number.

    At decode's rows, on V3's projections at 1, 16 and 64 rows, it beat the Triton FP8
    kernel in 17 of 18 cases (0.54-0.98x its time; the shared experts' gate_proj at 16 rows:
    12.2 against 12.0 us) and the bf16 weight on the wide ones (o_proj, the dense MLP:
    0.70-0.85x; H200, 2026-12-06, ``benchmarks/skinny_matmul_fp8.json``). At a prefill's
    8192 rows it took 0.84x (o_proj) and 0.79x (gate_proj) the time of the weight
    dequantized into a bf16 temporary then cuBLAS, which ``fp8_matmul.fastest`` runs there,
    and 0.90x and 0.84x the bf16 weight's (H100, 2026-12-06, a trial script; in
    ``benchmarks/fp8_matmul.json`` of the same day 0.82-0.93x the bf16 weight's on V3's
    projections at 8192 rows, 0.79-0.89x the dequantized weight's). At one row ``q_b_proj``
    (K = 1536) took 28.0 us against the Triton FP8 kernel's 14.7 in that table: not
    refined here yet."""
    return x.dtype == jnp.bfloat16
