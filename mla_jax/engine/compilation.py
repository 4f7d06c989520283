"""JAX's persistent compilation cache for the engine's programs, and a count of its hits.

With the cache on, a program compiled once (same model, settings, jax and device) is loaded
from disk by every later process instead of being compiled again.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = 0


def _count_hit(event: str, **_) -> None:
    global _hits
    if event == _CACHE_HIT:
        _hits += 1


jax.monitoring.register_event_listener(_count_hit)


def cache_root() -> str:
    """The project's cache folder: ``$MLA_JAX_CACHE``, else ``~/.cache/mla_jax``."""
    return os.environ.get("MLA_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "mla_jax"
    )


def default_program_dir() -> str:
    """Where compiled programs go by default: ``xla`` in ``cache_root()``."""
    return os.path.join(cache_root(), "xla")


def check_folder(path: str) -> None:
    """Raises ``NotADirectoryError`` naming the file when ``path`` is a file or lies below
    one (``os.makedirs`` would say FileExistsError, or NotADirectoryError without the
    file's name)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"{existing} is a file, not a folder")


def enable_cache(path: str | None = None) -> str:
    """Stores every compiled program under ``path`` (default: ``default_program_dir()``),
    however quick its compilation was, and loads it from there in later processes. Returns
    the folder. JAX's setting is process-wide. Raises ``OSError`` when the folder cannot be
    made (``check_folder``'s error when it is a file or lies below one)."""
    path = path or default_program_dir()
    check_folder(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX opens its cache once, at the first compilation after a folder is set: where one was
    # set before (JAX_COMPILATION_CACHE_DIR in the environment) and a program was compiled,
    # it stays open there, and programs would never be found in ``path``. Closed, it opens
    # here at the next compilation.
    compilation_cache.reset_cache()
    return path


def cache_hits() -> int:
    """Programs loaded from the persistent cache so far in this process."""
    return _hits
