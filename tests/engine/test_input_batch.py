"""The persistent batch: block-table rows kept across steps equal a from-scratch build after
any sequence of joins, departures, block growth and preemption."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mla_jax.cache.block_manager import BlockManager
from mla_jax.engine.batch import build_batch
from mla_jax.engine.input_batch import InputBatch
from mla_jax.engine.request import Request
from mla_jax.engine.scheduler import Scheduler


def _padded(requests: list[Request]) -> np.ndarray:
    """The block table of ``requests`` built the obvious way."""
    width = max((len(req.block_ids) for req in requests), default=0)
    table = np.zeros((len(requests), width), np.int32)
    for row, req in enumerate(requests):
        table[row, : len(req.block_ids)] = req.block_ids
    return table


def test_rows_follow_random_events(rng):
    """Over random steps, requests join, leave, come back, grow (a new array with blocks
    appended, as the scheduler grows them), are preempted (blocks released, then others
    taken) and are scheduled in any order; from few slots and columns, which must grow.
    Each step's table equals a fresh build's and the obvious one."""
    persistent = InputBatch(rows=2, width=2)
    pool = [Request([1], 1) for _ in range(24)]
    next_block = 0

    def blocks(n: int) -> np.ndarray:
        nonlocal next_block
        next_block += n
        return np.arange(next_block - n, next_block, dtype=np.int32)

    for _ in range(300):
        for req in pool:
            event = rng.random()
            if event < 0.2:  # grows
                req.block_ids = np.concatenate([req.block_ids, blocks(int(rng.integers(1, 4)))])
            elif event < 0.25:  # preempted: its blocks go, others come
                req.block_ids = np.zeros(0, np.int32)
                if rng.random() < 0.5:
                    req.block_ids = blocks(int(rng.integers(1, 6)))
        step = [req for req in pool if rng.random() < 0.6]
        step = [step[i] for i in rng.permutation(len(step))]
        table = persistent.block_tables(step)
        np.testing.assert_array_equal(table, _padded(step))
        np.testing.assert_array_equal(table, InputBatch().block_tables(step))
        assert table.dtype == np.int32


def _steps(scheduler: Scheduler, arrivals: list[Request], rng, window: int):
    """A scheduler's steps as the engine takes them (windows where it can run one), while
    ``arrivals`` join at random steps; each step's tokens given at once (random, no EOS):
    the chunks of each step."""
    while scheduler.has_work or arrivals:
        if arrivals and (rng.random() < 0.5 or not scheduler.has_work):
            scheduler.add(arrivals.pop())
        plan = scheduler.plan_window(window) if window > 1 else None
        if plan is not None and plan.fills:
            scheduled = scheduler.schedule_window(plan)
        else:
            scheduled = scheduler.schedule()
        yield scheduled
        for entry in scheduled:
            req = entry.request
            if entry.samples:
                req.num_pending -= entry.steps
                req.output_ids += rng.integers(1, 100, entry.steps).tolist()
                if len(req.output_ids) >= req.max_new_tokens:
                    scheduler.finish(req)


@pytest.mark.parametrize("window", [1, 4])
def test_batches_equal_fresh_builds_through_a_run(rng, window):
    """Through a scheduler's run with requests arriving, chunked prompts, windows, block
    growth, preemption (few blocks) and requests finishing, each step's batch from the
    persistent rows equals one built afresh."""
    scheduler = Scheduler(
        BlockManager(8, 4, enable_caching=False),
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=5,
        prefill_slots=2,
    )
    persistent = InputBatch()
    arrivals = [
        Request(rng.integers(1, 100, int(rng.integers(6, 13))).tolist(), int(rng.integers(4, 9)))
        for _ in range(16)
    ]
    steps = 0
    for scheduled in _steps(scheduler, arrivals, rng, window):
        kept = build_batch(scheduled, {}, persistent)
        fresh = build_batch(scheduled, {})
        for field in dataclasses.fields(kept):
            np.testing.assert_array_equal(getattr(kept, field.name), getattr(fresh, field.name))
        steps += 1
    assert steps and scheduler.preemptions
