"""A DP rank's scheduled requests as per-slot NumPy arrays kept from step to step.

Most of a step's requests are those of the step before, with the same cache blocks (a
request gains one block every ``block_size`` tokens), so rebuilding their block-table rows
every step would cost the host time in proportion to the batch. ``InputBatch`` keeps one
row per request (a *slot*) and writes a row only when its request joins or its blocks
change; a step's block table is then one gather of its requests' rows. This is vLLM V1's
persistent ``InputBatch``, kept small: the rest of a step's arrays are cheap to take from
the scheduled chunks (``batch.build_batch``).

A request's blocks change only by ``Request.block_ids`` getting a new array (the scheduler
grows and releases them so, never in place), so a slot knows its row is current while it
holds the very array its row was written from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mla_jax.engine.request import Request


class InputBatch:
    """Block-table rows of the requests one rank's steps run, by slot; a slot lives from the
    step its request joins to the first step that does not schedule it.

    Args:
      rows, width: the slots and block-table columns to start with (both double as needed).
    """

    def __init__(self, rows: int = 16, width: int = 16):
        self.block_table = np.zeros((rows, width), np.int32)
        self.num_blocks = np.zeros(rows, np.int32)  # of each slot's row that hold its blocks
        self._slot: dict[Request, int] = {}
        self._written: list[np.ndarray | None] = [None] * rows  # the block ids each row holds
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: lowest slot first

    def block_tables(self, requests: Sequence[Request]) -> np.ndarray:
        """``[len(requests), W]`` int32: each request's block ids, zero-padded to the most any
        of them holds. ``requests``: a step's (each once); a request that left since the
        last call gives its slot back, one that joined takes one, one whose blocks changed
        has its row rewritten."""
        slots = self._update(requests)
        width = int(self.num_blocks[slots].max(initial=0))
        return self.block_table[slots, :width]

    def _update(self, requests: Sequence[Request]) -> np.ndarray:
        """The slots of ``requests`` after bringing the rows up to date."""
        self._leave(self._slot.keys() - set(requests))
        slots = []
        for request in requests:
            slot = self._slot.get(request)
            if slot is None:
                slot = self._join(request)
            if self._written[slot] is not request.block_ids:
                self._write(slot, request.block_ids)
            slots.append(slot)
        return np.asarray(slots, np.intp)

    def _leave(self, requests: set[Request]) -> None:
        for request in requests:
            slot = self._slot.pop(request)
            self._written[slot] = None
            self._free.append(slot)

    def _join(self, request: Request) -> int:
        if not self._free:
            self._resize(2 * self.block_table.shape[0], self.block_table.shape[1])
        slot = self._free.pop()
        self._slot[request] = slot
        return slot

    def _write(self, slot: int, block_ids: np.ndarray) -> None:
        count = block_ids.shape[0]
        if count > self.block_table.shape[1]:
            self._resize(self.block_table.shape[0], max(count, 2 * self.block_table.shape[1]))
        # The whole row, not just the blocks a grown request appended: checking that its
        # earlier blocks stayed costs as much as writing them.
        self.block_table[slot, :count] = block_ids
        # Past its blocks a row holds zeros, the gathered table's padding (an earlier holder
        # of the slot may have left more).
        written = int(self.num_blocks[slot])
        if written > count:
            self.block_table[slot, count:written] = 0
        self.num_blocks[slot] = count
        self._written[slot] = block_ids

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self.block_table.shape
        table = np.zeros((rows, width), np.int32)
        table[:old_rows, :old_width] = self.block_table
        self.block_table = table
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - old_rows, np.int32)])
        self._written += [None] * (rows - old_rows)
        self._free[:0] = range(rows - 1, old_rows - 1, -1)
