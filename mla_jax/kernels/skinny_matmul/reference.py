"""The pure-jnp reference of ``skinny_matmul``: the same signature, one dot (an FP8 weight
dequantized first, as ``fp8_matmul``'s reference does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import fp8_blocks as _fp8_blocks
from .. import matmul_steps
from .pallas_mosaic_gpu import check


def skinny_matmul(
    x: jax.Array,
    weight: jax.Array,
    *,
    scale_inv: jax.Array | None = None,
    blocks: _fp8_blocks.Fp8Blocks | None = None,
    layer: int | jax.Array | None = None,
    config=None,
    interpret=None,
) -> jax.Array:
    """``x @ weight`` (``x @ weight[layer]`` for a stacked weight; ``x @ dequantize(weight,
    scale_inv)`` for an FP8 one, dequantized into bfloat16).

    Args:
      x: ``[M, K]`` bfloat16, M up to ``MAX_ROWS``.
      weight: ``[K, N]`` bfloat16 or float8_e4m3fn, or ``[L, K, N]`` with ``layer``, an
        int32 scalar in ``[0, L)`` (may be traced).
      scale_inv, blocks: a float8_e4m3fn weight's float32 block scales and their block
        sizes; None for bfloat16.
      config, interpret: the kernel's launch and mode; ignored here.

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32.
    """
    del config, interpret
    check(x, weight, layer, scale_inv, blocks)
    weight, scale_inv = matmul_steps.layer_of(weight, scale_inv, layer)
    if blocks is not None:
        weight = _fp8_blocks.dequantize(weight, scale_inv, blocks, x.dtype)
    return jnp.dot(x, weight, preferred_element_type=jnp.float32).astype(x.dtype)
