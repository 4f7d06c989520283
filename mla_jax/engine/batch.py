"""A step's requests as the arrays the model runner takes: the engine's side of the boundary.

The scheduler hands out ``Scheduled`` chunks of requests; ``build_batch`` turns one DP rank's
chunks into a ``StepBatch`` of NumPy arrays (no request objects cross to the runner), its
block table gathered from the rows the rank's ``InputBatch`` keeps across steps. With
data parallelism every rank's step must have one shape, so ``pad_ranks`` gives a rank that
lacks a part another rank has (decodes, prompt chunks) a padding request of that part, run
in the rank's scratch blocks: cache blocks at the end of each rank's share that the
scheduler never hands out (``scratch_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from mla_jax.cache.metadata import Buckets, is_decode
from mla_jax.engine.input_batch import InputBatch
from mla_jax.engine.scheduler import Scheduled


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One DP rank's step, decodes first.

    context_lens: ``[R]`` int32 tokens of each request already in the cache.
    query_lens: ``[R]`` int32 tokens it runs this step (1: a decode).
    block_table: ``[R, W]`` int32 cache block ids of each request (the rank's own ids).
    input_ids: ``[sum(query_lens)]`` int32 the tokens, request after request; a pending
      token (sampled by the previous step, not yet read by the host) holds 0.
    source: ``[sum(query_lens)]`` int32 the row of the previous step's sampled tokens a
      pending token takes on the device (a row within the rank), else -1.
    temperatures: ``[R]`` float32 sampling temperatures (0: greedy).
    steps: ``[R]`` int32 decode steps of a window each request runs (1 in a one-step
      batch; 0 on padding requests, which then write nothing).
    stops_at_eos: ``[R]`` bool: a window stops the request at the model's EOS tokens (not
      ``ignore_eos``).
    """

    context_lens: np.ndarray
    query_lens: np.ndarray
    block_table: np.ndarray
    input_ids: np.ndarray
    source: np.ndarray
    temperatures: np.ndarray
    steps: np.ndarray
    stops_at_eos: np.ndarray

    @property
    def is_decode(self) -> np.ndarray:
        """``[R]`` bool: the requests that run one token (``metadata.is_decode``)."""
        return is_decode(self.query_lens)

    @property
    def num_decodes(self) -> int:
        """Requests that run one token."""
        return int(np.count_nonzero(self.is_decode))

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the prompt chunks (the requests that run more than one)."""
        return int(self.query_lens[~self.is_decode].sum())


def build_batch(
    scheduled: Sequence[Scheduled],
    previous_rows: Mapping[int, int],
    input_batch: InputBatch | None = None,
) -> StepBatch:
    """The arrays of one rank's ``scheduled`` chunks (decodes first, as the scheduler orders
    them). ``previous_rows``: for each request (by ``id``) with a pending token, its row in
    the previous step's sampled tokens. ``input_batch``: the rank's block-table rows kept
    from earlier steps (by default built afresh)."""
    requests, starts, counts, _, steps = zip(*scheduled, strict=True) if scheduled else [()] * 5
    query_lens = np.array(counts, np.int32)
    input_ids = np.zeros(int(query_lens.sum()), np.int32)
    source = np.full(input_ids.shape[0], -1, np.int32)
    pending_offsets, pending_rows = [], []  # of the pending tokens, set at once
    offset = 0
    for request, start, count in zip(requests, starts, counts, strict=True):
        if is_decode(count) and start >= len(request.prompt_ids) + len(request.output_ids):
            # A decode whose token the host has not read: the device takes it from the
            # previous step's sampled row (the common case, without a token_ids call).
            pending_offsets.append(offset)
            pending_rows.append(previous_rows[id(request)])
        else:
            chunk, first_pending = request.token_ids(start, start + count)
            input_ids[offset : offset + count] = chunk
            if first_pending is not None:
                # Only the previous step's last token of a request is in its sampled row
                # (the engine reads a window's tokens before a step could take more).
                if count - first_pending != 1:
                    raise RuntimeError(f"a chunk takes {count - first_pending} pending tokens")
                pending_offsets.append(offset + first_pending)
                pending_rows.append(previous_rows[id(request)])
        offset += count
    source[pending_offsets] = pending_rows
    return StepBatch(
        np.array(starts, np.int32),
        query_lens,
        (InputBatch() if input_batch is None else input_batch).block_tables(requests),
        input_ids,
        source,
        np.array([r.temperature for r in requests], np.float32),
        np.array(steps, np.int32),
        np.array([not r.ignore_eos for r in requests], bool),
    )


def scratch_blocks(block_size: int, data_parallel: int) -> int:
    """Blocks at the end of each DP rank's cache share that no request gets: a rank's padding
    requests (a decode, a 2-token prompt) write there. None without data parallelism."""
    return 0 if data_parallel == 1 else 1 + -(-2 // block_size)


def _padding(block_ids: np.ndarray, count: int) -> StepBatch:
    """A padding request of ``count`` tokens from position 0 in ``block_ids``: a decode (1)
    or a prompt (2); greedy, its sampled token never read; in a window, no step of it
    writes."""
    return StepBatch(
        context_lens=np.zeros(1, np.int32),
        query_lens=np.array([count], np.int32),
        block_table=block_ids[None, :].astype(np.int32),
        input_ids=np.zeros(count, np.int32),
        source=np.full(count, -1, np.int32),
        temperatures=np.zeros(1, np.float32),
        steps=np.zeros(1, np.int32),
        stops_at_eos=np.zeros(1, bool),
    )


def _concatenate(parts: Sequence[StepBatch]) -> StepBatch:
    width = max(part.block_table.shape[1] for part in parts)
    return StepBatch(
        context_lens=np.concatenate([part.context_lens for part in parts]),
        query_lens=np.concatenate([part.query_lens for part in parts]),
        block_table=np.concatenate(
            [
                np.pad(part.block_table, ((0, 0), (0, width - part.block_table.shape[1])))
                for part in parts
            ]
        ),
        input_ids=np.concatenate([part.input_ids for part in parts]),
        source=np.concatenate([part.source for part in parts]),
        temperatures=np.concatenate([part.temperatures for part in parts]),
        steps=np.concatenate([part.steps for part in parts]),
        stops_at_eos=np.concatenate([part.stops_at_eos for part in parts]),
    )


def pad_ranks(
    batches: Sequence[StepBatch], buckets: Buckets, *, blocks_per_rank: int, block_size: int
) -> tuple[list[StepBatch], list[slice], Buckets]:
    """Every rank's batch given the parts any rank has (a padding decode in front, a padding
    prompt at the end, in the rank's scratch blocks, the last of its ``blocks_per_rank``),
    the slice of each rank's real requests in its padded batch, and ``buckets`` narrowed to
    one decode and one prefill-token size, those of the rank with the most: every rank's
    step then takes one shape (the other axes the engine's buckets fix)."""
    scratch = np.arange(
        blocks_per_rank - scratch_blocks(block_size, len(batches)), blocks_per_rank, dtype=np.int32
    )
    any_decodes = any(batch.num_decodes for batch in batches)
    any_prefills = any(batch.num_prefill_tokens for batch in batches)
    padded, real = [], []
    for batch in batches:
        front = [_padding(scratch[:1], 1)] if any_decodes and not batch.num_decodes else []
        back = [_padding(scratch[1:], 2)] if any_prefills and not batch.num_prefill_tokens else []
        padded.append(_concatenate([*front, batch, *back]))
        real.append(slice(len(front), len(front) + len(batch.query_lens)))
    common = dataclasses.replace(
        buckets,
        decode_buckets=(buckets.decodes(max(max(b.num_decodes for b in padded), 1)),),
        token_buckets=(buckets.prefill_tokens(max(max(b.num_prefill_tokens for b in padded), 2)),),
    )
    return padded, real, common
