"""Paged absorbed MLA decode (Pallas, Triton lowering): split-KV with an LSE combine.

Every decode query is MQA over the latent cache: keys ``[kv_c, k_pe]`` (576 = 512 + 64 wide,
loaded as two power-of-two tiles), values ``kv_c``. Work is cut into *items*, each a
contiguous KV range of one request, balanced by tokens as FlashMLA's scheduler does (see
``plan``); a program handles one item for one block of heads and reads its tokens straight
from the paged cache through the block table. A second kernel LSE-merges the items of each
request.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import online_softmax as osm

DEFAULT_NUM_SMS = 132  # H100 / H200
DEFAULT_BLOCK_K = 64


def default_block_h(num_heads: int) -> int:
    """Heads per program: all of them up to 64 (a [64, 512] float32 accumulator is what
    a program's registers hold)."""
    return min(num_heads, 64)


class DecodeSchedule(NamedTuple):
    """Items of work: item ``i`` covers KV tokens ``[item_start[i], item_end[i])`` of request
    ``item_req[i]``; request ``b`` owns items ``[req_items[b], req_items[b + 1])``. Items past
    ``req_items[-1]`` are padding (empty)."""

    item_req: jax.Array  # [P] int32
    item_start: jax.Array  # [P] int32
    item_end: jax.Array  # [P] int32
    req_items: jax.Array  # [B + 1] int32


def plan(
    seq_lens,
    *,
    target_items: int,
    block_k: int,
    num_items: int | None = None,
    xp=np,
) -> DecodeSchedule:
    """Splits every request into about ``len / (total / target_items)`` equal parts (rounded
    to ``block_k`` tokens), so that items carry similar token counts whatever the mix of
    lengths. Empty requests get no item.

    Runs on the host (``xp=np``: ``num_items`` defaults to the exact count) or traced on the
    device (``xp=jnp``: ``num_items`` must be a static bound, see ``max_items``).
    """
    seq_lens = xp.asarray(seq_lens).astype(xp.int32)
    total = xp.maximum(xp.sum(seq_lens), 1)
    ideal = xp.maximum(total / target_items, 1.0)
    parts = xp.where(seq_lens > 0, xp.maximum(xp.round(seq_lens / ideal), 1), 0)
    part = -(-seq_lens // xp.maximum(parts, 1)).astype(xp.int32)
    part = xp.maximum(-(-part // block_k) * block_k, block_k)
    counts = -(-seq_lens // part)
    req_items = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(counts).astype(xp.int32)])
    if num_items is None:
        num_items = int(req_items[-1])
    i = xp.arange(num_items, dtype=xp.int32)
    req = xp.clip(xp.searchsorted(req_items, i, side="right") - 1, 0, seq_lens.shape[0] - 1)
    real = i < req_items[-1]
    start = (i - req_items[req]) * part[req]
    end = xp.minimum(start + part[req], seq_lens[req])
    return DecodeSchedule(
        xp.where(real, req, 0).astype(xp.int32),
        xp.where(real, start, 0).astype(xp.int32),
        xp.where(real, end, 0).astype(xp.int32),
        req_items,
    )


def max_items(batch: int, target_items: int) -> int:
    """A static bound on ``plan``'s item count: rounding adds at most one item per request
    above ``target_items``, and each non-empty request has at least one."""
    return 2 * batch + target_items


def default_target_items(num_heads: int, block_h: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """About two programs per multiprocessor."""
    return max(1, 2 * num_sms // (num_heads // block_h))


def _decode_kernel(
    item_req_ref,
    item_start_ref,
    item_end_ref,
    block_table_ref,
    q_lat_ref,
    q_pe_ref,
    kv_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    block_h: int,
    block_k: int,
    block_size: int,
):
    """One item x one block of heads: online softmax over the item's KV tokens."""
    h, i = pl.program_id(0), pl.program_id(1)
    req, start, end = item_req_ref[i], item_start_ref[i], item_end_ref[i]
    heads = pl.ds(h * block_h, block_h)
    num_lat = q_lat_ref.shape[-1]
    rope = q_pe_ref.shape[-1]
    width = block_table_ref.shape[-1]
    q_lat = q_lat_ref[req, heads, :]
    q_pe = q_pe_ref[req, heads, :]

    def body(step, state):
        tok = start + step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        page = block_table_ref[req, jnp.minimum(tok // block_size, width - 1)]
        rows = page * block_size + tok % block_size
        kv_c = kv_ref[rows, pl.ds(0, num_lat)]
        k_pe = kv_ref[rows, pl.ds(num_lat, rope)]
        s = osm.dot(q_lat, kv_c, trans_b=True) + osm.dot(q_pe, k_pe, trans_b=True)
        s = jnp.where((tok < end)[None, :], s * (scale * osm.LOG2E), -jnp.inf)
        return osm.update(state, s, kv_c)

    state = jax.lax.fori_loop(0, pl.cdiv(end - start, block_k), body, osm.init(block_h, num_lat))
    out, lse = osm.finalize(state)

    @pl.when(start < end)  # padding items write nothing: no request reads them
    def _():
        o_ref[i, heads, :] = out
        lse_ref[i, heads] = lse


def _combine_kernel(req_items_ref, o_part_ref, lse_part_ref, o_ref, lse_ref, *, block_h: int):
    """LSE-merges the items of one request (none: out 0, lse -inf)."""
    h, b = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(h * block_h, block_h)
    first, last = req_items_ref[b], req_items_ref[b + 1]

    def body(i, carry):
        return osm.merge(*carry, o_part_ref[i, heads, :], lse_part_ref[i, heads])

    init = (
        jnp.zeros((block_h, o_part_ref.shape[-1]), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
    )
    out, lse = jax.lax.fori_loop(first, last, body, init)
    o_ref[b, heads, :] = out.astype(o_ref.dtype)
    lse_ref[b, heads] = lse


def _check(q_lat, q_pe, kv_cache, block_table, seq_lens, block_h):
    if q_lat.ndim != 3 or q_pe.ndim != 3 or kv_cache.ndim != 3:
        raise ValueError(
            f"q_lat {q_lat.shape}, q_pe {q_pe.shape} and kv_cache {kv_cache.shape} must be 3-D"
        )
    b, n, lkv = q_lat.shape
    r = q_pe.shape[-1]
    if q_pe.shape[:2] != (b, n):
        raise ValueError(f"q_pe {q_pe.shape} must be [B={b}, N={n}, R]")
    if kv_cache.shape[-1] != lkv + r:
        raise ValueError(f"kv_cache rows are {kv_cache.shape[-1]} wide, expected {lkv} + {r}")
    for name, d in (("Lkv", lkv), ("R", r)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} = {d} must be a power of two >= 16 (Triton tiles)")
    if n % 16:
        raise ValueError(f"the number of heads ({n}) must be a multiple of 16")
    if n % block_h:
        raise ValueError(f"block_h ({block_h}) must divide the number of heads ({n})")
    if block_table.ndim != 2 or block_table.shape[0] != b or block_table.dtype != jnp.int32:
        raise ValueError(
            f"block_table must be int32 [B={b}, W], got {block_table.dtype}"
            f"{list(block_table.shape)}"
        )
    if seq_lens.shape != (b,) or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"seq_lens must be int32 [B={b}], got {seq_lens.dtype}{list(seq_lens.shape)}"
        )
    if not (q_lat.dtype == q_pe.dtype == kv_cache.dtype):
        raise ValueError(
            f"q_lat, q_pe and kv_cache must share a dtype, got {q_lat.dtype}, {q_pe.dtype}, "
            f"{kv_cache.dtype}"
        )
    if q_lat.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"dtype {q_lat.dtype} is not supported (bfloat16 or float32)")


def _check_values(kv_cache, block_table, seq_lens):
    """Checks that need the values: run when they are concrete (not under a jit trace; the
    metadata builder has checked the same on the host)."""
    if isinstance(seq_lens, jax.core.Tracer) or isinstance(block_table, jax.core.Tracer):
        return
    lens, table = np.asarray(seq_lens), np.asarray(block_table)
    num_blocks, block_size, _ = kv_cache.shape
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.min()}")
    if lens.max(initial=0) > table.shape[1] * block_size:
        b = int(lens.argmax())
        raise ValueError(
            f"block_table is too narrow: request {b} has {lens[b]} tokens, the table holds "
            f"{table.shape[1]} blocks of {block_size}"
        )
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // block_size)
    if ((table < 0) | (table >= num_blocks))[used].any():
        raise ValueError(f"block_table holds ids outside [0, {num_blocks})")


def mla_decode(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule: DecodeSchedule | None = None,
    block_h: int | None = None,
    block_k: int = DEFAULT_BLOCK_K,
    target_items: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache.

    Args:
      q_lat: ``[B, N, Lkv]`` queries in the latent space (N a multiple of 16).
      q_pe: ``[B, N, R]`` rotated rope queries.
      kv_cache: ``[num_blocks, block_size, Lkv + R]`` rows ``concat(kv_c, k_pe)``.
      block_table: ``[B, W]`` int32; ``W * block_size`` must cover every ``seq_lens``.
      seq_lens: ``[B]`` int32 keys per request; 0 gives out 0 and lse -inf.
      scale: softmax scale.
      schedule: the split-KV plan (``plan`` on the host, from the metadata); None plans on
        the device with a static bound on the item count.
      block_h, block_k: heads and KV tokens per program step; num_warps, num_stages: Triton.

    Returns:
      ``out [B, N, Lkv]`` in q's dtype and ``lse [B, N]`` float32 (natural log).
    """
    block_h = block_h or default_block_h(q_lat.shape[1])
    _check(q_lat, q_pe, kv_cache, block_table, seq_lens, block_h)
    _check_values(kv_cache, block_table, seq_lens)
    if interpret is None:
        interpret = osm.interpret_default()
    return _mla_decode(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        schedule,
        scale=scale,
        block_h=block_h,
        block_k=block_k,
        target_items=target_items,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_h",
        "block_k",
        "target_items",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _mla_decode(
    q_lat,
    q_pe,
    kv_cache,
    block_table,
    seq_lens,
    schedule,
    *,
    scale,
    block_h,
    block_k,
    target_items,
    num_warps,
    num_stages,
    interpret,
):
    b, n, lkv = q_lat.shape
    num_blocks, block_size, width = kv_cache.shape
    if target_items is None:
        target_items = default_target_items(n, block_h)
    if schedule is None:
        schedule = plan(
            seq_lens,
            target_items=target_items,
            block_k=block_k,
            num_items=max_items(b, target_items),
            xp=jnp,
        )
    num_items = schedule.item_req.shape[0]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    o_part, lse_part = pl.pallas_call(
        functools.partial(
            _decode_kernel, scale=scale, block_h=block_h, block_k=block_k, block_size=block_size
        ),
        grid=(n // block_h, num_items),
        out_shape=(
            jax.ShapeDtypeStruct((num_items, n, lkv), jnp.float32),
            jax.ShapeDtypeStruct((num_items, n), jnp.float32),
        ),
        compiler_params=params,
        interpret=interpret,
        name="mla_decode",
    )(
        schedule.item_req,
        schedule.item_start,
        schedule.item_end,
        block_table,
        q_lat,
        q_pe,
        kv_cache.reshape(num_blocks * block_size, width),
    )
    return pl.pallas_call(
        functools.partial(_combine_kernel, block_h=block_h),
        grid=(n // block_h, b),
        out_shape=(
            jax.ShapeDtypeStruct((b, n, lkv), q_lat.dtype),
            jax.ShapeDtypeStruct((b, n), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_decode_combine",
    )(schedule.req_items, o_part, lse_part)
