"""Reading the paged cache through a block table, the way the references and the model's
context gather do (the Pallas kernels address pages themselves)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fp8


def gather_rows(
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    requests: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """Cache rows of (request, position) pairs through the block table.

    ``kv_cache [num_blocks, block_size, width]``, or an ``fp8.Fp8Cache`` whose rows come
    back dequantized (``concat(kv_c x scale, k_pe)``, exact in its bf16); ``block_table
    [R, W]`` int32; ``requests``, ``positions`` and ``valid`` share a shape ``S``. Returns
    ``[*S, width]``, zero where not ``valid``: those pairs address no cache row (an
    out-of-range slot read in fill mode), so stale rows and padded table entries (-1, any
    id) never reach the arithmetic.
    """
    num_blocks, block_size, _ = kv_cache.shape
    page = block_table[requests, jnp.where(valid, positions // block_size, 0)]
    slot = jnp.where(valid, page * block_size + positions % block_size, num_blocks * block_size)

    def gather(part: jax.Array) -> jax.Array:
        rows = part.reshape(num_blocks * block_size, part.shape[-1])
        return rows.at[slot].get(mode="fill", fill_value=0)

    if isinstance(kv_cache, fp8.Fp8Cache):
        return fp8.dequantize(*map(gather, kv_cache))
    return gather(kv_cache)
