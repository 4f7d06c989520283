"""FP8 block quantization of weights, the inverse of the loader's dequantization: what the
tests write DeepSeek-V3-style FP8 checkpoints with (the library only reads them)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from mla_jax.checkpoint.fp8_weights import (
    FP8BlockQuantization,
    dequantize,
    scale_name,
)
from mla_jax.kernels.fp8 import E4M3_MAX, FP8


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
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    quantized = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :inp]
    return quantized.astype(FP8), scale


def write_fp8_checkpoint(path, seed: int, blocks: FP8BlockQuantization):
    """A V3 MoE checkpoint (``hf_checkpoints.v3_moe``) as DeepSeek publishes V3: every
    projection matrix of the decoder layers, the routed experts' included, in
    float8_e4m3fn with ``weight_scale_inv`` block scales of ``blocks``; the embedding,
    norms, router and ``lm_head`` in float32. Returns ``(transformers model on the
    dequantized weights, float32, eval mode; the names of the fp8 tensors)``."""
    import json

    import torch
    from hf_checkpoints import v3_moe
    from safetensors.torch import load_file, save_file

    from mla_jax.checkpoint.fp8_weights import dequantize

    def round_trip(weight: np.ndarray, name: str) -> np.ndarray:
        quantized[name] = quantize(weight, blocks)
        return dequantize(*quantized[name], blocks)

    cls, cfg, _ = v3_moe()
    torch.manual_seed(seed)
    hf = cls(cfg).float().eval()
    quantized = {}  # HF tensor name -> (fp8 weight, scale_inv)
    inter = cfg.moe_intermediate_size
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
                continue
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            w = p.numpy()
            if name.endswith(("proj.weight", "proj_with_mqa.weight")) and p.ndim == 2:
                p.copy_(torch.from_numpy(round_trip(w, name)))
            elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up
                prefix = name[: -len("gate_up_proj")]
                for e in range(w.shape[0]):
                    for half, proj in ((slice(0, inter), "gate"), (slice(inter, None), "up")):
                        tensor = f"{prefix}{e}.{proj}_proj.weight"
                        w[e, half] = round_trip(w[e, half], tensor)
                p.copy_(torch.from_numpy(w))
            elif name.endswith("experts.down_proj"):  # [E, H, I]
                prefix = name[: -len("down_proj")]
                for e in range(w.shape[0]):
                    w[e] = round_trip(w[e], f"{prefix}{e}.down_proj.weight")
                p.copy_(torch.from_numpy(w))
    hf.save_pretrained(path, safe_serialization=True)
    tensors = load_file(path / "model.safetensors")
    for name, (weight, scale) in quantized.items():
        assert name in tensors, name
        tensors[name] = torch.from_numpy(weight.view(np.uint8)).view(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.from_numpy(scale)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": list(blocks.weight_block_size),
    }
    (path / "config.json").write_text(json.dumps(config))
    return hf, sorted(quantized)


def quantize_checkpoint(model_dir, quantization: FP8BlockQuantization) -> dict[str, np.ndarray]:
    """Rewrites the single-file HF checkpoint in ``model_dir`` as DeepSeek publishes FP8 ones:
    every linear layer's weight (``*_proj.weight``, ``kv_a_proj_with_mqa.weight``; not the
    embedding, ``lm_head`` or the router) in float8_e4m3fn beside its float32
    ``*.weight_scale_inv``, and ``quantization_config`` in config.json. Returns each
    quantized weight dequantized (float32 ``[out, in]``), what the loader must give back.
    Writes through torch (safetensors' NumPy API has no float8): skips the test without it."""
    torch = pytest.importorskip("torch")
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
