"""Host metadata: invariants on random batches, edge cases, and malformed input."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mla_jax.cache.latent_cache import PAD_SLOT
from mla_jax.cache.metadata import Buckets, MetadataError, build_metadata


def _random_batch(rng, block_size, num_reqs=None):
    num_reqs = num_reqs or int(rng.integers(1, 24))
    nd = int(rng.integers(0, num_reqs + 1))
    qlen = np.concatenate([np.ones(nd, int), rng.integers(2, 40, num_reqs - nd)])
    ctx = rng.integers(0, 200, num_reqs) * (rng.random(num_reqs) < 0.7)
    # land some sequences exactly on a block boundary
    edge = rng.random(num_reqs) < 0.3
    ctx = np.where(edge, np.maximum((ctx // block_size) * block_size - qlen, 0), ctx)
    need = -(-(ctx + qlen) // block_size)
    width = int(need.max()) + int(rng.integers(0, 3))
    num_blocks = int(need.sum()) + 5
    perm = rng.permutation(num_blocks)
    table = np.full((num_reqs, width), -1)
    at = 0
    for r in range(num_reqs):
        table[r, : need[r]] = perm[at : at + need[r]]
        at += need[r]
    return ctx, qlen, table, num_blocks


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("trial", range(6))
def test_invariants_on_random_batches(rng, block_size, trial):
    ctx, qlen, table, num_blocks = _random_batch(rng, block_size)
    workspace = int(rng.choice([64, 256, 1024])) * block_size
    md = build_metadata(
        ctx, qlen, table, block_size=block_size, num_blocks=num_blocks, workspace_size=workspace
    )
    nd = int((qlen == 1).sum())
    bd = md.num_decode_tokens
    shape = md.step_shape()
    for n in (shape.tokens - bd, shape.decodes, shape.prefills, shape.chunks):
        assert n == 0 or n & (n - 1) == 0  # buckets are powers of two

    # every new token: position and slot, written out token by token
    rows = md.token_rows()
    assert len(rows) == qlen.sum()
    k = 0
    for r in range(len(qlen)):
        for i in range(qlen[r]):
            pos = ctx[r] + i
            assert md.positions[rows[k]] == pos
            assert md.slot_mapping[rows[k]] == table[r, pos // block_size] * block_size + (
                pos % block_size
            )
            k += 1
    pad = np.setdiff1d(np.arange(shape.tokens), rows)
    assert (md.slot_mapping[pad] == PAD_SLOT).all()

    # each request's logits row is its last token
    last = np.cumsum(qlen) - 1
    assert (md.logits_indices[md.request_rows()] == rows[last]).all()

    if nd:
        d = md.decode
        assert (d.seq_lens[:nd] == ctx[:nd] + 1).all() and (d.seq_lens[nd:] == 0).all()
        for r in range(nd):
            need = -(-(ctx[r] + 1) // block_size)
            assert (d.block_table[r, :need] == table[r, :need]).all()
            assert (d.block_table[r, need:] == 0).all()
    else:
        assert md.decode is None
    if nd < len(qlen):
        p = md.prefill
        npf = len(qlen) - nd
        assert (np.diff(p.query_start_loc)[:npf] == qlen[nd:]).all()
        assert (np.diff(p.query_start_loc)[npf:] == 0).all()
        assert (p.context_lens[:npf] == ctx[nd:]).all()
        assert (p.seq_lens[:npf] == ctx[nd:] + qlen[nd:]).all()
        _check_chunks(p.chunks, ctx[nd:], block_size, workspace)
    else:
        assert md.prefill is None


def _check_chunks(chunks, ctx, block_size, workspace):
    if not ctx.any():
        assert chunks is None
        return
    covered = [[] for _ in ctx]
    for c in range(chunks.starts.shape[0]):
        lens = np.diff(chunks.cu_seq_lens[c])
        assert chunks.totals[c] == lens.sum() <= chunks.workspace_size <= workspace
        for r in range(len(ctx)):
            if lens[r]:
                assert chunks.starts[c, r] % block_size == 0
                covered[r].extend(range(chunks.starts[c, r], chunks.starts[c, r] + lens[r]))
    for r in range(len(ctx)):
        assert covered[r] == list(range(ctx[r]))  # each context token once, in order


def test_edge_cases():
    # a one-token prompt is a decode; zero context; exact block boundary
    md = build_metadata(
        np.array([0, 15, 0, 16]),
        np.array([1, 1, 16, 16]),
        np.arange(8).reshape(4, 2),
        block_size=16,
        num_blocks=8,
        workspace_size=64,
    )
    assert list(md.decode.seq_lens[:2]) == [1, 16]
    assert list(md.prefill.context_lens[:2]) == [0, 16]
    assert md.prefill.chunks.totals[0] == 16


def test_explicit_token_buckets():
    b = Buckets(token_buckets=(24, 48))
    kw = dict(block_size=4, num_blocks=64, workspace_size=64, buckets=b)
    md = build_metadata(np.array([0]), np.array([30]), np.arange(8)[None], **kw)
    assert md.positions.shape[0] == 48
    with pytest.raises(MetadataError, match="largest bucket"):
        build_metadata(np.array([0]), np.array([50]), np.arange(13)[None], **kw)


@pytest.mark.parametrize(
    "ctx,qlen,table,match",
    [
        ([-1], [3], [[0]], "context_lens must be >= 0"),
        ([0], [0], [[0]], "query_lens must be >= 1"),
        ([0, 3], [4, 1], [[0], [1]], "decode requests"),
        ([5], [4], [[0, 1]], "narrower"),
        ([0], [4], [[99]], r"block_table\[0, 0\] = 99"),
        ([0], [4], [[-1]], r"block_table\[0, 0\] = -1"),
        ([0, 0], [4, 4], [[2], [2]], "same cache slot"),
        # a prefill's new tokens land in a full block of a decode's context
        ([5, 0], [1, 4], [[0, 1], [0, 5]], r"request 1 .* block 0, which request 0 reads"),
        # a decode's new token lands in another decode's partly filled last block
        ([2, 0], [1, 1], [[3], [3]], r"request 1 .* block 3, which request 0 reads"),
        ([0, 0], [4], [[0], [1]], "must be equal"),
        ([0], [4], [0, 1], "block_table must be"),
        ([0.5], [4], [[0]], "integers"),
    ],
)
def test_malformed_input_is_rejected(ctx, qlen, table, match):
    with pytest.raises(MetadataError, match=match):
        build_metadata(
            np.array(ctx),
            np.array(qlen),
            np.array(table),
            block_size=4,
            num_blocks=8,
            workspace_size=64,
        )


def test_shared_context_blocks_are_allowed():
    """Requests may read the same context blocks (a shared prefix) while each writes its own."""
    md = build_metadata(
        np.array([4, 4]),
        np.array([1, 3]),
        np.array([[5, 6], [5, 7]]),
        block_size=4,
        num_blocks=8,
        workspace_size=64,
    )
    assert list(md.slot_mapping[:1]) == [24] and list(md.slot_mapping[8:11]) == [28, 29, 30]


def _overwrites_context(ctx, qlen, table, block_size):
    """Written out entry by entry: does a table entry that receives new tokens name the block
    of another entry that holds context?"""
    written, read = [], []
    for r in range(len(ctx)):
        last = -(-(ctx[r] + qlen[r]) // block_size)
        written += [(r, w) for w in range(ctx[r] // block_size, last)]
        read += [(r, w) for w in range(-(-ctx[r] // block_size))]
    return any(table[a] == table[b] and a != b for a in written for b in read)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_context_overwrites_match_a_brute_force_check(rng, block_size):
    """Random tables drawn from few blocks, so that requests often share them."""
    outcomes = set()
    for _ in range(100):
        num_reqs = int(rng.integers(2, 6))
        nd = int(rng.integers(0, num_reqs + 1))
        qlen = np.concatenate([np.ones(nd, int), rng.integers(2, 6, num_reqs - nd)])
        ctx = rng.integers(0, 10, num_reqs)
        width = int((-(-(ctx + qlen) // block_size)).max())
        num_blocks = 2 * num_reqs * width
        table = rng.integers(0, num_blocks, (num_reqs, width))
        expected = _overwrites_context(ctx, qlen, table, block_size)
        try:
            build_metadata(
                ctx,
                qlen,
                table,
                block_size=block_size,
                num_blocks=num_blocks,
                workspace_size=64 * block_size,
            )
            outcome = "ok"
        except MetadataError as e:
            outcome = "overwrite" if "reads as context" in str(e) else "same slot"
            assert outcome == "overwrite" or "same cache slot" in str(e), e
        assert (outcome == "overwrite") == expected, (ctx, qlen, table)
        outcomes.add(outcome)
    assert "overwrite" in outcomes and "ok" in outcomes


def test_workspace_too_small_for_the_prefills_with_context():
    with pytest.raises(MetadataError, match="workspace_size 8 is too small"):
        build_metadata(
            np.array([4, 4, 4]),
            np.array([2, 2, 2]),
            np.arange(6).reshape(3, 2),
            block_size=4,
            num_blocks=8,
            workspace_size=8,
        )


def test_kernel_schedules_add_no_buckets(rng):
    """With a kernel plan the metadata also carries the Pallas schedules, sized from the
    buckets alone (two batches of one bucket share every shape)."""
    from mla_jax.kernels import KernelPlan

    shapes = set()
    for _ in range(3):
        ctx = rng.integers(100, 120, 6)  # one bucket: same widths, one context chunk
        qlen = np.array([1, 1, 1, 5, 9, 20])
        table = rng.permutation(6 * 21).reshape(6, 21)
        md = build_metadata(
            ctx,
            qlen,
            table,
            block_size=16,
            num_blocks=6 * 21,
            workspace_size=512,
            kernel_plan=KernelPlan(16, num_sms=8),
        )
        leaves = [a.shape for a in jax.tree.leaves(md)]
        shapes.add((str(jax.tree.structure(md)), tuple(leaves)))
        s = md.decode.schedule
        assert s.req_items[-1] <= len(s.item_req) and md.prefill.schedule.rows_per_tile > 0
    assert len(shapes) == 1
