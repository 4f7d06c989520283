"""Paged latent KV cache: ``[num_layers, num_blocks, block_size, Lkv + R]``, every layer's
``[num_blocks, block_size, Lkv + R]`` blocks stacked (a layer's block ``i`` holds the same
tokens in every layer, so one block table serves them all). With ``kv_cache_dtype="fp8"`` it
is a ``kernels.fp8.Fp8Cache`` of three arrays stacked the same way (FlashMLA's layout: kv_c in
float8_e4m3fn with a power-of-two float32 scale per 128 values, k_pe in bf16; 656 bytes a
token and layer at DeepSeek's dims instead of 1152).

A row holds ``concat(kv_c, k_pe)`` of one token. Token ``pos`` of a request lives in block
``block_table[pos // block_size]`` at offset ``pos % block_size``, i.e. at the flat slot
``block_id * block_size + offset``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mla_jax.kernels import fp8

# Slot of padded tokens: out of range for any cache, so their writes are dropped.
PAD_SLOT = np.iinfo(np.int32).max


class CacheFullError(RuntimeError):
    """The block allocator has fewer free blocks than a request needs."""


# The cache dtypes the kernels take: the model's dtype ("auto"), an explicit float one, or
# the scaled FP8 layout. Anything else (float16, int8, a bare float8_* without scales) is
# refused rather than cast silently.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8")


def cache_dtype(name: str, model_dtype) -> jnp.dtype | str:
    """The cache dtype ``name`` stands for with a model of ``model_dtype``: a float dtype,
    or ``"fp8"``. Raises ``ValueError`` naming the value and the accepted ones."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv cache dtype {name!r}: accepted are {', '.join(KV_CACHE_DTYPES)}"
        )
    if name == "fp8":
        return name
    dtype = jnp.dtype(model_dtype if name == "auto" else name)
    if dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(
            f"unsupported kv cache dtype {name!r} (the model's {dtype}): accepted are "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    return dtype


def init_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    width: int,
    dtype=jnp.bfloat16,
    *,
    kv_lora_rank: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> jax.Array | fp8.Fp8Cache:
    """A zeroed ``[num_layers, num_blocks, block_size, width]`` cache of ``dtype`` (bfloat16
    or float32), or for ``dtype="fp8"`` an ``Fp8Cache`` of ``kv_lora_rank`` latent columns
    and ``width - kv_lora_rank`` rope columns, with the same leading axes. ``sharding``:
    where it lives across devices, made in place (a cache split over data-parallel ranks
    may not fit one device whole)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("width", width),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    slots = (num_layers, num_blocks, block_size)
    if isinstance(dtype, str) and dtype == "fp8":
        if kv_lora_rank is None or not 0 < kv_lora_rank < width:
            raise ValueError(f"an fp8 cache needs 0 < kv_lora_rank < {width}, got {kv_lora_rank}")
        return fp8.Fp8Cache(
            jnp.zeros((*slots, kv_lora_rank), fp8.FP8, device=sharding),
            jnp.zeros((*slots, width - kv_lora_rank), fp8.ROPE_DTYPE, device=sharding),
            jnp.ones((*slots, fp8.num_groups(kv_lora_rank)), jnp.float32, device=sharding),
        )
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        raise ValueError(
            f"unsupported cache dtype {jnp.dtype(dtype).name}: accepted are bfloat16, float32 "
            "and 'fp8' (scaled)"
        )
    return jnp.zeros((*slots, width), dtype, device=sharding)


def write_cache(
    cache: jax.Array | fp8.Fp8Cache,
    kv_c: jax.Array,
    k_pe: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: int | jax.Array | None = None,
) -> jax.Array | fp8.Fp8Cache:
    """Writes ``concat(kv_c [T, Lkv], k_pe [T, R])`` to the flat slots ``slot_mapping [T]``
    of ``cache [num_blocks, block_size, width]``, or with ``layer``, of that layer of
    ``cache [L, num_blocks, block_size, width]``. An ``Fp8Cache`` gets kv_c quantized
    (``fp8.quantize``: a scale per group of each token, no calibration) and k_pe in its bf16.

    Tokens whose slot is out of range (``PAD_SLOT``) are dropped. Donate ``cache`` to the
    enclosing jit so that XLA updates it in place.
    """
    if layer is None:
        stacked = jax.tree.map(lambda part: part[None], cache)
        return jax.tree.map(
            lambda part: part[0], write_cache(stacked, kv_c, k_pe, slot_mapping, layer=0)
        )
    if isinstance(cache, fp8.Fp8Cache):
        values, scales = fp8.quantize(kv_c)
        return fp8.Fp8Cache(
            _scatter(cache.kv_c, values, slot_mapping, layer),
            _scatter(cache.k_pe, k_pe, slot_mapping, layer),
            _scatter(cache.scales, scales, slot_mapping, layer),
        )
    rows = jnp.concatenate([kv_c, k_pe], axis=-1)
    return _scatter(cache, rows, slot_mapping, layer)


def as_stored(
    cache: jax.Array | fp8.Fp8Cache, kv_c: jax.Array, k_pe: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``kv_c [T, Lkv]`` and ``k_pe [T, R]`` as a read of ``cache`` gives them back, in their
    own dtypes: rounded to the cache's dtype, or for an ``Fp8Cache`` quantized as
    ``write_cache`` quantizes them and dequantized (exact in bf16) as the kernels read them.
    A prefill's new tokens attend these, so that every read of a token's latent, in its own
    chunk or later from the cache, sees one value: a request's tokens do not depend on how
    its prompt was chunked or whether it was recomputed after a preemption."""
    # The stored values pass an optimization barrier: XLA on GPUs may remove a narrowing
    # convert followed by a widening one (xla_allow_excess_precision), which would hand the
    # prefill its unrounded latents.
    if isinstance(cache, fp8.Fp8Cache):
        values, scales = lax.optimization_barrier(fp8.quantize(kv_c))
        rope = lax.optimization_barrier(k_pe.astype(cache.k_pe.dtype))
        row = fp8.dequantize(values, rope, scales)
        lkv = kv_c.shape[-1]
        return row[..., :lkv].astype(kv_c.dtype), row[..., lkv:].astype(k_pe.dtype)
    stored = lax.optimization_barrier((kv_c.astype(cache.dtype), k_pe.astype(cache.dtype)))
    return stored[0].astype(kv_c.dtype), stored[1].astype(k_pe.dtype)


def _scatter(
    part: jax.Array, rows: jax.Array, slot_mapping: jax.Array, layer: int | jax.Array
) -> jax.Array:
    """``part [L, num_blocks, block_size, C]`` with ``rows [T, C]`` at layer ``layer``'s
    flat slots (out of range: dropped)."""
    num_layers, num_blocks, block_size, width = part.shape
    flat = part.reshape(num_layers, num_blocks * block_size, width)
    flat = flat.at[layer, slot_mapping].set(rows.astype(part.dtype), mode="drop")
    return flat.reshape(part.shape)


class BlockAllocator:
    """Hands out cache block ids ``[0, num_blocks)`` from a free list, and takes back only
    the ones it handed out (a block freed twice would later have two owners)."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids, now held by the caller (``CacheFullError`` when fewer are
        free)."""
        if n > len(self._free):
            raise CacheFullError(
                f"out of KV cache blocks: {n} needed, {len(self._free)} free of {self.num_blocks}"
            )
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for block in taken:
            self._is_free[block] = False
        return taken[::-1]

    def free(self, block_ids: Iterable[int]) -> None:
        """Takes back held blocks (ints or NumPy integers). Refuses (``ValueError``, naming
        the id; nothing is freed) an id it never handed out, one already free, or one given
        twice."""
        ids: list[int] = []
        given: set[int] = set()
        for block in block_ids:
            try:
                block = operator.index(block)
            except TypeError:
                raise ValueError(
                    f"block id {block} ({type(block).__name__}) is not an integer"
                ) from None
            if not 0 <= block < self.num_blocks:
                raise ValueError(
                    f"block {block} is not one of this allocator's blocks [0, {self.num_blocks})"
                )
            if block in given:
                raise ValueError(f"block {block} is given twice")
            if self._is_free[block]:
                raise ValueError(f"block {block} is already free (freed twice?)")
            ids.append(block)
            given.add(block)
        self._free.extend(reversed(ids))
        for block in ids:
            self._is_free[block] = True
