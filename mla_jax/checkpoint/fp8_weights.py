"""FP8 block-quantized checkpoints as DeepSeek publishes them (V3, R1): dequantized at load
time, tensor by tensor, with NumPy.

A quantized linear weight ``W [out, in]`` is stored as ``float8_e4m3fn`` next to a float32
``<name>_scale_inv [cdiv(out, bo), cdiv(in, bi)]`` (``model.layers.3.mlp.gate_proj.weight``
and ``model.layers.3.mlp.gate_proj.weight_scale_inv``), where ``config.json`` says
``"quantization_config": {"quant_method": "fp8", "weight_block_size": [bo, bi], ...}``. The
dequantized value is the fp8 value times the scale of its ``bo x bi`` block; the blocks at the
bottom and right edges may be partial. Tensors without a ``_scale_inv`` companion (norms,
embeddings, the router, ``lm_head``) are stored unquantized.

``safetensors``' NumPy reader does not know fp8 (``numpy`` has no such dtype), so
``read_safetensors`` reads one tensor from the file's header and bytes with ``ml_dtypes``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from mla_jax.kernels.fp8 import FP8
from mla_jax.model.config import ConfigError

SCALE_SUFFIX = "_scale_inv"
SUPPORTED_METHODS = ("fp8",)


@dataclasses.dataclass(frozen=True)
class FP8BlockQuantization:
    """``weight_block_size = (bo, bi)``: one float32 scale per ``bo`` rows x ``bi`` columns of
    an ``[out, in]`` weight."""

    weight_block_size: tuple[int, int] = (128, 128)

    def __post_init__(self):
        size = self.weight_block_size
        if (
            len(size) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in size)
            or min(size) < 1
        ):
            raise ConfigError(f"weight_block_size must be two positive integers, got {size!r}")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``[cdiv(out, bo), cdiv(in, bi)]``: the scale grid of an ``[out, in]`` weight."""
        (out, inp), (bo, bi) = shape, self.weight_block_size
        return math.ceil(out / bo), math.ceil(inp / bi)


def parse_quantization_config(quantization: Any) -> FP8BlockQuantization | None:
    """A ``config.json``'s ``quantization_config`` (None: unquantized). Only DeepSeek's
    block-wise fp8 (e4m3) weights are accepted; anything else is refused in one line naming
    the method and the accepted ones."""
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ConfigError(
            f"config.json field 'quantization_config' must be an object: {quantization!r}"
        )
    method = quantization.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ConfigError(
            f"quantization method {method!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_METHODS)} with weight_block_size)"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"fp8 format {fmt!r} is not supported (only e4m3)")
    block = quantization.get("weight_block_size")
    if block is None:
        raise ConfigError(
            "quantization_config: fp8 without weight_block_size (per-tensor fp8) is not "
            "supported; DeepSeek's checkpoints give [128, 128]"
        )
    if not isinstance(block, list | tuple):
        raise ConfigError(f"weight_block_size must be a list of two integers, got {block!r}")
    return FP8BlockQuantization(tuple(block))


def scale_name(weight_name: str) -> str:
    """The scale tensor of a quantized weight: ``...weight`` -> ``...weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def dequantize(
    weight: np.ndarray,
    scale_inv: np.ndarray,
    quantization: FP8BlockQuantization,
    dtype: Any = np.float32,
) -> np.ndarray:
    """``weight [out, in]`` float8_e4m3fn times the scale of its block -> ``[out, in]`` in
    ``dtype`` (float32, or ``ml_dtypes.bfloat16``), computed in float32.

    ``scale_inv`` is float32 ``[cdiv(out, bo), cdiv(in, bi)]`` (DeepSeek's name: the inverse
    of the scale that quantized it). Raises ValueError naming the shapes when they disagree.
    """
    if weight.dtype != FP8 or weight.ndim != 2:
        raise ValueError(
            f"fp8 weight must be float8_e4m3fn [out, in], got {weight.dtype}{list(weight.shape)}"
        )
    want = quantization.scale_shape(weight.shape)
    if scale_inv.shape != want:
        raise ValueError(
            f"scale_inv {list(scale_inv.shape)} does not fit weight {list(weight.shape)} with "
            f"blocks {list(quantization.weight_block_size)} (expected {list(want)})"
        )
    (out, inp), (bo, bi) = weight.shape, quantization.weight_block_size
    # Block scales broadcast over a [rows, bo, cols, bi] view of the weight; the edge blocks are
    # handled by padding that view, then cut off.
    padded = np.zeros((want[0] * bo, want[1] * bi), np.float32)
    padded[:out, :inp] = weight
    blocks = padded.reshape(want[0], bo, want[1], bi)
    blocks *= scale_inv.astype(np.float32)[:, None, :, None]
    return padded[:out, :inp].astype(dtype)


# safetensors dtype names -> NumPy dtypes, those the loader may meet in a DeepSeek checkpoint.
_DTYPES = {
    "F8_E4M3": np.dtype(FP8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
}


def read_safetensors(path: str | os.PathLike, name: str) -> np.ndarray:
    """Tensor ``name`` of a safetensors file as a NumPy array (fp8 as ``float8_e4m3fn``),
    read from the file's header and bytes: ``safetensors``' NumPy reader has no fp8."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        if name not in header:
            raise KeyError(f"{path} holds no tensor {name!r}")
        entry = header[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"{path}: {name} has dtype {entry['dtype']}, not one of {list(_DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, _DTYPES[entry["dtype"]]).reshape(entry["shape"])
