"""DeepSeek mixture-of-experts layer: router, routed experts over a grouped matmul, shared
experts. Computes what transformers 5.23's ``DeepseekV2Moe`` / ``DeepseekV3MoE`` compute.

Parameters (nnx paths under the layer's ``mlp``) and the HF tensors they hold. ``kernel``
parameters follow the loader's rule: ``X.kernel`` is HF's ``X.weight`` transposed.

=================================  ==========================  =================================
parameter                          shape (dtype)               HF tensor(s) under ``mlp.``
=================================  ==========================  =================================
``gate.kernel``                    ``[H, E]``                  ``gate.weight [E, H]``, transposed
``gate.e_score_correction_bias``   ``[E]`` (float32; v3 only)  ``gate.e_score_correction_bias``
``experts.gate_up_proj``           ``[E, H, 2I]``              ``experts.{e}.gate_proj.weight
                                                               [I, H]`` transposed into
                                                               ``[e, :, :I]``, ``experts.{e}.
                                                               up_proj.weight`` into ``[e, :, I:]``
``experts.down_proj``              ``[E, I, H]``               ``experts.{e}.down_proj.weight
                                                               [H, I]`` transposed into ``[e]``
``shared_experts.{gate,up}_proj``  ``kernel [H, S]``           ``shared_experts.{gate,up}_proj.
                                                               weight [S, H]``, transposed
``shared_experts.down_proj``       ``kernel [S, H]``           ``shared_experts.down_proj.weight
                                                               [H, S]``, transposed
=================================  ==========================  =================================

E = n_routed_experts, H = hidden_size, I = moe_intermediate_size, S = I x n_shared_experts.
Kept FP8 (``fp8_blocks``), the routed experts' stacks hold HF's layout instead, as
transformers fuses them in memory: ``gate_up_proj [E, 2I, H]`` (each expert's gate_proj
rows, then its up_proj rows) and ``down_proj [E, H, I]``, with their ``*_scale_inv`` grids
``[E, 2 cdiv(I, bo), cdiv(H, bi)]`` (gate's, then up's) and ``[E, cdiv(H, bo), cdiv(I,
bi)]``: Hopper's FP8 tensor cores read a weight K-major, as HF stores it
(``w8a8_matmul``'s grouped form). Each shared expert's projection holds HF's ``weight [out,
in]`` and ``weight_scale_inv`` as stored (``layers.Linear``).
The per-expert names are what DeepSeek publishes and what transformers 5.23's
``save_pretrained`` writes (its conversion mapping splits the fused tensors back on saving).
In memory transformers fuses them as ``experts.gate_up_proj [E, 2I, H]`` (gate rows first)
and ``experts.down_proj [E, H, I]``; a checkpoint holding those (written from its state
dict, say) is read too, transposed on the last two axes, each of the two where the layer has
it. ``hf_expert_slice`` says where each HF expert tensor goes and
``hf_expert_names`` lists the ones a layer needs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import kernels
from mla_jax.kernels.fp8_blocks import FP8, Fp8Blocks
from mla_jax.model.config import MoEConfig
from mla_jax.model.layers import MLP
from mla_jax.parallel import expert_parallel

_HIGHEST = jax.lax.Precision.HIGHEST


def route(
    x: jax.Array,
    gate_kernel: jax.Array,
    e_score_correction_bias: jax.Array | None,
    cfg: MoEConfig,
) -> tuple[jax.Array, jax.Array]:
    """The experts each token goes to and their weights, as transformers 5.23's
    ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter`` compute them (in float32).

    Args:
      x: ``[T, H]`` hidden states (any float dtype).
      gate_kernel: ``[H, E]`` router weights (HF's ``gate.weight`` transposed).
      e_score_correction_bias: ``[E]`` added to the sigmoid scores to choose the experts
        (and their groups) but not to weight them; required for sigmoid scores, None for
        softmax scores.
      cfg: the MoE config.

    Returns:
      ``expert_ids [T, k]`` int32 and ``weights [T, k]`` float32, k = num_experts_per_tok,
      in no particular order within a token.
    """
    if (e_score_correction_bias is None) != (cfg.scoring_func == "softmax"):
        raise ValueError(
            f"{cfg.scoring_func} scores need e_score_correction_bias exactly when they are "
            "sigmoid scores"
        )
    logits = jnp.dot(x.astype(jnp.float32), gate_kernel.astype(jnp.float32), precision=_HIGHEST)
    t, num_experts = logits.shape
    per_group = num_experts // cfg.n_group
    if cfg.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        # v2 masks the experts of dropped groups to 0: softmax scores of kept ones are > 0.
        dropped = 0.0
        if cfg.grouped:
            group_scores = choice.reshape(t, cfg.n_group, per_group).max(axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + e_score_correction_bias.astype(jnp.float32)
        dropped = -jnp.inf
        best_two = jax.lax.top_k(choice.reshape(t, cfg.n_group, per_group), 2)[0]
        group_scores = best_two.sum(axis=-1)
    if cfg.grouped:
        kept_groups = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        kept = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], kept_groups].set(True)
        choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, dropped)
    expert_ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return expert_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    grouped_matmul: Callable = kernels.REFERENCE.grouped_matmul,
    scales: tuple[jax.Array, jax.Array] | None = None,
    fp8_blocks: tuple[int, int] | None = None,
    dtype=None,
) -> jax.Array:
    """Sum over each token's chosen experts of ``weight x down(silu(gate(x)) * up(x))``.

    The ``T x k`` (token, expert) pairs are sorted by expert, so that each expert's tokens
    are one group of rows for ``grouped_matmul`` (``kernels.select(impl).grouped_matmul``);
    experts no token chose have no rows, and their weights are not read.

    Args:
      x: ``[T, H]``; expert_ids: ``[T, k]`` int32; weights: ``[T, k]`` float32.
      gate_up_proj: ``[E, H, 2I]`` (gate columns first); down_proj: ``[E, I, H]``; both in
        the dtype the matmuls run in (x is cast to it). FP8 experts (``scales``) in HF's
        layout: ``[E, 2I, H]`` and ``[E, H, I]``. With ``layer``, every layer's: ``[L, ...]``.
      layer: which of the stacked layers' experts to use (may be traced). The grouped matmul
        reads them in place: slicing a layer's experts out under a scan would copy every
        expert of the layer each step, most of a decode step's time.
      scales, fp8_blocks: for FP8 experts (float8_e4m3fn), their float32 block scales
        ``(gate_up_proj_scale_inv [..., E, 2 cdiv(I, bo), cdiv(H, bi)], down_proj_scale_inv
        [..., E, cdiv(H, bo), cdiv(I, bi)])`` and ``(bo, bi)``; the grouped matmul reads
        them as they are (w8a8 on Hopper, else dequantized tile by tile).
      dtype: what the matmuls run in (x is cast to it); default: the experts' dtype.

    Returns:
      ``[T, H]`` float32.
    """
    t, k = expert_ids.shape
    num_experts = down_proj.shape[-3]
    inter = (gate_up_proj.shape[-1] if scales is None else gate_up_proj.shape[-2]) // 2
    group_offset = 0
    dtype = dtype or down_proj.dtype
    gate_up_fp8, down_fp8 = {}, {}
    if scales is not None:
        bo, bi = fp8_blocks
        gate_up_fp8 = dict(rhs_scale_inv=scales[0], blocks=Fp8Blocks(bo, bi, parts=2))
        down_fp8 = dict(rhs_scale_inv=scales[1], blocks=Fp8Blocks(bo, bi))
    if layer is not None:  # the grouped matmul reads [L, E, ...] as one [L * E, ...] stack
        group_offset = layer * num_experts
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # sorted row -> (token, expert) pair
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    rows = x.astype(dtype)[order // k]
    gate_up = grouped_matmul(
        rows, gate_up_proj, group_sizes, group_offset=group_offset, **gate_up_fp8
    )
    gate_up = gate_up.astype(jnp.float32)
    hidden = jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = grouped_matmul(
        hidden.astype(dtype), down_proj, group_sizes, group_offset=group_offset, **down_fp8
    )
    # Back to (token, expert) order by a gather (a scatter-add would serialise on tokens).
    position = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    out = out[position].reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", out, weights, precision=_HIGHEST)


class Router(nnx.Module):
    """``kernel [H, E]`` in the model's dtype (scores are computed in float32) and, for
    sigmoid scores, ``e_score_correction_bias [E]`` float32 (HF keeps it in float32)."""

    def __init__(self, cfg: MoEConfig, *, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        shape = (cfg.hidden_size, cfg.n_routed_experts)
        self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype))
        if cfg.scoring_func == "sigmoid":
            self.e_score_correction_bias = nnx.Param(
                jnp.zeros((cfg.n_routed_experts,), jnp.float32)
            )


class Experts(nnx.Module):
    """The routed experts' SwiGLU weights, stacked over experts: ``gate_up_proj [E, H, 2I]``
    (gate then up columns, so one grouped matmul computes both) and ``down_proj [E, I, H]``.
    With ``fp8_blocks = (bo, bi)``: both float8_e4m3fn in HF's layout, ``gate_up_proj [E,
    2I, H]`` (gate then up rows) and ``down_proj [E, H, I]``, with their float32 block scales
    ``gate_up_proj_scale_inv [E, 2 cdiv(I, bo), cdiv(H, bi)]`` (gate's grid, then up's) and
    ``down_proj_scale_inv [E, cdiv(H, bo), cdiv(I, bi)]``."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        param_dtype,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.fp8_blocks = fp8_blocks
        if fp8_blocks is None:
            self.gate_up_proj = nnx.Param(init(rngs.params(), (e, h, 2 * i), param_dtype))
            self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), param_dtype))
            return
        hf_init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        self.gate_up_proj = nnx.Param(hf_init(rngs.params(), (e, 2 * i, h)).astype(FP8))
        self.down_proj = nnx.Param(hf_init(rngs.params(), (e, h, i)).astype(FP8))
        gate_up = Fp8Blocks(*fp8_blocks, parts=2).scale_shape_nk(2 * i, h)
        self.gate_up_proj_scale_inv = nnx.Param(jnp.ones((e, *gate_up), jnp.float32))
        down = Fp8Blocks(*fp8_blocks).scale_shape_nk(h, i)
        self.down_proj_scale_inv = nnx.Param(jnp.ones((e, *down), jnp.float32))

    def scales(self) -> tuple[jax.Array, jax.Array] | None:
        """``(gate_up_proj_scale_inv, down_proj_scale_inv)`` of FP8 experts, else None."""
        if self.fp8_blocks is None:
            return None
        return self.gate_up_proj_scale_inv[...], self.down_proj_scale_inv[...]


