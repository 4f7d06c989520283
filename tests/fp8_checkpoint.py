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
