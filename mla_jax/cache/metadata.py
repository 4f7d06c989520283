"""Host-side (NumPy) attention metadata for one step of flattened tokens.

A step holds requests in vLLM's order: decodes (one new token) first, then prefills. Every
array is padded to a bucket, so the device sees few distinct shapes; the token axis is laid
out as

    [ decode slots (num_decodes bucket) | prefill slots (prefill-token bucket) ]

with real tokens first in each region and padding (slot ``PAD_SLOT``, no keys) after them.
Array shapes and the static fields (``ChunkedContext.workspace_size``, the prefill tile
height) select the compiled program: one jit compilation per bucket. With a ``KernelPlan``
the metadata also carries the Pallas kernels' work schedules, sized from the buckets alone.

Everything here is vectorised NumPy: no Python loop over requests or tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from mla_jax import kernels
from mla_jax.cache.latent_cache import PAD_SLOT
from mla_jax.kernels.decode import DecodeSchedule
from mla_jax.kernels.tiling import TileSchedule


class MetadataError(ValueError):
    """The requests of a step are malformed (lengths, order, block tables)."""


@dataclasses.dataclass(frozen=True)
class Buckets:
    """How each padded size of a step is chosen. An axis with a ladder takes its smallest
    entry that fits, an axis fixed to a size always takes it, and any other axis takes the
    smallest power of two >= max(n, its minimum). The engine fixes every axis (see
    ``EngineConfig.fixed_buckets``), so that the programs it can run are a small set known before
    the first request; the defaults suit one-off calls."""

    min_decodes: int = 8
    min_prefill_tokens: int = 16
    min_prefills: int = 1
    min_blocks: int = 4
    min_chunk_tokens: int = 256
    token_buckets: tuple[int, ...] | None = None  # prefill-token ladder
    decode_buckets: tuple[int, ...] | None = None  # decode batch ladder
    num_prefills: int | None = None  # prefill slots of every step with prefills
    table_width: int | None = None  # blocks per block-table row
    num_chunks: int | None = None  # context chunks of every step with prefills

    def decodes(self, n: int) -> int:
        """Padded decode batch for ``n`` decodes (0 for none)."""
        if n == 0:
            return 0
        if self.decode_buckets is None:
            return _pow2_at_least(n, self.min_decodes)
        return _smallest_fit(n, self.decode_buckets, "decodes")

    def prefill_tokens(self, n: int) -> int:
        """Padded token count of the prompt chunks for ``n`` tokens (0 for none)."""
        if n == 0:
            return 0
        if self.token_buckets is None:
            return _pow2_at_least(n, self.min_prefill_tokens)
        return _smallest_fit(n, self.token_buckets, "prefill tokens")

    def prefills(self, n: int) -> int:
        """Padded prompt-chunk slots for ``n`` chunks (0 for none)."""
        if n == 0:
            return 0
        if self.num_prefills is None:
            return _pow2_at_least(n, self.min_prefills)
        return _smallest_fit(n, (self.num_prefills,), "prefill requests")

    def blocks(self, n: int) -> int:
        """Block-table width for a request needing ``n`` blocks."""
        if self.table_width is None:
            return _pow2_at_least(n, self.min_blocks)
        return _smallest_fit(n, (self.table_width,), "blocks of a request")

    def chunks(self, n: int) -> int:
        """Context chunks for ``n`` needed (0 for none, unless the count is fixed)."""
        if self.num_chunks is None:
            return 0 if n == 0 else _pow2_at_least(n, 1)
        return _smallest_fit(n, (self.num_chunks,), "context chunks")

    def chunk_tokens(self, n: int, workspace_size: int) -> int:
        """Rows of a context chunk whose largest needs ``n``, within ``workspace_size``."""
        if self.num_chunks is not None:
            return workspace_size
        return min(_pow2_at_least(n, self.min_chunk_tokens), workspace_size)

    def step_shapes(self, workspace_size: int) -> list[StepShape]:
        """Every shape a step can take, when every axis is fixed or on a ladder: each decode
        size (or none) with each prefill-token size (or none)."""
        fixed = (
            self.decode_buckets,
            self.token_buckets,
            self.num_prefills,
            self.table_width,
            self.num_chunks,
        )
        if None in fixed:
            raise ValueError("these buckets leave an axis open: their shapes are not a fixed set")
        return [
            StepShape(
                tokens=decodes + tokens,
                decodes=decodes,
                decode_blocks=self.table_width if decodes else 0,
                prefills=self.num_prefills if tokens else 0,
                prefill_blocks=self.table_width if tokens else 0,
                chunks=self.num_chunks if tokens else 0,
                chunk_tokens=workspace_size if tokens else 0,
            )
            for decodes in (0, *sorted(self.decode_buckets))
            for tokens in (0, *sorted(self.token_buckets))
            if decodes or tokens
        ]


def _smallest_fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sorted(sizes):
        if size >= n:
            return size
    raise MetadataError(f"{n} {what} exceed the largest bucket {max(sizes)}")


def _pow2_at_least(n: int, minimum: int) -> int:
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkedContext:
    """Plan for the cached context of prefills, gathered ``workspace_size`` rows at a time.

    Chunk ``c`` gathers, for each prefill ``r``, context positions
    ``[starts[c, r], starts[c, r] + lens)`` into workspace rows
    ``[cu_seq_lens[c, r], cu_seq_lens[c, r + 1])``; ``totals[c] = cu_seq_lens[c, -1]``.
    """

    cu_seq_lens: np.ndarray  # [C, Bp + 1] int32
    starts: np.ndarray  # [C, Bp] int32, multiples of block_size
    totals: np.ndarray  # [C] int32
    workspace_size: int = dataclasses.field(metadata={"static": True})  # rows per chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """The decodes of a step (Bd padded requests of one token each)."""

    block_table: np.ndarray  # [Bd, Wd] int32; entries past a request's need are never read
    seq_lens: np.ndarray  # [Bd] int32: context + this token; 0 on padding rows
    schedule: DecodeSchedule | None = None  # split-KV plan (Pallas)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillMetadata:
    """The prompt chunks of a step (Bp padded requests), their cached context included."""

    query_start_loc: np.ndarray  # [Bp + 1] int32, offsets into the prefill token region
    seq_lens: np.ndarray  # [Bp] int32: context + new tokens
    context_lens: np.ndarray  # [Bp] int32: tokens already in the cache
    block_table: np.ndarray  # [Bp, Wp] int32 (context blocks)
    chunks: ChunkedContext | None  # None when no prefill has cached context
    schedule: TileSchedule | None = None  # query tiles (Pallas)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's T tokens sit in the cache and whom they attend to: the pytree every
    attention layer of the step reads (arrays to the device once; the sizes are static)."""

    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32; PAD_SLOT on padding
    logits_indices: np.ndarray  # [Bd + Bp] int32: the last token of each request
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    # The cache geometry the block ids were checked against (the module checks its cache).
    block_size: int = dataclasses.field(metadata={"static": True})
    num_blocks: int = dataclasses.field(metadata={"static": True})

    @property
    def num_tokens(self) -> int:
        """Rows of the padded token axis (the step's token bucket)."""
        return self.positions.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        """Rows of the decode region at the front of the token axis (Bd)."""
        return 0 if self.decode is None else self.decode.seq_lens.shape[0]

    def token_rows(self) -> np.ndarray:
        """Host-side: row of each real token in the padded token axis, in request order."""
        return self._rows(0 if self.prefill is None else int(self.prefill.query_start_loc[-1]))

    def request_rows(self) -> np.ndarray:
        """Host-side: row of each real request in ``logits_indices``, in request order."""
        return self._rows(
            0
            if self.prefill is None
            else int(np.count_nonzero(np.diff(self.prefill.query_start_loc)))
        )

    def _rows(self, num_prefill_rows: int) -> np.ndarray:
        """The real decode rows, then ``num_prefill_rows`` rows after the decode region."""
        num_decodes = 0 if self.decode is None else int(np.count_nonzero(self.decode.seq_lens))
        return np.concatenate(
            [np.arange(num_decodes), self.num_decode_tokens + np.arange(num_prefill_rows)]
        )

    def step_shape(self) -> StepShape:
        """The bucket this step compiles for."""
        decode, prefill = self.decode, self.prefill
        chunks = None if prefill is None else prefill.chunks
        return StepShape(
            tokens=self.positions.shape[0],
            decodes=0 if decode is None else decode.seq_lens.shape[0],
            decode_blocks=0 if decode is None else decode.block_table.shape[1],
            prefills=0 if prefill is None else prefill.seq_lens.shape[0],
            prefill_blocks=0 if prefill is None else prefill.block_table.shape[1],
            chunks=0 if chunks is None else chunks.starts.shape[0],
            chunk_tokens=0 if chunks is None else chunks.workspace_size,
        )