class MoE(nnx.Module):
    """A DeepSeek MoE layer: ``routed(x) + shared_experts(x)``, ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        self.cfg = cfg
        self.dtype = param_dtype
        self.gate = Router(cfg, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(cfg, param_dtype=param_dtype, rngs=rngs, fp8_blocks=fp8_blocks)
        self.shared_experts = MLP(
            cfg.hidden_size,
            cfg.shared_intermediate_size,
            param_dtype=param_dtype,
            rngs=rngs,
            fp8_blocks=fp8_blocks,
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        impl: str | kernels.KernelSet = "auto",
        layer_in_run: int | jax.Array | None = None,
        expert_axis: str | None = None,
    ) -> jax.Array:
        """``x [T, H]`` -> ``[T, H]`` in x's dtype. ``impl`` picks the grouped matmul
        (``kernels.select``: "auto", "pallas" or "reference"). ``layer_in_run``: when this
        module holds a whole run's experts (``[L, E, ...]``, as the model's scan passes
        them; the router is this layer's own, and so are the shared experts unless their
        FP8 weights are stacked too: ``Linear.__call__``), which of them to use.
        ``expert_axis``: a mesh axis, manual in the caller's ``shard_map``, over which the
        routed experts are split (each rank holds its range of them): the ranks' tokens go
        to every rank's experts and come back (``expert_parallel.dispatch_and_combine``);
        the router and shared experts run on this rank's tokens."""
        kernel_set = kernels.select(impl)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        expert_ids, weights = route(
            x, self.gate.kernel[...], None if bias is None else bias[...], self.cfg
        )
        experts = functools.partial(
            routed_experts,
            gate_up_proj=self.experts.gate_up_proj[...],
            down_proj=self.experts.down_proj[...],
            layer=layer_in_run,
            grouped_matmul=kernel_set.grouped_matmul,
            scales=self.experts.scales(),
            fp8_blocks=self.experts.fp8_blocks,
            dtype=self.dtype,
        )
        if expert_axis is None:
            routed = experts(x, expert_ids, weights)
        else:
            routed = expert_parallel.dispatch_and_combine(
                x,
                expert_ids,
                weights,
                experts,
                axis_name=expert_axis,
                num_local_experts=self.experts.down_proj.shape[-3],
            )
        shared = self.shared_experts(
            x.astype(self.dtype), impl=kernel_set, layer_in_run=layer_in_run
        )
        return (routed + shared.astype(jnp.float32)).astype(x.dtype)


