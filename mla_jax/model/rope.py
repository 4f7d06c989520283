"""DeepSeek rotary embedding with YaRN scaling.

The rope dims of ``q_pe`` and ``k_pe`` rotate in pairs. DeepSeek checkpoints interleave the
pairs (dims 2i and 2i+1 form pair i); the rotated output keeps that order. Since ``q_pe`` and
``k_pe`` get the same treatment, only their dot product matters, and it equals transformers'
(which de-interleaves in DeepseekV3 and rotates complex pairs in DeepseekV2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.model.config import RopeConfig, yarn_mscale


def inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Per-pair angular frequencies ``[dim // 2]`` float32, YaRN-blended when configured."""
    base = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / base
    if rope.rope_type != "yarn":
        return extrapolation.astype(np.float32)
    interpolation = 1.0 / (rope.factor * base)

    def correction_dim(num_rotations: float) -> float:
        ratio = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    return (interpolation * ramp + extrapolation * keep_extrapolated).astype(np.float32)


def cos_sin_scale(rope: RopeConfig) -> float:
    """YaRN's magnitude correction folded into cos/sin (1 for plain RoPE)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def rope_cos_sin(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``[T, dim // 2]`` float32 for int ``positions [T]``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(rope, dim))[None, :]
    scale = cos_sin_scale(rope)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotates ``x [T, ..., R]`` by ``cos, sin [T, R // 2]``; returns ``x``'s dtype.

    Pair i is dims (2i, 2i+1) when ``interleaved``, else (i, i + R/2).
    """
    dtype = x.dtype
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    extra = (1,) * (x.ndim - 2)
    cos = cos.reshape(cos.shape[0], *extra, half)
    sin = sin.reshape(sin.shape[0], *extra, half)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if interleaved:
        y = jnp.stack([y1, y2], axis=-1).reshape(x.shape)
    else:
        y = jnp.concatenate([y1, y2], axis=-1)
    return y.astype(dtype)