class StepShape(NamedTuple):
    """The padded sizes that select a step's compiled program, and its decode steps (more
    than one: a decode window, ``engine/runner.py``)."""

    tokens: int
    decodes: int
    decode_blocks: int
    prefills: int
    prefill_blocks: int
    chunks: int
    chunk_tokens: int
    steps: int = 1


def is_decode(query_lens: int | np.ndarray) -> bool | np.ndarray:
    """Whether a request running ``query_lens`` new tokens this step is a decode: one token
    (a one-token prompt chunk runs as a decode too). Elementwise on an array of lengths. The
    one definition of a decode, for the metadata, the packing and the engine."""
    return query_lens == 1


def build_metadata(
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    block_table: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    workspace_size: int,
    buckets: Buckets = Buckets(),
    kernel_plan: kernels.KernelPlan | None = None,
) -> AttentionMetadata:
    """Metadata of one step, padded to buckets.

    Args:
      context_lens: ``[R]`` tokens of each request already in the cache.
      query_lens: ``[R]`` new tokens this step (>= 1); requests with 1 are decodes and must
        come first.
      block_table: ``[R, W]`` cache block ids of each request; entries past
        ``cdiv(context + query, block_size)`` are ignored.
      block_size, num_blocks: the cache's geometry (block ids must be < num_blocks).
      workspace_size: the most cached-context rows gathered at once (vLLM's bound).
      kernel_plan: when given, also the Pallas kernels' work schedules (split-KV items,
        query tiles), sized by the buckets so that they add no compilations.
    """
    context_lens, query_lens, block_table = validate_step(
        context_lens, query_lens, block_table, block_size, num_blocks
    )
    return build_validated(
        context_lens,
        query_lens,
        block_table,
        block_size=block_size,
        num_blocks=num_blocks,
        workspace_size=workspace_size,
        buckets=buckets,
        kernel_plan=kernel_plan,
    )