class ExpertSlice(NamedTuple):
    """Where an HF expert tensor goes: ``param[index] = tensor.transpose(axes)``."""

    param: str  # "gate_up_proj" or "down_proj" (under the layer's mlp.experts)
    index: tuple  # ints and slices into the stacked parameter
    axes: tuple[int, ...]  # the transpose taking the HF layout to the parameter's
    hf_shape: tuple[int, ...]  # the shape the HF tensor must have


_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)$")


def hf_expert_slice(name: str, cfg: MoEConfig, *, fp8: bool = False) -> ExpertSlice | None:
    """For an HF tensor name (``model.layers.3.mlp.experts.5.up_proj.weight``, or
    transformers' fused ``model.layers.3.mlp.experts.gate_up_proj``), where it goes in the
    layer's ``experts`` parameters (``fp8``: kept FP8 ones, in HF's layout); None for a
    name that is no routed-expert tensor. Raises ValueError for an expert index out of
    range. An FP8 slot's index ends with its range of output rows (the loader maps it to
    the scale grid's rows)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    if match := _PER_EXPERT.search(name):
        e, proj = int(match.group(1)), match.group(2)
        if e >= cfg.n_routed_experts:
            raise ValueError(f"{name}: expert {e} is out of range ({cfg.n_routed_experts} experts)")
        if proj == "down":
            return ExpertSlice("down_proj", (e,), (0, 1) if fp8 else (1, 0), (h, i))
        outputs = slice(0, i) if proj == "gate" else slice(i, 2 * i)
        if fp8:
            return ExpertSlice("gate_up_proj", (e, outputs), (0, 1), (i, h))
        return ExpertSlice("gate_up_proj", (e, slice(None), outputs), (1, 0), (i, h))
    if match := _FUSED.search(name):
        e = cfg.n_routed_experts
        axes = (0, 1, 2) if fp8 else (0, 2, 1)
        if match.group(1) == "down_proj":
            return ExpertSlice("down_proj", (), axes, (e, h, i))
        return ExpertSlice("gate_up_proj", (), axes, (e, 2 * i, h))
    return None


def hf_expert_names(prefix: str, cfg: MoEConfig, *, fused: bool = False) -> list[str]:
    """The HF routed-expert tensor names of one layer, ``prefix`` being its MLP
    (``model.layers.3.mlp``): per expert, in the order DeepSeek's checkpoints list them, or
    with ``fused`` transformers' two stacked ones (``experts.gate_up_proj``,
    ``experts.down_proj``)."""
    if fused:
        return [f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]
    return [
        f"{prefix}.experts.{e}.{proj}_proj.weight"
        for e in range(cfg.n_routed_experts)
        for proj in ("gate", "up", "down")
    ]
