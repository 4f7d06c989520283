"""Model configuration: DeepSeek-V2/V3 dimensions, parsed from a Hugging Face config.json.

Two RoPE schemas occur in the wild and both are accepted:

- current transformers: ``"rope_parameters": {"rope_type": "yarn", "rope_theta": ..., ...}``
- legacy (the checkpoints DeepSeek published): top-level ``"rope_theta"`` plus
  ``"rope_scaling": {"type": "yarn", "factor": ..., ...}`` (or ``null``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


class ConfigError(ValueError):
    """A config.json field is missing, has the wrong type, or holds an unsupported value."""


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """DeepSeek rotary embedding: plain RoPE (``rope_type="default"``) or YaRN."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # overrides the mscale ratio when given
    truncate: bool = True
    # DeepSeek checkpoints store rope dims as interleaved pairs (2i, 2i+1); transformers'
    # DeepseekV3 `rope_interleave=False` means halves (i, i + R/2) instead.
    interleaved: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"rope type {self.rope_type!r} is not supported (only 'default' and 'yarn')"
            )
        if not self.theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type == "yarn":
            if not self.factor >= 1.0:
                raise ConfigError(f"yarn factor must be >= 1, got {self.factor}")
            if self.original_max_position_embeddings <= 0:
                raise ConfigError(
                    "yarn original_max_position_embeddings must be positive, got "
                    f"{self.original_max_position_embeddings}"
                )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Dimensions of one MLA layer (symbols of the project's DESIGN.md in the comments)."""

    hidden_size: int  # H
    num_heads: int  # N
    q_lora_rank: int | None  # Lq; None: plain q_proj (V2-Lite)
    kv_lora_rank: int  # Lkv
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0
        ):
            raise ConfigError(
                f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """P + R: a prefill head's q/k width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Width of one latent cache row: kv_c (Lkv) then k_pe (R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times yarn_mscale(factor, mscale_all_dim)**2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One DeepSeek mixture-of-experts layer, routed as transformers 5.23 routes it.

    ``scoring_func`` follows the model type: ``"softmax"`` (deepseek_v2) or ``"sigmoid"``
    (deepseek_v3). ``topk_method``: ``"greedy"`` or ``"group_limited_greedy"`` (v2: each
    group scored by its best expert) or ``"noaux_tc"`` (v3: the sum of each group's best two,
    ``e_score_correction_bias`` added for the choice only); group-limited methods keep the
    ``topk_group`` best of ``n_group`` groups before choosing ``num_experts_per_tok`` experts.
    """

    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str  # "softmax" | "sigmoid"
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        for name in (
            "hidden_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_shared_experts",
            "n_group",
            "topk_group",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        methods = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
        if self.scoring_func not in methods:
            raise ConfigError(
                f"scoring_func {self.scoring_func!r} is not supported (softmax or sigmoid)"
            )
        if self.topk_method not in methods[self.scoring_func]:
            raise ConfigError(
                f"topk_method {self.topk_method!r} does not go with {self.scoring_func} scores "
                f"(expected one of {list(methods[self.scoring_func])})"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts "
                f"{self.n_routed_experts}"
            )
        if self.grouped:
            if self.n_routed_experts % self.n_group:
                raise ConfigError(
                    f"n_routed_experts {self.n_routed_experts} must be a multiple of n_group "
                    f"{self.n_group}"
                )
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(
                    f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                    f"{self.topk_group * per_group} experts of the topk_group={self.topk_group} "
                    "groups kept"
                )
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise ConfigError(
                    "noaux_tc scores each group by its best two experts: n_routed_experts / "
                    f"n_group must be >= 2, got {per_group}"
                )
        if not self.routed_scaling_factor > 0:
            raise ConfigError(
                f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}"
            )

    @property
    def grouped(self) -> bool:
        """Whether experts are chosen within the ``topk_group`` best groups only."""
        return self.topk_method != "greedy"

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' SwiGLU (all shared experts as one MLP)."""
        return self.moe_intermediate_size * self.n_shared_experts


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor (DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek decoder: embeddings, ``num_layers`` x (MLA + MLP), final norm, lm_head."""

    model_type: str
    vocab_size: int
    num_layers: int
    intermediate_size: int
    mla: MLAConfig
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Which layers are mixture-of-experts (``is_moe_layer``); ``moe`` configures them.
    n_routed_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    # How the checkpoint's weights are stored (a quantization.FP8BlockQuantization), for the
    # loader: the model itself runs in its own dtype, so this is not written back.
    quantization: Any = None
    # The MoE layers' router and experts; None when no layer is MoE.
    moe: MoEConfig | None = None

    def __post_init__(self):
        if self.model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported "
                "(expected 'deepseek_v2' or 'deepseek_v3')"
            )
        for name in (
            "vocab_size",
            "num_layers",
            "intermediate_size",
            "max_position_embeddings",
            "moe_layer_freq",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
            _require_int(name, getattr(self, name), minimum=0)
        if self.n_routed_experts is not None:
            _require_int("n_routed_experts", self.n_routed_experts, minimum=1)
        if self.moe is not None and (
            self.moe.n_routed_experts != self.n_routed_experts
            or self.moe.hidden_size != self.mla.hidden_size
        ):
            raise ConfigError(
                f"the MoE config ({self.moe.n_routed_experts} experts, hidden "
                f"{self.moe.hidden_size}) disagrees with the model's ({self.n_routed_experts}, "
                f"{self.mla.hidden_size})"
            )

    def layer_runs(self) -> list[tuple[int, int, bool]]:
        """The decoder as runs of consecutive layers of one kind: ``(first layer, count,
        is_moe)``; each run is one stacked module scanned over (DeepSeek-V2-Lite: a dense
        layer, then 26 MoE layers)."""
        runs: list[tuple[int, int, bool]] = []
        for layer in range(self.num_layers):
            moe = self.is_moe_layer(layer)
            if runs and runs[-1][2] == moe:
                first, count, _ = runs[-1]
                runs[-1] = (first, count + 1, moe)
            else:
                runs.append((layer, 1, moe))
        return runs

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` (from 0) has routed experts instead of a dense MLP."""
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )


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
    from mla_jax.checkpoint.fp8_weights import (
        parse_quantization_config,  # (it imports ConfigError from here)
    )

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
_V2_YARN = RopeConfig(
    rope_type="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    mscale=0.707,
    mscale_all_dim=0.707,
)
PRESETS: dict[str, MLAConfig] = {
    "deepseek-v2": MLAConfig(
        hidden_size=5120,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope=_V2_YARN,
    ),
    "deepseek-v2-lite": MLAConfig(
        hidden_size=2048,
        num_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope=_V2_YARN,
    ),
    "deepseek-v3": MLAConfig(
        hidden_size=7168,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope=RopeConfig(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}


# The routed-expert layers of the published models (benchmarks and tests build on them).
MOE_PRESETS: dict[str, MoEConfig] = {
    "deepseek-v2-lite": MoEConfig(
        hidden_size=2048,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
        scoring_func="softmax",
        topk_method="greedy",
    ),
    "deepseek-v3": MoEConfig(
        hidden_size=7168,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def preset(name: str) -> MLAConfig:
    """MLA dimensions of a published model: 'deepseek-v2', 'deepseek-v2-lite', 'deepseek-v3'."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def moe_preset(name: str) -> MoEConfig:
    """Routed-expert layer of a published model: 'deepseek-v2-lite', 'deepseek-v3'."""
    if name not in MOE_PRESETS:
        raise ConfigError(f"unknown MoE preset {name!r}; choose one of {sorted(MOE_PRESETS)}")
    return MOE_PRESETS[name]
