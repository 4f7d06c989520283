"""DeepSeek Multi-head Latent Attention for JAX over a paged latent KV cache."""

from .attention import MLAAttention
from .cache import BlockAllocator, CacheFullError, init_cache, write_cache
from .cache_manager import CacheManager
from .config import MLAConfig, ModelConfig, RopeConfig, load_config, preset
from .engine import Engine, EngineConfig, Request
from .metadata import AttentionMetadata, Buckets, build_metadata
from .model import DeepseekModel
from .packing import PackedMetadata, packed_metadata
from .weights import load_model, save_checkpoint

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