def build_validated(
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    block_table: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    workspace_size: int,
    buckets: Buckets,
    kernel_plan: kernels.KernelPlan | None,
) -> AttentionMetadata:
    """``build_metadata`` on arrays ``validate_step`` has checked and converted (int64
    lengths, decodes first)."""
    num_requests = context_lens.shape[0]
    seq_lens = context_lens + query_lens
    num_decodes = int(np.count_nonzero(is_decode(query_lens)))
    num_prefills = num_requests - num_decodes
    num_new_tokens = int(query_lens.sum())
    num_prefill_tokens = num_new_tokens - num_decodes

    # Position and cache slot of every new token.
    query_offsets = np.zeros(num_requests + 1, np.int64)
    np.cumsum(query_lens, out=query_offsets[1:])
    request = np.repeat(np.arange(num_requests), query_lens)  # of each new token
    token_positions = context_lens[request] + (np.arange(num_new_tokens) - query_offsets[request])
    slots = (
        block_table[request, token_positions // block_size].astype(np.int64) * block_size
        + token_positions % block_size
    )
    ordered = np.sort(slots)
    if (ordered[1:] == ordered[:-1]).any():
        raise MetadataError("two new tokens map to the same cache slot: block tables overlap")

    decode_bucket = buckets.decodes(num_decodes)
    prefill_token_bucket = buckets.prefill_tokens(num_prefill_tokens)
    prefill_bucket = buckets.prefills(num_prefills)
    num_tokens = decode_bucket + prefill_token_bucket
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, PAD_SLOT, np.int32)
    positions[:num_decodes] = token_positions[:num_decodes]
    slot_mapping[:num_decodes] = slots[:num_decodes]
    prefill_rows = slice(decode_bucket, decode_bucket + num_prefill_tokens)
    positions[prefill_rows] = token_positions[num_decodes:]
    slot_mapping[prefill_rows] = slots[num_decodes:]

    logits_indices = np.zeros(decode_bucket + prefill_bucket, np.int32)
    logits_indices[:num_decodes] = np.arange(num_decodes)
    logits_indices[decode_bucket : decode_bucket + num_prefills] = (
        decode_bucket + (query_offsets[num_decodes + 1 :] - num_decodes) - 1
    )

    decode = None
    if num_decodes:
        decode_seq_lens = _pad(seq_lens[:num_decodes], decode_bucket)
        decode = DecodeMetadata(
            block_table=_pad_table(
                block_table[:num_decodes],
                seq_lens[:num_decodes],
                decode_bucket,
                buckets,
                block_size,
            ),
            seq_lens=decode_seq_lens,
            schedule=(
                None if kernel_plan is None else kernel_plan.decode_schedule(decode_seq_lens)
            ),
        )
    prefill = None
    if num_prefills:
        prefill_context_lens = context_lens[num_decodes:]
        query_start = np.full(prefill_bucket + 1, num_prefill_tokens, np.int32)
        query_start[: num_prefills + 1] = query_offsets[num_decodes:] - num_decodes
        prefill = PrefillMetadata(
            query_start_loc=query_start,
            seq_lens=_pad(seq_lens[num_decodes:], prefill_bucket),
            context_lens=_pad(prefill_context_lens, prefill_bucket),
            block_table=_pad_table(
                block_table[num_decodes:],
                prefill_context_lens,
                prefill_bucket,
                buckets,
                block_size,
            ),
            chunks=_plan_chunks(
                _pad(prefill_context_lens, prefill_bucket), block_size, workspace_size, buckets
            ),
            schedule=(
                None
                if kernel_plan is None
                else kernel_plan.prefill_schedule(query_start, prefill_token_bucket)
            ),
        )
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        decode=decode,
        prefill=prefill,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def _plan_chunks(
    context_lens: np.ndarray, block_size: int, workspace_size: int, buckets: Buckets
) -> ChunkedContext | None:
    """vLLM's rule: the workspace is shared equally among the prefills that have context,
    each share rounded down to whole blocks; chunk c covers ``[c * share, (c + 1) * share)``.
    Chunks past the last needed one are empty (the module skips them); with no context at
    all there are none, unless the buckets fix their number."""
    num_with_context = int(np.count_nonzero(context_lens))
    if num_with_context == 0 and buckets.num_chunks is None:
        return None
    share = workspace_size // max(num_with_context, 1) // block_size * block_size
    if share == 0:
        raise MetadataError(
            f"workspace_size {workspace_size} is too small for {num_with_context} prefills with "
            f"cached context: it needs at least {num_with_context * block_size} rows (one block "
            "each)"
        )
    num_chunks = buckets.chunks(-(-int(context_lens.max()) // share))
    starts = np.arange(num_chunks, dtype=np.int64)[:, None] * share
    lens = np.clip(np.minimum(context_lens[None, :], starts + share) - starts, 0, None)
    cu_seq_lens = np.zeros((num_chunks, context_lens.shape[0] + 1), np.int32)
    np.cumsum(lens, axis=1, out=cu_seq_lens[:, 1:])
    totals = cu_seq_lens[:, -1].copy()
    return ChunkedContext(
        cu_seq_lens=cu_seq_lens,
        starts=np.broadcast_to(starts, lens.shape).astype(np.int32),
        totals=totals,
        workspace_size=buckets.chunk_tokens(int(totals.max()), workspace_size),
    )


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, np.int32)
    out[: x.shape[0]] = x
    return out


def _pad_table(
    block_table: np.ndarray, lens: np.ndarray, rows: int, buckets: Buckets, block_size: int
) -> np.ndarray:
    """Rows of ``block_table`` cut to the blocks ``lens`` needs, padded to buckets; the
    entries past that are zeroed, though no kernel reads them."""
    needed = -(-lens // block_size)
    width = buckets.blocks(int(needed.max()) if needed.size else 1)
    columns = min(width, block_table.shape[1])
    out = np.zeros((rows, width), np.int32)
    used = np.arange(columns)[None, :] < needed[:, None]
    out[: block_table.shape[0], :columns] = np.where(used, block_table[:, :columns], 0)
    return out


def validate_step(
    context_lens, query_lens, block_table, block_size: int, num_blocks: int, *, decodes_first=True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checks of ``build_metadata``, errors naming requests by their index here;
    ``decodes_first=False`` for requests in a caller's order (``packing.packed_metadata``).
    Returns ``context_lens [R]`` and ``query_lens [R]`` as int64 and ``block_table [R, W]``
    as given, for ``build_validated``."""
    context_lens = np.asarray(context_lens)
    query_lens = np.asarray(query_lens)
    block_table = np.asarray(block_table)
    if (
        context_lens.ndim != 1
        or query_lens.shape != context_lens.shape
        or context_lens.shape[0] == 0
    ):
        raise MetadataError(
            f"context_lens {context_lens.shape} and query_lens {query_lens.shape} must be "
            "equal, non-empty 1-D"
        )
    if block_table.ndim != 2 or block_table.shape[0] != context_lens.shape[0]:
        raise MetadataError(
            f"block_table must be [num_requests={context_lens.shape[0]}, W], got "
            f"{block_table.shape}"
        )
    for name, a in (
        ("context_lens", context_lens),
        ("query_lens", query_lens),
        ("block_table", block_table),
    ):
        if a.dtype.kind not in "iu":  # np.issubdtype(dtype, np.integer), at a fraction of its cost
            raise MetadataError(f"{name} must hold integers, got dtype {a.dtype}")
    if block_size <= 0:
        raise MetadataError(f"block_size must be positive, got {block_size}")
    _check(context_lens >= 0, "context_lens must be >= 0", context_lens)
    _check(query_lens >= 1, "query_lens must be >= 1", query_lens)
    context_lens, query_lens = context_lens.astype(np.int64), query_lens.astype(np.int64)
    decodes = is_decode(query_lens)
    num_decodes = int(np.count_nonzero(decodes))
    if decodes_first:
        _check(
            decodes[:num_decodes],
            "decode requests (query_len 1) must come before prefills",
            query_lens,
        )
    needed = -(-(context_lens + query_lens) // block_size)
    _check(
        needed <= block_table.shape[1],
        f"block_table (width {block_table.shape[1]}) is narrower than a request needs",
        needed,
    )
    # int32: half the time of an int64 compare over the [R, W] grid (widths are small)
    used = (
        np.arange(block_table.shape[1], dtype=np.int32)[None, :] < needed.astype(np.int32)[:, None]
    )
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bad.any():
        r, w = np.argwhere(bad)[0]
        raise MetadataError(
            f"block_table[{r}, {w}] = {block_table[r, w]} is not a block id in [0, {num_blocks})"
        )
    _check_context_not_written(context_lens, needed, used, block_table, block_size, num_blocks)
    return context_lens, query_lens, block_table


def _check_context_not_written(context_lens, needed, used, block_table, block_size, num_blocks):
    """No request's new tokens may go into a block that another request reads as context:
    the step writes the cache before attention reads it. Only a request's own partly filled
    last block is both. One gather over the used table entries; the rest is per written
    entry (about one per request)."""
    first = context_lens // block_size  # the first table entry that receives new tokens
    counts = needed - first
    writer = np.repeat(np.arange(block_table.shape[0]), counts)
    column = np.arange(writer.shape[0]) - np.repeat(np.cumsum(counts) - counts - first, counts)
    written = block_table[writer, column]
    is_written = np.zeros(num_blocks, bool)
    is_written[written] = True
    # Every written entry is used and names a written block; any other such entry is a full
    # context block (column < first) that some request writes.
    hits = used & np.take(is_written, block_table, mode="clip")
    if np.count_nonzero(hits) > written.shape[0]:
        reader, w = np.argwhere(hits & (np.arange(block_table.shape[1]) < first[:, None]))[0]
        _raise_overwrite(reader, block_table[reader, w], writer, written)
    # A partly filled last block is its reader's first written entry: a second write entry of
    # the same block (any request's) writes into that context.
    ordered = np.sort(written)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if twice.size:
        partial = np.flatnonzero(context_lens % block_size)
        shared = np.isin(block_table[partial, first[partial]], twice)
        if shared.any():
            reader = partial[np.argmax(shared)]
            _raise_overwrite(reader, block_table[reader, first[reader]], writer, written)


def _raise_overwrite(reader, block, writer, written):
    """Names a request that writes ``block``: another than ``reader`` unless only it does (a
    block listed twice in its own table)."""
    writers = writer[written == block]
    others = writers[writers != reader]
    culprit = others[0] if others.size else reader
    raise MetadataError(
        f"request {culprit} writes new tokens into cache block {block}, which request {reader} "
        "reads as context: block tables overlap"
    )


def _check(ok: np.ndarray, message: str, values: np.ndarray) -> None:
    if not ok.all():
        i = int(np.argmin(ok))
        raise MetadataError(f"{message} (request {i}: {values[i]})")
