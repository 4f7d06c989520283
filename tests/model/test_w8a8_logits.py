"""What w8a8 (``kernels/w8a8_matmul``: activations quantized to e4m3 per token and 128
columns, as DeepSeek's inference runs its FP8 projections) costs in a whole model's logits:
the built-in tiny model with FP8 weights (128 x 128 blocks, random scales), bf16, its
projections on w8a8 wherever the kernel takes them, against the same FP8 model with every
projection on the dequantized weight (the reference kernels), teacher-forced through the
engine (prefill, then decodes); and the same for a mixture-of-experts variant of it, its
routed experts on w8a8's grouped form. Both variants make the Hopper set's choice of path
(``kernels._hopper_fp8_matmul``, ``kernels._hopper_grouped_matmul``); w8a8 runs as its
reference, or as the Mosaic GPU kernel (compiled on a GPU, interpreted elsewhere on jax >=
0.11)."""

from __future__ import annotations

import dataclasses

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
from mla_jax.model.config import MoEConfig
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.model.layers import Linear
from mla_jax.model.moe import Experts

# The tiny model with its second layer a mixture of experts whose widths are whole 128 x
# 128 blocks (w8a8 takes them): 8 experts of 128, top 2, one shared expert.
TINY_MOE = dataclasses.replace(
    TINY,
    first_k_dense_replace=1,
    n_routed_experts=8,
    moe=MoEConfig(
        hidden_size=TINY.mla.hidden_size,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
)


def _w8a8_set(where: str, monkeypatch):
    """The reference kernels with the Hopper set's FP8 matmul as it ships
    (``kernels._hopper_fp8_matmul``: w8a8 where it takes the product, the weight-only path
    elsewhere), w8a8 run as ``where`` says: ``"kernel"``, the Mosaic GPU kernel;
    ``"reference"``, its reference, the choice made as on a GPU on any machine. ``taken``
    records which ``[N, K]`` weights went to w8a8 (the experts' as ``("experts", N, K)``).
    The routed experts take the Hopper set's grouped matmul too."""
    taken = set()
    source = w8a8_matmul if where == "kernel" else w8a8_matmul.reference

    def spy(name, tag):
        run = getattr(source, name)

        def spied(x, weight, *args, **kwargs):
            taken.add((*tag, *weight.shape[-2:]))
            return run(x, weight, *args, **kwargs)

        monkeypatch.setattr(w8a8_matmul, name, spied)

    spy("w8a8_matmul", ())
    spy("grouped_w8a8_matmul", ("experts",))
    if where == "reference":
        monkeypatch.setattr(mosaic_gpu, "device_unsupported", lambda: None)
    # w8a8 at every row count: the decode steps' two rows of these shallow projections
    # would go to the weight-only kernel (``w8a8_matmul.pays_off``).
    monkeypatch.setattr(w8a8_matmul, "FEW_ROWS", 0)
    hopper = kernels.MOSAIC_GPU
    w8a8_set = kernels.REFERENCE._replace(
        fp8_matmul=hopper.fp8_matmul, grouped_matmul=hopper.grouped_matmul
    )
    return w8a8_set, taken


def _fp8_tiny_model(rng, cfg=TINY) -> DeepseekModel:
    """The tiny model (of ``cfg``), bf16, FP8 projections and experts with random
    power-of-two block scales (so that each block's scale is in play; the weights' values as
    initialised, in e4m3)."""
    model = DeepseekModel(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=(128, 128))

    def randomize(scales):
        scales[...] = jnp.asarray(2.0 ** rng.integers(-1, 2, scales.shape), jnp.float32)

    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.blocks is not None:
            randomize(node.weight_scale_inv)
        if isinstance(node, Experts) and node.fp8_blocks is not None:
            randomize(node.gate_up_proj_scale_inv)
            randomize(node.down_proj_scale_inv)
    return model


def _logit_error(rng, where, monkeypatch, cfg) -> tuple[float, set]:
    """The teacher-forced logits' relative L2 error of the model of ``cfg`` with w8a8 run as
    ``where`` says, against the dequantized model, and the weights w8a8 took."""
    model = _fp8_tiny_model(rng, cfg)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 19)]
    forced = [rng.integers(0, cfg.vocab_size, 4).tolist() for _ in prompts]
    config = dict(block_size=16, num_blocks=8, max_num_batched_tokens=32, workspace_size=32)
    w8a8_set, taken = _w8a8_set(where, monkeypatch)
    want, _ = teacher_forced_logits(
        model, EngineConfig(impl=kernels.REFERENCE, **config), prompts, forced
    )
    got, _ = teacher_forced_logits(model, EngineConfig(impl=w8a8_set, **config), prompts, forced)
    return rel_err(np.concatenate(got), np.concatenate(want)), taken


def _skip_where_it_cannot_run(where):
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


@pytest.mark.parametrize("where", ["reference", pytest.param("kernel", marks=mosaic_gpu_runs)])
def test_w8a8_logit_error_against_the_dequantized_model(rng, where, monkeypatch):
    """The logits' relative L2 error (printed), within 7-14%. Each variant draws its own
    scales and tokens (``rng`` follows the test's id): the reference's gave 8.87% (8.7-9.1%
    over four MLA_TEST_SEEDs), the kernel's 11.20% interpreted and 11.37% compiled (H100,
    2026-12-06; 10.90% interpreted since w8a8 takes fewer slices of K); on one set of
    inputs the reference and the interpreted kernel both gave 11.34%. The e4m3 rounding of
    each projection's input is what w8a8 changes: 2.5% a product (``test_w8a8_matmul.py``),
    over ten products in two layers of random weights."""
    _skip_where_it_cannot_run(where)
    error, taken = _logit_error(rng, where, monkeypatch, TINY)
    # q_b_proj [1024, 128], o_proj and down_proj [256, 512], gate_proj and up_proj [512,
    # 256]; fused_qkv_a_proj's 288 rows are not whole blocks.
    assert taken == {(1024, 128), (256, 512), (512, 256)}
    print(f"w8a8 ({where}): logits' relative L2 error against the dequantized model {error:.2%}")
    assert 0.07 < error < 0.14, error


@pytest.mark.parametrize("where", ["reference", pytest.param("kernel", marks=mosaic_gpu_runs)])
def test_w8a8_logit_error_with_experts(rng, where, monkeypatch):
    """The mixture-of-experts variant (``TINY_MOE``): the routed experts on w8a8's grouped
    form beside the projections; the logits' relative L2 error (printed) within 5-50%. The
    reference gave 10.55%, 27.90%, 15.55% and 10.81% over MLA_TEST_SEEDs 0-3, the kernel
    interpreted 37.73% on its own draw (37.84% compiled, H100, 2026-12-06; 37.80% interpreted
    since w8a8 takes fewer slices of K); on two shared
    draws the reference and the interpreted kernel gave the same errors, 26.55% and 39.08%
    (CPU, 2026-12-06): the spread is the draw's, wider than the dense model's, perhaps from
    tokens whose top-2 experts change with the rounding upstream (not checked)."""
    _skip_where_it_cannot_run(where)
    error, taken = _logit_error(rng, where, monkeypatch, TINY_MOE)
    # the dense layer's projections as above; the MoE layer's shared expert [128, 256] and
    # [256, 128], its routed experts' gate_up [256, 256] and down [256, 128]
    assert taken == {
        (1024, 128),
        (256, 512),
        (512, 256),
        (128, 256),
        (256, 128),
        ("experts", 256, 256),
        ("experts", 256, 128),
    }
    print(f"w8a8 with experts ({where}): logits' relative L2 error {error:.2%}")
    assert 0.05 < error < 0.5, error
