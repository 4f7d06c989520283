"""The README's kernel snippets run as they are (interpreted on a CPU, compiled on a GPU);
each checks its kernel against the pure-jnp reference itself."""

from __future__ import annotations

import os

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def _kernel_snippets() -> list[str]:
    with open(README) as f:
        section = f.read().split("\n## Kernels\n", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]


def test_every_kernel_has_a_snippet():
    snippets = _kernel_snippets()
    for call in ("decode.mla_decode(", "prefill.flash_prefill(", "merge.merge_attn_states("):
        assert sum(call in snippet for snippet in snippets) == 1, call


@pytest.mark.parametrize("index", range(3))
def test_kernel_snippet_runs(index):
    exec(compile(_kernel_snippets()[index], f"README kernel snippet {index}", "exec"), {})
