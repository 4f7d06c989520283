"""A request: what a user asks the engine for, and its progress through the engine.

Progress counts tokens: ``num_computed`` are in the cache (or being written by a step in
flight), ``num_pending`` were sampled by steps whose results the host has not read yet (the
engine overlaps steps: such a token counts as one of the request's, and the device feeds it
to the next step itself).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np


class RequestError(ValueError):
    """A request the engine cannot run: a field of the wrong type or value, a prompt that is
    empty, outside the vocabulary or too long for the model, a request given twice or
    already finished."""


def _described(value) -> str:
    """``value`` and its type's name, as an error shows a value of the wrong type (a string
    quoted, a NumPy scalar as its number)."""
    text = repr(value) if isinstance(value, str) else str(value)
    return f"{text} ({type(value).__name__})"


def _is_integer(value) -> bool:
    """A Python int or a NumPy integer scalar (not a bool: True is no token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def checked_prompt(prompt_ids) -> list[int]:
    """``prompt_ids`` as a list of Python ints: a list or tuple of ints (or NumPy integer
    scalars), or a 1-D integer NumPy or JAX array. Raises ``RequestError`` naming the item or
    the array's dtype or rank otherwise (a float id would otherwise be truncated silently)."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        if prompt_ids.ndim != 1:
            raise RequestError(f"prompt_ids is a {prompt_ids.ndim}-D array; want a 1-D one")
        if not np.issubdtype(prompt_ids.dtype, np.integer):
            raise RequestError(
                f"prompt_ids is a {np.dtype(prompt_ids.dtype).name} array; want integer token ids"
            )
        return np.asarray(prompt_ids).tolist()
    if not isinstance(prompt_ids, (list, tuple)):
        raise RequestError(
            f"prompt_ids is a {type(prompt_ids).__name__}; want a list of integer token ids "
            "or a 1-D integer array"
        )
    if all(type(t) is int for t in prompt_ids):  # the common case, without a copy's cost
        return prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
    for i, t in enumerate(prompt_ids):
        if not _is_integer(t):
            raise RequestError(f"prompt_ids[{i}] is {_described(t)}; token ids are integers")
    return [int(t) for t in prompt_ids]


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

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Refuses (``RequestError``, naming the field) what the fields cannot mean: token
        ids that are not integers, a ``max_new_tokens`` that is not an integer >= 1, a
        temperature that is not a finite number >= 0; stores them as Python ints and float
        (a 1-D integer array becomes a list). The engine checks again what it is given, as
        fields may have changed since."""
        self.prompt_ids = checked_prompt(self.prompt_ids)
        n = self.max_new_tokens
        if not _is_integer(n):
            raise RequestError(f"max_new_tokens is {_described(n)}; want an integer >= 1")
        if n < 1:
            raise RequestError(f"max_new_tokens is {n}; want an integer >= 1")
        self.max_new_tokens = int(n)
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, (bool, np.bool_)):
            raise RequestError(f"temperature is {_described(t)}; want a finite number >= 0")
        if not (math.isfinite(t) and t >= 0):
            raise RequestError(f"temperature is {float(t)}; want a finite number >= 0")
        self.temperature = float(t)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def tokens_to_go(self) -> int:
        """Tokens it may still generate past its known and pending ones (none once finished)."""
        if self.finished:
            return 0
        return self.max_new_tokens - len(self.output_ids) - self.num_pending

    @property
    def wants_tokens(self) -> bool:
        """Not finished, and its known and pending tokens leave room for another."""
        return self.tokens_to_go > 0

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
