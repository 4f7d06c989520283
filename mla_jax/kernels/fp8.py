"""The FP8 latent cache layout (FlashMLA's "FP8 with scale"), shared by the kernels, their
references and the cache writer.

Per token: the ``Lkv`` latent values ``kv_c`` in float8_e4m3fn with one float32 scale per
``GROUP`` (128) of them, and the ``R`` rope values ``k_pe`` in bfloat16. For DeepSeek's
512 + 64 that is 512 + 4 x 4 + 64 x 2 = 656 bytes a token instead of 1152 in bf16. The three
parts live in three arrays of one ``Fp8Cache`` (Pallas loads typed tiles; a packed byte row
would need bitcasts the Triton lowering does not do); every array is indexed by the same
``[num_blocks, block_size]`` slots, so block tables and slot mappings are unchanged.

Scales are powers of two: the smallest one above ``amax / 448`` of the token's group, so the
group's largest value lands in [224, 448) and nothing saturates. A power of two makes
dequantization exact in bfloat16 (``fp8 x 2^k`` has e4m3's 3 mantissa bits) and lets the
decode kernel apply the scale to scores and probabilities instead of to every cache value,
with no rounding beyond the bf16 path's. Rounding to e4m3 costs at most 2^-4 of a value
(half a unit in the last of 3 mantissa bits) while ``|value| / scale >= 2^-6`` (e4m3's
smallest normal), and at most ``2^-10 x scale`` (half its subnormal spacing, 2^-9) below
that.

``k_pe`` stays bf16: it is not normalized (its range follows the weights and the rotation),
and it is an eighth of the bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP = 128  # latent values per scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = jnp.float8_e4m3fn
ROPE_DTYPE = jnp.bfloat16


class Fp8Cache(NamedTuple):
    """An FP8 latent cache (a pytree: jit, scan, donation and ``tree.map`` see three arrays
    that share their leading axes ``[..., num_blocks, block_size]``; the engine's has a layer
    axis in front, a kernel takes one ``[num_blocks, block_size]``).

    kv_c: ``[..., Lkv]`` float8_e4m3fn, the latent divided by its scale.
    k_pe: ``[..., R]`` bfloat16.
    scales: ``[..., cdiv(Lkv, GROUP)]`` float32 powers of two.
    """

    kv_c: jax.Array
    k_pe: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """``[..., Lkv + R]``: the shape of the bf16 cache it stands for."""
        return (*self.kv_c.shape[:-1], self.kv_c.shape[-1] + self.k_pe.shape[-1])

    @property
    def ndim(self) -> int:
        return self.kv_c.ndim

    @property
    def dtype(self):
        """What it dequantizes to and what the kernels compute in: the rope dtype."""
        return self.k_pe.dtype


# The sizes in bytes, (low, high], of a 1-byte operand that a Pallas Triton kernel would index
# with wrapping offsets (``check_triton_indexable``).
TRITON_WRAPPING_BYTES = (2**31, 2**32)


def wraps_triton_offsets(array: jax.Array) -> bool:
    """Whether a Pallas Triton kernel would index ``array`` with wrapping offsets
    (``check_triton_indexable``): 1-byte values filling (2 GiB, 4 GiB]."""
    itemsize = jnp.dtype(array.dtype).itemsize
    return itemsize == 1 and wraps_triton_bytes(math.prod(array.shape))


def wraps_triton_bytes(nbytes: int) -> bool:
    """Whether ``nbytes`` of 1-byte values fall in ``TRITON_WRAPPING_BYTES``."""
    low, high = TRITON_WRAPPING_BYTES
    return low < nbytes <= high


def check_triton_indexable(array: jax.Array, what: str) -> None:
    """ValueError (one line, naming ``what``) for an operand a Pallas Triton kernel would
    read wrongly: 1-byte values (the FP8 cache's ``kv_c``, FP8 weights) filling more than
    2 GiB and at most 4 GiB. Pallas' Triton lowering (jax 0.10 to 0.12) indexes an operand of
    at most 2^32 bytes with 32-bit offsets, and the GPU sign-extends them, so every element
    past 2^31 would be read from before the array (an illegal address, or silently another
    buffer's bytes). Wider values stay below 2^31 elements there; larger operands get 64-bit
    offsets. The Mosaic GPU kernels address by TMA and have no such limit."""
    if wraps_triton_offsets(array):
        nbytes = math.prod(array.shape) * jnp.dtype(array.dtype).itemsize
        raise ValueError(
            f"{what} {jnp.dtype(array.dtype).name}{list(array.shape)} fills {nbytes} bytes, "
            "within (2 GiB, 4 GiB], where Pallas' Triton lowering indexes 1-byte values with "
            "32-bit offsets that wrap past 2 GiB: make it smaller or larger (a cache's "
            "blocks, a stack's layers)"
        )


def num_groups(lkv: int) -> int:
    """Scales per token for ``lkv`` latent values."""
    return -(-lkv // GROUP)


def quantize(kv_c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``kv_c [..., Lkv]`` (any float dtype) -> ``(fp8 [..., Lkv], scales [..., G] float32)``
    with power-of-two scales per group of ``GROUP`` values (the last group may be short)."""
    lkv = kv_c.shape[-1]
    g = num_groups(lkv)
    x = kv_c.astype(jnp.float32)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, g * GROUP - lkv)])
    amax = jnp.max(jnp.abs(padded.reshape(*x.shape[:-1], g, GROUP)), axis=-1)
    # frexp: amax / 448 = m x 2^e with m in [0.5, 1), so 2^e >= amax / 448 exactly (no log2
    # rounding); an all-zero group gets 2^0. The clip keeps the scale a normal float32.
    _, exponent = jnp.frexp(amax / E4M3_MAX)
    scales = jnp.ldexp(jnp.ones_like(amax), jnp.clip(exponent, -126, 127))
    values = x / jnp.repeat(scales, GROUP, axis=-1)[..., :lkv]
    return values.astype(FP8), scales


def dequantize(kv_c: jax.Array, k_pe: jax.Array, scales: jax.Array) -> jax.Array:
    """``concat(kv_c x scale, k_pe)`` ``[..., Lkv + R]`` in k_pe's dtype (exact: the scales
    are powers of two), from ``kv_c [..., Lkv]`` fp8 and ``scales [..., G]``."""
    lkv = kv_c.shape[-1]
    full = jnp.repeat(scales, GROUP, axis=-1)[..., :lkv]
    latent = (kv_c.astype(jnp.float32) * full).astype(k_pe.dtype)
    return jnp.concatenate([latent, k_pe], axis=-1)
