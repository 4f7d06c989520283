"""The pure-jnp reference of ``skinny_matmul``: the same signature, one dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .pallas_mosaic_gpu import check


def skinny_matmul(
    x: jax.Array, weight: jax.Array, *, layer: int | None = None, config=None, interpret=None
) -> jax.Array:
    """``x @ weight`` (``x @ weight[layer]`` for a stacked weight).

    Args:
      x: ``[M, K]`` bfloat16, M up to ``MAX_ROWS``.
      weight: ``[K, N]`` bfloat16, or ``[L, K, N]`` with ``layer`` (static) in ``[0, L)``.
      config, interpret: the kernel's launch and mode; ignored here.

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32.
    """
    del config, interpret
    check(x, weight, layer)
    if layer is not None:
        weight = weight[layer]
    return jnp.dot(x, weight, preferred_element_type=jnp.float32).astype(x.dtype)
