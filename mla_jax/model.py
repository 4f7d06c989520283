"""A DeepSeek decoder (dense layers) for generation, parameters named as in HF checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import MLAAttention
from .config import ModelConfig
from .layers import RMSNorm, linear, matmul_precision
from .metadata import AttentionMetadata


class MoENotSupportedError(NotImplementedError):
    """The config makes a layer mixture-of-experts, which this library does not run yet."""


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, *, param_dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(hidden, intermediate, param_dtype, rngs)
        self.up_proj = linear(hidden, intermediate, param_dtype, rngs)
        self.down_proj = linear(intermediate, hidden, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        eps = cfg.mla.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.mla.hidden_size, eps, param_dtype=param_dtype)
        self.self_attn = MLAAttention(cfg.mla, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.mla.hidden_size, eps, param_dtype=param_dtype)
        self.mlp = MLP(
            cfg.mla.hidden_size, cfg.intermediate_size, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x, cache, md: AttentionMetadata, *, impl: str):
        h, cache = self.self_attn(self.input_layernorm(x), cache, md, impl=impl)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class DeepseekModel(nnx.Module):
    """Embeddings, decoder layers, final norm and lm_head (HF's DeepseekV2/V3ForCausalLM)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                raise MoENotSupportedError(
                    f"layer {i} is a mixture-of-experts layer (n_routed_experts="
                    f"{cfg.n_routed_experts}, first_k_dense_replace={cfg.first_k_dense_replace}, "
                    f"moe_layer_freq={cfg.moe_layer_freq}): MoE is not supported yet"
                )
        self.cfg = cfg
        h = cfg.mla.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, h, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(h, cfg.mla.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(h, cfg.vocab_size, param_dtype, rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        caches: tuple[jax.Array, ...],
        md: AttentionMetadata,
        *,
        impl: str = "auto",
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """``input_ids [T]`` -> logits of ``md.logits_indices`` ``[R, vocab]`` float32 and the
        updated per-layer caches."""
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} caches given for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cache, md, impl=impl)
            new_caches.append(cache)
        x = self.norm(x[md.logits_indices])
        if self.cfg.tie_word_embeddings:
            embedding = self.embed_tokens.embedding[...]
            logits = jnp.dot(x, embedding.T, precision=matmul_precision(embedding.dtype))
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32), tuple(new_caches)
