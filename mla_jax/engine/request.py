"""A request: what a user asks the engine for, and its progress through the engine.

Progress counts tokens: ``num_computed`` are in the cache (or being written by a step in
flight), ``num_pending`` were sampled by steps whose results the host has not read yet (the
engine overlaps steps: such a token counts as one of the request's, and the device feeds it
to the next step itself).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)  # a request is itself, whatever its fields hold
class Request:
    """One generation: its prompt, sampling settings and stopping rule, and what the engine
    records as it runs (output token ids, cache blocks, progress).

    prompt_ids: the prompt's token ids.
    max_new_tokens: the most tokens to generate.
    temperature: 0 samples greedily, else softmax(logits / temperature).
    ignore_eos: generate past the model's EOS tokens.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    num_computed: int = 0  # tokens in the cache, or being written by a step in flight
    num_pending: int = 0  # tokens sampled by steps whose results the host has not read
    num_cached_blocks: int = 0  # leading blocks the prefix cache knows by content
    finished: bool = False
    token_times: list[float] = dataclasses.field(default_factory=list)  # perf_counter, per output

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def wants_tokens(self) -> bool:
        """Not finished, and its known and pending tokens leave room for another."""
        return not self.finished and len(self.output_ids) + self.num_pending < self.max_new_tokens

    def token_ids(self, start: int, stop: int) -> tuple[list[int], int | None]:
        """Token ids ``[start, stop)`` of prompt + output, and the offset among them of the
        first pending token (pending ids are only on the device, given here as 0), if they
        hold one. Slices only (no copy of a whole prompt: this runs for every request every
        step)."""
        prompt_len = len(self.prompt_ids)
        known = prompt_len + len(self.output_ids)
        ids = self.prompt_ids[start:stop] if start < prompt_len else []
        if stop > prompt_len:
            ids += self.output_ids[max(start - prompt_len, 0) : stop - prompt_len]
        if stop <= known:
            return ids, None
        first_pending = max(start, known)
        return ids + [0] * (stop - first_pending), first_pending - start
