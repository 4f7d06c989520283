"""Cache blocks with automatic prefix caching: blocks are shared by content and kept after use.

A *full* block (``block_size`` tokens whose latent rows are in the cache) can be known by its
content: its token ids and everything before them. Its key is ``(parent, token_ids)``, where
``parent`` is the content id of the block before it (``NO_PARENT`` for a sequence's first
block); a content id is a serial number given to each distinct content when it is first
cached and never given again. The keys chain like vLLM's block hashes, but exactly: the
dictionary that finds a key hashes it and then compares it whole, token ids and parent, so
two contents whose hashes collide never match, and no content id stands for two prefixes.

Each block has a reference count (the sequences holding it). A cached block whose count
drops to 0 stays cached, in a least-recently-used order, until the allocator needs a block
and no uncached one is free: then the least recently used cached block is evicted (its
content forgotten) and handed out. A block in use is never evicted. A sequence releases its
blocks last to first, so that a prefix's tail is evicted before its head, which more
sequences share.

A sequence never writes into a block it shares: it shares only full blocks of its prefix
and writes its own tokens after them, so a cached block's rows stay those of its content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mla_jax.cache.latent_cache import BlockAllocator, CacheFullError

NO_PARENT = -1  # the parent content id of a sequence's first block

BlockKey = tuple[int, tuple[int, ...]]  # (parent content id, the block's token ids)


class BlockManager:
    """Hands out cache block ids, reference-counted; with ``enable_caching``, keeps full
    blocks by content for later sequences (``match``, ``acquire``, ``cache``).

    Args:
      num_blocks: blocks of the cache (ids ``0 .. num_blocks - 1``).
      block_size: tokens a block holds.
      enable_caching: False: a released block is free at once and nothing is matched.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self._uncached = BlockAllocator(num_blocks)  # free blocks holding no cached content
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks  # of a cached block
        self._content: list[int] = [NO_PARENT] * num_blocks  # content id of a full block
        self._cached: dict[BlockKey, int] = {}  # key -> the block that holds it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self._next_content = 0
        self.evictions = 0  # cached blocks given other data

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds: free ones and cached ones that may be evicted."""
        return self._uncached.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is kept for matching (held or not)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one sequence (reference count 1): free ones first, then the
        least recently used cached ones, evicted. Raises ``CacheFullError`` when fewer than
        ``n`` are not held."""
        if n > self.num_free:
            raise CacheFullError(
                f"out of KV cache blocks: {n} needed, {self.num_free} free of {self.num_blocks}"
            )
        taken = self._uncached.allocate(min(n, self._uncached.num_free))
        while len(taken) < n:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[block]]
            self._key[block] = None
            self.evictions += 1
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
            self._content[block] = NO_PARENT
        return taken

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``token_ids`` made of whole cached
        blocks (a trailing partial block is never matched); not acquired."""
        if not self.enable_caching:
            return []
        size, blocks, parent = self.block_size, [], NO_PARENT
        for start in range(0, len(token_ids) - size + 1, size):
            block = self._cached.get((parent, tuple(token_ids[start : start + size])))
            if block is None:
                break
            blocks.append(block)
            parent = self._content[block]
        return blocks

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more sequence holds ``block_ids`` (cached blocks from ``match``): they leave
        the eviction order while held."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def cache(
        self, block_ids: Sequence[int], token_ids: Sequence[int], parent_block: int | None
    ) -> None:
        """Records that full blocks ``block_ids`` hold ``token_ids`` (``block_size`` each,
        in order) after the content of ``parent_block`` (None: they start a sequence). A
        content another block already holds stays with that block: the duplicate takes its
        content id, so the blocks after it chain on, and is freed, not kept, when released."""
        if not self.enable_caching:
            return
        if len(token_ids) != len(block_ids) * self.block_size:
            raise ValueError(
                f"{len(token_ids)} token ids for {len(block_ids)} blocks of {self.block_size}"
            )
        parent = NO_PARENT if parent_block is None else self._content[parent_block]
        if parent_block is not None and parent == NO_PARENT:
            raise ValueError(f"parent block {parent_block} holds no cached content")
        size = self.block_size
        for i, block in enumerate(block_ids):
            key = (parent, tuple(token_ids[i * size : (i + 1) * size]))
            holder = self._cached.get(key)
            if holder is None:
                self._cached[key] = block
                self._key[block] = key
                self._content[block] = parent = self._next_content
                self._next_content += 1
            else:
                self._content[block] = parent = self._content[holder]

    def release(self, block_ids: Sequence[int]) -> None:
        """One sequence less holds ``block_ids``, last to first: a block no sequence holds
        becomes evictable if cached, else free."""
        for block in reversed(block_ids):
            if self._refs[block] == 0:
                raise ValueError(f"block {block} released more often than it was held")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._content[block] = NO_PARENT
                self._uncached.free([block])
