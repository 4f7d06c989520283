"""DeepSeek Multi-head Latent Attention for JAX over a paged latent KV cache."""

from mla_jax.cache.latent_cache import BlockAllocator, CacheFullError, init_cache, write_cache
from mla_jax.cache.manager import CacheManager
from mla_jax.cache.metadata import AttentionMetadata, Buckets, build_metadata
from mla_jax.cache.packing import PackedMetadata, packed_metadata
from mla_jax.checkpoint.hf_config import load_config
from mla_jax.checkpoint.loader import load_model, save_checkpoint
from mla_jax.engine.engine import Engine, EngineConfig, Request
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import MLAConfig, ModelConfig, RopeConfig, preset
from mla_jax.model.deepseek import DeepseekModel

__all__ = [
    "AttentionMetadata",
    "BlockAllocator",
    "Buckets",
    "CacheFullError",
    "CacheManager",
    "DeepseekModel",
    "Engine",
    "EngineConfig",
    "MLAAttention",
    "MLAConfig",
    "ModelConfig",
    "PackedMetadata",
    "Request",
    "RopeConfig",
    "build_metadata",
    "init_cache",
    "load_config",
    "load_model",
    "packed_metadata",
    "preset",
    "save_checkpoint",
    "write_cache",
]
