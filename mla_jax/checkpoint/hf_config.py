"""Hugging Face ``config.json`` <-> ``ModelConfig`` (deepseek_v2 / deepseek_v3).

Two RoPE schemas occur in the wild and both are accepted:

- current transformers: ``"rope_parameters": {"rope_type": "yarn", "rope_theta": ..., ...}``
- legacy (the checkpoints DeepSeek published): top-level ``"rope_theta"`` plus
  ``"rope_scaling": {"type": "yarn", "factor": ..., ...}`` (or ``null``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mla_jax.checkpoint.fp8_weights import parse_quantization_config
from mla_jax.model.config import ConfigError, MLAConfig, ModelConfig, MoEConfig, RopeConfig

_MISSING = object()


def _field(d: dict, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    if key not in d or (d[key] is None and default is not _MISSING):
        if default is _MISSING:
            raise ConfigError(f"config.json is missing the field {key!r}")
        return default
    value = d[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"config.json field {key!r} has the wrong type: {value!r}")
    return value


def _parse_rope(d: dict, *, interleaved: bool) -> RopeConfig:
    if "rope_parameters" in d and d["rope_parameters"] is not None:
        params = d["rope_parameters"]
        where = "rope_parameters"
        if not isinstance(params, dict):
            raise ConfigError(f"config.json field 'rope_parameters' must be an object: {params!r}")
        theta = _field(params, "rope_theta", float, d.get("rope_theta", _MISSING))
    else:
        params = d.get("rope_scaling") or {}
        where = "rope_scaling"
        if not isinstance(params, dict):
            raise ConfigError(f"config.json field 'rope_scaling' must be an object: {params!r}")
        theta = _field(d, "rope_theta", float, 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    if rope_type != "yarn":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only yarn)")
    try:
        return RopeConfig(
            theta=theta,
            rope_type="yarn",
            factor=_field(params, "factor", float),
            original_max_position_embeddings=_field(
                params, "original_max_position_embeddings", int
            ),
            beta_fast=_field(params, "beta_fast", float, 32.0),
            beta_slow=_field(params, "beta_slow", float, 1.0),
            mscale=_field(params, "mscale", float, 1.0),
            mscale_all_dim=_field(params, "mscale_all_dim", float, 0.0),
            attention_factor=_field(params, "attention_factor", float, None),
            truncate=_field(params, "truncate", bool, True),
            interleaved=interleaved,
        )
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


# transformers 5.23's defaults for the MoE fields a config.json leaves out.
_MOE_DEFAULTS = {
    "deepseek_v2": dict(
        moe_intermediate_size=1407,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        topk_method="greedy",
    ),
    "deepseek_v3": dict(
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
    ),
}


def _parse_moe(d: dict, model_type: str, hidden_size: int) -> MoEConfig:
    """The MoE fields of a deepseek_v2 / deepseek_v3 ``config.json``.

    Read from transformers 5.23: ``DeepseekV2TopkRouter`` always scores with a softmax and
    never renormalises the chosen weights, whatever ``norm_topk_prob`` says (DeepSeek's own
    V2 code renormalises instead of scaling when it is set; no published V2 config sets it);
    ``DeepseekV3TopkRouter`` always scores with a sigmoid and runs noaux_tc. A
    ``scoring_func`` or ``topk_method`` the model's router would not run is refused.
    """
    defaults = _MOE_DEFAULTS[model_type]

    def get(key, kind):
        return _field(d, key, kind, defaults.get(key, _MISSING))

    scoring = "softmax" if model_type == "deepseek_v2" else "sigmoid"
    if _field(d, "scoring_func", str, scoring) != scoring:
        raise ConfigError(
            f"scoring_func {d['scoring_func']!r} is not what {model_type} routers compute "
            f"({scoring!r})"
        )
    if model_type == "deepseek_v2":
        topk_method = get("topk_method", str)
        grouped = topk_method == "group_limited_greedy"
        norm_topk_prob = False
        group_default = _MISSING if grouped else 1
        n_group = _field(d, "n_group", int, group_default)
        topk_group = _field(d, "topk_group", int, group_default)
    else:
        topk_method = _field(d, "topk_method", str, "noaux_tc")
        norm_topk_prob = get("norm_topk_prob", bool)
        n_group, topk_group = get("n_group", int), get("topk_group", int)
    return MoEConfig(
        hidden_size=hidden_size,
        n_routed_experts=_field(d, "n_routed_experts", int),
        num_experts_per_tok=get("num_experts_per_tok", int),
        moe_intermediate_size=get("moe_intermediate_size", int),
        n_shared_experts=get("n_shared_experts", int),
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=get("routed_scaling_factor", float),
    )


def config_from_dict(d: dict) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face ``config.json`` dict (deepseek_v2 / deepseek_v3)."""
    model_type = _field(d, "model_type", str)
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (no DeepSeek checkpoint uses it)")
    quantization = parse_quantization_config(d.get("quantization_config"))
    act = _field(d, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    interleaved = _field(d, "rope_interleave", bool, True)
    mla = MLAConfig(
        hidden_size=_field(d, "hidden_size", int),
        num_heads=_field(d, "num_attention_heads", int),
        q_lora_rank=_field(d, "q_lora_rank", int, None),
        kv_lora_rank=_field(d, "kv_lora_rank", int),
        qk_nope_head_dim=_field(d, "qk_nope_head_dim", int),
        qk_rope_head_dim=_field(d, "qk_rope_head_dim", int),
        v_head_dim=_field(d, "v_head_dim", int),
        rms_norm_eps=_field(d, "rms_norm_eps", float, 1e-6),
        rope=_parse_rope(d, interleaved=interleaved),
    )
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
    if not all(isinstance(t, int) for t in eos_ids):
        raise ConfigError(f"config.json field 'eos_token_id' has the wrong type: {eos!r}")
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=_field(d, "vocab_size", int),
        num_layers=_field(d, "num_hidden_layers", int),
        intermediate_size=_field(d, "intermediate_size", int),
        mla=mla,
        tie_word_embeddings=_field(d, "tie_word_embeddings", bool, False),
        max_position_embeddings=_field(d, "max_position_embeddings", int, 4096),
        bos_token_id=_field(d, "bos_token_id", int, None),
        eos_token_ids=eos_ids,
        n_routed_experts=_field(d, "n_routed_experts", int, None),
        first_k_dense_replace=_field(d, "first_k_dense_replace", int, 0),
        moe_layer_freq=_field(d, "moe_layer_freq", int, 1),
        num_nextn_predict_layers=_field(d, "num_nextn_predict_layers", int, 0),
        quantization=quantization,
    )
    # The MoE fields are read only where a layer is MoE: dense configs leave them null.
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        cfg = dataclasses.replace(cfg, moe=_parse_moe(d, model_type, mla.hidden_size))
    return cfg


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Reads ``model_dir/config.json``."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {model_dir}")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config_from_dict(d)


def config_to_dict(cfg: ModelConfig) -> dict:
    """The HF ``config.json`` of ``cfg`` (current ``rope_parameters`` schema)."""
    m, r = cfg.mla, cfg.mla.rope
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        rope.update(
            factor=r.factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
            beta_fast=r.beta_fast,
            beta_slow=r.beta_slow,
            mscale=r.mscale,
            mscale_all_dim=r.mscale_all_dim,
        )
    return {
        "architectures": [
            "DeepseekV3ForCausalLM" if cfg.model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"
        ],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rms_norm_eps": m.rms_norm_eps,
        "rope_parameters": rope,
        "rope_interleave": r.interleaved,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "n_routed_experts": cfg.n_routed_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        **(_moe_to_dict(cfg.moe) if cfg.moe is not None else {}),
    }


def _moe_to_dict(moe: MoEConfig) -> dict:
    """The HF ``config.json`` fields of ``moe``."""
    return {
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "n_shared_experts": moe.n_shared_experts,
        "scoring_func": moe.scoring_func,
        "topk_method": moe.topk_method,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
    }


# Attention dimensions of the published models (their config.json values).
