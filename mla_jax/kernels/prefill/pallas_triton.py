"""Ragged (varlen) flash attention forward with LSE (Pallas, Triton lowering).

MLA's prefill is MHA with q/k 192 = 128 + 64 wide and v 128 wide; the q/k dimension is
processed as power-of-two pieces (Triton tiles). Other widths are zero-padded: q/k to a
multiple of 16 (pieces of at least 16, a dot's depth), v to a power of two; DeepSeek's widths
need no padding. Any head count runs (one head per program). Query rows are cut into tiles of
``block_q`` rows that never straddle two sequences; the tile -> sequence schedule comes from
the host (``schedule_query_tiles``, the shared ``tiling`` planner), so that a batch of one
long and many short prompts runs exactly the tiles it needs, heaviest first. Padding rows
past the last sequence form a key-less segment: they get out 0 and lse -inf like any row
without keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import online_softmax, tiling


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (``dataclasses.replace`` makes variants). The
    defaults are tuned on an H200 (``scripts/bench_prefill.py --sweep``)."""

    block_q: int = 128  # query rows per tile (a host schedule's rows_per_tile wins)
    block_k: int = 64  # keys per step
    num_warps: int = 8
    num_stages: int = 3


def schedule_query_tiles(
    cu_seqlens_q, num_rows: int, rows_per_tile: int, *, num_tiles: int | None = None, xp=np
) -> tiling.TileSchedule:
    """The query tiles of ``cu_seqlens_q [S + 1]`` (and of the padding rows after them up to
    ``num_rows``): ``rows_per_tile`` rows of one sequence each, heaviest (latest causal rows)
    first. ``xp=np`` on the host, or ``xp=jnp`` traced with ``num_tiles`` a static bound
    (``tiling.max_tiles(num_rows, S, rows_per_tile)``)."""
    return tiling.schedule_tiles(
        cu_seqlens_q, num_rows, rows_per_tile, heaviest_first=True, num_tiles=num_tiles, xp=xp
    )


def _pieces(d: int) -> tuple[int, ...]:
    """``d`` as descending powers of two (192 -> 128 + 64); ``d`` a multiple of 16."""
    return tuple(1 << i for i in reversed(range(d.bit_length())) if d >> i & 1)


def _prefill_kernel(
    tile_segment_ref,
    tile_start_ref,
    tile_end_ref,
    cu_q_ref,
    cu_k_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    causal: bool,
    block_q: int,
    block_k: int,
    pieces: tuple[int, ...],
):
    """One query tile x one head."""
    t, h = pl.program_id(0), pl.program_id(1)
    seg, r0, r1 = tile_segment_ref[t], tile_start_ref[t], tile_end_ref[t]
    num_seqs = cu_k_ref.shape[0] - 1
    has_keys = (seg < num_seqs) & (r0 < r1)
    s_idx = jnp.minimum(seg, num_seqs - 1)
    k0 = jnp.where(has_keys, cu_k_ref[s_idx], 0)
    k1 = jnp.where(has_keys, cu_k_ref[s_idx + 1], 0)
    rows = r0 + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < r1
    offsets = [sum(pieces[:i]) for i in range(len(pieces))]
    qs = [
        plgpu.load(q_ref.at[pl.ds(r0, block_q), h, pl.ds(o, d)], mask=row_ok[:, None], other=0)
        for o, d in zip(offsets, pieces, strict=True)
    ]
    if causal:
        # Query i of the sequence sees key offsets <= i + (len_k - len_q).
        q0 = cu_q_ref[s_idx]
        shift = (k1 - k0) - (cu_q_ref[s_idx + 1] - q0)
        last_key = k0 + (rows - q0) + shift  # inclusive, per row
        k_hi = jnp.clip(k0 + (r1 - 1 - q0) + shift + 1, k0, k1)
        k_all = jnp.clip(k0 + (r0 - q0) + shift + 1, k0, k1)  # keys every row of the tile sees
    else:
        k_hi = k_all = k1

    def body(step, state, *, masked: bool):
        """One block of keys; ``masked`` only where a block crosses the diagonal or the end
        of the keys (the other blocks skip the bounds checks)."""
        first = k0 + step * block_k
        cols = first + jnp.arange(block_k, dtype=jnp.int32)
        col_ok = cols < k_hi
        load = (
            functools.partial(plgpu.load, mask=col_ok[:, None], other=0)
            if masked
            else (lambda ref: ref[...])
        )
        s = 0.0
        for qp, o, d in zip(qs, offsets, pieces, strict=True):
            kp = load(k_ref.at[pl.ds(first, block_k), h, pl.ds(o, d)])
            s = s + online_softmax.dot(qp, kp, trans_b=True)
        v = load(v_ref.at[pl.ds(first, block_k), h, :])
        s = s * (scale * online_softmax.LOG2E)
        if masked:
            mask = col_ok[None, :]
            if causal:
                mask = mask & (cols[None, :] <= last_key[:, None])
            s = jnp.where(mask, s, -jnp.inf)
        return online_softmax.update(state, s, v)

    state = online_softmax.init(block_q, v_ref.shape[-1])
    num_clear = (k_all - k0) // block_k
    state = jax.lax.fori_loop(0, num_clear, functools.partial(body, masked=False), state)
    state = jax.lax.fori_loop(
        num_clear, pl.cdiv(k_hi - k0, block_k), functools.partial(body, masked=True), state
    )
    out, lse = online_softmax.finalize(state)
    plgpu.store(o_ref.at[pl.ds(r0, block_q), h, :], out.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(r0, block_q), h], lse, mask=row_ok)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k):
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} must be 3-D [T, N, D]")
    if k.shape[:2] != v.shape[:2] or k.shape[1:] != q.shape[1:]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: mismatched heads or widths")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(
            f"q, k, v must all be bfloat16 or float32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if min(q.shape[1:]) < 1 or v.shape[-1] < 1:
        raise ValueError(f"q {q.shape}, v {v.shape}: heads and widths must be >= 1")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.ndim != 1 or cu.shape[0] < 2 or cu.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [S + 1], got {cu.dtype}{list(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} differ"
        )


