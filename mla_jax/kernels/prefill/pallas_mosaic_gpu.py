"""Ragged (varlen) flash attention forward with LSE on Hopper (Pallas, Mosaic GPU lowering):
wgmma, TMA, a producer warpgroup and a ring of key/value stages, FlashAttention-3 style.

Same contract as ``pallas_triton.flash_prefill`` (the same checks, the same host schedule of
query tiles). A program owns one 128-row query tile of the schedule (rows of one sequence)
and one head, on three warpgroups:

* two consumer warpgroups each own 64 query rows (one wgmma M tile), copied once into
  (swizzled) shared memory, then per block of ``block_k`` keys (64, or 128 for long
  tiles)
  ``S = Q K^T`` (a wgmma over the whole q/k width, 192 = three 64-column swizzled tiles),
  the online softmax in float32 (log2 domain, ``exp2`` with the folded scale) and
  ``acc = acc * alpha + P V`` (a wgmma with the bf16 probabilities in registers, or
  staged in shared memory);
* a producer warpgroup copies the queries and the key and value blocks by TMA, the blocks
  into a ring of ``num_stages`` shared-memory slots, each slot refilled once both consumers
  released it (an mbarrier per slot and direction).

Causal blocks that no row of the tile sees are not visited; the blocks that every row sees
whole run without a mask; the others (the diagonal, a sequence's last partial block) are
masked per row and column.

Boxes are fixed-size, so every box is kept inside its array instead of being masked: a
query tile's 128-row window starts at ``min(tile_start, Tq - 128)``; key blocks start on
multiples of 8 from the sequence's first key rounded down (a TMA box into 8-row swizzled
tiles must provably start on a multiple of 8, so ragged sequences cannot start their blocks
on their first key; queries that do not start on one go through registers), and a block
that would run past the end of k is read from ``Tk - block_k`` (arrays shorter than a box,
and k not a multiple of 8 rows, are zero-padded first). Rows of a window outside the tile
are computed and never stored; keys of a box outside the block's range (the previous
sequence's, the previous block's, those past the causal or sequence end) are masked in the
scores and their value rows zeroed in shared memory before ``P V`` reads them
(``0 x NaN`` would not be 0), so nothing past a sequence leaks in. The output leaves
through shared memory by TMA stores of the tile's rows only, as a ladder of power-of-two
row counts (64, 32, ..., 1), which writes no row of another tile; the LSE goes to a
per-tile buffer ``[tiles, N, 128]`` gathered into ``[Tq, N]`` afterwards.

Design notes, shared memory, registers and what is unmeasured: ``MOSAIC_GPU.md`` here.

Runs bf16 with q/k widths a multiple of 64 up to 256 and v 64 or 128 on sm90 (jax 0.11),
tiles of 128 rows; ``flash_prefill`` hands anything else to the Triton kernel (logged once
per reason).
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

from .. import mosaic_gpu, online_softmax, tiling
from . import pallas_triton

log = logging.getLogger(__name__)

BLOCK_Q = 128  # query rows of a program (a schedule's rows_per_tile)
WG_ROWS = 64  # query rows of a consumer warpgroup: one wgmma M tile
NUM_CONSUMERS = BLOCK_Q // WG_ROWS
ALIGN = 8  # rows of a swizzled shared-memory tile: key boxes start on multiples of it
L2_BUDGET = 24 * 2**20  # keys and values in flight: half of an H100's or H200's L2


MAX_STAGES = 4  # key/value slots the kernel chooses at most (five do not fit at 192 / 128)
# Tiles that visit at least this many keys on average run 128-key blocks when the
# kernel chooses (``block_k=None``): fewer rescales, row reductions and barriers per key pay
# on long tiles; a block's fixed costs and masked edges weigh more on short ones (figures
# in MOSAIC_GPU.md).
LONG_TILE_KEYS = 1024


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Compile options of the Mosaic GPU prefill kernel.

    block_k: keys per step, 64 or 128; None: both compiled, the call choosing 128 where its
      tiles visit ``LONG_TILE_KEYS`` keys or more on average and 128-key blocks fit shared
      memory, 64 elsewhere.
    num_stages: key/value slots in shared memory (>= 2); None: the most that fit, up to
      ``MAX_STAGES``.
    p_in_registers: ``P V`` takes the probabilities from registers (FlashAttention-3's
      register operand); off, they are staged in shared memory first (as the decode
      kernel does). Interpret mode always stages them (its wgmma reads refs only).
    producer_warpgroup: a third warpgroup issues the query and key/value copies (FA3);
      off, consumer 0 issues them as both consumers release a slot (256 threads: ptxas
      may give a consumer up to 255 registers, where 384 threads cap every role at 168).
    schedule_barrier: FA3's ping-pong, an mbarrier through which the consumers take
      turns: one's softmax runs while the other's matmuls do (with a producer only).
    approx_math: exp2, log and reciprocals through the special-function unit.
    auto_barriers: let Pallas put a warpgroup barrier around every shared-memory access
      (off: the kernel orders its stores itself, through mbarriers and commit_smem).
    lazy_rescale: rows keep their maximum until a score exceeds it by
      ``online_softmax.RESCALE_SLACK``, and a warp rescales its rows of the accumulator
      only after a block that moved one of them (off: the exact online softmax). On an
      H200 (2026-11-28, same run): 1 x 4096 at 128 heads 1128 against 1187 us off, 1 x 1024
      136 against 139, at 16 heads 163 against 175 and 30.7 against 31.4.
    """

    block_k: int | None = None
    num_stages: int | None = None
    p_in_registers: bool = True
    producer_warpgroup: bool = True
    schedule_barrier: bool = True
    approx_math: bool = True
    auto_barriers: bool = False
    lazy_rescale: bool = True

    def __post_init__(self):
        if self.block_k not in (None, 64, 128):
            raise ValueError(f"block_k must be 64, 128 or None, got {self.block_k}")
        if self.num_stages is not None and self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
        if self.schedule_barrier and not self.producer_warpgroup:
            # Consumer 0 would wait for consumer 1's release of a block that consumer 1
            # finishes only after consumer 0's next turn.
            raise ValueError("schedule_barrier needs producer_warpgroup")

    def compiled(self, dqk: int, dv: int, *, stage_p: bool) -> tuple[MosaicPrefillConfig, ...]:
        """The kernels a call compiles at these widths, each with its block size and stages
        fixed: one, or a 64-key and a 128-key one to choose between (``block_k=None``
        where 128-key blocks fit). The first is the one ``unsupported`` checks."""
        sizes = (self.block_k,) if self.block_k else (64, 128)
        configs = []
        for block_k in sizes:
            stages = self.num_stages
            if stages is None:
                fits = [
                    n
                    for n in range(2, MAX_STAGES + 1)
                    if smem_bytes(dqk, dv, block_k, n, stage_p=stage_p) <= mosaic_gpu.SMEM_BYTES
                ]
                stages = max(fits, default=2)
            configs.append(dataclasses.replace(self, block_k=block_k, num_stages=stages))
        if self.block_k is None:
            configs = [c for c in configs if c.block_k == 64 or _fits(c, dqk, dv, stage_p)]
        return tuple(configs)


