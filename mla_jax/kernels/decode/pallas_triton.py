"""Paged absorbed MLA decode (Pallas, Triton lowering): split-KV with an LSE combine.

Every decode query is MQA over the latent cache: keys ``[kv_c, k_pe]`` (576 = 512 + 64 wide,
loaded as two power-of-two tiles), values ``kv_c``. As in FlashMLA, a fixed number of
programs per block of heads (a multiple of the multiprocessor count) each take an equal
share of the batch's KV tokens, whatever the mix of lengths: ``schedule_splits`` cuts the
token stream of the batch at request and share boundaries into *items* (a contiguous KV range
of one request) and hands each program its consecutive items. Every token is read straight from
the paged cache through the block table, once per block of heads. An item that covers a
whole request writes the final output; the items of split requests leave float32 partial
results that a second kernel LSE-merges.

Any head count and widths run: heads are padded to a multiple of 16 (a dot's rows) with zero
queries, ``Lkv`` and ``R`` to power-of-two tiles whose extra cache columns are masked (never
read). DeepSeek's 512 + 64 and its head counts need no padding. A program reads only cache
rows ``[0, seq_len)`` of its request, through the block-table entries those rows need.

Over an FP8 cache (``fp8.Fp8Cache``) the latent is loaded as one float8_e4m3fn tile per scale
group of 128 columns, converted to the queries' bf16 in registers (exact); each group's
score is multiplied by its keys' scales, and the probabilities by the same scales before they
meet that group's values, so one code path serves both caches (a bf16 cache is one unscaled
group).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import fp8, online_softmax

DEFAULT_NUM_SMS = 132  # H100 / H200


def device_num_sms(device: jax.Device | None = None) -> int:
    """``device``'s multiprocessors (default: the first device), or an H100's / H200's where
    it reports none (a CPU running the kernels interpreted)."""
    device = device or jax.devices()[0]
    return getattr(device, "core_count", None) or DEFAULT_NUM_SMS


def padded_heads(num_heads: int) -> int:
    """Heads the kernel runs: N rounded up to a multiple of 16, the fewest rows of a dot.
    The padding heads get zero queries and are dropped from the output."""
    return -(-num_heads // 16) * 16


def head_rows(req, heads, heads_major: bool) -> tuple:
    """The index of request ``req``'s rows ``heads`` in ``q_lat`` or ``out``: ``[B, N, ...]``,
    or ``[N, B, ...]`` with ``heads_major``."""
    return (heads, req) if heads_major else (req, heads)


def batch_major_view(q_lat, heads_major: bool):
    """``q_lat``'s shape and dtype as ``[B, N, Lkv]`` (what the checks read, and the shape
    their errors name), without a transpose."""
    if heads_major and q_lat.ndim == 3:
        return jax.ShapeDtypeStruct((q_lat.shape[1], q_lat.shape[0], q_lat.shape[2]), q_lat.dtype)
    return q_lat


def head_shape(batch: int, heads: int, width: int, heads_major: bool) -> tuple[int, int, int]:
    """The shape of ``q_lat`` or ``out`` for ``batch`` requests of ``heads`` heads."""
    return (heads, batch, width) if heads_major else (batch, heads, width)


# Up to this many rows (the engine's smallest decode batch) the merge kernel splits its work
# finely enough that one request holding every split keeps many programs busy: on an H200
# (2026-11-27, ``bench_decode.py --sweep combine``, ``decode_combine_sweep.json``) one
# 4096-token request among 15 padding rows merged at 128 heads in 7.0 instead of 23.5 us and
# at 16 heads in 4.6 instead of 14.0; 16 requests of 4096 tokens at 128 heads in 6.7
# instead of 4.9 us.
ITEM_PARALLEL_MAX_BATCH = 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels; ``for_shape`` picks them for a batch, and
    ``dataclasses.replace`` makes variants. The defaults suit bandwidth-bound blocks of
    fewer than 64 heads in small batches."""

    block_h: int  # heads per program
    block_k: int = 64  # KV tokens per step
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1  # decode programs per multiprocessor (all blocks of heads)
    combine_block_h: int = 16  # merge kernel: heads, latent dims and items per step
    combine_block_d: int = 128
    combine_block_items: int = 4
    # Where an item's last, partial step is masked: False, in every step of one loop; True,
    # full steps unmasked and the last one in a branch (see for_shape).
    split_tail: bool = False
    # Load step j + 1's tiles before step j's math, carried in registers, instead of leaving
    # the overlap to Triton's pipeliner (which may not pipeline loads that are converted
    # before their dot, as an FP8 cache's are). Needs split_tail False (one masked loop).
    prefetch: bool = False
    # FP8 cache only: what its e4m3 tiles are converted to for the latent dots (queries and
    # probabilities too). bfloat16: exact, the queries' own dtype. float16: also exact for
    # e4m3 values, converted in one instruction per two values where bf16 takes several,
    # but queries round to float16 (10 mantissa bits; |q| must stay below 65504) and
    # probabilities x scales below 2^-14 lose precision (float16's subnormals).
    fp8_compute: str = "bfloat16"

    @classmethod
    @functools.cache  # the host plans a schedule with it every decode step
    def for_shape(cls, num_heads: int, batch: int, quantized: bool = False) -> DecodeConfig:
        """Tuned on an H200 (``scripts/bench_decode.py --sweep``). Up to 64 heads (a power
        of two dividing the padded N) share a program: a [64, 512] float32 accumulator is
        what 8 warps' registers hold. 64-head blocks are compute-bound and want a deep
        pipeline. Smaller head blocks are bandwidth-bound: large batches want two programs
        per multiprocessor, small ones fewer splits to merge. The merge kernel takes many
        items per step when few requests are each split many ways, and many heads per step
        for large batches; in between (up to ``ITEM_PARALLEL_MAX_BATCH`` rows) 8 heads x 64
        latent columns x 16 items, since a batch of that size may be one request split over
        every program beside padding rows. ``quantized`` (an FP8 cache): large batches of
        small head blocks take two pipeline stages instead of three (at 16 heads, 64 x 16384
        on an H200, three stages are 5% faster over a bf16 cache and 4% slower over an FP8
        one)."""
        heads = padded_heads(num_heads)
        block_h = min(heads & -heads, 64)  # a power of two (Triton) that divides the heads
        # Compute-bound 64-head blocks gain from unmasked full steps with the partial step in
        # a branch; bandwidth-bound blocks lose more to that branch than they gain and keep
        # one masked loop instead.
        if block_h == 64:
            config = cls(block_h, num_warps=8, split_tail=True)
        elif batch >= 32:
            config = cls(block_h, num_stages=2 if quantized else 3, programs_per_sm=2)
        else:
            config = cls(block_h)
        splits_per_request = DEFAULT_NUM_SMS * config.programs_per_sm // max(batch, 1)
        if splits_per_request >= 32:
            config = dataclasses.replace(
                config, combine_block_h=1, combine_block_d=64, combine_block_items=64
            )
        elif batch <= ITEM_PARALLEL_MAX_BATCH:
            config = dataclasses.replace(
                config, combine_block_h=8, combine_block_d=64, combine_block_items=16
            )
        return config


