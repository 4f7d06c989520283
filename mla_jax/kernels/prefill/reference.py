"""The pure-jnp reference of ``flash_prefill``: the same signature, dense and easy to read.

It is the CPU/debug path of the MLA module. It materialises whole score matrices, so keep it
to small shapes. LSE is the natural log of the softmax denominator (scores already scaled); a
row with no keys has ``lse = -inf`` and ``out = 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import online_softmax


def _segments(cu_seqlens: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Sequence id and offset of each of ``n`` flattened rows; rows past the end get id -1."""
    idx = jnp.arange(n)
    seg = jnp.searchsorted(cu_seqlens, idx, side="right") - 1
    seg = jnp.where(idx < cu_seqlens[-1], seg, -1)
    return seg, idx - cu_seqlens[jnp.maximum(seg, 0)]


def flash_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    scale: float,
    causal: bool,
    schedule=None,
    config=None,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged attention with LSE over flattened sequences.

    Args:
      q: ``[Tq, N, Dqk]``; k: ``[Tk, N, Dqk]``; v: ``[Tk, N, Dv]``.
      cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 sequence offsets (rows past the last
        offset are padding and get no keys).
      scale: softmax scale.
      causal: query i of a sequence sees its keys up to ``i + (len_k - len_q)`` (queries
        aligned to the end of the keys); otherwise all of its keys.
      schedule, config, interpret: the Pallas kernel's tile plan, launch parameters and
        mode; ignored here.

    Returns:
      ``out [Tq, N, Dv]`` (q's dtype) and ``lse [Tq, N]`` float32.
    """
    del schedule, config, interpret
    seg_q, off_q = _segments(cu_seqlens_q, q.shape[0])
    seg_k, off_k = _segments(cu_seqlens_k, k.shape[0])
    mask = (seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] >= 0)
    if causal:
        sq = jnp.maximum(seg_q, 0)
        len_q = cu_seqlens_q[sq + 1] - cu_seqlens_q[sq]
        len_k = cu_seqlens_k[sq + 1] - cu_seqlens_k[sq]
        mask &= off_k[None, :] <= (off_q + len_k - len_q)[:, None]
    f32 = jnp.float32
    s = jnp.einsum("qnd,knd->nqk", q, k, preferred_element_type=f32)
    p, lse = online_softmax.softmax_with_lse(s * scale, mask[None])
    out = jnp.einsum("nqk,knd->qnd", p, v.astype(f32), preferred_element_type=f32)
    return out.astype(q.dtype), lse.T
