"""A tiny DeepSeek-V3-style model (YaRN, q LoRA, interleaved rope) with deterministic random
weights, written as an HF checkpoint so that it loads through the same path as real ones."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from flax import nnx

from mla_jax.checkpoint.hf_config import config_to_dict
from mla_jax.checkpoint.loader import save_checkpoint
from mla_jax.engine.compilation import cache_root
from mla_jax.model.config import MLAConfig, ModelConfig, RopeConfig
from mla_jax.model.deepseek import DeepseekModel

TINY = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=512,
    num_layers=2,
    intermediate_size=512,
    mla=MLAConfig(
        hidden_size=256,
        num_heads=16,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        rope=RopeConfig(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=256,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    max_position_embeddings=1024,
    bos_token_id=0,
)


def default_tiny_dir() -> str:
    """Where the tiny checkpoint is written by default: in ``cache_root()``."""
    return os.path.join(cache_root(), "tiny-deepseek-v3")


def tiny_checkpoint(path: str | None = None, seed: int = 0) -> str:
    """Path of the tiny checkpoint, written on first use (or when its config changed)."""
    path = path or default_tiny_dir()
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        with open(config_path) as f:
            if json.load(f) == json.loads(json.dumps(config_to_dict(TINY))):
                return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent)  # written aside, then moved, so no half checkpoint
    save_checkpoint(DeepseekModel(TINY, rngs=nnx.Rngs(seed)), tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
