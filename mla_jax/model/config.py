"""Model configuration: DeepSeek-V2/V3 dimensions (the symbols of the project's DESIGN.md), their
checks, and the published models' presets. ``mla_jax.checkpoint.hf_config`` reads and writes
them as Hugging Face ``config.json``.
"""

from __future__ import annotations

import dataclasses
import math
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
