from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mla_jax.checkpoint import loader
from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization, scale_name
from mla_jax.checkpoint.hf_config import config_from_dict, config_to_dict
from mla_jax.checkpoint.loader import WeightsError, load_model, save_checkpoint
from mla_jax.model.config import MLAConfig, ModelConfig
from mla_jax.model.deepseek import DeepseekModel

CFG = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=40,
    num_layers=2,
    intermediate_size=24,
    num_nextn_predict_layers=1,
    mla=MLAConfig(
        hidden_size=16,
        num_heads=2,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    ),
)


@pytest.fixture
def ckpt(tmp_path):
    save_checkpoint(DeepseekModel(CFG, rngs=nnx.Rngs(3)), tmp_path)
    return tmp_path


def _params(model):
    return {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _shard(ckpt, sharded):
    """Rewrites the checkpoint ``ckpt`` as two shards and an index under ``sharded``."""
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((ckpt / "config.json").read_text())
    return sharded


def _truncate(file):
    file.write_bytes(file.read_bytes()[:-100])


def test_sharded_equals_single_file(ckpt, tmp_path_factory):
    _, single = load_model(ckpt)
    _, model = load_model(_shard(ckpt, tmp_path_factory.mktemp("sharded")))
    a, b = _params(single), _params(model)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_bfloat16_load(ckpt):
    _, model = load_model(ckpt, dtype=jnp.bfloat16)
    assert {v.dtype for v in _params(model).values()} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_checkpoint_loads(tmp_path, dtype):
    """DeepSeek publishes bfloat16 checkpoints; they load exactly, in any dtype."""
    saved = DeepseekModel(CFG, param_dtype=dtype, rngs=nnx.Rngs(3))
    save_checkpoint(saved, tmp_path)
    _, model = load_model(tmp_path, dtype=jnp.float32)
    a, b = _params(saved), _params(model)
    assert all((a[k].astype(np.float32) == b[k]).all() for k in a)


@pytest.mark.parametrize("dtype,code", [(np.int32, "I32"), (np.int8, "I8"), (np.uint8, "U8")])
def test_integer_tensor_is_refused_by_name(ckpt, dtype, code):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: t[name].astype(dtype)}))
    with pytest.raises(WeightsError, match=rf"tensor {name} has dtype {code}; weights must be"):
        load_model(ckpt)


def test_truncated_checkpoint_is_named(ckpt, tmp_path_factory):
    sharded = _shard(ckpt, tmp_path_factory.mktemp("sharded"))
    _truncate(ckpt / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.safetensors is not a readable safetensors"):
        load_model(ckpt)
    _truncate(sharded / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightsError, match=r"model-00002-of-00002\.safetensors is not a readable"):
        load_model(sharded)


def test_broken_index_is_named(ckpt, tmp_path_factory):
    sharded = _shard(ckpt, tmp_path_factory.mktemp("sharded"))
    index = sharded / "model.safetensors.index.json"
    index.write_text('{"weight_map": {')
    with pytest.raises(WeightsError, match=r"index\.json is not valid JSON"):
        load_model(sharded)
    index.write_text("[]")
    with pytest.raises(WeightsError, match=r"index\.json has no 'weight_map' object"):
        load_model(sharded)


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(
        WeightsError, match=r"lacks tensors: model\.layers\.1\.self_attn\.kv_b_proj"
    ):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.bogus": np.ones(3, np.float32)}))
    with pytest.raises(
        WeightsError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.bogus"
    ):
        load_model(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(ckpt, lambda t: t.update({name: np.ones((16, 9), np.float32)}))
    with pytest.raises(
        WeightsError, match=rf"{name} has shape \(16, 9\), the config needs \(16, 8\)"
    ):
        load_model(ckpt)


def test_mtp_layer_and_rotary_buffers_are_ignored(ckpt):
    extra = {
        "model.layers.2.self_attn.q_a_proj.weight": np.ones((8, 16), np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32),
    }
    _rewrite(ckpt, lambda t: t.update(extra))
    load_model(ckpt)


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(CFG)))
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}})
    )
    with pytest.raises(WeightsError, match="missing shard gone.safetensors"):
        load_model(tmp_path)


def _moe_config():
    d = dict(
        config_to_dict(CFG),
        n_routed_experts=4,
        first_k_dense_replace=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=8,
        n_shared_experts=1,
    )
    return config_from_dict(d)


