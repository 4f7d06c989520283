"""Host-side bookkeeping of a paged latent cache for a model author's own generate loop.

``CacheManager`` owns a ``BlockAllocator``: it knows which cache blocks each sequence holds
and how many of its tokens are cached, grows the blocks as tokens arrive and builds each
step's ``PackedMetadata``. The device cache itself (``init_cache``) stays with the caller,
passed through the jitted step and returned updated, as JAX wants state.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Mapping

from mla_jax import kernels
from mla_jax.cache.latent_cache import BlockAllocator, CacheFullError
from mla_jax.cache.metadata import Buckets
from mla_jax.cache.packing import PackedMetadata, packed_metadata


class CacheManager:
    """Which blocks of a ``[..., num_blocks, block_size, width]`` cache each sequence owns.

    Args:
      num_heads: the attention's heads (they size the Pallas decode's schedule).
      num_blocks, block_size: the cache's geometry.
      workspace_size, buckets, impl, kernel_plan: as ``packing.packed_metadata``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_blocks: int,
        block_size: int,
        workspace_size: int = 8192,
        buckets: Buckets | None = None,
        impl: str = "auto",
        kernel_plan: kernels.KernelPlan | None = None,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self._options = dict(
            num_heads=num_heads,
            block_size=block_size,
            num_blocks=num_blocks,
            workspace_size=workspace_size,
            buckets=buckets,
            impl=impl,
            # Chosen once here, not on every step.
            kernel_plan=kernel_plan
            or kernels.KernelPlan.for_impl(impl, num_heads, page_size=block_size),
        )
        self._blocks: dict[Hashable, list[int]] = {}
        self._cached: dict[Hashable, int] = {}

    def cached_tokens(self, sequence: Hashable) -> int:
        """Tokens of ``sequence`` in the cache (0 for one not seen)."""
        return self._cached.get(sequence, 0)

    def blocks(self, sequence: Hashable) -> list[int]:
        """The cache block ids of ``sequence``, in token order."""
        return list(self._blocks.get(sequence, ()))

    def step(self, num_new_tokens: Mapping[Hashable, int]) -> PackedMetadata:
        """The metadata of a step appending ``num_new_tokens[s]`` tokens to each sequence
        ``s`` (a new id starts empty); tokens go in packed in the mapping's order. Gives
        each sequence the blocks its new tokens need (``CacheFullError`` when too few are
        free; nothing is then allocated) and counts the tokens as cached: run the step."""
        sequences = list(num_new_tokens)
        counts = [num_new_tokens[s] for s in sequences]
        for sequence, count in zip(sequences, counts, strict=True):
            if not isinstance(count, numbers.Integral) or count < 1:
                raise ValueError(f"num_new_tokens[{sequence!r}] must be an int >= 1, got {count!r}")
        totals = [self.cached_tokens(s) + n for s, n in zip(sequences, counts, strict=True)]
        needs = [
            -(-total // self.block_size) - len(self._blocks.get(s, ()))
            for s, total in zip(sequences, totals, strict=True)
        ]
        if sum(needs) > self.allocator.num_free:
            raise CacheFullError(
                f"the step needs {sum(needs)} more cache blocks; {self.allocator.num_free} "
                f"of {self.allocator.num_blocks} are free"
            )
        added = {s: self.allocator.allocate(n) for s, n in zip(sequences, needs, strict=True)}
        tables = [self._blocks.get(s, []) + added[s] for s in sequences]
        try:
            metadata = packed_metadata(
                [self.cached_tokens(s) for s in sequences], counts, tables, **self._options
            )
        except Exception:
            for ids in added.values():
                self.allocator.free(ids)
            raise
        for sequence, table, total in zip(sequences, tables, totals, strict=True):
            self._blocks[sequence], self._cached[sequence] = table, total
        return metadata

    def free(self, sequence: Hashable) -> None:
        """Returns the blocks of ``sequence`` to the allocator and forgets it."""
        if sequence not in self._blocks:
            raise KeyError(f"sequence {sequence!r} holds no cache blocks")
        self.allocator.free(self._blocks.pop(sequence))
        del self._cached[sequence]
