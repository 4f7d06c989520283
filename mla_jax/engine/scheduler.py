"""The scheduler: which tokens of which requests each step runs.

Each step takes every running decode (one token each) and then fills the rest of the token
budget with up to ``prefill_slots`` prompt chunks, so long prompts span steps and come back
with cached context. Cache blocks are allocated as tokens arrive; when a decode finds none
free, the newest running request is preempted (its blocks freed) and later recomputed from
its prompt and the tokens it had generated, as vLLM does. A request waits while its next
chunk finds no free block.

With prefix caching (``block_manager.py``) a request's full blocks are cached as their tokens
become known and computed (prompt and generated tokens alike), and stay cached when it
finishes or is preempted; a request starting (or restarting after preemption) takes the
longest cached block-aligned prefix of its tokens as context already in the cache and
computes the rest, at least its last token (whose logits it samples from).

A step is scheduled before the previous one's sampled tokens reach the host (the engine
overlaps them): a request's sampled but unread token is *pending* (``request.py``).

When every running request decodes and no waiting request could start, the engine may run a
*window* of several decode steps in one device program (``plan_window``, ``schedule_window``):
each request gets the blocks of all its window's tokens up front, so the device never needs
a new one, and its window ends where its ``max_new_tokens`` (hence the model length) would;
a window never preempts (its plan asks for the free blocks first), and runs only where some
request takes all its steps (``WindowPlan.fills``).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from mla_jax.cache.block_manager import BlockManager
from mla_jax.cache.metadata import is_decode
from mla_jax.engine.request import Request


class Scheduled(NamedTuple):
    """``count`` tokens of ``request`` from position ``start`` (its context length);
    ``samples``: the step samples its next token (the chunk ends its tokens); ``steps``: the
    decode steps a window runs it for (a decode each, ``count`` 1), 1 in a one-step batch."""

    request: Request
    start: int
    count: int
    samples: bool
    steps: int = 1

    @property
    def is_decode(self) -> bool:
        """One token: a decode (``metadata.is_decode``; a 1-token prompt chunk runs as one
        too)."""
        return is_decode(self.count)


class WindowPlan(NamedTuple):
    """A window ``Scheduler.plan_window`` found possible: each running request that wants
    tokens with the decode steps it runs, and whether some request runs all of them (a
    window's program runs every step, ``runner.py``: where none would, its last steps would
    compute for no request)."""

    entries: list[tuple[Request, int]]
    fills: bool


class Scheduler:
    """One DP rank's queues (``waiting``, ``running``) over its block manager; ``schedule``
    picks each step's requests and grows their blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_slots: int,
    ):
        self.block_manager = block_manager
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_slots = prefill_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.cached_prompt_tokens = 0  # prompt tokens taken from the prefix cache

    def add(self, req: Request) -> None:
        """Queues ``req`` behind the waiting ones."""
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        """Some request waits or runs."""
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        """Takes ``req`` out of the queues and frees its blocks."""
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def withdraw(self, requests: set[Request]) -> None:
        """Takes ``requests`` out of the queues, where they are, and frees their blocks
        (requests it does not hold are left alone): a failed call's cleanup. A block is
        cached when its step is scheduled, before the step runs, so the content of the
        blocks they alone hold is forgotten (the failed step may have been theirs), and
        none is cached anew."""
        held = [req for req in (*self.running, *self.waiting) if req in requests]
        self.running = [req for req in self.running if req not in requests]
        self.waiting = deque(req for req in self.waiting if req not in requests)
        for req in held:
            blocks = req.block_ids.tolist()
            self.block_manager.forget(blocks)
            self.block_manager.release(blocks)
            req.block_ids = np.zeros(0, np.int32)
            req.num_cached_blocks = 0

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Gives ``req`` the blocks ``num_tokens`` tokens need; False (and nothing taken)
        when too few are free."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need > self.block_manager.num_free:
            return False
        if need > 0:
            new = np.asarray(self.block_manager.allocate(need), np.int32)
            req.block_ids = np.concatenate([req.block_ids, new])
        return True

    def release(self, req: Request) -> None:
        """Gives ``req``'s blocks back to the block manager, its full blocks cached."""
        self.cache_full_blocks(req)
        self.block_manager.release(req.block_ids.tolist())
        req.block_ids = np.zeros(0, np.int32)
        req.num_cached_blocks = 0

    def cache_full_blocks(self, req: Request) -> None:
        """Caches ``req``'s blocks that are full of tokens both computed and known (a pending
        token's id is not, until the host reads it)."""
        if not self.block_manager.enable_caching:
            return
        known = len(req.prompt_ids) + len(req.output_ids)
        full = min(req.num_computed, known) // self.block_size
        done = req.num_cached_blocks
        if full <= done:
            return
        token_ids, _ = req.token_ids(done * self.block_size, full * self.block_size)
        parent = int(req.block_ids[done - 1]) if done else None
        self.block_manager.cache(req.block_ids[done:full].tolist(), token_ids, parent)
        req.num_cached_blocks = full

    def _take_cached_prefix(self, req: Request) -> int:
        """Gives ``req`` (holding no blocks) the cached blocks of the longest block-aligned
        prefix of its known tokens that leaves at least one token to compute, as context
        already computed; returns the tokens it took."""
        known = len(req.prompt_ids) + len(req.output_ids)
        limit = min(known, req.num_tokens - 1) // self.block_size * self.block_size
        token_ids, _ = req.token_ids(0, limit)
        blocks = self.block_manager.match(token_ids)
        if not blocks:
            return 0
        self.block_manager.acquire(blocks)
        req.block_ids = np.asarray(blocks, np.int32)
        req.num_cached_blocks = len(blocks)
        req.num_computed = len(blocks) * self.block_size
        return req.num_computed

    def schedule(self) -> list[Scheduled]:
        """The next step: every decode first, then up to ``prefill_slots`` prompt chunks
        (running prompts before new ones), within the token budget. A running request that
        finds no free block preempts the newest one (itself, if it is the newest) back to
        the front of ``waiting``; a new request only takes blocks that are free. Advances
        each scheduled request's ``num_computed`` (and ``num_pending`` where it samples)."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        running, waiting = self.running, self.waiting
        preempted: set[Request] = set()  # (a set: `in running` would be O(n) per request)

        def preempt_newest() -> Request:
            nonlocal budget
            victim = running.pop()
            for i, (req, n) in enumerate(batch):
                if req is victim:
                    del batch[i]
                    budget += n
                    break
            self.release(victim)
            victim.num_computed = 0
            self.preemptions += 1
            preempted.add(victim)
            waiting.appendleft(victim)
            return victim

        def add(req: Request, n: int, *, preempt: bool) -> bool:
            """Schedules ``n`` tokens of ``req`` if its blocks can grow to hold them."""
            nonlocal budget
            while not self.grow(req, req.num_computed + n):
                if not preempt or preempt_newest() is req:
                    return False
            batch.append((req, n))
            budget -= n
            return True

        def fitting(req: Request) -> int:
            """The tokens of ``req``'s next chunk that the budget and free blocks allow."""
            free = (len(req.block_ids) + self.block_manager.num_free) * self.block_size
            return min(req.num_tokens - req.num_computed, budget, free - req.num_computed)

        for req in list(running):  # oldest first: preemption takes the newest
            if (
                budget
                and req.wants_tokens
                and is_decode(req.num_tokens - req.num_computed)
                and req not in preempted
            ):
                add(req, 1, preempt=True)
        chunks = 0
        for req in list(running):
            left = req.num_tokens - req.num_computed
            if budget and chunks < self.prefill_slots and left > 1 and req not in preempted:
                # What the free blocks hold, or else a block's worth made free.
                n = fitting(req)
                n = n if n > 0 else min(left, budget, self.block_size)
                chunks += add(req, n, preempt=True) and not is_decode(n)
        while (
            waiting and budget and chunks < self.prefill_slots and len(running) < self.max_num_seqs
        ):
            req = waiting[0]
            cached = self._take_cached_prefix(req)
            n = fitting(req)
            if n <= 0 or not add(req, n, preempt=False):
                self.release(req)  # its cached prefix, back to the eviction order
                req.num_computed = 0
                break
            running.append(waiting.popleft())
            self.cached_prompt_tokens += min(cached, len(req.prompt_ids))
            chunks += not is_decode(n)
        batch.sort(key=lambda rn: not is_decode(rn[1]))  # stable: 1-token chunks join the decodes
        return self._advance(
            [
                Scheduled(req, req.num_computed, n, req.num_computed + n == req.num_tokens)
                for req, n in batch
            ]
        )

    def plan_window(self, steps: int) -> WindowPlan | None:
        """A window of up to ``steps`` decode steps, or None where one cannot run now: it
        needs every running request that wants tokens to decode, within the token budget; no
        waiting request that could start now (none waits, or the running ones fill
        ``max_num_seqs``: a prompt that waits for room is not delayed by a window beyond the
        request it waits for); and free blocks for every request's tokens of the window. Each
        request runs as many steps as it still wants tokens (a request admitted within the
        model length stays within it). One pass over the running requests: this runs every
        window."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        entries, need, block_size, fills = [], 0, self.block_size, False
        for req in self.running:
            to_go = req.tokens_to_go
            if to_go <= 0:
                continue
            if not is_decode(req.num_tokens - req.num_computed):
                return None
            req_steps = min(steps, to_go)
            fills |= req_steps == steps
            tokens = req.num_computed + req_steps
            need += max(-(-tokens // block_size) - len(req.block_ids), 0)
            entries.append((req, req_steps))
        if len(entries) > self.max_num_batched_tokens or need > self.block_manager.num_free:
            return None
        return WindowPlan(entries, fills)

    def schedule_window(self, plan: WindowPlan) -> list[Scheduled]:
        """The window ``plan_window`` planned (nothing changed since): each of its requests
        with its blocks grown for all its steps. Advances ``num_computed`` and
        ``num_pending`` by those steps; a request the device stops early (EOS) has them
        corrected when the host reads its tokens (``Engine``)."""
        scheduled = []
        for req, req_steps in plan.entries:
            tokens = req.num_computed + req_steps
            # (Most windows need no new block: grow only where one does.)
            if tokens > len(req.block_ids) * self.block_size and not self.grow(req, tokens):
                raise RuntimeError("a window ran out of blocks: its plan did not hold")
            scheduled.append(Scheduled(req, req.num_computed, 1, True, req_steps))
        return self._advance(scheduled)

    def _advance(self, scheduled: list[Scheduled]) -> list[Scheduled]:
        """Counts ``scheduled``'s tokens computed (and sampled, where they sample) and caches
        the blocks they leave full of known tokens; returns ``scheduled``."""
        for entry in scheduled:
            entry.request.num_computed += entry.count * entry.steps
            entry.request.num_pending += entry.samples * entry.steps
            # After this step's admissions: a block is shared from the next step on.
            self.cache_full_blocks(entry.request)
        return scheduled
