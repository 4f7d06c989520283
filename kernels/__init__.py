"""MLA attention kernels, the MoE grouped matmul and the FP8 weight-only matmul: Pallas
(Triton lowering on GPU, interpret mode elsewhere) and their pure-jnp references, behind one
selector, plus the host-side plan the Pallas kernels' schedules are built with.

Each kernel can be called on its own: the README's Kernels section gives their shapes,
dtypes, the LSE layout and the block-table contract, with a snippet for each that runs as it
is (``tests/test_readme.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from . import decode, fp8_matmul, grouped_matmul, merge, prefill, tiling


class KernelSet(NamedTuple):
    """The kernels a model step calls, all Pallas or all references (``select``), or wrapped
    (``mla_jax.parallel.sharding.sharded_kernels``); each entry is called as the model calls
    ``decode.mla_decode``, ``prefill.flash_prefill``, ``merge.merge_attn_states``,
    ``grouped_matmul.grouped_matmul`` and ``fp8_matmul.fp8_matmul`` in turn (arrays, scale,
    causal, schedule, FP8 weights' scales and blocks)."""

    mla_decode: Callable
    flash_prefill: Callable
    merge_attn_states: Callable
    grouped_matmul: Callable
    fp8_matmul: Callable


REFERENCE = KernelSet(
    decode.reference.mla_decode,
    prefill.reference.flash_prefill,
    merge.reference.merge_attn_states,
    grouped_matmul.reference.grouped_matmul,
    fp8_matmul.reference.fp8_matmul,
)
PALLAS = KernelSet(
    decode.mla_decode,
    prefill.flash_prefill,
    merge.merge_attn_states,
    grouped_matmul.grouped_matmul,
    fp8_matmul.fp8_matmul,
)


def select(impl: str | KernelSet = "auto") -> KernelSet:
    """``"pallas"``: the Pallas kernels (compiled through Triton on GPUs, interpreted
    elsewhere); ``"reference"``: the pure-jnp references; ``"auto"``: Pallas on GPUs, the
    references elsewhere (interpret mode is for tests, not speed); a ``KernelSet`` (e.g.
    ``mla_jax.parallel.sharding.sharded_kernels``) is used as it is."""
    if isinstance(impl, KernelSet):
        return impl
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl == "pallas":
        return PALLAS
    if impl == "reference":
        return REFERENCE
    raise ValueError(f"unknown kernel implementation {impl!r} (auto, pallas or reference)")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What the host needs to schedule the Pallas kernels of a model with ``num_heads``
    heads on a GPU with ``num_sms`` multiprocessors."""

    num_heads: int
    num_sms: int = decode.DEFAULT_NUM_SMS
    prefill_block_q: int = prefill.PrefillConfig().block_q

    def decode_config(self, batch: int) -> decode.DecodeConfig:
        """The launch parameters ``mla_decode`` picks for a batch of ``batch`` decodes."""
        return decode.DecodeConfig.for_shape(self.num_heads, batch)

    def decode_programs(self, batch: int) -> int:
        """Decode programs per block of heads for a batch of ``batch`` decodes."""
        return decode.num_programs(self.decode_config(batch), self.num_heads, self.num_sms)

    def decode_schedule(self, seq_lens: np.ndarray) -> decode.DecodeSchedule:
        """The split-KV schedule of ``mla_decode`` for a batch of decodes with ``seq_lens
        [B]`` keys each (host, NumPy int; padding rows 0). Its arrays have sizes fixed by B
        alone, so that a padded batch size compiles once."""
        batch = seq_lens.shape[0]
        programs = self.decode_programs(batch)
        return decode.schedule_splits(
            seq_lens,
            num_programs=programs,
            block_k=self.decode_config(batch).block_k,
            num_items=decode.max_items(batch, programs),
        )

    def prefill_schedule(self, query_start: np.ndarray, num_rows: int) -> tiling.TileSchedule:
        """The query tiles of ``flash_prefill`` for prompt chunks at offsets ``query_start
        [S + 1]`` (host, NumPy int) in a query region of ``num_rows`` rows (padding after
        them). Its arrays have sizes fixed by S and ``num_rows`` alone, so that padded sizes
        compile once."""
        num_tiles = tiling.max_tiles(num_rows, query_start.shape[0] - 1, self.prefill_block_q)
        return prefill.schedule_query_tiles(
            query_start, num_rows, self.prefill_block_q, num_tiles=num_tiles
        )

    @classmethod
    def for_device(cls, num_heads: int, device: jax.Device | None = None) -> KernelPlan:
        """The plan for ``device`` (default: the first one): its multiprocessor count, or an
        H100's / H200's where it reports none (a CPU running the kernels interpreted)."""
        device = device or jax.devices()[0]
        return cls(num_heads, getattr(device, "core_count", None) or decode.DEFAULT_NUM_SMS)

    @classmethod
    def for_impl(cls, impl: str | KernelSet, num_heads: int) -> KernelPlan | None:
        """The plan for this device when ``impl`` selects the Pallas kernels (they need the
        schedules); None for the references, which take none."""
        return cls.for_device(num_heads) if select(impl) is PALLAS else None
