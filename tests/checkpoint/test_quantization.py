"""FP8 block dequantization (DeepSeek's ``weight_scale_inv`` format) against a float64 loop
over the elements, quantize -> dequantize round trips, config parsing, and reading fp8 from a
safetensors file that PyTorch wrote.

Dequantization is exact: an fp8 value (4 significant bits) times a float32 scale is exact in
float64, so its float32 rounding equals the float32 product. The round trip is bounded by fp8
e4m3 rounding, half an ulp: 2^-4 of the value for normal numbers, 2^-10 x the block scale in
the subnormal range (the float32 division before rounding adds 1e-6 of slack; the worst
element measured reaches 0.9999993 of the bound, so the bound is tight and has no margin to
give).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from fp8_checkpoint import quantize

from mla_jax.checkpoint.fp8_weights import (
    FP8BlockQuantization,
    dequantize,
    parse_quantization_config,
    read_safetensors,
    scale_name,
)
from mla_jax.kernels.fp8 import FP8
from mla_jax.model.config import ConfigError

# (out, in, block): whole blocks, partial edge blocks (DeepSeek's 128 x 128 on odd widths),
# odd block sizes, a block larger than the tensor, one element.
SHAPES = [
    (256, 384, (128, 128)),
    (130, 200, (128, 128)),
    (7, 11, (3, 5)),
    (5, 4, (8, 8)),
    (1, 1, (1, 1)),
]


def _blockwise(weight: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    out = np.empty(weight.shape)
    for i in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            out[i, j] = float(weight[i, j]) * float(scale[i // block[0], j // block[1]])
    return out


@pytest.mark.parametrize("out,inp,block", SHAPES)
def test_dequantize_is_value_times_its_block_scale(out, inp, block, rng):
    q = FP8BlockQuantization(block)
    weight = (rng.standard_normal((out, inp)) * 100).astype(FP8)
    scale = rng.uniform(1e-4, 1e-1, q.scale_shape((out, inp))).astype(np.float32)
    got = dequantize(weight, scale, q)
    assert got.dtype == np.float32 and got.shape == (out, inp)
    np.testing.assert_array_equal(got, _blockwise(weight, scale, block).astype(np.float32))
    bf16 = dequantize(weight, scale, q, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16, got.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("out,inp,block", SHAPES)
def test_round_trip_within_fp8_rounding(out, inp, block, rng):
    q = FP8BlockQuantization(block)
    # Magnitudes spread over six decades, so that blocks hold subnormal fp8 values too.
    weight = rng.standard_normal((out, inp)) * 10.0 ** rng.uniform(-4, 2, (out, inp))
    weight[: block[0], : block[1]] = 0.0  # an all-zero block
    quantized, scale = quantize(weight, q)
    assert quantized.dtype == FP8 and scale.dtype == np.float32
    assert scale.shape == q.scale_shape(weight.shape)
    back = dequantize(quantized, scale, q).astype(np.float64)
    expanded = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:out, :inp]
    bound = np.maximum(2.0**-4 * np.abs(weight), 2.0**-10 * expanded) * (1 + 1e-6)
    assert (np.abs(back - weight) <= bound).all()
    np.testing.assert_array_equal(back[: block[0], : block[1]], 0.0)
    # Each block's largest magnitude maps to fp8's largest, 448; the zero block has scale 1.
    rows, cols = scale.shape
    padded = np.zeros((rows * block[0], cols * block[1]))
    padded[:out, :inp] = np.abs(quantized.astype(np.float32))
    block_max = padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3))
    np.testing.assert_array_equal(block_max[1:], 448.0)
    np.testing.assert_array_equal(block_max[0, 1:], 448.0)
    assert block_max[0, 0] == 0.0 and scale[0, 0] == 1.0


def test_scale_shape_mismatch_is_named(rng):
    q = FP8BlockQuantization((128, 128))
    weight = np.zeros((130, 200), FP8)
    with pytest.raises(ValueError, match=r"expected \[2, 2\]"):
        dequantize(weight, np.ones((1, 2), np.float32), q)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize(np.zeros((130, 200), np.float32), np.ones((2, 2), np.float32), q)


def test_quantization_config_parsed():
    deepseek = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert parse_quantization_config(deepseek) == FP8BlockQuantization((128, 128))
    assert parse_quantization_config({"quant_method": "fp8", "weight_block_size": [3, 5]}) == (
        FP8BlockQuantization((3, 5))
    )
    assert parse_quantization_config(None) is None
    assert scale_name("model.layers.0.mlp.down_proj.weight").endswith("down_proj.weight_scale_inv")


@pytest.mark.parametrize(
    "config,match",
    [
        ({"quant_method": "awq", "bits": 4}, r"quantization method 'awq' is not supported \("),
        ({"bits": 4}, "quantization method None is not supported"),
        ({"quant_method": "fp8"}, "without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "two positive integers"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [1, 1]}, "e5m2"),
        ("fp8", "must be an object"),
    ],
)
def test_bad_quantization_config_is_refused(config, match):
    with pytest.raises(ConfigError, match=match) as error:
        parse_quantization_config(config)
    assert "\n" not in str(error.value)
    if isinstance(config, dict) and config.get("quant_method") == "awq":
        assert "supported: fp8" in str(error.value)


def test_reads_fp8_safetensors_written_by_torch(tmp_path, rng):
    """A DeepSeek-style pair written by PyTorch, read and dequantized here, equals PyTorch's
    own dequantization."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    block = (4, 8)
    weight = torch.from_numpy(rng.standard_normal((10, 20)).astype(np.float32) * 50)
    weight = weight.to(torch.float8_e4m3fn)
    scale = torch.from_numpy(rng.uniform(0.01, 1.0, (3, 3)).astype(np.float32))
    name = "model.layers.0.mlp.gate_proj.weight"
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({name: weight, scale_name(name): scale}, str(path))
    got_weight, got_scale = read_safetensors(path, name), read_safetensors(path, scale_name(name))
    assert got_weight.dtype == FP8 and got_scale.dtype == np.float32
    np.testing.assert_array_equal(got_weight.astype(np.float32), weight.float().numpy())
    full_scale = scale.repeat_interleave(block[0], 0)[:10].repeat_interleave(block[1], 1)[:, :20]
    want = (weight.float() * full_scale).numpy()
    np.testing.assert_array_equal(
        dequantize(got_weight, got_scale, FP8BlockQuantization(block)), want
    )
    with pytest.raises(KeyError, match="no tensor"):
        read_safetensors(path, "missing")
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert json.loads(path.read_bytes()[8 : 8 + header_len])[name]["dtype"] == "F8_E4M3"
