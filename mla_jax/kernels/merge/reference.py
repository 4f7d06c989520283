"""The pure-jnp reference of ``merge_attn_states``: the same signature, easy to read."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_attn_states(
    prefix_out: jax.Array,
    prefix_lse: jax.Array,
    suffix_out: jax.Array,
    suffix_lse: jax.Array,
    *,
    out_dtype=None,
    config=None,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """Combines two attention results over disjoint key sets.

    ``out [T, N, D]``, ``lse [T, N]`` float32 on each side. A ``-inf`` side contributes
    nothing; two ``-inf`` sides give out 0 and lse ``-inf``. out in ``out_dtype`` (default:
    prefix_out's dtype). ``config``, ``interpret``: the Pallas kernel's launch parameters
    and mode; ignored here.
    """
    del config, interpret
    m = jnp.maximum(prefix_lse, suffix_lse)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wp = jnp.exp(prefix_lse - m)
    ws = jnp.exp(suffix_lse - m)
    denom = wp + ws
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = prefix_out.astype(jnp.float32) * (wp * inv)[..., None]
    out += suffix_out.astype(jnp.float32) * (ws * inv)[..., None]
    return out.astype(out_dtype or prefix_out.dtype), m + jnp.log(denom)
