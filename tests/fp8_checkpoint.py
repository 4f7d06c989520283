"""FP8 block quantization of weights, the inverse of the loader's dequantization: what the
tests write DeepSeek-V3-style FP8 checkpoints with (the library only reads them)."""

from __future__ import annotations

import numpy as np

from mla_jax.checkpoint.fp8_weights import FP8, FP8_MAX, FP8BlockQuantization


def quantize(
    weight: np.ndarray, quantization: FP8BlockQuantization
) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``dequantize`` up to fp8 rounding: each
    block scaled so that its largest magnitude maps to fp8's largest (448). Returns
    ``(weight float8_e4m3fn [out, in], scale_inv float32 [cdiv(out, bo), cdiv(in, bi)])``; an
    all-zero block gets scale 1."""
    weight = np.asarray(weight, np.float32)
    (out, inp), (bo, bi) = weight.shape, quantization.weight_block_size
    rows, cols = quantization.scale_shape(weight.shape)
    padded = np.zeros((rows * bo, cols * bi), np.float32)
    padded[:out, :inp] = weight
    blocks = padded.reshape(rows, bo, cols, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    quantized = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :inp]
    return quantized.astype(FP8), scale
