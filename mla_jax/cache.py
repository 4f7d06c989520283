"""Paged latent KV cache: ``[num_layers, num_blocks, block_size, Lkv + R]``, every layer's
``[num_blocks, block_size, Lkv + R]`` blocks stacked (a layer's block ``i`` holds the same
tokens in every layer, so one block table serves them all).

A row holds ``concat(kv_c, k_pe)`` of one token. Token ``pos`` of a request lives in block
``block_table[pos // block_size]`` at offset ``pos % block_size``, i.e. at the flat slot
``block_id * block_size + offset``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Slot of padded tokens: out of range for any cache, so their writes are dropped.
PAD_SLOT = np.iinfo(np.int32).max


class CacheFullError(RuntimeError):
    """The block allocator has fewer free blocks than a request needs."""


def init_cache(
    num_layers: int, num_blocks: int, block_size: int, width: int, dtype=jnp.bfloat16
) -> jax.Array:
    """A zeroed ``[num_layers, num_blocks, block_size, width]`` cache."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("width", width),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    return jnp.zeros((num_layers, num_blocks, block_size, width), dtype)


def write_cache(
    cache: jax.Array,
    kv_c: jax.Array,
    k_pe: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Writes ``concat(kv_c [T, Lkv], k_pe [T, R])`` to the flat slots ``slot_mapping [T]``
    of ``cache [num_blocks, block_size, width]``, or with ``layer``, of that layer of
    ``cache [L, num_blocks, block_size, width]``.

    Tokens whose slot is out of range (``PAD_SLOT``) are dropped. Donate ``cache`` to the
    enclosing jit so that XLA updates it in place.
    """
    if layer is None:
        return write_cache(cache[None], kv_c, k_pe, slot_mapping, layer=0)[0]
    rows = jnp.concatenate([kv_c, k_pe], axis=-1).astype(cache.dtype)
    num_layers, num_blocks, block_size, width = cache.shape
    flat = cache.reshape(num_layers, num_blocks * block_size, width)
    flat = flat.at[layer, slot_mapping].set(rows, mode="drop")
    return flat.reshape(cache.shape)


class BlockAllocator:
    """Hands out cache block ids from a free list."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"out of KV cache blocks: {n} needed, {len(self._free)} free of {self.num_blocks}"
            )
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
