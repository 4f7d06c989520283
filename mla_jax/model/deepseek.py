"""A DeepSeek decoder for generation, parameters named as in HF checkpoints.

Each run of consecutive layers of one kind (dense MLP or mixture-of-experts, see
``ModelConfig.layer_runs``; ``stacked_runs`` may split one where FP8 weights are kept) is one
``DecoderLayer`` whose parameters carry a leading layer axis, run by a ``lax.scan``: XLA
compiles each run's layer once, so a 61-layer model compiles about as fast as a 2-layer one
(``unroll_layers`` trades that for fewer launches where a step's launches, not its kernels,
bound it). The latent cache is stacked the same way, ``[L, num_blocks, block_size, Lkv +
R]``, and carried through the scans whole (each layer writes and reads its own slice in
place; slicing it out would copy it). An FP8 cache (``kernels.fp8.Fp8Cache``) is three such
arrays, carried the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import kernels
from mla_jax.cache.metadata import AttentionMetadata
from mla_jax.kernels import fp8
from mla_jax.kernels.fp8 import FP8, Fp8Cache
from mla_jax.kernels.mosaic_gpu import log_once
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import ModelConfig
from mla_jax.model.layers import COLUMNS, MLP, RMSNorm, linear, matmul_precision
from mla_jax.model.moe import MoE

log = logging.getLogger(__name__)

# What a scan over a run of layers passes whole, each layer's kernels indexing it in place
# (a layer sliced out of a stack is copied before a kernel can take it, every step): the
# routed experts' parameters (``mlp.experts.*``; not ``mlp.shared_experts``) and the FP8
# projections' weights and scales (``Linear``).
_KEPT_WHOLE = nnx.Any(
    nnx.PathContains("experts"),
    lambda path, value: (
        path[-1] == "weight_scale_inv" or (path[-1] == "weight" and value.dtype == FP8)
    ),
)


class DecoderLayer(nnx.Module):
    """Pre-norm MLA attention then a pre-norm MLP or MoE, each added to the residual."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        moe: bool,
        param_dtype,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        eps = cfg.mla.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.mla.hidden_size, eps, param_dtype=param_dtype)
        self.self_attn = MLAAttention(
            cfg.mla, param_dtype=param_dtype, rngs=rngs, fp8_blocks=fp8_blocks
        )
        self.post_attention_layernorm = RMSNorm(cfg.mla.hidden_size, eps, param_dtype=param_dtype)
        if moe:
            self.mlp = MoE(cfg.moe, param_dtype=param_dtype, rngs=rngs, fp8_blocks=fp8_blocks)
        else:
            self.mlp = MLP(
                cfg.mla.hidden_size,
                cfg.intermediate_size,
                param_dtype=param_dtype,
                rngs=rngs,
                fp8_blocks=fp8_blocks,
            )

    def __call__(
        self,
        x,
        cache,
        metadata: AttentionMetadata,
        *,
        layer,
        layer_in_run,
        impl: kernels.KernelSet,
        expert_axis: str | None = None,
    ):
        """``layer``: this layer's index in the model (its cache slice); ``layer_in_run``:
        in its run (its routed experts and FP8 projections, which the scan passes for the
        whole run);
        ``expert_axis``: see ``MoE.__call__``."""
        h, cache = self.self_attn(
            self.input_layernorm(x),
            cache,
            metadata,
            layer=layer,
            layer_in_run=layer_in_run,
            impl=impl,
        )
        x = x + h
        h = self.post_attention_layernorm(x)
        moe = isinstance(self.mlp, MoE)
        if moe:
            h = self.mlp(h, impl=impl, layer_in_run=layer_in_run, expert_axis=expert_axis)
        else:
            h = self.mlp(h, impl=impl, layer_in_run=layer_in_run)
        return x + h, cache


