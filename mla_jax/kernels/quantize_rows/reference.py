"""The pure-jnp reference of ``quantize_rows``: the same signature and the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8, matmul_steps
from .pallas_triton import GROUP, check


def quantize_rows(
    x: jax.Array, num_rows: int | None = None, *, interpret: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` quantized per row and 128 columns (``pallas_triton.quantize_rows``'s
    contract): ``values [R, K]`` float8_e4m3fn and ``scales [K / 128, R]`` float32, ``R =
    num_rows`` (None: M), rows past M zero.

    Through ``frexp``: ``amax = mantissa x 2^e`` with the mantissa in [0.5, 1), and the
    scale ``2^(e - 9)``, or ``2^(e - 8)`` where the mantissa is above 0.875 (``448 = 0.875 x
    2^9``); ``frexp(0)`` gives ``e = 0``."""
    del interpret
    check(x, num_rows)
    m, k = x.shape
    rows = m if num_rows is None else num_rows
    groups = jnp.pad(x.astype(jnp.float32), ((0, rows - m), (0, 0)))
    groups = groups.reshape(rows, k // GROUP, GROUP)
    mantissa, exponent = jnp.frexp(jnp.max(jnp.abs(groups), axis=-1))
    # Both powers of two stay normal float32 numbers (a bf16 amax's exponent is at most 128).
    exponent = jnp.clip(exponent - 9 + (mantissa > 0.875), -126, 126)
    values = (groups * matmul_steps.power_of_two(-exponent)[..., None]).astype(fp8.FP8)
    return values.reshape(rows, k), matmul_steps.power_of_two(exponent).T