def num_programs(config: DecodeConfig, num_heads: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Decode programs per block of heads (what ``schedule_splits`` schedules for)."""
    head_blocks = padded_heads(num_heads) // config.block_h
    return max(1, num_sms * config.programs_per_sm // head_blocks)


class DecodeSchedule(NamedTuple):
    """Program ``p`` runs items ``[prog_items[p], prog_items[p + 1])``; item ``i`` covers KV
    tokens ``[item_start[i], item_end[i])`` of request ``item_req[i]``; request ``b`` owns
    items ``[req_items[b], req_items[b + 1])``. Items past ``req_items[-1]`` are padding."""

    prog_items: jax.Array  # [P + 1] int32
    item_req: jax.Array  # [I] int32
    item_start: jax.Array  # [I] int32
    item_end: jax.Array  # [I] int32
    req_items: jax.Array  # [B + 1] int32


def schedule_splits(
    seq_lens: np.ndarray,
    *,
    num_programs: int,
    block_k: int,
    snap: float = 0.1,
    num_items: int | None = None,
    item_cost: int = 0,
) -> DecodeSchedule:
    """Host-side (NumPy) schedule: program ``p`` gets the tokens between boundaries
    ``p * share`` and ``(p + 1) * share`` of the batch's concatenated KV, ``share`` rounded up
    to whole ``block_k`` steps. A boundary within ``snap * share`` of a request boundary moves
    onto it, so that a request is not split only to be merged again. Empty requests get no
    item. ``num_items`` pads the item arrays to a static size (at least
    ``max_items(B, num_programs)``; default: the exact count).

    ``item_cost`` (in ``block_k`` steps; 0: off) is what a program pays for each item it
    starts beyond its steps. With it, the shares of the fewest programs that give each
    program the same whole number of the batch's nonempty requests
    (``whole_request_programs``) are tried beside ``num_programs``' and kept where the most
    loaded program's steps plus ``item_cost`` an item come to no more (the programs past
    them get no item). Equal requests then run unsplit where splitting them would gain
    less than the items cost: 64 x 16384 tokens on 66 programs would leave 119 items."""
    lens = np.asarray(seq_lens, np.int64)
    cum = np.concatenate([[0], np.cumsum(lens)])
    starts = cum[:-1][lens > 0]
    items = _items(cum, starts, _share_bounds(cum, num_programs, block_k, snap))
    fewer = whole_request_programs(len(starts), num_programs)
    if item_cost and fewer < num_programs and len(items.req) > len(starts):  # a split
        cost = _largest_load(items, block_k, item_cost)
        # Fewer programs' most loaded one has at least this much (skips the common case).
        if -(-int(cum[-1]) // (fewer * block_k)) + item_cost <= cost:
            other = _items(cum, starts, _share_bounds(cum, fewer, block_k, snap))
            if _largest_load(other, block_k, item_cost) <= cost:
                items = other
    prog_items = np.searchsorted(items.prog, np.arange(num_programs + 1), side="left")
    req_items = np.searchsorted(items.req, np.arange(len(lens) + 1), side="left")
    count = len(items.req)
    pad = (num_items or count) - count
    if pad < 0:
        raise ValueError(f"num_items {num_items} < the {count} items this batch needs")
    fill = lambda a: np.concatenate([a, np.zeros(pad, np.int64)]).astype(np.int32)  # noqa: E731
    return DecodeSchedule(
        prog_items.astype(np.int32),
        fill(items.req),
        fill(items.first),
        fill(items.last),
        req_items.astype(np.int32),
    )


def whole_request_programs(requests: int, num_programs: int) -> int:
    """The fewest programs that take ``requests`` requests in equal whole numbers as
    ``num_programs`` programs would at best (``ceil(requests / num_programs)`` each)."""
    if requests == 0:
        return num_programs
    return -(-requests // -(-requests // num_programs))


def _share_bounds(cum: np.ndarray, num_programs: int, block_k: int, snap: float) -> np.ndarray:
    """The program boundaries (token offsets, ascending, inside ``(0, total)``) of
    ``schedule_splits`` over ``num_programs`` programs."""
    total = int(cum[-1])
    share = -(-max(-(-total // num_programs), 1) // block_k) * block_k
    bounds = np.arange(1, -(-total // share)) * share
    i = np.clip(np.searchsorted(cum, bounds), 1, len(cum) - 1)
    nearest = np.where(bounds - cum[i - 1] < cum[i] - bounds, cum[i - 1], cum[i])
    bounds = np.where(np.abs(nearest - bounds) <= snap * share, nearest, bounds)
    return _sorted_unique(bounds[(bounds > 0) & (bounds < total)])


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` for a small 1-D integer array, in a quarter of its time (the
    host builds a schedule every decode step)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))[: values.size]]


class _Items(NamedTuple):
    req: np.ndarray  # [I] each item's request
    first: np.ndarray  # [I] its first token in the request
    last: np.ndarray  # [I] its end in the request
    prog: np.ndarray  # [I] its program


def _items(cum: np.ndarray, starts: np.ndarray, bounds: np.ndarray) -> _Items:
    """The items of programs split at ``bounds`` (offsets in the batch's concatenated KV),
    the requests' offsets ``cum``, the nonempty ones starting at ``starts``."""
    cuts = _sorted_unique(np.concatenate([starts, bounds]))
    ends = np.append(cuts[1:], cum[-1])
    req = np.searchsorted(cum, cuts, side="right") - 1
    prog = np.searchsorted(bounds, cuts, side="right")
    return _Items(req, cuts - cum[req], ends - cum[req], prog)


def _largest_load(items: _Items, block_k: int, item_cost: int) -> int:
    """The most loaded program's ``block_k`` steps (a step an item covers in part counts
    whole, as the kernels run it) plus ``item_cost`` for each of its items."""
    steps = -(-items.last // block_k) - items.first // block_k
    return int(np.bincount(items.prog, weights=steps + item_cost).max())


def truncate_schedule(schedule: DecodeSchedule, seq_lens: jax.Array) -> DecodeSchedule:
    """``schedule`` (built for longer lengths) cut to ``seq_lens [B]`` keys per request, on
    the device: each item ends at most at its request's length, items past it become empty.
    A multi-step decode builds one schedule for its window's last lengths and cuts it for
    each step; the kernel reads only ``[item_start, item_end)`` and decides whether a request
    is whole by its item count, so a cut schedule reads no key past a request's length and
    combines its items as the uncut one would."""
    item_end = jnp.minimum(schedule.item_end, seq_lens[schedule.item_req])
    item_start = jnp.minimum(schedule.item_start, item_end)
    return schedule._replace(item_start=item_start, item_end=item_end)


def max_items(batch: int, num_programs: int) -> int:
    """Items of any batch of ``batch`` requests: one per request start plus one per share
    boundary."""
    return batch + num_programs


def _whole_requests(seq_lens: jax.Array) -> DecodeSchedule:
    """The device-side fallback when no host schedule is given: one program and one item per
    request, no split (correct for any lengths; balanced only for uniform ones)."""
    b = seq_lens.shape[0]
    idx = jnp.arange(b + 1, dtype=jnp.int32)
    return DecodeSchedule(idx, idx[:-1], jnp.zeros(b, jnp.int32), seq_lens, idx)


def _row_columns(ref, rows: jax.Array, first: int, count: int, tile: int) -> jax.Array:
    """Columns ``[first, first + count)`` of the given ``rows`` of ``ref`` as a
    ``[len(rows), tile]`` tile, zero (and not read) past ``count``."""
    if count == tile:
        return ref[rows, pl.ds(first, count)]
    cols = jnp.arange(tile, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(cols < count, (rows.shape[0], tile))
    return plgpu.load(ref.at[rows[:, None], first + cols], mask=mask, other=0)


class _Group(NamedTuple):
    """Latent columns ``[first, first + count)`` held in a ``tile``-wide power-of-two tile."""

    first: int
    count: int
    tile: int


def _latent_groups(num_lat: int, quantized: bool) -> tuple[_Group, ...]:
    """How the kernel splits the latent: one tile for a bf16/float32 cache; one per scale
    group (``fp8.GROUP`` columns) for an FP8 cache, whose scales then apply per tile."""
    width = fp8.GROUP if quantized else num_lat
    return tuple(
        _Group(
            first,
            min(width, num_lat - first),
            online_softmax.tile_width(min(width, num_lat - first)),
        )
        for first in range(0, num_lat, width)
    )


def _load_keys(
    cache_refs: tuple,
    rows: jax.Array,
    groups: tuple[_Group, ...],
    *,
    num_lat: int,
    rope: int,
    rope_tile: int,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array | None, ...], jax.Array]:
    """The keys of cache ``rows`` as stored: per latent group a ``[len(rows), tile]`` tile
    and its ``[len(rows)]`` float32 scales (None for an unscaled cache), and the
    ``[len(rows), rope_tile]`` k_pe tile. ``cache_refs``: ``(kv,)`` rows ``concat(kv_c,
    k_pe)``, or an FP8 cache's ``(kv_c, k_pe, scales)``, whose float8_e4m3fn tiles the
    caller converts in registers (exact) and whose scales it applies to scores and
    probabilities."""
    if len(cache_refs) == 1:
        (kv_ref,) = cache_refs
        [group] = groups
        kv_c = _row_columns(kv_ref, rows, 0, num_lat, group.tile)
        return (kv_c,), (None,), _row_columns(kv_ref, rows, num_lat, rope, rope_tile)
    kv_c_ref, k_pe_ref, scales_ref = cache_refs
    kv_c = tuple(_row_columns(kv_c_ref, rows, g.first, g.count, g.tile) for g in groups)
    scales = tuple(scales_ref[rows, i] for i in range(len(groups)))
    return kv_c, scales, _row_columns(k_pe_ref, rows, 0, rope, rope_tile)


def _scaled(scores: jax.Array, key_scales: jax.Array | None) -> jax.Array:
    """``scores [rows, cols]`` of one latent group times its keys' ``[cols]`` scales."""
    return scores if key_scales is None else scores * key_scales[None, :]


def _decode_kernel(
    prog_items_ref,
    item_req_ref,
    item_start_ref,
    item_end_ref,
    req_items_ref,
    block_table_ref,
    q_lat_ref,
    q_pe_ref,
    *refs,
    scale: float,
    block_h: int,
    block_k: int,
    block_size: int,
    num_lat: int,
    rope: int,
    split_tail: bool,
    prefetch: bool,
    fp8_compute: str,
    heads_major: bool,
):
    """One program x one block of heads: online softmax over each of its items. Queries
    and outputs are padded tiles (``q_lat_ref.shape[-1]`` >= ``num_lat`` columns), heads
    leading with ``heads_major``.
    ``refs``: the cache refs (see ``_load_keys``), then out, lse, o_part and lse_part."""
    cache_refs, (out_ref, lse_ref, o_part_ref, lse_part_ref) = refs[:-4], refs[-4:]
    quantized = len(cache_refs) > 1
    groups = _latent_groups(num_lat, quantized=quantized)
    # The latent dots' dtype: the queries' (bf16 or float32), or fp8_compute over FP8 tiles.
    lat_dtype = jnp.dtype(fp8_compute) if quantized else q_pe_ref.dtype
    h, p = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(h * block_h, block_h)
    rope_tile = q_pe_ref.shape[-1]
    load_keys = functools.partial(
        _load_keys, cache_refs, groups=groups, num_lat=num_lat, rope=rope, rope_tile=rope_tile
    )

    def item(i, carry):
        req, start, end = item_req_ref[i], item_start_ref[i], item_end_ref[i]
        rows_of_req = head_rows(req, heads, heads_major)
        q_lat = tuple(
            q_lat_ref[(*rows_of_req, pl.ds(g.first, g.tile))].astype(lat_dtype) for g in groups
        )
        q_pe = q_pe_ref[req, heads, :]
        # Tokens past the item's end read its last token instead, a row the request owns:
        # no block-table entry or cache row outside [0, seq_len) is touched, and their scores
        # are masked.
        last = end - 1
        last_page = last // block_size
        last_row = block_table_ref[req, last_page] * block_size + last % block_size

        def tokens(j):
            return start + j * block_k + jnp.arange(block_k, dtype=jnp.int32)

        def rows(j, *, masked: bool):
            """Cache rows of step j's tokens; unmasked steps lie inside ``[start, end)``."""
            tok = tokens(j)
            if masked:
                page = block_table_ref[req, jnp.minimum(tok // block_size, last_page)]
                return jnp.where(tok < end, page * block_size + tok % block_size, last_row)
            return block_table_ref[req, tok // block_size] * block_size + tok % block_size

        def attend(j, state, keys, *, masked: bool):
            """Folds step j's ``block_k`` tokens (their loaded ``keys``) into ``state``."""
            kv_c, kv_scales, k_pe = keys
            kv_c = tuple(tile.astype(lat_dtype) for tile in kv_c)
            s = functools.reduce(
                operator.add,
                (
                    _scaled(online_softmax.dot(q_g, kv_g, trans_b=True), scale_g)
                    for q_g, kv_g, scale_g in zip(q_lat, kv_c, kv_scales, strict=True)
                ),
            )
            s += online_softmax.dot(q_pe, k_pe, trans_b=True)
            s *= scale * online_softmax.LOG2E
            if masked:
                s = jnp.where((tokens(j) < end)[None, :], s, -jnp.inf)
            return online_softmax.update(state, s, kv_c, kv_scales)

        def step(j, state, *, masked: bool):
            return attend(j, state, load_keys(rows(j, masked=masked)), masked=masked)

        def prefetched_step(j, carry):
            """Step j on the keys loaded by step j - 1, loading step j + 1's (past the end:
            the last row, masked)."""
            state, keys = carry
            next_keys = load_keys(rows(j + 1, masked=True))
            return attend(j, state, keys, masked=True), next_keys

        state = online_softmax.init(block_h, tuple(g.tile for g in groups))
        num_steps = pl.cdiv(end - start, block_k)
        if prefetch:
            first_keys = load_keys(rows(0, masked=True))
            state, _ = jax.lax.fori_loop(0, num_steps, prefetched_step, (state, first_keys))
        elif split_tail:
            # A branch, not a second loop: Triton gives every loop its own pipeline.
            num_full = (end - start) // block_k
            state = jax.lax.fori_loop(0, num_full, functools.partial(step, masked=False), state)
            state = jax.lax.cond(
                num_full < num_steps,
                functools.partial(step, num_full, masked=True),
                lambda state: state,
                state,
            )
        else:
            state = jax.lax.fori_loop(0, num_steps, functools.partial(step, masked=True), state)
        out, lse = online_softmax.finalize(state)
        # A request of one item is whole: its output goes straight to out (the combine
        # kernel leaves such requests alone, by the same count).
        whole = req_items_ref[req + 1] - req_items_ref[req] == 1

        @pl.when(whole)
        def _():
            for g, out_g in zip(groups, out, strict=True):
                out_ref[(*rows_of_req, pl.ds(g.first, g.tile))] = out_g.astype(out_ref.dtype)
            lse_ref[req, heads] = lse

        @pl.when(jnp.logical_not(whole))
        def _():
            for g, out_g in zip(groups, out, strict=True):
                o_part_ref[i, heads, pl.ds(g.first, g.tile)] = out_g
            lse_part_ref[i, heads] = lse

        return carry

    jax.lax.fori_loop(prog_items_ref[p], prog_items_ref[p + 1], item, 0)


def _combine_kernel(
    req_items_ref,
    o_part_ref,
    lse_part_ref,
    _out_in,
    _lse_in,
    out_ref,
    lse_ref,
    *,
    block_h: int,
    block_d: int,
    block_items: int,
    heads_major: bool,
):
    """LSE-merges the partial results of one split request (``block_items`` at a time) for
    ``block_h`` heads x ``block_d`` latent dims; empty requests get 0 and -inf; requests of
    one item were written by the decode kernel and are left alone."""
    h, b, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, dims = pl.ds(h * block_h, block_h), pl.ds(d * block_d, block_d)
    first, last = req_items_ref[b], req_items_ref[b + 1]

    def body(k, state):
        i = first + k * block_items
        ok = i + jnp.arange(block_items) < last
        o = plgpu.load(
            o_part_ref.at[pl.ds(i, block_items), heads, dims], mask=ok[:, None, None], other=0.0
        )
        lse = plgpu.load(
            lse_part_ref.at[pl.ds(i, block_items), heads], mask=ok[:, None], other=-jnp.inf
        )
        return online_softmax.merge_block(state, o, lse)

    @pl.when(last - first != 1)
    def _():
        state = jax.lax.fori_loop(
            0, pl.cdiv(last - first, block_items), body, online_softmax.init(block_h, block_d)
        )
        out, lse = online_softmax.finalize(state, log2_domain=False)
        out_ref[(*head_rows(b, heads, heads_major), dims)] = out.astype(out_ref.dtype)

        @pl.when(d == 0)
        def _():
            lse_ref[b, heads] = lse


def _check_fp8(kv_cache: fp8.Fp8Cache) -> None:
    """The FP8 layout's parts: dtypes and matching slots (``fp8.Fp8Cache``)."""
    kv_c, k_pe, scales = kv_cache
    if kv_c.dtype != fp8.FP8 or scales.dtype != jnp.float32:
        raise ValueError(
            f"an Fp8Cache holds kv_c float8_e4m3fn and scales float32, got {kv_c.dtype} and "
            f"{scales.dtype}"
        )
    lkv = kv_c.shape[-1] if kv_c.ndim == 3 else 0
    want = (*kv_c.shape[:2], fp8.num_groups(lkv))
    if kv_c.ndim != 3 or k_pe.shape[:2] != kv_c.shape[:2] or scales.shape != want:
        raise ValueError(
            f"Fp8Cache parts kv_c {kv_c.shape}, k_pe {k_pe.shape} and scales {scales.shape} "
            f"must be [blocks, page, Lkv], [blocks, page, R] and [blocks, page, cdiv(Lkv, "
            f"{fp8.GROUP})]"
        )


def _check(q_lat, q_pe, kv_cache, block_table, seq_lens, block_h):
    if isinstance(kv_cache, fp8.Fp8Cache):
        _check_fp8(kv_cache)
    if q_lat.ndim != 3 or q_pe.ndim != 3 or len(kv_cache.shape) != 3:
        raise ValueError(
            f"q_lat {q_lat.shape}, q_pe {q_pe.shape} and kv_cache {kv_cache.shape} must be 3-D"
        )
    b, n, lkv = q_lat.shape
    r = q_pe.shape[-1]
    if min(n, lkv, r) < 1:
        raise ValueError(f"q_lat {q_lat.shape} and q_pe {q_pe.shape} need N, Lkv and R >= 1")
    if q_pe.shape[:2] != (b, n):
        raise ValueError(f"q_pe {q_pe.shape} must be [B={b}, N={n}, R]")
    if kv_cache.shape[-1] != lkv + r:
        raise ValueError(f"kv_cache rows are {kv_cache.shape[-1]} wide, expected {lkv} + {r}")
    if block_h < 16 or block_h & (block_h - 1) or padded_heads(n) % block_h:
        raise ValueError(
            f"block_h ({block_h}) must be a power of two >= 16 dividing the {n} heads rounded "
            f"up to a multiple of 16 ({padded_heads(n)})"
        )
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
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule: DecodeSchedule | None = None,
    config: DecodeConfig | None = None,
    interpret: bool | None = None,
    heads_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache.

    Args:
      q_lat: ``[B, N, Lkv]`` queries in the latent space (any N, Lkv >= 1); ``[N, B, Lkv]``
        with ``heads_major``.
      q_pe: ``[B, N, R]`` rotated rope queries.
      kv_cache: ``[num_blocks, block_size, Lkv + R]`` rows ``concat(kv_c, k_pe)`` in q's
        dtype, or an ``fp8.Fp8Cache`` (queries in its k_pe dtype, bf16): its latent tiles
        are loaded as float8_e4m3fn and converted in registers, and each group's
        power-of-two scales multiply the scores and the probabilities (no rounding beyond
        the bf16 cache's).
      block_table: ``[B, W]`` int32; ``W * block_size`` must cover every ``seq_lens``. Only
        the first ``cdiv(seq_lens[b], block_size)`` entries of row b are read; the rest may
        hold anything (-1, a stale id), and cache rows past ``seq_lens[b]`` are never read.
      seq_lens: ``[B]`` int32 keys per request; 0 gives out 0 and lse -inf.
      scale: softmax scale.
      schedule: the split-KV plan (``schedule_splits``, built on the host with the metadata
        by ``KernelPlan.decode_schedule``), or one built for longer lengths and cut to
        ``seq_lens`` by ``truncate_schedule``; None runs each request whole in a program of
        its own.
      config: launch parameters (default: ``DecodeConfig.for_shape(N, B, quantized)``).
      heads_major: q_lat and out with heads leading, ``[N, B, Lkv]``: the layout the
        absorbed path's batched matmuls (one a head) take and give, so that neither side
        transposes them.

    Returns:
      ``out [B, N, Lkv]`` (``[N, B, Lkv]`` with ``heads_major``) in q's dtype and
      ``lse [B, N]`` float32 (natural log).
    """
    view = batch_major_view(q_lat, heads_major)
    b, n = view.shape[:2] if view.ndim == 3 else (0, 0)
    config = config or DecodeConfig.for_shape(n, b, isinstance(kv_cache, fp8.Fp8Cache))
    _check(view, q_pe, kv_cache, block_table, seq_lens, config.block_h)
    _check_values(kv_cache, block_table, seq_lens)
    if config.prefetch and config.split_tail:
        raise ValueError("config.prefetch needs split_tail False (it runs one masked loop)")
    if config.fp8_compute not in ("bfloat16", "float16"):
        raise ValueError(
            f"config.fp8_compute {config.fp8_compute!r} must be 'bfloat16' or 'float16'"
        )
    if interpret is None:
        interpret = online_softmax.interpret_default()
    if isinstance(kv_cache, fp8.Fp8Cache) and not interpret:
        fp8.check_triton_indexable(kv_cache.kv_c, "kv_cache.kv_c")
    config = dataclasses.replace(
        config,
        combine_block_h=min(config.combine_block_h, padded_heads(n)),
        combine_block_d=min(config.combine_block_d, online_softmax.tile_width(q_lat.shape[-1])),
    )
    return _mla_decode(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        schedule,
        scale=scale,
        config=config,
        interpret=interpret,
        heads_major=heads_major,
    )


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "heads_major"))
def _mla_decode(
    q_lat,
    q_pe,
    kv_cache,
    block_table,
    seq_lens,
    schedule,
    *,
    scale,
    config,
    interpret,
    heads_major,
):
    b, n, lkv = batch_major_view(q_lat, heads_major).shape
    rope = q_pe.shape[-1]
    num_blocks, block_size, _ = kv_cache.shape
    # Each part of the cache as [slots, columns] (one array, or the FP8 layout's three).
    cache_parts = [
        a.reshape(num_blocks * block_size, a.shape[-1]) for a in jax.tree.leaves(kv_cache)
    ]
    heads = padded_heads(n)
    lat_tile = online_softmax.tile_width(lkv)
    q_lat = online_softmax.pad_to(q_lat, head_shape(b, heads, lat_tile, heads_major))
    q_pe = online_softmax.pad_to(q_pe, (b, heads, online_softmax.tile_width(rope)))
    if schedule is None:
        schedule = _whole_requests(seq_lens)
    num_programs = schedule.prog_items.shape[0] - 1
    num_items = schedule.item_req.shape[0]
    out, lse, o_part, lse_part = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            scale=scale,
            block_h=config.block_h,
            block_k=config.block_k,
            block_size=block_size,
            num_lat=lkv,
            rope=rope,
            split_tail=config.split_tail,
            prefetch=config.prefetch,
            fp8_compute=config.fp8_compute,
            heads_major=heads_major,
        ),
        grid=(heads // config.block_h, num_programs),
        out_shape=(
            jax.ShapeDtypeStruct(head_shape(b, heads, lat_tile, heads_major), q_lat.dtype),
            jax.ShapeDtypeStruct((b, heads), jnp.float32),
            jax.ShapeDtypeStruct((num_items, heads, lat_tile), jnp.float32),
            jax.ShapeDtypeStruct((num_items, heads), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="mla_decode",
    )(
        schedule.prog_items,
        schedule.item_req,
        schedule.item_start,
        schedule.item_end,
        schedule.req_items,
        block_table,
        q_lat,
        q_pe,
        *cache_parts,
    )
    out, lse = combine_splits(
        schedule.req_items,
        o_part,
        lse_part,
        out,
        lse,
        config=config,
        interpret=interpret,
        heads_major=heads_major,
    )
    return unpad_out(out, n, lkv, heads_major), lse[:, :n]


def unpad_out(out: jax.Array, num_heads: int, width: int, heads_major: bool) -> jax.Array:
    """``out`` without its padding heads and columns."""
    if heads_major:
        return out[:num_heads, :, :width]
    return out[:, :num_heads, :width]


def combine_splits(
    req_items: jax.Array,
    o_part: jax.Array,
    lse_part: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    *,
    config: DecodeConfig,
    interpret: bool,
    heads_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The second pass of a split-KV decode: LSE-merges the float32 partial results
    ``o_part [I, H, D]``, ``lse_part [I, H]`` of each request split over several items into
    ``out [B, H, D]`` (``[H, B, D]`` with ``heads_major``) and ``lse [B, H]`` (updated in
    place: rows of requests run whole are kept, empty requests get 0 and -inf). ``H`` and
    ``D`` must be multiples of the config's combine blocks."""
    b, heads = lse.shape
    width = out.shape[-1]
    return pl.pallas_call(
        functools.partial(
            _combine_kernel,
            block_h=config.combine_block_h,
            block_d=config.combine_block_d,
            block_items=config.combine_block_items,
            heads_major=heads_major,
        ),
        grid=(heads // config.combine_block_h, b, width // config.combine_block_d),
        out_shape=(
            jax.ShapeDtypeStruct(out.shape, out.dtype),
            jax.ShapeDtypeStruct((b, heads), jnp.float32),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="mla_decode_combine",
    )(req_items, o_part, lse_part, out, lse)
