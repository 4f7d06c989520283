"""``quantize_rows`` (the Pallas kernel, interpreted on the CPU and compiled on a GPU, and its
jnp reference) against float64 NumPy from DeepSeek's formula: a float32 scale ``amax /
448`` per row and 128 columns (here the smallest power of two at or above it), the values
rounded to e4m3. Exact: the same bits are asked of both (``ml_dtypes`` rounds to nearest
even, as the GPU's conversion does)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_jax.kernels import quantize_rows as quantize

PATHS = {"kernel": quantize.quantize_rows, "reference": quantize.reference.quantize_rows}


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] in float64: its e4m3 values and their scales [M, K / 128], each group over
    the smallest power of two at or above its amax / 448 (float64 divides a bf16 amax by
    448 without crossing a power of two)."""
    m, k = x.shape
    groups = x.astype(np.float64).reshape(m, k // 128, 128)
    mantissa, exponent = np.frexp(np.abs(groups).max(axis=-1) / 448.0)
    scales = np.ldexp(1.0, exponent - (mantissa == 0.5))  # 2^exponent unless v is 2^(e-1)
    scales = np.where(groups.any(axis=-1), scales, 2.0**-9)  # an all-zero group: 2^-9
    values = (groups / scales[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return values.reshape(m, k), scales


def _x(rng, m, k):
    """bf16 x [m, k] over many magnitudes: one 128-column group of zeros in row 0, one whose
    amax / 448 is a power of two in row 1, one of e4m3's top value there."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-20, 20, (m, 1)))
    x[0, :128] = 0.0
    x[1, 128:256] = np.clip(x[1, 128:256], -3.0, 3.0)
    x[1, 130] = 3.5  # 448 x 2^-7: its own scale's top value, 448
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,k,num_rows", [(5, 256, None), (5, 256, 64), (70, 384, 100)])
def test_matches_float64(rng, path, m, k, num_rows):
    """The values' bits and the scales as the formula gives them, rows past M zero (100
    rows: the kernel's last block of 32 rows passes the end)."""
    x = _x(rng, m, k)
    values, scales = PATHS[path](x, num_rows)
    rows = m if num_rows is None else num_rows
    assert values.shape == (rows, k) and values.dtype == jnp.float8_e4m3fn
    assert scales.shape == (k // 128, rows) and scales.dtype == jnp.float32
    want_values, want_scales = quantized_rows(np.asarray(x, np.float32))
    got = np.asarray(values)
    np.testing.assert_array_equal(got[:m].view(np.uint8), want_values.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales)[:, :m], want_scales.T)
    assert not got[m:].astype(np.float32).any()
    assert float(scales[1, 1]) == 2.0**-7


@pytest.mark.parametrize(
    "shape,dtype,num_rows,message",
    [
        ((4, 200), jnp.bfloat16, None, "K a multiple of 128"),
        ((4, 128), jnp.float16, None, "bfloat16 or float32"),
        ((4, 128), jnp.bfloat16, 3, "3 rows for x's 4"),
    ],
)
def test_refuses(shape, dtype, num_rows, message):
    for quantize_fn in PATHS.values():
        with pytest.raises(ValueError, match=message):
            quantize_fn(jnp.zeros(shape, dtype), num_rows)
