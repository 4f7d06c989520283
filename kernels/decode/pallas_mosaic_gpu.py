"""Paged absorbed MLA decode on Hopper (Pallas, Mosaic GPU lowering): wgmma, TMA, warp
specialization, split-KV with the Triton kernel's plan and LSE combine.

Same contract as ``pallas_triton.mla_decode``. The design follows FlashMLA's Hopper kernel
(design notes in ``kernels/decode/MOSAIC_GPU.md``): a program owns 64 query-head rows (one
wgmma M tile; heads are zero-padded to a multiple of 64) and runs its items (``schedule_splits``)
page by page with two warpgroups, each owning half of the ``[64, Lkv]`` float32 output (128
registers a thread instead of 256):

* each item's queries and each 64-token page (through the block table) are copied into
  shared memory by TMA, two page slots deep, the latent ``[64, Lkv]`` and rope ``[64, R]``
  parts apart; warpgroup 0 issues the copies as the slots are released;
* the warpgroups take turns on the pages: the owner of a page (warpgroup 0 the even pages,
  1 the odd ones) computes its scores ``[q_lat, q_pe] @ [kv_c, k_pe]^T`` and the online
  softmax, and hands the bf16 probabilities and the new row maximum to the other through
  shared memory (the probabilities overwrite the page's rope part, which nothing reads
  after the scores); both then add ``P @ kv_c[:, half]``. While one runs its softmax the
  other keeps the tensor cores busy (FlashMLA's "seesaw").

A page's rows past the item's end are loaded with the page (TMA copies whole pages) but
their scores are masked and their values zeroed in shared memory before any product reads
them, so stale or NaN rows there change nothing; no block-table entry past
``cdiv(seq_len, 64)`` is read.

Runs on sm90 with page 64, bf16, ``Lkv`` a multiple of 128 and ``R == 64``; ``mla_decode``
hands anything else to the Triton kernel (logged once per reason).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import fp8, online_softmax
from . import pallas_triton

log = logging.getLogger(__name__)

BLOCK_H = 64  # query-head rows of a program: one wgmma M tile
PAGE = 64  # cache page = tokens per step
ROPE = 64  # k_pe width: one 128-byte swizzled tile
NUM_WARPGROUPS = 2  # each holds half of the output's columns


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Compile options of the Mosaic GPU decode kernel.

    approx_math: exp2 through the special-function unit (``ex2.approx``), as FlashMLA.
    auto_barriers: let Pallas put a warpgroup barrier around every shared-memory store
      (off: the kernel orders its stores itself, through its mbarriers and commit_smem).
    """

    approx_math: bool = True
    auto_barriers: bool = False


