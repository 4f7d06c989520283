"""Packed tokens: a step's tokens in the caller's request order, into and out of the module.

A model author holds a step's tokens packed in request order, ``[T, H]``, requests in any mix
of decodes and prefills and in any order. The kernels run on the bucket layout of
``metadata.py`` (decodes first, each region padded to its bucket). ``PackedMetadata`` carries
the permutation between the two layouts and ``MLAAttention`` applies it under jit: a gather
before the attention, a scatter after it.

The packed axis is as long as the bucket's: rows ``[0, num_real)`` hold the real tokens in
request order, and the caller may pass up to ``num_tokens - num_real`` padding rows after them
(or none): padding never reaches a cache slot or a real row, and its output is zero. Passing
``[metadata.num_tokens, H]`` keeps the compiled programs to one per bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import kernels
from mla_jax.cache.latent_cache import PAD_SLOT
from mla_jax.cache.metadata import (
    AttentionMetadata,
    Buckets,
    MetadataError,
    build_validated,
    is_decode,
    validate_step,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMetadata:
    """A step's metadata for tokens packed in request order."""

    attention: AttentionMetadata  # the bucket layout the kernels run on
    packed_index: np.ndarray  # [T] int32: the packed row bucket row r holds (a permutation)

    @property
    def num_tokens(self) -> int:
        """The most packed rows a call may pass (the step's token bucket)."""
        return self.attention.num_tokens

    def num_real_tokens(self) -> int:
        """Host-side: the step's real tokens (the packed rows a call must at least pass)."""
        return int(np.count_nonzero(np.asarray(self.attention.slot_mapping) != PAD_SLOT))

    def to_buckets(self, x: jax.Array) -> jax.Array:
        """``x [T', ...]`` packed (``T' <= num_tokens``) -> ``[num_tokens, ...]`` in the bucket
        layout; bucket rows whose packed row is past ``T'`` read zeros."""
        return x.at[self.packed_index].get(mode="fill", fill_value=0, unique_indices=True)

    def from_buckets(self, y: jax.Array, num_rows: int) -> jax.Array:
        """``y [num_tokens, ...]`` in the bucket layout -> ``[num_rows, ...]`` packed."""
        packed = jnp.zeros((num_rows, *y.shape[1:]), y.dtype)
        return packed.at[self.packed_index].set(y, mode="drop", unique_indices=True)


def packed_metadata(
    context_lens: Sequence[int] | np.ndarray,
    query_lens: Sequence[int] | np.ndarray,
    block_table: Sequence[Sequence[int]] | np.ndarray,
    *,
    num_heads: int,
    block_size: int,
    num_blocks: int,
    workspace_size: int = 8192,
    buckets: Buckets | None = None,
    impl: str = "auto",
    kernel_plan: kernels.KernelPlan | None = None,
) -> PackedMetadata:
    """Device-ready metadata of one step of requests in the caller's order.

    Args:
      context_lens: ``[R]`` tokens of each request already in the cache.
      query_lens: ``[R]`` new tokens of each request this step (>= 1; 1 is a decode).
      block_table: each request's cache block ids, an ``[R, W]`` integer array or ``R``
        lists of any lengths; a request needs its first ``cdiv(context + query, block_size)``
        (later entries are ignored).
      num_heads: the attention's heads (they size the Pallas decode's schedule).
      block_size, num_blocks: the cache's geometry (the module checks its cache against them).
      workspace_size: the most cached-context rows gathered at once.
      buckets: how padded sizes are chosen (default: powers of two).
      impl: the kernels the step will run (``kernels.select``); for the Pallas kernels the
        metadata carries their schedules, for the device ``kernel_plan`` (default
        ``KernelPlan.for_device(num_heads)`` for ``block_size``-row pages).

    Returns:
      ``PackedMetadata`` whose arrays are on the default device; tokens go in packed in the
      order of the requests here.
    """
    block_table = _rectangular(block_table)
    # Checked once, errors naming requests in the caller's order; built decodes first (the
    # checks hold in any order).
    context_lens, query_lens, block_table = validate_step(
        context_lens, query_lens, block_table, block_size, num_blocks, decodes_first=False
    )
    order = np.argsort(~is_decode(query_lens), kind="stable")
    kernel_plan = kernel_plan or kernels.KernelPlan.for_impl(impl, num_heads, page_size=block_size)
    attention = build_validated(
        context_lens[order],
        query_lens[order],
        block_table[order],
        block_size=block_size,
        num_blocks=num_blocks,
        workspace_size=workspace_size,
        buckets=buckets or Buckets(),
        kernel_plan=kernel_plan,
    )
    # The packed row of each real token, requests taken in the builder's order.
    packed_starts = np.cumsum(query_lens) - query_lens
    lens = query_lens[order]
    num_real = int(lens.sum())
    ordered_starts = np.cumsum(lens) - lens
    packed_rows = np.arange(num_real) + np.repeat(packed_starts[order] - ordered_starts, lens)
    # Padding bucket rows take the packed padding rows, so that the index is a permutation.
    packed_index = np.empty(attention.num_tokens, np.int32)
    real_rows = attention.token_rows()
    packed_index[real_rows] = packed_rows
    padding = np.ones(attention.num_tokens, bool)
    padding[real_rows] = False
    packed_index[padding] = np.arange(num_real, attention.num_tokens)
    return jax.device_put(PackedMetadata(attention, packed_index))


def _rectangular(block_table) -> np.ndarray:
    """``[R, W]`` block ids from an array or from ``R`` lists of any lengths (padded with -1,
    which no kernel reads)."""
    if hasattr(block_table, "ndim") or not len(block_table):
        return np.asarray(block_table)
    rows = [np.asarray(row) for row in block_table]
    if any(row.ndim != 1 for row in rows):
        raise MetadataError("block_table must be [R, W] or R lists of block ids")
    table = np.full((len(rows), max(1, *(row.shape[0] for row in rows))), -1, np.int64)
    for i, row in enumerate(rows):
        table[i, : row.shape[0]] = row
    return table
