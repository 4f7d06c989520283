"""The device allocator the engine runs best under on a GPU: CUDA's stream-ordered pool
(``cudaMallocAsync``, JAX's ``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``).

XLA runs a program's kernels as CUDA graphs, and re-records a graph whenever a buffer it
holds has moved since its last run. A decode window's loop body is one graph of about 600
commands; besides the weights and the cache, which stay put, it holds the program's
temporary buffer (the runner keeps the program's input and outputs out of it), and under
JAX's default BFC allocator one of its buffers moved every window (XLA's command-buffer
log). Re-recording the body (its cuBLAS calls traced again) took 2.4-6.3 ms a window on
an H100, more host time than a window's 8 steps of a small batch leave. Under the
stream-ordered pool no buffer of the body moves and it is recorded once (``bench_serve.py``,
V2-Lite-shaped model, windows of 8, an H100, 2026-12-05: the window's call 0.6-0.8 -> 0.21 ms
a step at 1 x 512 and 1.2-1.6 -> 0.38 ms at 64 x 512, three runs under BFC against one).

JAX reads the variable when it starts its GPU backend, so the entry point sets it before
any array exists (``prefer_cuda_async``); the engine says once when it runs on a GPU
without it (``check``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax

VARIABLE = "XLA_PYTHON_CLIENT_ALLOCATOR"
CUDA_ASYNC = "cuda_async"
_checked = False


def prefer_cuda_async() -> None:
    """Sets ``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async`` unless it is set already. Call it
    before JAX starts its backend (before any array or device query); later it changes
    nothing."""
    os.environ.setdefault(VARIABLE, CUDA_ASYNC)


def chosen() -> str:
    """The allocator JAX starts (or started) its GPU backend with: the variable's value, or
    ``default`` (BFC)."""
    return os.environ.get(VARIABLE, "default")


def check(log: Callable[[str], None]) -> None:
    """On a GPU whose allocator is not the stream-ordered pool, says once through ``log``
    what that costs and how to choose it."""
    global _checked
    if _checked or jax.default_backend() != "gpu":
        return
    _checked = True
    if chosen() != CUDA_ASYNC:
        log(
            f"allocator: {VARIABLE}={chosen()}, not {CUDA_ASYNC}: under JAX's default (BFC) "
            "a decode window's CUDA graph is re-recorded every window, milliseconds of host "
            f"time; set {VARIABLE}={CUDA_ASYNC} before JAX starts "
            "(mla_jax.engine.allocator.prefer_cuda_async)"
        )
