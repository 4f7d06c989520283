from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mla_jax.checkpoint.hf_config import config_from_dict, config_to_dict, load_config
from mla_jax.model.config import ConfigError, preset

V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "eos_token_id": 1,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def _current_schema(d):
    d = dict(d)
    rope = dict(d.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = d.pop("rope_theta")
    d["rope_parameters"] = rope
    return d


@pytest.mark.parametrize("schema", ["legacy", "current"])
def test_v3_config_parses_both_schemas(schema):
    cfg = config_from_dict(V3 if schema == "legacy" else _current_schema(V3))
    assert cfg.mla == preset("deepseek-v3")
    assert cfg.num_layers == 61 and cfg.eos_token_ids == (1,)
    assert cfg.is_moe_layer(3) and not cfg.is_moe_layer(2)
    mscale = 0.1 * math.log(40) + 1.0
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)


def test_v2_lite_legacy_config():
    d = dict(V3, model_type="deepseek_v2", q_lora_rank=None, hidden_size=2048)
    d.update(n_routed_experts=64, num_experts_per_tok=6)
    d["num_attention_heads"] = 16
    d["rope_scaling"] = dict(V3["rope_scaling"], mscale=0.707, mscale_all_dim=0.707)
    cfg = config_from_dict(d)
    assert cfg.mla == preset("deepseek-v2-lite")


def test_no_rope_scaling_is_plain_rope():
    cfg = config_from_dict(dict(V3, rope_scaling=None, rope_theta=5000.0))
    assert cfg.mla.rope.rope_type == "default" and cfg.mla.rope.theta == 5000.0
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "kv_lora_rank", "v_head_dim", "vocab_size"]
)
def test_missing_field_is_named(field):
    d = dict(V3)
    del d[field]
    with pytest.raises(ConfigError, match=field):
        config_from_dict(d)


def test_missing_yarn_field_is_named():
    d = dict(V3, rope_scaling={k: v for k, v in V3["rope_scaling"].items() if k != "factor"})
    with pytest.raises(ConfigError, match="rope_scaling.*factor"):
        config_from_dict(d)


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"hidden_size": "7168"}, "hidden_size"),
        ({"kv_lora_rank": -1}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"quantization_config": {"quant_method": "fp8"}}, "without weight_block_size"),
        ({"quantization_config": {"quant_method": "awq"}}, "'awq' is not supported"),
        ({"quantization_config": "fp8"}, "'quantization_config' must be an object"),
        ({"quantization_config": ["fp8"]}, "'quantization_config' must be an object"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
        ({"max_position_embeddings": -4096}, "max_position_embeddings"),
        ({"moe_layer_freq": 0}, "moe_layer_freq must be an integer >= 1, got 0"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace must be an integer >= 0"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be an integer >= 0"),
        ({"n_routed_experts": 0}, "n_routed_experts must be an integer >= 1"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"rope_scaling": dict(V3["rope_scaling"], factor=0.5)}, "factor"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_bad_values_are_named(patch, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(dict(V3, **patch))


@pytest.mark.parametrize(
    "field,value",
    [("max_position_embeddings", 0), ("moe_layer_freq", 0), ("first_k_dense_replace", -2)],
)
def test_model_config_checks_its_own_fields(field, value):
    """Configs built in code (not from config.json) are checked too, so that is_moe_layer
    never divides by zero."""
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(config_from_dict(V3), **{field: value})


def test_roundtrip_and_load(tmp_path):
    cfg = config_from_dict(V3)
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    assert load_config(tmp_path) == cfg
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_presets():
    assert preset("deepseek-v2-lite").q_lora_rank is None
    assert preset("deepseek-v2").num_heads == 128 and preset("deepseek-v2").hidden_size == 5120
    assert preset("deepseek-v3").cache_width == 576
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("deepseek-v4")


def test_transformers_default_v3_config_parses():
    transformers = pytest.importorskip("transformers")
    d = transformers.DeepseekV3Config().to_dict()
    cfg = config_from_dict(d)
    assert (cfg.mla.hidden_size, cfg.mla.num_heads, cfg.mla.kv_lora_rank) == (7168, 128, 512)