def _check_values(q, k, cu_seqlens_q, cu_seqlens_k):
    """Checks that need the offsets' values: run when they are concrete."""
    for name, cu, rows in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0]),
    ):
        if isinstance(cu, jax.core.Tracer):
            continue
        cu = np.asarray(cu)
        if cu[0] < 0 or (np.diff(cu) < 0).any() or cu[-1] > rows:
            raise ValueError(f"{name} must rise from >= 0 to at most {rows}, got {cu.tolist()}")


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
    config: PrefillConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged flash attention forward.

    Args:
      q: ``[Tq, N, Dqk]``; k: ``[Tk, N, Dqk]``; v: ``[Tk, N, Dv]`` (bf16 or f32; any N,
        Dqk, Dv >= 1).
      cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 offsets of the sequences.
      scale: softmax scale.
      causal: query i of a sequence sees its keys up to ``i + len_k - len_q``; otherwise all.
      schedule: the query tiles (``schedule_query_tiles``, from the host metadata; its
        ``rows_per_tile`` wins over ``config.block_q``); None plans tiles of
        ``config.block_q`` rows on the device, up to a static bound.
      config: launch parameters (default: ``PrefillConfig()``).

    Returns:
      ``out [Tq, N, Dv]`` in q's dtype and ``lse [Tq, N]`` float32 (natural log); rows
      without keys give 0 and -inf.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_values(q, k, cu_seqlens_q, cu_seqlens_k)
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
        config=config or PrefillConfig(),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("scale", "causal", "config", "interpret"))
def _flash_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_k, schedule, *, scale, causal, config, interpret
):
    tq, n, dqk = q.shape
    dv = v.shape[-1]
    qk_width = -(-dqk // 16) * 16
    q = online_softmax.pad_to(q, (tq, n, qk_width))
    k = online_softmax.pad_to(k, (k.shape[0], n, qk_width))
    v = online_softmax.pad_to(v, (v.shape[0], n, online_softmax.tile_width(dv)))
    if schedule is None:
        schedule = schedule_query_tiles(
            cu_seqlens_q,
            tq,
            config.block_q,
            num_tiles=tiling.max_tiles(tq, cu_seqlens_q.shape[0] - 1, config.block_q),
            xp=jnp,
        )
    block_q, block_k = schedule.rows_per_tile, config.block_k
    if k.shape[0] < block_k:  # a whole block must be addressable (keys past cu_k are masked)
        pad = ((0, block_k - k.shape[0]), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    kernel = functools.partial(
        _prefill_kernel,
        scale=scale,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        pieces=_pieces(qk_width),
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(schedule.tile_segment.shape[0], n),
        out_shape=(
            jax.ShapeDtypeStruct((tq, n, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((tq, n), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="flash_prefill",
    )(
        schedule.tile_segment,
        schedule.tile_start,
        schedule.tile_end,
        cu_seqlens_q,
        cu_seqlens_k,
        q,
        k,
        v,
    )
    return out[..., :dv], lse