def _stages_p(config: MosaicPrefillConfig, interpret: bool) -> bool:
    """Whether the probabilities go through shared memory (interpret mode's wgmma reads
    refs only)."""
    return interpret or not config.p_in_registers


def _fits(config: MosaicPrefillConfig, dqk: int, dv: int, stage_p: bool) -> bool:
    need = smem_bytes(dqk, dv, config.block_k, config.num_stages, stage_p=stage_p)
    return need <= mosaic_gpu.SMEM_BYTES


def smem_bytes(dqk: int, dv: int, block_k: int, num_stages: int, *, stage_p: bool) -> int:
    """Shared memory of a program: queries (whose bytes the staged output reuses), the
    key/value ring and (when ``stage_p``) the probabilities."""
    bf16 = 2
    total = BLOCK_Q * max(dqk, dv) * bf16  # queries, then the output staging
    total += num_stages * block_k * (dqk + dv) * bf16
    if stage_p:
        total += BLOCK_Q * block_k * bf16
    return total + 2048  # barriers and alignment (Mosaic GPU counts ~1.1 KB)


def head_group(num_heads: int, key_rows: int, width: int) -> int:
    """Heads whose programs launch side by side: the largest divisor of ``num_heads`` whose
    keys and values (``key_rows x width`` bf16 each) fit ``L2_BUDGET``, at least 1.

    The launch order runs a group's heads fastest, then the query tiles (heaviest first),
    then the groups: the programs in flight read one group's keys, which stay in L2. With
    every head fastest, 128 heads x 4096 tokens put 335 MB of keys in flight and each
    program read its keys from DRAM; with the tiles fastest, a head's heavy tiles ran in the
    last wave (16 heads: 18% slower)."""
    per_head = key_rows * width * 2
    fits = max(1, L2_BUDGET // max(per_head, 1))
    return max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and d <= fits)


