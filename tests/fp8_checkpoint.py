"""FP8 block quantization of weights, the inverse of the loader's dequantization: what the
tests write DeepSeek-V3-style FP8 checkpoints with (the library only reads them)."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from mla_jax.checkpoint.fp8_weights import (
    FP8,
    FP8_MAX,
    FP8BlockQuantization,
    dequantize,
    scale_name,
)


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


def quantize_checkpoint(model_dir, quantization: FP8BlockQuantization) -> dict[str, np.ndarray]:
    """Rewrites the single-file HF checkpoint in ``model_dir`` as DeepSeek publishes FP8 ones:
    every linear layer's weight (``*_proj.weight``, ``kv_a_proj_with_mqa.weight``; not the
    embedding, ``lm_head`` or the router) in float8_e4m3fn beside its float32
    ``*.weight_scale_inv``, and ``quantization_config`` in config.json. Returns each
    quantized weight dequantized (float32 ``[out, in]``), what the loader must give back."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    dequantized = {}
    for name, tensor in list(tensors.items()):
        if re.search(r"_proj(_with_mqa)?\.weight$", name):
            weight, scale = quantize(tensor.float().numpy(), quantization)
            tensors[name] = torch.from_numpy(weight.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[scale_name(name)] = torch.from_numpy(scale)
            dequantized[name] = dequantize(weight, scale, quantization)
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": list(quantization.weight_block_size),
    }
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dequantized
