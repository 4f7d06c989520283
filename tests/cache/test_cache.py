from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.cache.latent_cache import (
    PAD_SLOT,
    BlockAllocator,
    CacheFullError,
    init_cache,
    write_cache,
)


def test_write_cache_writes_slots_and_drops_padding(rng):
    cache = jnp.asarray(rng.standard_normal((5, 4, 6)), jnp.float32)
    kv_c = rng.standard_normal((4, 4)).astype(np.float32)
    k_pe = rng.standard_normal((4, 2)).astype(np.float32)
    slots = np.array([7, PAD_SLOT, 0, 19], np.int32)
    out = np.asarray(write_cache(cache, kv_c, k_pe, jnp.asarray(slots))).reshape(20, 6)
    want = np.asarray(cache).reshape(20, 6).copy()
    for i in (0, 2, 3):
        want[slots[i]] = np.concatenate([kv_c[i], k_pe[i]])
    np.testing.assert_array_equal(out, want)


def test_write_cache_stacked_touches_only_its_layer(rng):
    cache = jnp.asarray(rng.standard_normal((3, 5, 4, 6)), jnp.float32)
    kv_c = rng.standard_normal((3, 4)).astype(np.float32)
    k_pe = rng.standard_normal((3, 2)).astype(np.float32)
    slots = np.array([19, PAD_SLOT, 4], np.int32)
    out = np.asarray(write_cache(cache, kv_c, k_pe, jnp.asarray(slots), layer=jnp.int32(1)))
    want = np.asarray(cache).reshape(3, 20, 6).copy()
    for i in (0, 2):
        want[1, slots[i]] = np.concatenate([kv_c[i], k_pe[i]])
    np.testing.assert_array_equal(out.reshape(3, 20, 6), want)


def test_init_cache_shapes():
    cache = init_cache(3, 10, 16, 576, jnp.bfloat16)
    assert cache.shape == (3, 10, 16, 576) and cache.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="num_blocks"):
        init_cache(1, 0, 16, 576)


def test_block_allocator():
    alloc = BlockAllocator(6)
    a = alloc.allocate(4)
    assert len(set(a)) == 4 and alloc.num_free == 2
    with pytest.raises(CacheFullError, match="3 needed, 2 free of 6"):
        alloc.allocate(3)
    alloc.free(a)
    b = alloc.allocate(6)
    assert sorted(b) == list(range(6))


@pytest.mark.parametrize(
    "block_ids,message",
    [
        ([2], "block 2 is already free (freed twice?)"),
        ([0, 1, 0], "block 0 is given twice"),
        ([99], "block 99 is not one of this allocator's blocks [0, 6)"),
        ([-1], "block -1 is not one of this allocator's blocks [0, 6)"),
        ([1.0], "block id 1.0 (float) is not an integer"),
    ],
)
def test_block_allocator_refuses_what_it_does_not_hold(block_ids, message):
    """A double free or a foreign id would hand a block to two owners later; the free is
    refused whole, naming the id, and the allocator is as before."""
    alloc = BlockAllocator(6)
    held = alloc.allocate(2)  # blocks 0 and 1
    with pytest.raises(ValueError) as error:
        alloc.free(block_ids)
    assert str(error.value) == message
    assert alloc.num_free == 4
    alloc.free(np.asarray(held, np.int32).tolist())
    assert sorted(alloc.allocate(6)) == list(range(6))


def test_block_allocator_takes_numpy_ids():
    alloc = BlockAllocator(4)
    alloc.free(np.asarray(alloc.allocate(3), np.int32))
    assert alloc.num_free == 4
