"""The engine's allocator choice: the scripts' default and the engine's one-line notice."""

from __future__ import annotations

import pytest

from mla_jax.engine import allocator


@pytest.fixture
def fresh(monkeypatch):
    """No allocator chosen, no notice given yet, a GPU backend."""
    monkeypatch.delenv(allocator.VARIABLE, raising=False)
    monkeypatch.setattr(allocator, "_checked", False)
    monkeypatch.setattr(allocator.jax, "default_backend", lambda: "gpu")
    return monkeypatch


def test_prefer_cuda_async_sets_only_an_unset_variable(fresh):
    allocator.prefer_cuda_async()
    assert allocator.os.environ[allocator.VARIABLE] == "cuda_async"
    fresh.setenv(allocator.VARIABLE, "platform")
    allocator.prefer_cuda_async()
    assert allocator.os.environ[allocator.VARIABLE] == "platform"


def test_check_says_once_what_the_default_allocator_costs(fresh):
    said = []
    allocator.check(said.append)
    allocator.check(said.append)
    assert len(said) == 1
    assert said[0].startswith("allocator: XLA_PYTHON_CLIENT_ALLOCATOR=default, not cuda_async:")
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async" in said[0]


@pytest.mark.parametrize("backend, chosen", [("gpu", "cuda_async"), ("cpu", None)])
def test_check_is_silent_under_cuda_async_and_off_the_gpu(fresh, backend, chosen):
    fresh.setattr(allocator.jax, "default_backend", lambda: backend)
    if chosen:
        fresh.setenv(allocator.VARIABLE, chosen)
    said = []
    allocator.check(said.append)
    assert said == []
