"""Argument checks at ``MLAAttention``'s boundary: each error names the argument at fault.

They run on shapes, dtypes and static fields at trace time (free under jit); the one check
that needs values (enough packed rows) runs only when the metadata is concrete.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from mla_jax import kernels
from mla_jax.cache.metadata import AttentionMetadata
from mla_jax.cache.packing import PackedMetadata
from mla_jax.kernels.fp8 import Fp8Cache
from mla_jax.model.config import MLAConfig

# Cache dtypes the kernels read (the references read any float; the Pallas kernels these).
# An FP8 cache (``Fp8Cache``) passes as the bf16 it dequantizes to (its ``dtype``).
CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_hidden(cfg: MLAConfig, x: jax.Array) -> None:
    """``x`` is ``[T, H]`` hidden states of the layer's width."""
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"x must be [tokens, hidden_size={cfg.hidden_size}], got shape {tuple(x.shape)}"
        )


def check_packed(x: jax.Array, metadata: PackedMetadata) -> None:
    """``x`` holds the packed tokens: at least the step's real ones, at most its bucket."""
    rows = x.shape[0]
    if rows > metadata.num_tokens:
        raise ValueError(
            f"x has {rows} packed rows, more than the {metadata.num_tokens} tokens of the "
            "metadata's bucket: x and metadata belong to different steps"
        )
    if isinstance(metadata.attention.slot_mapping, jax.core.Tracer):
        return
    real = metadata.num_real_tokens()
    if rows < real:
        raise ValueError(f"x has {rows} packed rows; the metadata's step has {real} tokens")


def check_layer(layer: int | jax.Array, num_layers: int) -> None:
    """A concrete ``layer`` indexes one of the stacked cache's ``num_layers`` (past them,
    the write would be dropped and the decode would read zeros); a traced one, as in a scan
    over the layers, is the caller's to keep in range."""
    if isinstance(layer, jax.core.Tracer):
        return
    try:
        index = operator.index(layer)
    except TypeError:
        raise ValueError(
            f"layer must be an integer (or a traced integer index), got {layer} "
            f"({type(layer).__name__})"
        ) from None
    if not 0 <= index < num_layers:
        raise ValueError(
            f"layer {index} is outside the stacked cache's {num_layers} layers [0, {num_layers})"
        )


def check_step(
    cfg: MLAConfig,
    x: jax.Array,
    cache: jax.Array | Fp8Cache,
    metadata: AttentionMetadata,
    *,
    layer: int | jax.Array | None,
    kernel_set: kernels.KernelSet,
) -> None:
    """``x`` in ``metadata``'s bucket layout, ``cache`` the geometry ``metadata`` was built
    for and of this module's width, and the Pallas kernels' schedules present."""
    check_hidden(cfg, x)
    if x.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} rows but metadata lays out {metadata.num_tokens} (its token "
            "bucket): metadata was built for other requests or buckets (pass packed tokens "
            "with packing.PackedMetadata to have the module lay them out)"
        )
    expected_ndim = 3 if layer is None else 4
    if cache.ndim != expected_ndim:
        layout = "[num_blocks, block_size, width]"
        if layer is not None:
            layout = "[num_layers, num_blocks, block_size, width] (a stacked cache, with layer)"
        raise ValueError(f"cache must be {layout}, got shape {tuple(cache.shape)}")
    if layer is not None:
        check_layer(layer, cache.shape[0])
    if cache.shape[-1] != cfg.cache_width:
        raise ValueError(
            f"cache rows are {cache.shape[-1]} wide; this module's are kv_lora_rank + "
            f"qk_rope_head_dim = {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} = {cfg.cache_width}"
        )
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"cache dtype {cache.dtype} is not supported ("
            + " or ".join(str(d) for d in CACHE_DTYPES)
            + ")"
        )
    num_blocks, block_size = cache.shape[-3:-1]
    if (block_size, num_blocks) != (metadata.block_size, metadata.num_blocks):
        raise ValueError(
            f"metadata was built for block_size={metadata.block_size}, "
            f"num_blocks={metadata.num_blocks}; the cache has {num_blocks} blocks of "
            f"{block_size}"
        )
    if kernel_set.backend != "reference":
        for part in (metadata.decode, metadata.prefill):
            if part is not None and part.schedule is None:
                raise ValueError(
                    "metadata has no kernel schedules (built without kernel_plan), which the "
                    "Pallas kernels need to balance their work: build it with "
                    "packing.packed_metadata(..., impl=...) or build_metadata(..., "
                    "kernel_plan=kernels.KernelPlan.for_device(num_heads))"
                )