def stacked_layers(
    cfg: ModelConfig,
    num_layers: int,
    *,
    moe: bool,
    param_dtype,
    rngs: nnx.Rngs,
    fp8_blocks: tuple[int, int] | None = None,
) -> DecoderLayer:
    """``num_layers`` independently initialised ``DecoderLayer``s as one module whose
    parameters have a leading ``[num_layers]`` axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, moe=moe, param_dtype=param_dtype, rngs=rngs, fp8_blocks=fp8_blocks)

    return make(rngs)


# The most runs ``stacked_runs`` splits a run into: each compiles its layer on its own.
MAX_SPLIT = 4


def stacked_runs(
    cfg: ModelConfig,
    fp8_blocks: tuple[int, int] | None = None,
    placement: Callable[[tuple, int], jax.sharding.Sharding] | None = None,
) -> tuple[tuple[int, int, bool], ...]:
    """The runs of layers the model stacks, ``(first layer, count, is_moe)`` in order:
    ``cfg.layer_runs()``, where FP8 weights are kept each split into the fewest runs (up to
    ``MAX_SPLIT``; the longest of them as short as it can be) whose FP8 stacks all stay out
    of ``fp8.TRITON_WRAPPING_BYTES`` on each device (``placement(path, ndim)``, as
    ``load_model`` takes it, says what a device holds; default: all of it), so that the
    Pallas Triton kernels read every layer in place (a stack in that range has its layer
    copied out at each call). DeepSeek-V3 on one device: the 58-layer ``q_b_proj`` stack,
    2.19 GB, would be copied from; its MoE layers run as stacks of 40 and 18 layers, whose
    ``o_proj`` stacks (4.7 and 2.1 GB) stay out of the range too. A run no such split helps
    stays whole."""
    runs = cfg.layer_runs()
    if fp8_blocks is None:
        return tuple(runs)
    split = []
    for first, count, moe in runs:
        layer = nnx.eval_shape(
            lambda moe=moe: stacked_layers(
                cfg, 1, moe=moe, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=fp8_blocks
            )
        )
        per_layer = set()  # bytes a device holds of one layer of each 1-byte stack
        for path, var in nnx.to_flat_state(nnx.state(layer)):
            if var.dtype.itemsize == 1:
                shape = var.shape
                if placement is not None:  # (under the path of the model's next run)
                    where = ("layers", str(len(split)), *path)
                    shape = placement(where, len(shape)).shard_shape(shape)
                per_layer.add(math.prod(shape))
        allowed = {
            n
            for n in range(1, count + 1)
            if not any(fp8.wraps_triton_bytes(n * size) for size in per_layer)
        }
        lengths = _run_lengths(count, allowed)
        if len(lengths) > 1:
            log_once(
                log,
                f"layers {first}-{first + count - 1} ({'MoE' if moe else 'dense'}) stacked as "
                f"runs of {', '.join(map(str, lengths))} layers: as one run a kept FP8 stack "
                "of theirs would fill (2 GiB, 4 GiB] on a device, which the Pallas Triton "
                "kernels would copy a layer out of at each call",
            )
        for length in lengths:
            split.append((first, length, moe))
            first += length
    return tuple(split)


def _run_lengths(count: int, allowed: set[int], max_parts: int = MAX_SPLIT) -> list[int]:
    """``count`` as the fewest ``allowed`` parts, at most ``max_parts``, the longest as
    short as it can be (longest first); ``[count]`` where it is allowed or no such parts
    sum to it."""
    if count in allowed:
        return [count]
    for parts in range(2, max_parts + 1):
        for longest in range(-(-count // parts), count + 1):
            # Bit t of reach[j]: j parts of at most ``longest`` sum to t.
            lengths = [n for n in allowed if n <= longest]
            reach = [1]
            for _ in range(parts):
                sums = 0
                for n in lengths:
                    sums |= reach[-1] << n
                reach.append(sums & ((2 << count) - 1))
            if not reach[parts] >> count & 1:
                continue
            chosen, total = [], count
            for j in range(parts, 0, -1):  # a last part whose remainder j - 1 parts reach
                n = next(n for n in lengths if total >= n and reach[j - 1] >> (total - n) & 1)
                chosen.append(n)
                total -= n
            return sorted(chosen, reverse=True)
    return [count]


def _checked(runs: Sequence[tuple[int, int, bool]], cfg: ModelConfig):
    """``runs`` as a tuple, once they are ``cfg``'s layers in order, each run of one kind
    (``cfg.layer_runs()``, possibly split); else ValueError naming the first wrong run."""
    runs = tuple(tuple(run) for run in runs)
    start = 0
    for first, count, moe in runs:
        kinds = {cfg.is_moe_layer(layer) for layer in range(first, first + count)}
        if first != start or count < 1 or kinds != {moe}:
            raise ValueError(
                f"runs: {(first, count, moe)} is not the next {count} layers from {start}, all "
                f"{'MoE' if moe else 'dense'}, of the model's {cfg.layer_runs()}"
            )
        start += count
    if start != cfg.num_layers:
        raise ValueError(f"runs {runs} cover {start} of the model's {cfg.num_layers} layers")
    return runs


class DeepseekModel(nnx.Module):
    """Embeddings, decoder layers, final norm and lm_head (HF's DeepseekV2/V3ForCausalLM).

    ``fp8_blocks = (bo, bi)`` (an FP8 checkpoint's ``weight_block_size``, kept as it is):
    the decoder layers' projections (attention but ``kv_b_proj``, dense MLPs, shared and
    routed experts) hold float8_e4m3fn weights with float32 block scales beside them
    (``<name>_scale_inv``); activations, embedding, norms, router and ``lm_head`` stay in
    ``param_dtype``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
        runs: Sequence[tuple[int, int, bool]] | None = None,
    ):
        self.cfg = cfg
        self.fp8_blocks = fp8_blocks  # (bo, bi) of the FP8 weights kept, else None
        h = cfg.mla.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, h, param_dtype=param_dtype, rngs=rngs)
        # One stacked module per run of layers, in order.
        self.runs = stacked_runs(cfg, fp8_blocks) if runs is None else _checked(runs, cfg)
        self.layers = nnx.List(
            [
                stacked_layers(
                    cfg,
                    count,
                    moe=moe,
                    param_dtype=param_dtype,
                    rngs=rngs,
                    fp8_blocks=fp8_blocks,
                )
                for _, count, moe in self.runs
            ]
        )
        self.norm = RMSNorm(h, cfg.mla.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(h, cfg.vocab_size, param_dtype, rngs, tensor_split=COLUMNS)

    def __call__(
        self,
        input_ids: jax.Array,
        cache: jax.Array | Fp8Cache,
        metadata: AttentionMetadata,
        *,
        impl: str | kernels.KernelSet = "auto",
        expert_axis: str | None = None,
        unroll_layers: bool = False,
    ) -> tuple[jax.Array, jax.Array | Fp8Cache]:
        """``input_ids [T]`` int32 and the stacked cache ``[L, num_blocks, block_size,
        Lkv + R]`` (or an ``Fp8Cache`` of those leading axes) -> logits of
        ``metadata.logits_indices`` ``[R, vocab]`` float32 and the updated cache.
        ``expert_axis``: under a ``shard_map`` manual over that mesh axis, the routed
        experts are split over it (this rank holds its range of them) and the MoE layers
        send every rank's tokens to them (``MoE.__call__``). ``unroll_layers``: unroll the
        scans over the layers (the same computation, each layer compiled on its own: one
        straight program that XLA's GPU runtime launches as few CUDA graphs, where a loop
        launches each layer's; worth its compile time where the launches, not the kernels,
        bound a step: small decode batches)."""
        if cache.ndim != 4 or cache.shape[0] != self.cfg.num_layers:
            raise ValueError(
                f"cache {cache.shape} must be [num_layers={self.cfg.num_layers}, num_blocks, "
                "block_size, width]"
            )
        # NumPy arrays cannot be indexed by the scan's tracers.
        metadata = jax.tree.map(jnp.asarray, metadata)
        kernel_set = kernels.select(impl)  # resolved once for every layer
        x = self.embed_tokens(input_ids)
        for (first, count, _), layers in zip(self.runs, self.layers, strict=True):
            # The routed experts and FP8 projections stay whole (indexed in place by their
            # kernels); the scan slices the rest layer by layer.
            graphdef, whole, state = nnx.split(layers, _KEPT_WHOLE, ...)

            def layer_step(carry, scanned, graphdef=graphdef, whole=whole, first=first):
                x, cache = carry
                layer_in_run, layer_state = scanned
                x, cache = nnx.merge(graphdef, whole, layer_state)(
                    x,
                    cache,
                    metadata,
                    layer=first + layer_in_run,
                    layer_in_run=layer_in_run,
                    impl=kernel_set,
                    expert_axis=expert_axis,
                )
                return (x, cache), None

            (x, cache), _ = jax.lax.scan(
                layer_step,
                (x, cache),
                (jnp.arange(count, dtype=jnp.int32), state),
                unroll=unroll_layers,
            )
        x = self.norm(x[metadata.logits_indices])
        if self.cfg.tie_word_embeddings:
            embedding = self.embed_tokens.embedding[...]
            logits = jnp.dot(x, embedding.T, precision=matmul_precision(embedding.dtype))
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32), cache
