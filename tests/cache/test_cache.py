from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.cache.latent_cache import (
    PAD_SLOT,
    BlockAllocator,
    CacheFullError,
    as_stored,
    init_cache,
    write_cache,
)
from mla_jax.kernels import fp8


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


@pytest.mark.parametrize("dtype", ["fp8", jnp.bfloat16, jnp.float32])
def test_as_stored_is_what_a_read_of_the_cache_gives(rng, dtype):
    """``as_stored`` gives float32 kv_c and k_pe exactly as written rows read back: rounded
    to bf16, quantized to FP8 with its scales (and k_pe to bf16), or unchanged in float32."""
    lkv, r = 200, 8  # two scale groups, the second short
    stacked = init_cache(1, 3, 4, lkv + r, dtype, kv_lora_rank=lkv)
    cache = jax.tree.map(lambda part: part[0], stacked)
    kv_c = jnp.asarray(rng.standard_normal((5, lkv)) * 3.0, jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((5, r)), jnp.float32)
    slots = jnp.asarray(rng.permutation(12)[:5], jnp.int32)
    written = write_cache(cache, kv_c, k_pe, slots)
    if dtype == "fp8":
        rows = fp8.dequantize(written.kv_c, written.k_pe, written.scales).reshape(12, lkv + r)
    else:
        rows = written.reshape(12, lkv + r)
    stored_kv_c, stored_k_pe = as_stored(cache, kv_c, k_pe)
    assert stored_kv_c.dtype == stored_k_pe.dtype == jnp.float32
    got = np.concatenate([stored_kv_c, stored_k_pe], axis=-1)
    np.testing.assert_array_equal(got, np.asarray(rows[slots], np.float32))
    if dtype != jnp.float32:
        assert (got != np.concatenate([kv_c, k_pe], axis=-1)).any()  # it did round
