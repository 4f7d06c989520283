"""``quantize_rows`` as a Pallas kernel (Triton lowering): each program reads a block of
``BLOCK_ROWS`` rows by 128 columns of x once and writes their e4m3 values and scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import fp8, matmul_steps, online_softmax

GROUP = 128  # columns a scale covers (DeepSeek's activation groups; the weight's blocks)
# Rows a program quantizes: 32 and 64 took the same time at V3's shapes over 8192 tokens
# (H100, 2026-12-06, a trial).
BLOCK_ROWS = 32
NUM_WARPS = 4
# float32's exponent field: amax = 1.f x 2^(E - 127) = (1.f / 2) x 2^(E - 126), frexp's
# mantissa above 0.875 where f is above 0.75.
_MANTISSA_BITS = 23
_THREE_QUARTERS = 3 << (_MANTISSA_BITS - 2)


def check(x: jax.Array, num_rows: int | None = None) -> None:
    """Refuses, in one line naming it, an argument ``quantize_rows`` does not take."""
    if x.ndim != 2 or x.shape[1] % GROUP or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(
            f"quantize_rows: x [M, K] bfloat16 or float32 with K a multiple of {GROUP}, got "
            f"{x.dtype}{list(x.shape)}"
        )
    if num_rows is not None and num_rows < x.shape[0]:
        raise ValueError(f"quantize_rows: {num_rows} rows for x's {x.shape[0]}")


def _kernel(x_ref, values_ref, scales_ref):
    block, group = pl.program_id(0), pl.program_id(1)
    rows = block * BLOCK_ROWS + jnp.arange(BLOCK_ROWS, dtype=jnp.int32)
    columns = group * GROUP + jnp.arange(GROUP, dtype=jnp.int32)
    # Index arrays, not slices: the last block may pass the rows' end (a slice's start would
    # be clamped where the arrays are interpreted, shifting the masked rows).
    tile = (rows[:, None], columns[None, :])
    in_x, in_out = rows < x_ref.shape[0], rows < values_ref.shape[0]
    x = plgpu.load(x_ref.at[tile], mask=in_x[:, None], other=0).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1)
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    rounds_up = (bits & ((1 << _MANTISSA_BITS) - 1)) > _THREE_QUARTERS
    exponent = (bits >> _MANTISSA_BITS) - 126 - 9 + rounds_up.astype(jnp.int32)
    # frexp(0) is (0, 0): the reference's scale of a zero group is 2^-9.
    exponent = jnp.where(amax == 0, -9, jnp.clip(exponent, -126, 126))
    values = x * matmul_steps.power_of_two(-exponent)[:, None]
    plgpu.store(values_ref.at[tile], values.astype(fp8.FP8), mask=in_out[:, None])
    plgpu.store(scales_ref.at[group, rows], matmul_steps.power_of_two(exponent), mask=in_out)


def quantize_rows(
    x: jax.Array, num_rows: int | None = None, *, interpret: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` as the w8a8 kernels read it, x read once.

    Args:
      x: ``[M, K]`` bfloat16 or float32, K a multiple of 128 (finite: an infinite or NaN
        group's scale is not defined).
      num_rows: R, the rows of the result (at least M; None: M); rows past M are zero.
      interpret: Pallas' interpret mode (None: off a GPU).

    Returns:
      ``values [R, K]`` float8_e4m3fn and ``scales [K / 128, R]`` float32: ``values x
      scales`` (each scale over its row's 128 columns) is x rounded to e4m3's 3 mantissa
      bits. A group's scale is the smallest power of two at or above ``amax / 448``, so
      nothing saturates, found from amax's exponent bits with no rounded division (every
      backend picks the same scale; dividing by a power of two is exact); DeepSeek's
      ``act_quant`` takes ``amax / 448`` itself, and as e4m3 rounds relative to a value's
      own exponent a power of two costs no precision.
    """
    check(x, num_rows)
    if interpret is None:
        interpret = online_softmax.interpret_default()
    m, k = x.shape
    rows = m if num_rows is None else num_rows
    return pl.pallas_call(
        _kernel,
        grid=(pl.cdiv(rows, BLOCK_ROWS), k // GROUP),
        out_shape=(
            jax.ShapeDtypeStruct((rows, k), fp8.FP8),
            jax.ShapeDtypeStruct((k // GROUP, rows), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="quantize_rows",
    )(x)
