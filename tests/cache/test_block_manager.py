"""The block manager (``mla_jax/cache/block_manager.py``): blocks matched by content through
the key chain, reference counts, eviction of unused cached blocks least recently used first,
never of a block in use; against a fake cache that records what each block holds."""

from __future__ import annotations

import numpy as np
import pytest

from mla_jax.cache.block_manager import BlockManager
from mla_jax.cache.latent_cache import CacheFullError

SIZE = 4


def _sequence(manager: BlockManager, tokens: list[int], fake: dict[int, tuple]) -> list[int]:
    """A sequence's life until release: it takes the cached prefix of ``tokens`` (leaving
    one token to compute), allocates the rest, "writes" each new block into ``fake`` (the
    prefix up to its end: what its rows depend on), caches its full blocks; returns its
    blocks (held)."""
    limit = (len(tokens) - 1) // SIZE * SIZE
    blocks = manager.match(tokens[:limit])
    manager.acquire(blocks)
    new = manager.allocate(-(-len(tokens) // SIZE) - len(blocks))
    for i, block in enumerate(new, start=len(blocks)):
        fake[block] = tuple(tokens[: (i + 1) * SIZE])
    full = len(tokens) // SIZE
    parent = blocks[-1] if blocks else None
    manager.cache(new[: full - len(blocks)], tokens[len(blocks) * SIZE : full * SIZE], parent)
    return blocks + new


def test_match_takes_the_longest_chain_of_whole_blocks():
    manager, fake = BlockManager(16, SIZE), {}
    tokens = list(range(10, 24))  # 3 full blocks and 2 tokens
    blocks = _sequence(manager, tokens, fake)
    assert manager.num_cached == 3
    assert manager.match(tokens) == blocks[:3]  # the partial block is never matched
    assert manager.match(tokens[:11]) == blocks[:2]
    assert manager.match(tokens[:3]) == []
    diverging = tokens[:6] + [99] + tokens[7:]  # differs inside the second block
    assert manager.match(diverging) == blocks[:1]
    # The same second block after another cached first block: a different content.
    other = _sequence(manager, [0, 1, 2, 3, 4], fake)
    assert manager.match([0, 1, 2, 3] + tokens[4:]) == other[:1]


def test_a_hash_collision_never_matches():
    """Python hashes the ints 0 and 2**61 - 1 alike, so the two keys below hash alike; the
    dictionary compares the token ids and tells them apart."""
    manager, fake = BlockManager(8, SIZE), {}
    tokens = [0, 1, 2, 3, 4]
    colliding = [2**61 - 1, 1, 2, 3, 4]
    assert hash((-1, tuple(tokens[:4]))) == hash((-1, tuple(colliding[:4])))
    blocks = _sequence(manager, tokens, fake)
    assert manager.match(colliding) == []
    assert manager.match(tokens) == blocks[:1]


def test_shared_blocks_are_counted_and_evicted_only_when_unused():
    manager, fake = BlockManager(6, SIZE), {}
    a = list(range(100, 113))  # 3 full blocks + 1 token: 4 blocks
    first = _sequence(manager, a, fake)
    second = _sequence(manager, a[:12] + [7, 8], fake)  # shares the first 3 blocks
    assert second[:3] == first[:3] and manager.num_free == 6 - 5
    manager.release(first)
    assert manager.num_free == 2  # first's own partial block; the shared ones still held
    with pytest.raises(CacheFullError, match="3 needed, 2 free of 6"):
        manager.allocate(3)
    manager.release(second)
    assert manager.num_free == 6 and manager.num_cached == 3
    # Every block goes, the cached ones evicted: the uncached free ones first.
    everything = manager.allocate(6)
    assert sorted(everything) == list(range(6)) and manager.evictions == 3
    assert manager.num_cached == 0 and manager.match(a) == []


def test_eviction_takes_the_least_recently_used_tail_first():
    manager, fake = BlockManager(8, SIZE), {}
    old, new = list(range(0, 13)), list(range(50, 63))  # 4 blocks each, 3 full
    old_blocks = _sequence(manager, old, fake)
    manager.release(old_blocks)
    new_blocks = _sequence(manager, new, fake)
    manager.release(new_blocks)
    # Free: the two partial blocks; cached: old's 3 (older), then new's 3.
    manager.allocate(2)  # the free ones: nothing evicted
    assert manager.evictions == 0
    manager.allocate(1)  # the least recently used: old's last full block
    assert manager.match(old) == old_blocks[:2] and manager.match(new) == new_blocks[:3]
    # A match taken and released again is the most recently used.
    manager.acquire(manager.match(old))
    manager.release(old_blocks[:2])
    manager.allocate(3)  # new's 3, tail first
    assert manager.match(new) == [] and manager.match(old) == old_blocks[:2]


def test_evicted_blocks_hold_other_data_and_are_not_matched():
    manager, fake = BlockManager(4, SIZE), {}
    a = list(range(20, 29))  # 2 full blocks + 1 token
    manager.release(_sequence(manager, a, fake))
    b = list(range(70, 85))  # 4 blocks: every block, the cached ones evicted
    b_blocks = _sequence(manager, b, fake)
    assert manager.evictions == 2 and manager.match(a) == []
    manager.release(b_blocks)
    assert [fake[block] for block in manager.match(b)] == [tuple(b[:n]) for n in (4, 8, 12)]


def test_a_duplicate_content_stays_with_its_first_block():
    """Two sequences computing the same prefix at once: the second's blocks are duplicates,
    freed on release; blocks cached after a duplicate chain on to the same content."""
    manager = BlockManager(8, SIZE)
    tokens = list(range(30, 39))  # 2 full blocks + 1
    first = manager.allocate(3)
    second = manager.allocate(3)
    manager.cache(first[:1], tokens[:4], None)
    manager.cache(second[:1], tokens[:4], None)  # a duplicate of first[0]
    manager.cache(second[1:2], tokens[4:8], second[0])  # chains on the shared content
    assert manager.match(tokens) == [first[0], second[1]]
    manager.release(second)
    # second[0] and second[2] are free, second[1] cached; first's 3 are held.
    assert manager.num_cached == 2 and manager.num_free == 8 - 3
    assert manager.match(tokens) == [first[0], second[1]]


def test_without_caching_blocks_are_free_at_release():
    manager, fake = BlockManager(4, SIZE, enable_caching=False), {}
    tokens = list(range(9))
    blocks = _sequence(manager, tokens, fake)
    assert manager.num_cached == 0
    manager.release(blocks)
    assert manager.match(tokens) == [] and manager.num_free == 4


def test_bad_calls_are_refused():
    manager = BlockManager(4, SIZE)
    blocks = manager.allocate(2)
    with pytest.raises(ValueError, match="5 token ids for 1 blocks of 4"):
        manager.cache(blocks[:1], [1, 2, 3, 4, 5], None)
    with pytest.raises(ValueError, match=f"parent block {blocks[0]} holds no cached content"):
        manager.cache(blocks[1:], [1, 2, 3, 4], blocks[0])
    manager.release(blocks)
    with pytest.raises(ValueError, match="released more often than it was held"):
        manager.release(blocks[:1])
    with pytest.raises(ValueError, match="block_size must be > 0"):
        BlockManager(4, 0)


def test_random_sequences_only_ever_match_their_own_content(rng):
    """Sequences (a random part of one of 4 stems, then random tokens, all from 3 token
    ids, so that prefixes and blocks repeat) start, finish and overlap at random in a cache
    too small for them all: every matched block holds exactly the prefix it is matched for,
    no held block is handed out again, and the counts add up."""
    manager, fake = BlockManager(12, SIZE), {}
    stems = rng.integers(0, 3, (4, 14)).tolist()
    held: list[list[int]] = []
    matched_blocks = 0
    for _ in range(400):
        if held and (rng.random() < 0.45 or manager.num_free < 4):
            manager.release(held.pop(int(rng.integers(len(held)))))
            continue
        stem = stems[int(rng.integers(4))][: int(rng.integers(15))]
        tokens = stem + rng.integers(0, 3, int(rng.integers(1, 15 - len(stem) + 1))).tolist()
        in_use = {block for blocks in held for block in blocks}
        match = manager.match(tokens)
        for i, block in enumerate(match):
            assert fake[block] == tuple(tokens[: (i + 1) * SIZE])
        matched_blocks += len(match)
        taken = len(manager.match(tokens[: (len(tokens) - 1) // SIZE * SIZE]))
        blocks = _sequence(manager, tokens, fake)
        assert not in_use & set(blocks[taken:])
        held.append(blocks)
        refs = np.bincount([b for blocks in held for b in blocks], minlength=12)
        assert manager.num_free == int((refs == 0).sum())
    assert matched_blocks > 50 and manager.evictions > 50
