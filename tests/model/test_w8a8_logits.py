"""What w8a8 (``kernels/w8a8_matmul``: activations quantized to e4m3 per token and 128
columns, as DeepSeek's inference runs its FP8 projections) costs in a whole model's logits:
the built-in tiny model with FP8 weights (128 x 128 blocks, random scales), bf16, its
projections on w8a8 wherever the kernel takes them, against the same FP8 model with every
projection on the dequantized weight (the reference kernels), teacher-forced through the
engine (prefill, then decodes). Both variants make the Hopper set's choice of path
(``kernels._hopper_fp8_matmul``); w8a8 runs as its reference, or as the Mosaic GPU kernel
(compiled on a GPU, interpreted elsewhere on jax >= 0.11)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mosaic_gpu_runs, rel_err
from flax import nnx
from teacher_forcing import teacher_forced_logits

from mla_jax import kernels
from mla_jax.checkpoint.tiny import TINY
from mla_jax.engine.engine import EngineConfig
from mla_jax.kernels import fp8_blocks, mosaic_gpu, w8a8_matmul
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.model.layers import Linear


def _w8a8_set(where: str, monkeypatch):
    """The reference kernels with the Hopper set's FP8 matmul as it ships
    (``kernels._hopper_fp8_matmul``: w8a8 where it takes the product, the weight-only path
    elsewhere), w8a8 run as ``where`` says: ``"kernel"``, the Mosaic GPU kernel;
    ``"reference"``, its reference, the choice made as on a GPU on any machine. ``taken``
    records which ``[N, K]`` weights went to w8a8."""
    taken = set()
    run = w8a8_matmul.w8a8_matmul if where == "kernel" else w8a8_matmul.reference.w8a8_matmul

    def spy(x, weight, scale_inv, **kwargs):
        taken.add(tuple(weight.shape[-2:]))
        return run(x, weight, scale_inv, **kwargs)

    monkeypatch.setattr(w8a8_matmul, "w8a8_matmul", spy)
    if where == "reference":
        monkeypatch.setattr(mosaic_gpu, "device_unsupported", lambda: None)
    return kernels.REFERENCE._replace(fp8_matmul=kernels.MOSAIC_GPU.fp8_matmul), taken


def _fp8_tiny_model(rng) -> DeepseekModel:
    """The tiny model, bf16, FP8 projections with random power-of-two block scales (so that
    each block's scale is in play; the weights' values as initialised, in e4m3)."""
    model = DeepseekModel(TINY, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=(128, 128))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.blocks is not None:
            shape = node.weight_scale_inv.shape
            node.weight_scale_inv[...] = jnp.asarray(2.0 ** rng.integers(-1, 2, shape), jnp.float32)
    return model


@pytest.mark.parametrize("where", ["reference", pytest.param("kernel", marks=mosaic_gpu_runs)])
def test_w8a8_logit_error_against_the_dequantized_model(rng, where, monkeypatch):
    """The logits' relative L2 error (printed), within 7-14%. Each variant draws its own
    scales and tokens (``rng`` follows the test's id): the reference's gave 8.87% (8.7-9.1%
    over four MLA_TEST_SEEDs), the kernel's 11.20% interpreted and 11.37% compiled (H100,
    2026-12-06); on one set of inputs the reference and the interpreted kernel both gave
    11.34%. The e4m3 rounding of each projection's input is what w8a8 changes: 2.5% a
    product (``test_w8a8_matmul.py``), over ten products in two layers of random weights."""
    if where == "reference" and jax.default_backend() == "gpu":
        # Jitted whole on an H100 the reference's logits equaled the dequantized model's
        # (error 0.0, 2026-12-06): XLA's GPU compiler may drop x's round trip through e4m3
        # (its excess-precision rule; inferred, not checked). The kernel's x is e4m3 itself.
        pytest.skip("the reference's rounding of x is measured on the CPU")
    if where == "kernel" and w8a8_matmul.unsupported(
        jnp.zeros((1, 128), jnp.bfloat16),
        jnp.zeros((128, 128), fp8_blocks.FP8),
        jnp.ones((1, 1), jnp.float32),
    ):
        pytest.skip("the w8a8 kernel does not run here")
    model = _fp8_tiny_model(rng)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 19)]
    forced = [rng.integers(0, TINY.vocab_size, 4).tolist() for _ in prompts]
    config = dict(block_size=16, num_blocks=8, max_num_batched_tokens=32, workspace_size=32)
    w8a8_set, taken = _w8a8_set(where, monkeypatch)
    want, _ = teacher_forced_logits(
        model, EngineConfig(impl=kernels.REFERENCE, **config), prompts, forced
    )
    got, _ = teacher_forced_logits(model, EngineConfig(impl=w8a8_set, **config), prompts, forced)
    # q_b_proj [1024, 128], o_proj and down_proj [256, 512], gate_proj and up_proj [512,
    # 256]; fused_qkv_a_proj's 288 rows are not whole blocks.
    assert taken == {(1024, 128), (256, 512), (512, 256)}
    error = rel_err(np.concatenate(got), np.concatenate(want))
    print(f"w8a8 ({where}): logits' relative L2 error against the dequantized model {error:.2%}")
    assert 0.07 < error < 0.14, error