def test_moe_checkpoint_round_trips_per_expert(tmp_path):
    """Layer 1 is MoE: its experts are stacked in the model and stored per expert under
    DeepSeek's names; a save/load round trip gives back every parameter."""
    model = DeepseekModel(_moe_config(), rngs=nnx.Rngs(5))
    save_checkpoint(model, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    loaded = _params(load_model(tmp_path)[1])
    for name, value in _params(model).items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_missing_or_misshaped_expert_is_named(tmp_path):
    save_checkpoint(DeepseekModel(_moe_config(), rngs=nnx.Rngs(5)), tmp_path)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=f"lacks tensors: {name}"):
        load_model(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({name: np.ones((8, 15), np.float32)}))
    with pytest.raises(
        WeightsError, match=rf"{name} has shape \(8, 15\), the config needs \(8, 16\)"
    ):
        load_model(tmp_path)


# -- FP8 checkpoints -----------------------------------------------------------------------

BLOCKS = FP8BlockQuantization((4, 3))  # partial blocks at the right edge of every matrix


@pytest.fixture
def fp8_ckpt(ckpt):
    """``ckpt`` with its projections in float8_e4m3fn and block scales; and each quantized
    weight dequantized."""
    from fp8_checkpoint import quantize_checkpoint

    return ckpt, quantize_checkpoint(ckpt, BLOCKS)


def _rewrite_fp8(path, edit):
    """``_rewrite`` through torch, which reads and writes float8_e4m3fn tensors."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    tensors = load_torch(path / "model.safetensors")
    edit(tensors)
    save_torch(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def headers_only(monkeypatch):
    """Fails a load that reads an fp8 tensor's data: what the headers show is refused first."""

    def read(path, name):
        raise AssertionError(f"read the data of {name} before checking every header")

    monkeypatch.setattr(loader, "read_safetensors", read)


def test_fp8_checkpoint_loads_dequantized(fp8_ckpt, tmp_path_factory):
    ckpt, dequantized = fp8_ckpt
    _, model = load_model(ckpt)
    again = tmp_path_factory.mktemp("again")
    save_checkpoint(model, again)
    tensors = load_file(again / "model.safetensors")
    assert len(dequantized) == 2 * 8  # q_a, q_b, kv_a, kv_b, o, gate, up, down in 2 layers
    for name, want in dequantized.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)


@pytest.mark.parametrize("value", [np.nan, np.inf, 0.0, -0.5])
def test_a_scale_that_is_not_finite_and_positive_is_refused(fp8_ckpt, value):
    """A NaN scale made the model emit token 0 forever; a zero or negative one is no scale
    a quantizer writes."""
    ckpt, _ = fp8_ckpt
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    def edit(tensors):
        tensors[scale_name(name)][2, 1] = float(value)

    _rewrite_fp8(ckpt, edit)
    with pytest.raises(WeightsError) as error:
        load_model(ckpt)
    assert str(error.value) == (
        f"tensor {scale_name(name)} holds {float(value)} at block [2, 1]; block scales must be "
        "finite and > 0"
    )


def test_a_scale_beside_a_weight_that_is_not_fp8_is_refused(fp8_ckpt, headers_only):
    """A float weight with a scale beside it is an inconsistent checkpoint: the scale would
    be ignored."""
    import torch

    ckpt, dequantized = fp8_ckpt
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite_fp8(ckpt, lambda t: t.update({name: torch.from_numpy(dequantized[name])}))
    with pytest.raises(WeightsError) as error:
        load_model(ckpt)
    assert str(error.value) == (
        f"tensor {scale_name(name)} scales {name}, which is F32: only float8_e4m3fn (F8_E4M3) "
        "weights have block scales"
    )


@pytest.mark.parametrize("dtype,code", [("int32", "I32"), ("uint8", "U8"), ("int64", "I64")])
def test_an_integer_scale_is_refused_from_the_header(fp8_ckpt, headers_only, dtype, code):
    import torch

    ckpt, _ = fp8_ckpt
    name = scale_name("model.layers.1.mlp.gate_proj.weight")
    _rewrite_fp8(ckpt, lambda t: t.update({name: t[name].to(getattr(torch, dtype))}))
    with pytest.raises(WeightsError) as error:
        load_model(ckpt)
    assert str(error.value) == (
        f"tensor {name} has dtype {code}; block scales must be floating point (F32, BF16, F16)"
    )


@pytest.mark.parametrize("shape", [(4, 2), (3, 3), (12,), (4, 3, 1)])
def test_a_misshaped_scale_is_refused_from_the_header(fp8_ckpt, headers_only, shape):
    import torch

    ckpt, _ = fp8_ckpt
    name = "model.layers.0.self_attn.o_proj.weight"  # [16, 8]: blocks of 4 x 3 -> [4, 3]
    _rewrite_fp8(ckpt, lambda t: t.update({scale_name(name): torch.ones(shape)}))
    with pytest.raises(WeightsError) as error:
        load_model(ckpt)
    assert str(error.value) == (
        f"tensor {scale_name(name)} has shape {shape}; {name} [16, 8] in blocks [4, 3] needs (4, 3)"
    )
