"""``examples/tiny_decoder.py``: a user's own decoder over MLAAttention generates the tokens
and logits of a dense float64 NumPy forward of the same weights, and the README's module
section is that file's marked region, verbatim.

The example fixes its weights (``nnx.Rngs(0)``) and prompts: it is documentation, so the
test checks what a reader runs. float32 through 2 layers and the head: the logits' relative
error is 4.6e-7 and 4.8e-7 (CPU, reference kernels), so the tolerance is 2e-6 (the Pallas
kernels on a GPU sum in another order). The closest top-2 logits differ by 0.015, far above
that: the greedy tokens must match exactly.
"""

from __future__ import annotations

import math
import os
import runpy

import numpy as np
import numpy_ref as ref
import pytest
from conftest import mla_dims, rel_err, split_fused_qkv_a
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(__file__))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_decoder.py")
BEGIN, END = "# --- README begin\n", "# --- README end\n"
TOL = 2e-6


def _region(text: str) -> str:
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def test_readme_module_section_is_the_example():
    with open(EXAMPLE) as f:
        region = _region(f.read())
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## The attention module", 1)[1].split("\n## ", 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == region


@pytest.fixture(scope="module")
def example():
    """The example run as a script would run it (its module-level code generates)."""
    return runpy.run_path(EXAMPLE)


def _params(module) -> dict[tuple[str, ...], np.ndarray]:
    return {
        tuple(str(k) for k in path): np.asarray(var[...], np.float64)
        for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))
    }


def _rms_norm(x, scale):
    """flax's nnx.RMSNorm (epsilon 1e-6)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def _gelu(x):
    """jax.nn.gelu's default (tanh approximation)."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _dense_logits(example, tokens) -> np.ndarray:
    """``[S, vocab]`` logits of the whole sequence ``tokens``, no cache: float64 NumPy."""
    model, cfg = example["model"], example["cfg"]
    blocks = _params(model.blocks)
    dims = mla_dims(cfg)
    x = _params(model.embed)[("embedding",)][tokens]
    for layer in range(example["num_layers"]):
        attn = {path[1]: value[layer] for path, value in blocks.items() if path[0] == "attn"}
        attn = split_fused_qkv_a(attn, cfg)
        normed = _rms_norm(x, blocks[("attn_norm", "scale")][layer])
        x = x + ref.mla(attn, dims, normed, np.arange(len(tokens)))
        normed = _rms_norm(x, blocks[("mlp_norm", "scale")][layer])
        up = normed @ blocks[("up", "kernel")][layer] + blocks[("up", "bias")][layer]
        x = x + _gelu(up) @ blocks[("down", "kernel")][layer] + blocks[("down", "bias")][layer]
    x = _rms_norm(x, _params(model.norm)[("scale",)])
    return x @ _params(model.head)[("kernel",)]


def test_example_generates_the_dense_tokens(example):
    prompts, sampled, logits_of = example["prompts"], example["sampled"], example["logits_of"]
    assert sum(map(len, sampled.values())) >= 8  # the steps sampled what the docs say
    for name, prompt in prompts.items():
        tokens = prompt + sampled[name][:-1]  # the last sampled token was never fed
        want = _dense_logits(example, np.array(tokens))[len(prompt) - 1 :]
        got = np.stack(logits_of[name])
        assert got.dtype == np.float32 and got.shape == want.shape
        assert rel_err(got, want) < TOL, name
        assert sampled[name] == np.argmax(want, axis=-1).tolist(), name
