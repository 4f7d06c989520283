"""The engine's persistent compilation cache (``mla_jax/engine/compilation.py``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from conftest import SHARED_XLA_CACHE

from mla_jax.engine import compilation


def test_enable_cache_moves_a_cache_jax_opened_elsewhere(tmp_path):
    """JAX opens its cache at the first compilation, in the folder set then (here the tests'
    shared one; for a user, ``JAX_COMPILATION_CACHE_DIR``): ``enable_cache`` moves it, so
    that the programs compiled after it are stored in its folder (before, they went on into
    the first folder and a later process looking in this one found none)."""
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(3.0))  # the cache is open in the shared folder
    path = str(tmp_path / "programs")
    try:
        assert compilation.enable_cache(path) == path
        jax.jit(lambda x: x * 7 - 2)(jnp.arange(5.0))
        assert os.listdir(path), "nothing was stored in the folder enable_cache set"
    finally:
        compilation.enable_cache(SHARED_XLA_CACHE)