def unsupported(q, k, v, config: MosaicPrefillConfig | None = None) -> str | None:
    """Why the Mosaic GPU kernel cannot run these inputs (None: it can)."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        return "inputs that are not 3-D"
    if not (q.dtype == k.dtype == v.dtype == jnp.bfloat16):
        return f"dtype {q.dtype} (runs bfloat16)"
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk % 64 or not 64 <= dqk <= 256 or dv not in (64, 128):
        return f"widths q/k {dqk} and v {dv} (runs q/k 64..256 in steps of 64, v 64 or 128)"
    config = config or MosaicPrefillConfig()
    interpret = jax.default_backend() != "gpu"
    stage_p = _stages_p(config, interpret)
    first = config.compiled(dqk, dv, stage_p=stage_p)[0]
    if not _fits(first, dqk, dv, stage_p):
        need = smem_bytes(dqk, dv, first.block_k, first.num_stages, stage_p=stage_p)
        return (
            f"widths q/k {dqk} and v {dv} with block_k {first.block_k} and "
            f"{first.num_stages} stages ({need} bytes of shared memory)"
        )
    return mosaic_gpu.device_unsupported()


def flash_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    scale: float,
    causal: bool,
    schedule: tiling.TileSchedule | None = None,
    config: MosaicPrefillConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged flash attention forward (the contract of ``pallas_triton.flash_prefill``).

    Args:
      q: ``[Tq, N, Dqk]``; k: ``[Tk, N, Dqk]``; v: ``[Tk, N, Dv]``; bf16 with Dqk a
        multiple of 64 up to 256 and Dv 64 or 128 (DeepSeek: 192 and 128). Other dtypes
        and widths run the Triton kernel (logged once).
      cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 offsets of the sequences.
      scale: softmax scale.
      causal: query i of a sequence sees its keys up to ``i + len_k - len_q``; otherwise all.
      schedule: the query tiles (``pallas_triton.schedule_query_tiles``, from the host) of
        128 rows; a schedule of other tiles runs the Triton kernel (logged once). None
        plans 128-row tiles on the device, up to a static bound.
      config: compile options (default ``MosaicPrefillConfig()``).
      interpret: run in Mosaic GPU's interpret mode (default: off a GPU).

    Returns:
      ``out [Tq, N, Dv]`` in q's dtype and ``lse [Tq, N]`` float32 (natural log); rows
      without keys give 0 and -inf.
    """
    pallas_triton._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    pallas_triton._check_values(q, k, cu_seqlens_q, cu_seqlens_k)
    config = config or MosaicPrefillConfig()
    reason = unsupported(q, k, v, config)
    if reason is None and schedule is not None and schedule.rows_per_tile != BLOCK_Q:
        reason = f"tiles of {schedule.rows_per_tile} rows (runs {BLOCK_Q})"
    if reason is not None:
        mosaic_gpu.log_once(
            log, f"flash_prefill: the Mosaic GPU kernel does not run {reason}; using Triton"
        )
        return pallas_triton.flash_prefill(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            scale=scale,
            causal=causal,
            schedule=schedule,
            interpret=interpret,
        )
    if interpret is None:
        interpret = online_softmax.interpret_default()
    return _flash_prefill(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        schedule,
        scale=scale,
        causal=causal,
        config=config,
        interpret=bool(interpret),
    )