def padded_heads(num_heads: int) -> int:
    """Heads the kernel runs: N rounded up to a multiple of 64 (padding heads get zero
    queries and are dropped)."""
    return -(-num_heads // BLOCK_H) * BLOCK_H


def num_programs(num_heads: int, num_sms: int = pallas_triton.DEFAULT_NUM_SMS) -> int:
    """Programs per block of 64 heads: one a multiprocessor (a program takes 225 KB of
    shared memory), the multiprocessors shared between the head blocks."""
    return max(1, num_sms // (padded_heads(num_heads) // BLOCK_H))


def unsupported(q_lat, q_pe, kv_cache) -> str | None:
    """Why the Mosaic GPU kernel cannot run these inputs (None: it can)."""
    if isinstance(kv_cache, fp8.Fp8Cache):
        return "an FP8 cache"
    if len(kv_cache.shape) != 3 or q_lat.ndim != 3 or q_pe.ndim != 3:
        return "inputs that are not 3-D"
    if kv_cache.shape[1] != PAGE:
        return f"page size {kv_cache.shape[1]} (runs {PAGE})"
    if q_lat.dtype != jnp.bfloat16:
        return f"dtype {q_lat.dtype} (runs bfloat16)"
    if q_lat.shape[-1] % (2 * 64) or q_pe.shape[-1] != ROPE:
        return f"Lkv {q_lat.shape[-1]} and R {q_pe.shape[-1]} (runs Lkv % 128 == 0, R == {ROPE})"
    if jax.default_backend() != "gpu" and not hasattr(plgpu, "InterpretGPUParams"):
        return f"jax {jax.__version__} interpreted (Mosaic GPU's interpret mode needs 0.11)"
    if jax.default_backend() == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", "")
        if cc and not str(cc).startswith("9"):
            return f"compute capability {cc} (runs sm90)"
        if tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11):
            # Compiled and run on 0.11.2. The Mosaic GPU lowering of 0.12 refuses the
            # output's register-to-global stores (a warp's bf16 row is half a 32-byte
            # sector); interpret mode runs on 0.11 and 0.12.
            return f"jax {jax.__version__} compiled (runs 0.11)"
    return None


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def mla_decode(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule: pallas_triton.DecodeSchedule | None = None,
    config: MosaicDecodeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache (the contract of
    ``pallas_triton.mla_decode``).

    Args:
      q_lat: ``[B, N, Lkv]`` bf16 queries in the latent space (any N).
      q_pe: ``[B, N, R]`` bf16 rotated rope queries.
      kv_cache: ``[num_blocks, 64, Lkv + R]`` bf16 rows ``concat(kv_c, k_pe)``. Other page
        sizes, dtypes, widths and the FP8 cache run the Triton kernel (logged once).
      block_table: ``[B, W]`` int32; only the first ``cdiv(seq_lens[b], 64)`` entries of
        row b are read.
      seq_lens: ``[B]`` int32 keys per request; 0 gives out 0 and lse -inf.
      scale: softmax scale.
      schedule: the split-KV plan (``pallas_triton.schedule_splits``, e.g. for
        ``num_programs`` programs in whole pages), or one cut to shorter lengths by
        ``truncate_schedule``; None runs each request whole in a program of its own.
      config: compile options (default ``MosaicDecodeConfig()``).
      interpret: run in Mosaic GPU's interpret mode (default: off a GPU).

    Returns:
      ``out [B, N, Lkv]`` in q's dtype and ``lse [B, N]`` float32 (natural log).
    """
    reason = unsupported(q_lat, q_pe, kv_cache)
    if reason is not None:
        _log_once(f"mla_decode: the Mosaic GPU kernel does not run {reason}; using Triton")
        return pallas_triton.mla_decode(
            q_lat,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            scale=scale,
            schedule=schedule,
            interpret=interpret,
        )
    b, n, lkv = q_lat.shape
    triton_config = pallas_triton.DecodeConfig.for_shape(n, b)
    # The same checks and the same one-line errors as the Triton kernel.
    pallas_triton._check(q_lat, q_pe, kv_cache, block_table, seq_lens, triton_config.block_h)
    pallas_triton._check_values(kv_cache, block_table, seq_lens)
    if interpret is None:
        interpret = online_softmax.interpret_default()
    heads = padded_heads(n)
    combine_config = dataclasses.replace(
        triton_config,
        combine_block_h=min(triton_config.combine_block_h, heads),
        combine_block_d=min(triton_config.combine_block_d, lkv),
    )
    return _mla_decode(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        schedule,
        scale=scale,
        config=config or MosaicDecodeConfig(),
        combine_config=combine_config,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("scale", "config", "combine_config", "interpret"))
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
    combine_config,
    interpret,
):
    b, n, lkv = q_lat.shape
    heads = padded_heads(n)
    q_lat = online_softmax.pad_to(q_lat, (b, heads, lkv))
    q_pe = online_softmax.pad_to(q_pe, (b, heads, ROPE))
    if schedule is None:
        schedule = pallas_triton._whole_requests(seq_lens)
    programs = schedule.prog_items.shape[0] - 1
    items = schedule.item_req.shape[0]
    out, lse, o_part, lse_part = _decode_call(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        schedule,
        scale=scale,
        programs=programs,
        items=items,
        config=config,
        interpret=interpret,
    )
    out, lse = pallas_triton.combine_splits(
        schedule.req_items,
        o_part,
        lse_part,
        out,
        lse,
        config=combine_config,
        interpret=interpret,
    )
    return out[:, :n], lse[:, :n]


def _decode_call(
    q_lat,
    q_pe,
    kv_cache,
    block_table,
    schedule,
    *,
    scale,
    programs,
    items,
    config,
    interpret,
):
    """The split-KV kernel: ``(out, lse)`` of the items that cover a request whole, the
    float32 partials ``(o_part, lse_part)`` of the others."""
    b, heads, lkv = q_lat.shape
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf16 = jnp.bfloat16
    scratch = dict(
        q_lat_smem=plgpu.SMEM((BLOCK_H, lkv), bf16, transforms=swizzled),
        q_pe_smem=plgpu.SMEM((BLOCK_H, ROPE), bf16, transforms=swizzled),
        kv_smem=plgpu.SMEM((2, PAGE, lkv), bf16, transforms=swizzled),
        pe_smem=plgpu.SMEM((2, PAGE, ROPE), bf16, transforms=swizzled),
        m_smem=plgpu.SMEM((2, BLOCK_H), jnp.float32),
        l_smem=plgpu.SMEM((NUM_WARPGROUPS, BLOCK_H), jnp.float32),
        kv_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),  # two copies a page
        kv_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # warpgroup 1 -> 0
        p_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        q_ready=plgpu.Barrier(num_arrivals=2),
        q_free=plgpu.Barrier(num_arrivals=1),
        l_ready=plgpu.Barrier(num_arrivals=NUM_WARPGROUPS),
    )
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, interpret=bool(interpret)),
        out_type=(
            jax.ShapeDtypeStruct((b, heads, lkv), q_lat.dtype),
            jax.ShapeDtypeStruct((b, heads), jnp.float32),
            jax.ShapeDtypeStruct((items, heads, lkv), jnp.float32),
            jax.ShapeDtypeStruct((items, heads), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(heads // BLOCK_H, programs),
        grid_names=("h", "p"),
        num_threads=NUM_WARPGROUPS,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=config.approx_math,
            unsafe_no_auto_barriers=not config.auto_barriers,
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(
        schedule.prog_items,
        schedule.item_req,
        schedule.item_start,
        schedule.item_end,
        schedule.req_items,
        block_table,
        q_lat,
        q_pe,
        kv_cache,
    )


def _kernel(
    prog_items_ref,
    item_req_ref,
    item_start_ref,
    item_end_ref,
    req_items_ref,
    block_table_ref,
    q_lat_ref,
    q_pe_ref,
    cache_ref,
    out_ref,
    lse_ref,
    o_part_ref,
    lse_part_ref,
    *,
    q_lat_smem,
    q_pe_smem,
    kv_smem,
    pe_smem,
    m_smem,
    l_smem,
    kv_ready,
    kv_free,
    p_ready,
    q_ready,
    q_free,
    l_ready,
    scale,
    interpret,
):
    """One program (a block of 64 heads x a share of the batch's tokens) on two warpgroups;
    the refs are the kernel's inputs, outputs and shared memory (see ``_decode_call``)."""
    lkv = q_lat_smem.shape[-1]
    half_width = lkv // NUM_WARPGROUPS
    wg = lax.axis_index("wg")
    p = lax.axis_index("p")
    heads = pl.ds(lax.axis_index("h") * BLOCK_H, BLOCK_H)
    first_item, last_item = prog_items_ref[p], prog_items_ref[p + 1]
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    log2_scale = scale * math.log2(math.e)

    def item_pages(i):
        """An item's request, token range, first and last page and page pairs (its pages
        rounded up to an even count: the warpgroups take pages two at a time)."""
        req, start, end = item_req_ref[i], item_start_ref[i], item_end_ref[i]
        first_page = start // PAGE
        last_page = jnp.maximum(end - 1, 0) // PAGE
        pairs = jnp.where(end > start, (last_page - first_page + 2) // 2, 0)
        return req, start, end, first_page, last_page, pairs

    def load_page(slot, block):
        """Starts the copies of cache page ``block`` into ``slot`` (warpgroup 0 issues them,
        once the slot is free)."""
        plgpu.copy_gmem_to_smem(
            cache_ref.at[block, :, pl.ds(0, lkv)], kv_smem.at[slot], kv_ready.at[slot]
        )
        plgpu.copy_gmem_to_smem(
            cache_ref.at[block, :, pl.ds(lkv, ROPE)], pe_smem.at[slot], kv_ready.at[slot]
        )

    def accumulate(acc, alpha, a_ref, b_ref, during=lambda: None):
        """``acc * alpha[:, None] + a_ref @ b_ref`` with ``during()`` run while the wgmma is
        in flight; returns the sum and what ``during`` returned. Interpret mode cannot load
        a value into a wgmma accumulator, so there the product starts from zero and is added
        after (the same arithmetic in a different order)."""
        scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        def scope(acc_ref):
            if not interpret:
                acc_ref[...] = scaled
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            result = during()
            return acc_ref[...], result

        total, result = pl.run_scoped(scope, plgpu.ACC(acc.shape, jnp.float32))
        return (scaled + total if interpret else total), result

    def scores(slot, during=lambda: None):
        """``[64, 64]`` raw scores of the page in ``slot`` (waits for its copy), with
        ``during()`` run while the wgmma is in flight."""

        def scope(s_ref):
            plgpu.barrier_wait(kv_ready.at[slot])
            plgpu.wgmma(s_ref, q_lat_smem, kv_smem.at[slot].T)
            plgpu.wgmma(s_ref, q_pe_smem, pe_smem.at[slot].T)
            result = during()
            return s_ref[...], result

        return pl.run_scoped(scope, plgpu.ACC((BLOCK_H, PAGE), jnp.float32))

    def warpgroup(w):
        """Warpgroup ``w``'s part of the program's items: output columns ``half``, the
        pages ``2j + w`` of each pair ``j`` (and, for warpgroup 0, every copy)."""
        half = pl.ds(w * half_width, half_width)

        def item(i, pairs_done):
            req, start, end, first_page, last_page, pairs = item_pages(i)

            def block(k):
                """The cache block of the item's page ``k`` (past the last page: the last
                page again, which the padding page of an odd count reloads, masked)."""
                return block_table_ref[req, jnp.minimum(first_page + k, last_page)]

            if w == 0:
                # The item's queries once warpgroup 1 is done with the last item's, its first
                # two pages once warpgroup 1 released the last pair's slots.
                @pl.when(i > first_item)
                def _():
                    plgpu.barrier_wait(q_free)

                plgpu.copy_gmem_to_smem(q_lat_ref.at[req, heads], q_lat_smem, q_ready)
                plgpu.copy_gmem_to_smem(q_pe_ref.at[req, heads], q_pe_smem, q_ready)

                @pl.when(pairs > 0)
                def _():
                    for slot, first_block in enumerate([block(0), block(1)]):

                        @pl.when(pairs_done > 0)
                        def _(slot=slot):
                            plgpu.barrier_wait(kv_free.at[slot])

                        load_page(slot, first_block)

            plgpu.barrier_wait(q_ready)

            def own_page(slot, s, m_prev, l, k):
                """The owner's part of page ``k`` of the item (in ``slot``, raw scores
                ``s``): zero the value rows past the end, mask, online softmax, publish the
                probabilities and the new maximum. Returns (m_new, l_new, alpha)."""
                tok0 = (first_page + k) * PAGE
                rows_valid = end - jnp.minimum(first_page + k, last_page) * PAGE

                @pl.when(rows_valid < PAGE)
                def _():
                    row = plgpu.broadcasted_iota(jnp.int32, (PAGE, 64), 0, layout=wgmma_layout)
                    for c in range(lkv // 64):
                        tile = kv_smem.at[slot, :, pl.ds(c * 64, 64)]
                        values = tile[...]
                        tile[...] = jnp.where(row < rows_valid, values, jnp.zeros_like(values))

                def mask(s):
                    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, PAGE), 1, layout=wgmma_layout)
                    tok = tok0 + col
                    return jnp.where((tok >= start) & (tok < end), s, -jnp.inf)

                # Only an item's first and last pages have keys outside it: the mask's
                # registers are needed in that branch alone.
                boundary = (tok0 < start) | (tok0 + PAGE > end)
                s = lax.cond(boundary, mask, lambda s: s, s)
                # The first page of an item has a key in every row, so m_new is finite
                # from then on and no -inf - -inf arises.
                m_new = jnp.maximum(m_prev, s.max(axis=1) * log2_scale)
                probs = jnp.exp2(s * log2_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m_prev - m_new)
                l = l * alpha + probs.sum(axis=1)
                pe_smem[slot] = probs.astype(jnp.bfloat16)
                m_smem[slot] = m_new
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[slot])
                return m_new, l, alpha

            def values(slot):
                return kv_smem.at[slot, :, half]

            def pair(j, state):
                acc, m, l = state
                if w == 0:
                    # Page 2j is ours: scores, softmax, publish, then our half of both
                    # pages' products (page 2j + 1's probabilities come from warpgroup 1).
                    # Each slot is refilled with the next pair's page as soon as warpgroup 1
                    # releases it; the block ids are read first, their latency hidden by
                    # this pair's work.
                    more = j + 1 < pairs
                    next_blocks = [block(2 * j + 2), block(2 * j + 3)]

                    def refill(slot):
                        @pl.when(more)
                        def _():
                            plgpu.barrier_wait(kv_free.at[slot])
                            load_page(slot, next_blocks[slot])

                    s, _ = scores(0)
                    m0, l, alpha0 = own_page(0, s, m, l, 2 * j)

                    def wait_for_odd_page():
                        plgpu.barrier_wait(kv_ready.at[1])
                        plgpu.barrier_wait(p_ready.at[1])
                        return plgpu.layout_cast(m_smem[1], row_layout)

                    acc, m1 = accumulate(acc, alpha0, pe_smem.at[0], values(0), wait_for_odd_page)
                    refill(0)
                    alpha1 = jnp.exp2(m0 - m1)
                    acc, _ = accumulate(acc, alpha1, pe_smem.at[1], values(1))
                    refill(1)
                    return acc, m1, l * alpha1

                # Page 2j + 1 is ours: its scores run while page 2j's softmax finishes on
                # warpgroup 0; our softmax runs while page 2j's product is in flight.
                def wait_for_even_page():
                    plgpu.barrier_wait(kv_ready.at[0])
                    plgpu.barrier_wait(p_ready.at[0])
                    return plgpu.layout_cast(m_smem[0], row_layout)

                s, m0 = scores(1, wait_for_even_page)
                alpha0 = jnp.exp2(m - m0)
                acc, (m1, l, alpha1) = accumulate(
                    acc,
                    alpha0,
                    pe_smem.at[0],
                    values(0),
                    lambda: own_page(1, s, m0, l * alpha0, 2 * j + 1),
                )
                plgpu.barrier_arrive(kv_free.at[0])
                acc, _ = accumulate(acc, alpha1, pe_smem.at[1], values(1))
                plgpu.barrier_arrive(kv_free.at[1])
                return acc, m1, l

            acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half_width), jnp.float32), wgmma_layout)
            m = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout)
            acc, m, l = lax.fori_loop(0, pairs, pair, (acc, m, l))
            if w == 1:
                plgpu.barrier_arrive(q_free)

            # Each warpgroup summed the probabilities of its own pages.
            l_smem[w] = l
            plgpu.barrier_arrive(l_ready)
            plgpu.barrier_wait(l_ready)
            l = plgpu.layout_cast(l_smem[0], row_layout) + plgpu.layout_cast(l_smem[1], row_layout)
            nonempty = l > 0
            inv = 1.0 / jnp.where(nonempty, l, 1.0)
            out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            lse = jnp.where(
                nonempty, m * online_softmax.LN2 + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf
            )
            # A request of one item is whole (the combine kernel's rule): its output goes
            # straight to out.
            whole = req_items_ref[req + 1] - req_items_ref[req] == 1

            @pl.when(whole)
            def _():
                out_ref[req, heads, half] = out.astype(out_ref.dtype)
                if w == 0:
                    lse_ref[req, heads] = lse

            @pl.when(jnp.logical_not(whole))
            def _():
                o_part_ref[i, heads, half] = out
                if w == 0:
                    lse_part_ref[i, heads] = lse

            return pairs_done + pairs

        pairs_done = lax.fori_loop(first_item, last_item, item, 0)
        if w == 0:
            # Observe warpgroup 1's last releases: every mbarrier phase is waited for.
            @pl.when(pairs_done > 0)
            def _():
                for slot in range(2):
                    plgpu.barrier_wait(kv_free.at[slot])

            @pl.when(last_item > first_item)
            def _():
                plgpu.barrier_wait(q_free)

    for w in range(NUM_WARPGROUPS):
        pl.when(wg == w)(functools.partial(warpgroup, w))
