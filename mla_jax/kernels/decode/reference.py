"""The pure-jnp reference of ``mla_decode``: the same signature, dense and easy to read.

It is the CPU/debug path of the MLA module. It materialises whole score matrices, so keep it
to small shapes. LSE is the natural log of the softmax denominator (scores already scaled); a
row with no keys has ``lse = -inf`` and ``out = 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8, online_softmax, paged


def mla_decode(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule=None,
    config=None,
    interpret=None,
    heads_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode: MQA of ``[q_lat, q_pe]`` over the paged latent cache.

    Args:
      q_lat: ``[B, N, Lkv]`` queries absorbed into the latent space.
      q_pe: ``[B, N, R]`` rotated rope part of the queries.
      kv_cache: ``[num_blocks, block_size, Lkv + R]`` rows ``concat(kv_c, k_pe)``, or an
        ``fp8.Fp8Cache`` (dequantized as it is gathered).
      block_table: ``[B, W]`` int32 block ids of each sequence; entries past
        ``cdiv(seq_lens[b], block_size)`` are never used (may hold anything).
      seq_lens: ``[B]`` int32 keys per sequence (0: empty row).
      scale: softmax scale.
      schedule, config, interpret: the Pallas kernel's work plan, launch parameters and
        mode; ignored here.
      heads_major: q_lat and out are ``[N, B, Lkv]``.

    Returns:
      ``out [B, N, Lkv]`` (``[N, B, Lkv]`` with ``heads_major``; q_lat's dtype) and
      ``lse [B, N]`` float32.
    """
    del schedule, config, interpret
    if heads_major:
        q_lat = jnp.swapaxes(q_lat, 0, 1)
    num_lat = q_lat.shape[-1]
    b, w = block_table.shape
    positions = jnp.arange(w * kv_cache.shape[1])[None, :]
    mask = positions < seq_lens[:, None]
    kv = paged.gather_rows(kv_cache, block_table, jnp.arange(b)[:, None], positions, mask)
    kv_c, k_pe = kv[..., :num_lat], kv[..., num_lat:]
    f32 = jnp.float32
    s = jnp.einsum("bnl,bkl->bnk", q_lat, kv_c, preferred_element_type=f32)
    s += jnp.einsum("bnr,bkr->bnk", q_pe, k_pe, preferred_element_type=f32)
    p, lse = online_softmax.softmax_with_lse(s * scale, mask[:, None, :])
    out = jnp.einsum("bnk,bkl->bnl", p, kv_c.astype(f32), preferred_element_type=f32)
    if heads_major:
        out = jnp.swapaxes(out, 0, 1)
    return out.astype(q_lat.dtype), lse