@functools.partial(jax.jit, static_argnames=("scale", "causal", "config", "interpret"))
def _flash_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_k, schedule, *, scale, causal, config, interpret
):
    tq, n, dqk = q.shape
    tk, dv = k.shape[0], v.shape[-1]
    if schedule is None:
        schedule = pallas_triton.schedule_query_tiles(
            cu_seqlens_q,
            tq,
            BLOCK_Q,
            num_tiles=tiling.max_tiles(tq, cu_seqlens_q.shape[0] - 1, BLOCK_Q),
            xp=jnp,
        )
    # Every TMA box must lie inside its array: arrays shorter than a box are padded (rows
    # past Tq / Tk are never stored, and their keys are masked). Boxes start on multiples
    # of 8 rows, which TMA takes from arrays of a multiple of 8 rows: q, k and v are
    # rounded up to one (a copy only where they are not; the engine's buckets are).
    q = online_softmax.pad_to(q, (max(-(-tq // ALIGN) * ALIGN, BLOCK_Q), n, dqk))
    configs = config.compiled(dqk, dv, stage_p=_stages_p(config, interpret))
    rows_k = max(-(-tk // ALIGN) * ALIGN, *(c.block_k for c in configs))
    k = online_softmax.pad_to(k, (rows_k, n, dqk))
    v = online_softmax.pad_to(v, (rows_k, n, dv))
    calls = [
        functools.partial(
            _prefill_call,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            schedule,
            scale=scale,
            causal=causal,
            config=c,
            interpret=interpret,
        )
        for c in configs
    ]
    if len(calls) == 1:
        out, lse_tiles = calls[0]()
    else:
        keys = mean_tile_keys(schedule, cu_seqlens_q, cu_seqlens_k, causal=causal)
        out, lse_tiles = lax.cond(keys >= LONG_TILE_KEYS, calls[1], calls[0])
    return out[:tq], _gather_lse(lse_tiles, schedule, tq, q.shape[0])


def tile_keys(seg, r0, r1, cu_seqlens_q, cu_seqlens_k, *, causal: bool):
    """The keys of the tile(s) covering rows ``[r0, r1)`` of sequence ``seg`` (scalars in
    the kernel, read from its refs; arrays over a schedule's tiles outside it): ``(k0, k1,
    diag, k_hi)``, the sequence's keys ``[k0, k1)`` (empty for a tile of padding rows),
    ``diag`` (causal: row r sees key c iff ``c - r <= diag``, the queries aligned to the end
    of the keys; None otherwise) and ``k_hi``, one past the last key the tile's last row
    sees."""
    num_seqs = cu_seqlens_k.shape[0] - 1
    has_keys = (seg < num_seqs) & (r0 < r1)
    s = jnp.minimum(seg, num_seqs - 1)
    k0 = jnp.where(has_keys, cu_seqlens_k[s], 0)
    k1 = jnp.where(has_keys, cu_seqlens_k[s + 1], 0)
    if not causal:
        return k0, k1, None, k1
    diag = k1 - cu_seqlens_q[s + 1]  # row q0 + i sees keys up to k0 + i + len_k - len_q
    return k0, k1, diag, jnp.clip(r1 + diag, k0, k1)


def mean_tile_keys(schedule, cu_seqlens_q, cu_seqlens_k, *, causal: bool) -> jax.Array:
    """The keys a tile of ``schedule`` visits, on average over its non-empty tiles (float32
    scalar; 0 without any): the kernel's reach, from the sequence's first key to the last
    key its last row sees."""
    seg, r0, r1 = schedule.tile_segment, schedule.tile_start, schedule.tile_end
    k0, _, _, k_hi = tile_keys(seg, r0, r1, cu_seqlens_q, cu_seqlens_k, causal=causal)
    real = (seg < cu_seqlens_k.shape[0] - 1) & (r0 < r1)
    total = jnp.sum((k_hi - k0).astype(jnp.float32))  # 0 for tiles of padding rows
    return total / jnp.maximum(jnp.sum(real), 1).astype(jnp.float32)


def _window_start(tile_start, q_rows: int):
    """The first row of a tile's 128-row query window (kept inside the ``q_rows`` rows)."""
    return jnp.minimum(tile_start, q_rows - BLOCK_Q)


def _gather_lse(lse_tiles, schedule, tq: int, q_rows: int):
    """``[Tq, N]`` from the per-tile ``[tiles, N, 128]`` buffer: row r of tile t sits at
    ``r - window_start(t)``; rows of no tile get -inf."""
    tiles, n, _ = lse_tiles.shape
    local = jnp.arange(BLOCK_Q, dtype=jnp.int32)
    rows = _window_start(schedule.tile_start, q_rows)[:, None] + local[None, :]
    valid = (rows >= schedule.tile_start[:, None]) & (rows < schedule.tile_end[:, None])
    flat = jnp.arange(tiles, dtype=jnp.int32)[:, None] * BLOCK_Q + local[None, :]
    index = (
        jnp.full((tq,), tiles * BLOCK_Q, jnp.int32)
        .at[jnp.where(valid, rows, tq).reshape(-1)]
        .set(flat.reshape(-1), mode="drop")
    )
    by_row = lse_tiles.transpose(0, 2, 1).reshape(tiles * BLOCK_Q, n)
    return jnp.take(by_row, index, axis=0, mode="fill", fill_value=-jnp.inf)


def _prefill_call(
    q, k, v, cu_seqlens_q, cu_seqlens_k, schedule, *, scale, causal, config, interpret
):
    q_rows, n, dqk = q.shape
    dv = v.shape[-1]
    bk, stages = config.block_k, config.num_stages
    stage_p = _stages_p(config, interpret)
    tiles = schedule.tile_segment.shape[0]
    group = head_group(n, k.shape[0], dqk + dv)
    warpgroups = NUM_CONSUMERS + int(config.producer_warpgroup)
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf16 = jnp.bfloat16
    scratch = dict(
        # A consumer's queries are dead after its last ``S``: its output staging (plain
        # rows, no tiling: the output leaves in TMA stores of any row count) takes their
        # bytes. One union per consumer, as they finish at different times.
        q_o_smem=[
            plgpu.RefUnion(
                plgpu.SMEM((WG_ROWS, dqk), bf16, transforms=swizzled),
                plgpu.SMEM((WG_ROWS, dv), bf16),
            )
            for _ in range(NUM_CONSUMERS)
        ],
        k_smem=plgpu.SMEM((stages, bk, dqk), bf16, transforms=swizzled),
        v_smem=plgpu.SMEM((stages, bk, dv), bf16, transforms=swizzled),
        q_ready=plgpu.Barrier(num_arrivals=1, num_barriers=NUM_CONSUMERS),
        k_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        v_ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    )
    if config.schedule_barrier:
        scratch["turns"] = plgpu.Barrier(num_arrivals=NUM_CONSUMERS)
    if stage_p:
        scratch["p_smem"] = plgpu.SMEM((NUM_CONSUMERS, WG_ROWS, bk), bf16, transforms=swizzled)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            scale=scale,
            causal=causal,
            block_k=bk,
            num_stages=stages,
            producer_warpgroup=config.producer_warpgroup,
            lazy_rescale=config.lazy_rescale,
            heads_per_group=group,
            interpret=interpret,
        ),
        out_type=(
            jax.ShapeDtypeStruct((q_rows, n, dv), q.dtype),
            jax.ShapeDtypeStruct((tiles, n, BLOCK_Q), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(n // group, tiles, group),
        grid_names=("g", "t", "hg"),
        num_threads=warpgroups,
        thread_name="wg",
        **mosaic_gpu.kernel_options(config, interpret, warpgroups),
    )
    return kernel(
        schedule.tile_segment,
        schedule.tile_start,
        schedule.tile_end,
        cu_seqlens_q,
        cu_seqlens_k,
        q,
        k,
        v,
    )


def _kernel(
    tile_segment_ref,
    tile_start_ref,
    tile_end_ref,
    cu_q_ref,
    cu_k_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    *,
    q_o_smem,
    k_smem,
    v_smem,
    q_ready,
    k_ready,
    v_ready,
    k_free,
    v_free,
    p_smem=None,
    turns=None,
    scale,
    causal,
    block_k,
    num_stages,
    producer_warpgroup,
    lazy_rescale,
    heads_per_group,
    interpret,
):
    """One query tile x one head on three warpgroups (two consumers, one producer); the
    refs are the kernel's inputs, outputs and shared memory (see ``_prefill_call``)."""
    t, wg = lax.axis_index("t"), lax.axis_index("wg")
    h = lax.axis_index("g") * heads_per_group + lax.axis_index("hg")
    dv = v_smem.shape[-1]
    seg, r0, r1 = tile_segment_ref[t], tile_start_ref[t], tile_end_ref[t]
    k0, k1, diag, k_hi = tile_keys(seg, r0, r1, cu_q_ref, cu_k_ref, causal=causal)
    # Keys every row of the tile sees.
    k_all = k1 if diag is None else jnp.clip(r0 + diag + 1, k0, k1)
    # Key blocks start on multiples of ALIGN (a TMA box into 8-row tiles must start on
    # one, provably): block j holds keys [kb + j * block_k, ...) from kb = k0 rounded down.
    # Keys before k0 in block 0 (the previous sequence's) are masked like any stray key.
    kb8 = lax.div(k0, ALIGN)
    kb = kb8 * ALIGN
    num_blocks = jnp.where(k_hi > k0, lax.div(k_hi - kb + (block_k - 1), block_k), 0)
    # Blocks [head, clear_end) hold keys that every row of the tile sees, nothing else.
    head = jnp.minimum(jnp.where(kb < k0, 1, 0), num_blocks)
    clear_end = jnp.maximum(head, lax.div(k_all - kb, block_k))
    w0 = _window_start(r0, q_ref.shape[0])
    last_box8 = (k_ref.shape[0] - block_k) // ALIGN

    def block_window(j):
        """Block j's first counted key and the first key of its TMA box: the block's own
        start, or an earlier one where the block would run past the end of k (keys before
        ``first`` are then masked)."""
        block8 = kb8 + j * (block_k // ALIGN)
        first = jnp.maximum(block8 * ALIGN, k0)
        # A product by the constant ALIGN: Mosaic GPU proves the box's alignment from it.
        return first, jnp.minimum(block8, last_box8) * ALIGN

    def slot_of(j):
        return lax.rem(j, jnp.int32(num_stages))

    def load(j, *, wait_free):
        """Copies key and value block ``j`` into its slot (first waiting for the consumers
        to release the slot's previous block, where ``wait_free``)."""
        slot = slot_of(j)
        _, start = block_window(j)
        rows = pl.ds(start, block_k)

        @pl.when(wait_free)
        def _():
            plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem.at[slot], k_ready.at[slot])

        @pl.when(wait_free)
        def _():
            plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem.at[slot], v_ready.at[slot])

    def drain():
        """Observes the consumers' last releases: every mbarrier phase is waited for."""

        def body(j, carry):
            plgpu.barrier_wait(k_free.at[slot_of(j)])
            plgpu.barrier_wait(v_free.at[slot_of(j)])
            return carry

        lax.fori_loop(jnp.maximum(num_blocks - num_stages, 0), num_blocks, body, 0)

    def first_row(w):
        """The first of consumer ``w``'s 64 query rows."""
        return w0 + w * WG_ROWS

    def queries_aligned(w):
        """Whether consumer ``w``'s query rows start on a multiple of 8 (a TMA box into
        8-row tiles must provably start on one)."""
        return lax.rem(first_row(w), ALIGN) == 0

    def copy_queries():
        """Copies each consumer's query rows by TMA where they are aligned."""
        for w in range(NUM_CONSUMERS):
            rows = pl.ds(lax.div(first_row(w), ALIGN) * ALIGN, WG_ROWS)
            copy = functools.partial(
                plgpu.copy_gmem_to_smem, q_ref.at[rows, h], q_o_smem[w][0], q_ready.at[w]
            )
            pl.when(queries_aligned(w))(copy)

    def queries_by_registers(w):
        """Copies consumer ``w``'s query rows through registers (any start row)."""
        q_smem = q_o_smem[w][0]
        for c in range(q_smem.shape[-1] // 64):
            cols = pl.ds(c * 64, 64)
            q_smem.at[:, cols][...] = plgpu.load(
                q_ref.at[pl.ds(first_row(w), WG_ROWS), h, cols],
                layout=plgpu.Layout.WGMMA,
                optimized=False,
            )
        plgpu.commit_smem()

    def producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        copy_queries()

        def body(j, carry):
            load(j, wait_free=j >= num_stages)
            return carry

        lax.fori_loop(0, num_blocks, body, 0)
        drain()

    def consumer(w):
        # Without a producer warpgroup, consumer 0 issues the copies: the first stages
        # up front, then each slot's next block once both consumers released it.
        issues_copies = w == 0 and not producer_warpgroup
        if producer_warpgroup and not interpret:
            plgpu.set_max_registers(232, action="increase")
        if issues_copies:
            copy_queries()
            for i in range(num_stages):
                pl.when(i < num_blocks)(functools.partial(load, i, wait_free=False))
        wgmma_layout = plgpu.Layout.WGMMA
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        log2_scale = scale * math.log2(math.e)
        row0 = first_row(w)
        q_smem, o_smem = q_o_smem[w]
        # The window's rows come by TMA where they start on a multiple of 8 (issued with
        # the key copies), through registers elsewhere.
        aligned = queries_aligned(w)
        pl.when(aligned)(lambda: plgpu.barrier_wait(q_ready.at[w]))
        pl.when(jnp.logical_not(aligned))(functools.partial(queries_by_registers, w))

        def take_turns():
            """FA3's ping-pong: the consumers' matmuls alternate with their softmaxes (both
            pass the same number of these points; consumer 1 starts one ahead)."""
            if turns is not None:
                plgpu.barrier_arrive(turns)
                plgpu.barrier_wait(turns)

        def scores(slot):
            def scope(s_ref):
                plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
                take_turns()
                return s_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((WG_ROWS, block_k), jnp.float32))

        def wait_keys(j):
            """Waits for key block ``j`` (if there is one) to land."""
            pl.when(j < num_blocks)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(j)]))

        def accumulate(acc, alpha, a, b, j):
            """``acc * alpha[:, None] + a @ b`` (block ``j``'s values); the next key block
            is awaited while the product runs. Interpret mode cannot load a value into a
            wgmma accumulator, so there the product starts from zero and is added after (the
            same arithmetic in a different order)."""
            scaled = mosaic_gpu.rescale_rows(acc, alpha, lazy=lazy_rescale, interpret=interpret)

            def scope(acc_ref):
                if not interpret:
                    acc_ref[...] = scaled
                plgpu.wgmma(acc_ref, a, b)
                wait_keys(j + 1)
                return acc_ref[...]

            total = pl.run_scoped(scope, plgpu.ACC(acc.shape, jnp.float32))
            return scaled + total if interpret else total

        def zero_stray_values(slot, first, start):
            """Zeroes the value rows of the box in ``slot`` whose keys are not block keys
            (before ``first``, from a box moved back inside k, or from ``k_hi`` on)."""

            @pl.when((start < first) | (start + block_k > k_hi))
            def _():
                key = start + plgpu.broadcasted_iota(
                    jnp.int32, (block_k, 64), 0, layout=wgmma_layout
                )
                keep = (key >= first) & (key < k_hi)
                for c in range(dv // 64):
                    tile = v_smem.at[slot, :, pl.ds(c * 64, 64)]
                    values = tile[...]
                    tile[...] = jnp.where(keep, values, jnp.zeros_like(values))
                plgpu.commit_smem()

        def step(j, state, *, masked: bool):
            acc, m, l = state
            slot = slot_of(j)
            first, start = block_window(j)
            s = scores(slot)
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                shape = (WG_ROWS, block_k)
                col = start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
                keep = (col >= first) & (col < k_hi)
                if causal:
                    row = row0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
                    keep = keep & (col - row <= diag)
                s = jnp.where(keep, s, -jnp.inf)
            row_max = s.max(axis=1) * log2_scale
            if lazy_rescale:
                m_new = online_softmax.lazy_maximum(m, row_max)
            else:
                m_new = jnp.maximum(m, row_max)
            if masked:
                # A row with no key yet keeps m = -inf: subtract 0 instead (no -inf - -inf).
                m_new = online_softmax.finite(m_new)
            p = jnp.exp2(s * log2_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            alpha = online_softmax.rescale_factor(m, m_new)
            l = l * alpha + p.sum(axis=1)
            if turns is not None:
                plgpu.barrier_arrive(turns)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            if masked:
                zero_stray_values(slot, first, start)
            if p_smem is None:
                a = p.astype(jnp.bfloat16)
            else:
                p_smem[w] = p.astype(jnp.bfloat16)
                plgpu.commit_smem()
                a = p_smem.at[w]
            if turns is not None:
                plgpu.barrier_wait(turns)  # the other consumer's matmuls are issued
            acc = accumulate(acc, alpha, a, v_smem.at[slot], j)
            plgpu.barrier_arrive(v_free.at[slot])
            if issues_copies:
                refill = j + num_stages
                pl.when(refill < num_blocks)(functools.partial(load, refill, wait_free=True))
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((WG_ROWS, dv), jnp.float32), wgmma_layout)
        m = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), row_layout)
        wait_keys(0)
        if w == 1:
            take_turns()
        masked = functools.partial(step, masked=True)
        state = lax.fori_loop(0, head, masked, (acc, m, l))
        state = lax.fori_loop(head, clear_end, functools.partial(step, masked=False), state)
        acc, m, l = lax.fori_loop(clear_end, num_blocks, masked, state)
        if w == 0:
            take_turns()
        if issues_copies:
            drain()

        nonempty = l > 0
        l_safe = jnp.where(nonempty, l, 1.0)
        out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        lse = jnp.where(nonempty, m * online_softmax.LN2 + jnp.log(l_safe), -jnp.inf)

        # The tile's rows among this warpgroup's 64 leave by TMA stores of 64, 32, ..., 1
        # rows (a store's box is static): no row of another tile is written.
        o_smem[...] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        lo = jnp.clip(r0 - row0, 0, WG_ROWS)
        count = jnp.clip(r1 - row0, 0, WG_ROWS) - lo
        count = jnp.maximum(count, 0)
        offset = lo
        size = WG_ROWS
        while size:

            @pl.when((count & size) != 0)
            def _(offset=offset, size=size):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(offset, size)],
                    out_ref.at[pl.ds(row0 + offset, size), h],
                )

            offset = offset + (count & size)
            size //= 2
        lse_ref[t, h, pl.ds(w * WG_ROWS, WG_ROWS)] = lse
        plgpu.wait_smem_to_gmem(0)

    for w in range(NUM_CONSUMERS):
        pl.when(wg == w)(functools.partial(consumer, w))
    if producer_warpgroup:
        pl.when(wg == NUM_CONSUMERS)(producer)
