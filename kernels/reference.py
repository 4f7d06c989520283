"""Pure-jnp references of the kernels: the same signatures, dense and easy to read.

They are the CPU/debug path of the MLA module and the oracles of the kernel tests. They
materialise whole score matrices, so keep them to small shapes.

LSE is the natural log of the softmax denominator (scores already scaled). A row with no
keys has ``lse = -inf`` and ``out = 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fp8


def _softmax_with_lse(s: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax of scaled scores ``s [..., k]`` over the keys where ``mask``; rows with no key
    get all-zero probabilities and ``lse = -inf``."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return p, (m + jnp.log(denom))[..., 0]


def mla_decode(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule=None,
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
      schedule: the Pallas kernel's work plan; ignored here.

    Returns:
      ``out [B, N, Lkv]`` (q_lat's dtype) and ``lse [B, N]`` float32.
    """
    del schedule
    num_lat = q_lat.shape[-1]
    b, w = block_table.shape
    positions = jnp.arange(w * kv_cache.shape[1])[None, :]
    mask = positions < seq_lens[:, None]
    kv = gather_rows(kv_cache, block_table, jnp.arange(b)[:, None], positions, mask)
    kv_c, k_pe = kv[..., :num_lat], kv[..., num_lat:]
    f32 = jnp.float32
    s = jnp.einsum("bnl,bkl->bnk", q_lat, kv_c, preferred_element_type=f32)
    s += jnp.einsum("bnr,bkr->bnk", q_pe, k_pe, preferred_element_type=f32)
    p, lse = _softmax_with_lse(s * scale, mask[:, None, :])
    out = jnp.einsum("bnk,bkl->bnl", p, kv_c.astype(f32), preferred_element_type=f32)
    return out.astype(q_lat.dtype), lse


def gather_rows(
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    requests: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """Cache rows of (request, position) pairs through the block table.

    ``kv_cache [num_blocks, block_size, width]``, or an ``fp8.Fp8Cache`` whose rows come
    back dequantized (``concat(kv_c x scale, k_pe)``, exact in its bf16); ``block_table
    [R, W]`` int32; ``requests``, ``positions`` and ``valid`` share a shape ``S``. Returns
    ``[*S, width]``, zero where not ``valid``: those pairs address no cache row (an
    out-of-range slot read in fill mode), so stale rows and padded table entries (-1, any
    id) never reach the arithmetic.
    """
    num_blocks, block_size, _ = kv_cache.shape
    page = block_table[requests, jnp.where(valid, positions // block_size, 0)]
    slot = jnp.where(valid, page * block_size + positions % block_size, num_blocks * block_size)

    def gather(part: jax.Array) -> jax.Array:
        rows = part.reshape(num_blocks * block_size, part.shape[-1])
        return rows.at[slot].get(mode="fill", fill_value=0)

    if isinstance(kv_cache, fp8.Fp8Cache):
        return fp8.dequantize(*map(gather, kv_cache))
    return gather(kv_cache)


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
) -> tuple[jax.Array, jax.Array]:
    """Ragged attention with LSE over flattened sequences.

    Args:
      q: ``[Tq, N, Dqk]``; k: ``[Tk, N, Dqk]``; v: ``[Tk, N, Dv]``.
      cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 sequence offsets (rows past the last
        offset are padding and get no keys).
      scale: softmax scale.
      causal: query i of a sequence sees its keys up to ``i + (len_k - len_q)`` (queries
        aligned to the end of the keys); otherwise all of its keys.
      schedule: the Pallas kernel's tile plan; ignored here.

    Returns:
      ``out [Tq, N, Dv]`` (q's dtype) and ``lse [Tq, N]`` float32.
    """
    del schedule
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
    p, lse = _softmax_with_lse(s * scale, mask[None])
    out = jnp.einsum("nqk,knd->qnd", p, v.astype(f32), preferred_element_type=f32)
    return out.astype(q.dtype), lse.T


def merge_attn_states(
    prefix_out: jax.Array,
    prefix_lse: jax.Array,
    suffix_out: jax.Array,
    suffix_lse: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Combines two attention results over disjoint key sets.

    ``out [T, N, D]``, ``lse [T, N]`` float32 on each side. A ``-inf`` side contributes
    nothing; two ``-inf`` sides give out 0 and lse ``-inf``. Returns prefix_out's dtype.
    """
    m = jnp.maximum(prefix_lse, suffix_lse)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wp = jnp.exp(prefix_lse - m)
    ws = jnp.exp(suffix_lse - m)
    denom = wp + ws
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = prefix_out.astype(jnp.float32) * (wp * inv)[..., None]
    out += suffix_out.astype(jnp.float32) * (ws * inv)[..., None]
    return out.astype(prefix_out.dtype), m + jnp.log(denom)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    schedule=None,
    config=None,
) -> jax.Array:
    """Grouped matmul over rows sorted by group (``jax.lax.ragged_dot``; fine on CPUs, but on
    GPUs it lowers to a dense matmul over every group, so the Pallas kernel runs there).

    Args:
      lhs: ``[M, K]`` rows sorted by group; rhs: ``[G', K, N]``, lhs's dtype.
      group_sizes: ``[G]`` int32 rows per group, summing to at most M; G <= G'.
      group_offset: group g's rows multiply ``rhs[group_offset + g]`` (int32, may be traced).
      schedule, config: the Pallas kernel's tile plan and launch parameters; ignored here.

    Returns:
      ``out [M, N]`` in lhs's dtype: ``lhs[r] @ rhs[g]`` for the rows r of group g, 0 for the
      rows after the last group.
    """
    del schedule, config
    rhs = jax.lax.dynamic_slice_in_dim(rhs, group_offset, group_sizes.shape[0])
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    out = jax.lax.ragged_dot(
        lhs, rhs, group_sizes, precision=precision, preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)
