"""Tensor and data parallelism across the local devices, on ``jax.sharding``.

Tensor parallelism: a one-axis ``Mesh`` (axis ``"tp"``) over N devices; every parameter gets
a ``NamedSharding`` from its path (``partition_spec``) and XLA's SPMD partitioner derives the
rest of the step:

- attention heads split across ranks: ``q_proj`` / ``q_b_proj`` by output columns (whole
  heads), ``W_UK`` / ``W_UV`` (``kv_b_proj``'s parts) by their leading heads axis, ``o_proj``
  by input rows,
  whose partial products XLA sums across ranks (an all-reduce of ``[T, H]`` per layer);
- the down projections to the latents (``fused_qkv_a_proj``, or ``kv_a_proj_with_mqa``
  without a query LoRA), the norms and the latent cache are replicated: with one latent KV
  head every rank attends over every latent row (the cost of TP for MLA: the cache is not
  divided, each rank holds all of it);
- the dense MLP and the MoE layers' shared experts split column (gate, up) / row (down), a
  second all-reduce per layer;
- the embedding table and ``lm_head`` split by vocabulary rows / columns;
- the routed experts split by expert (expert parallelism over the same ranks): every rank
  routes every token (the router is replicated) and runs the rows of its own experts; the
  ranks' outputs, each zero outside its rows, are summed after each expert matmul.

The Pallas kernels are opaque to the partitioner, so ``sharded_kernels`` wraps each in a
``shard_map``: the decode, prefill and merge kernels run on each rank over its heads (the
cache, block tables and schedules replicated), the grouped matmul on each rank over its
experts, the FP8 projections' matmul on each rank's columns or rows of its weight (as the
``Linear`` declares its ``tensor_split``, which ``test_linear_splits_match_the_rules``
holds to the rules below). The only collectives are those XLA inserts for the shardings
above (all-reduces of partial sums, and the gathers of each rank's best logit) and the
FP8 matmul's sum of a row split's partial products (``jax.lax.psum``, as XLA sums a dot's).

Data parallelism (attention): a ``("dp", "tp")`` mesh of M x N devices. Each DP rank runs
its own requests over its own part of the cache (the cache split on its block axis, block
ids local to the rank); the parameters are split on ``"tp"`` as above and replicated over
``"dp"``. The runner runs the whole step under a ``shard_map`` manual over ``"dp"`` only
(``"tp"`` left to the partitioner), so the kernels' ``shard_map`` over ``"tp"`` nests in it
(``_heads_mesh``). Each rank runs the MLP / MoE on its own tokens with the weights it holds:
no collective crosses ``"dp"``.

Expert parallelism over all ranks (``expert_parallel``, ``--dp M --ep``): the routed experts
(and an FP8 stack's scales) split by expert over ``("dp", "tp")``, so DP rank r's devices
hold the range ``[r E/M, (r + 1) E/M)``, split among them as TP splits experts; everything
else as under DP. The runner's ``shard_map`` takes each rank's range (``data_rank_spec``),
and the MoE layers send the ranks' tokens to it and back (``expert_parallel.py``: an
all-gather and a reduce-scatter over ``"dp"`` per MoE layer, the only collectives across
ranks).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import kernels
from mla_jax.model import layers
from mla_jax.model.config import ModelConfig

TENSOR_AXIS = "tp"
DATA_AXIS = "dp"

# Parameter path suffix -> how its own (trailing) axes split; stacked layers' leading layer
# axis is never split. Paths not listed are replicated.
_COLUMN_SPLIT = (None, TENSOR_AXIS)  # [in, out]: outputs (heads, MLP columns, vocabulary) split
_ROW_SPLIT = (TENSOR_AXIS, None)  # [in, out]: inputs split; the products are summed across ranks
_BY_HEAD = (TENSOR_AXIS, None, None)  # [N, Lkv, P or V]: W_UK / W_UV by head
_BY_EXPERT = (TENSOR_AXIS, None, None)  # [E, in, out]: by expert, over a DP rank's devices
# With expert parallelism: by expert over every device, a DP rank's experts one range.
_BY_EXPERT_OVER_ALL = ((DATA_AXIS, TENSOR_AXIS), None, None)
_WEIGHT_RULES: tuple[tuple[tuple[str, ...], tuple[str | None, ...]], ...] = (
    (("self_attn", "q_proj", "kernel"), _COLUMN_SPLIT),
    (("self_attn", "q_b_proj", "kernel"), _COLUMN_SPLIT),
    (("self_attn", "W_UK"), _BY_HEAD),
    (("self_attn", "W_UV"), _BY_HEAD),
    (("self_attn", "o_proj", "kernel"), _ROW_SPLIT),
    (("gate_proj", "kernel"), _COLUMN_SPLIT),  # the dense MLP and the shared experts
    (("up_proj", "kernel"), _COLUMN_SPLIT),
    (("down_proj", "kernel"), _ROW_SPLIT),
    (("embed_tokens", "embedding"), _ROW_SPLIT),  # [vocab, H]: by vocabulary
    (("lm_head", "kernel"), _COLUMN_SPLIT),
    (("experts", "gate_up_proj"), _BY_EXPERT),  # [E, H, 2I] (FP8: [E, 2I, H])
    (("experts", "down_proj"), _BY_EXPERT),  # [E, I, H] (FP8: [E, H, I])
)
# An FP8 projection holds HF's ``weight [out, in]`` (``layers.Linear``) instead of its
# ``kernel [in, out]``: the same split, on the swapped axes.
_FP8_PROJECTION_RULES = tuple(
    ((*path[:-1], "weight"), spec[::-1])
    for path, spec in _WEIGHT_RULES
    if path[-1] == "kernel" and path[-2] != "lm_head"
)
# An FP8 weight's block scales (``<name>_scale_inv``, its grid in the weight's layout) split
# as the weight does.
_RULES = (
    _WEIGHT_RULES
    + _FP8_PROJECTION_RULES
    + tuple(
        ((*path[:-1], path[-1] + "_scale_inv"), spec)
        for path, spec in _FP8_PROJECTION_RULES + _WEIGHT_RULES
        if path[-1] == "weight" or path[0] == "experts"
    )
)


def make_mesh(
    tensor_parallel: int, data_parallel: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``("tp",)`` mesh over the first ``tensor_parallel`` devices (default: all local
    devices of the default backend), or with ``data_parallel > 1`` a ``("dp", "tp")`` mesh
    over the first ``data_parallel * tensor_parallel`` (a DP rank's TP ranks adjacent)."""
    devices = list(devices if devices is not None else jax.local_devices())
    if data_parallel == 1:
        if not 1 <= tensor_parallel <= len(devices):
            raise ValueError(
                f"tensor_parallel={tensor_parallel} needs that many devices; "
                f"{len(devices)} are available ({devices[0].platform})"
            )
        return Mesh(np.array(devices[:tensor_parallel]), (TENSOR_AXIS,))
    needed = data_parallel * tensor_parallel
    if not 1 <= needed <= len(devices):
        raise ValueError(
            f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} needs {needed} "
            f"devices; {len(devices)} are available ({devices[0].platform})"
        )
    _partitioner_for_data_parallel()
    grid = np.array(devices[:needed]).reshape(data_parallel, tensor_parallel)
    return Mesh(grid, (DATA_AXIS, TENSOR_AXIS))


def gspmd_for_data_parallel() -> bool:
    """Whether data parallelism compiles with the GSPMD partitioner here: on jax 0.11, whose
    Shardy partitioner crashes the process (SIGSEGV, in its pipeline before any pass runs)
    compiling a data-parallel prefill step with a chunked-context bucket; 0.10 and 0.12
    compile it with Shardy."""
    return jax.__version_info__[:2] == (0, 11)


def _partitioner_for_data_parallel() -> None:
    """On jax 0.11 (``gspmd_for_data_parallel``) the data-parallel mesh switches JAX to its
    GSPMD partitioner (a process-wide setting), said once on the log."""
    if not gspmd_for_data_parallel() or not jax.config.jax_use_shardy_partitioner:
        return
    jax.config.update("jax_use_shardy_partitioner", False)
    logging.getLogger(__name__).warning(
        "jax %s: data parallelism compiles with the GSPMD partitioner "
        "(jax_use_shardy_partitioner=False): this version's Shardy crashes on the step",
        jax.__version__,
    )


def data_parallel(mesh: Mesh | None) -> int:
    """The number of DP ranks of ``mesh`` (1 without a ``"dp"`` axis)."""
    return 1 if mesh is None else mesh.shape.get(DATA_AXIS, 1)


def check_divisible(
    cfg: ModelConfig,
    tensor_parallel: int,
    data_parallel: int = 1,
    expert_parallel: bool = False,
    fp8_blocks: tuple[int, int] | None = None,
) -> None:
    """Raises ValueError (one line, naming the value) unless ``tensor_parallel`` divides the
    heads, the MLP widths, the vocabulary and the routed experts that it splits, with
    ``expert_parallel`` the ``data_parallel x tensor_parallel`` devices the routed experts,
    and with FP8 weights kept (``fp8_blocks = (bo, bi)``) each device's share of a split
    FP8 projection is whole blocks (its scales then split as evenly as it does)."""
    sizes = {
        "num_attention_heads": cfg.mla.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.moe is not None:
        sizes["shared experts' intermediate size"] = cfg.moe.shared_intermediate_size
        sizes["n_routed_experts"] = cfg.moe.n_routed_experts
    for name, size in sizes.items():
        if size % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide the model's {name} ({size})"
            )
    devices = data_parallel * tensor_parallel
    if expert_parallel and cfg.moe is not None and cfg.moe.n_routed_experts % devices:
        raise ValueError(
            f"expert parallelism over data_parallel={data_parallel} x tensor_parallel="
            f"{tensor_parallel} = {devices} devices does not divide the model's "
            f"n_routed_experts ({cfg.moe.n_routed_experts})"
        )
    if fp8_blocks is not None and tensor_parallel > 1:  # (at TP 1 nothing splits)
        _check_fp8_blocks(cfg, tensor_parallel, fp8_blocks)


def _check_fp8_blocks(cfg: ModelConfig, tensor_parallel: int, fp8_blocks: tuple[int, int]):
    """The FP8 projections TP splits (``_WEIGHT_RULES``; the routed experts split by expert,
    on no block): output columns in blocks of ``bo``, input rows in blocks of ``bi``."""
    bo, bi = fp8_blocks
    mla = cfg.mla
    both = math.lcm(bo, bi)  # an MLP's width: gate / up columns, then down rows
    widths = {
        "query heads x qk_head_dim": (mla.num_heads * mla.qk_head_dim, bo),
        "heads x v_head_dim (o_proj's inputs)": (mla.num_heads * mla.v_head_dim, bi),
        "intermediate_size": (cfg.intermediate_size, both),
    }
    if cfg.moe is not None:
        widths["shared experts' intermediate size"] = (cfg.moe.shared_intermediate_size, both)
    for name, (width, block) in widths.items():
        if width % (tensor_parallel * block):
            raise ValueError(
                f"tensor_parallel={tensor_parallel} splits the model's FP8 {name} ({width}) off "
                f"its {bo} x {bi} weight blocks (each device's share must be whole blocks of "
                f"{block})"
            )


def partition_spec(path: Sequence[str], ndim: int, expert_parallel: bool = False) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` (nnx state keys, e.g. ``("layers",
    "0", "self_attn", "o_proj", "kernel")``) with ``ndim`` axes; with ``expert_parallel``
    the routed experts (and their FP8 scales) split by expert over ``("dp", "tp")``."""
    path = tuple(path)
    for suffix, spec in _RULES:
        if path[-len(suffix) :] == suffix:
            # By path, not by spec: W_UK's and W_UV's specs have the experts' form.
            if expert_parallel and suffix[0] == "experts":
                spec = _BY_EXPERT_OVER_ALL
            return P(*(None,) * (ndim - len(spec)), *spec)
    return P()


def param_paths(state) -> list[tuple[str, ...]]:
    """The path of each leaf of an nnx ``state`` as strings (``("layers", "0", "self_attn",
    "o_proj", "kernel")``), in ``jax.tree.flatten`` order."""
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        if keys[-1] == "value":  # nnx.Variable's own leaf
            keys.pop()
        paths.append(tuple(keys))
    return paths


def param_shardings(state, mesh: Mesh, expert_parallel: bool = False) -> list[NamedSharding]:
    """The ``NamedSharding`` of each leaf of an nnx ``state``, in ``jax.tree.flatten``
    order (``expert_parallel``: see ``partition_spec``)."""
    return [
        NamedSharding(mesh, partition_spec(path, leaf.ndim, expert_parallel))
        for path, leaf in zip(param_paths(state), jax.tree.leaves(state), strict=True)
    ]


def placement(mesh: Mesh, expert_parallel: bool = False):
    """``weights.load_model``'s ``placement``: an nnx parameter path and its number of axes
    -> its ``NamedSharding`` on ``mesh``, so that each device receives only its shards."""

    def place(path: Sequence, ndim: int) -> NamedSharding:
        spec = partition_spec([str(key) for key in path], ndim, expert_parallel)
        return NamedSharding(mesh, spec)

    return place


def data_rank_spec(placed: NamedSharding) -> P:
    """What a ``shard_map`` manual over ``"dp"`` alone takes as the in_spec of an array
    placed by ``placed``: its spec with ``"tp"`` left out (the partitioner keeps it), so a
    routed expert stack split over ``("dp", "tp")`` reaches each DP rank as its own range of
    experts, and everything else whole."""

    def on_data_axis(axis):
        names = axis if isinstance(axis, tuple) else (axis,)
        return DATA_AXIS if DATA_AXIS in names else None

    return P(*(on_data_axis(axis) for axis in placed.spec))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def per_data_rank(mesh: Mesh, axis: int = 0) -> NamedSharding:
    """Per-rank data (the cache on its block ``axis``, a step's packed buffers, the sampled
    tokens): split on ``axis`` over the DP ranks where there are several (replicated over
    ``"tp"``), else replicated."""
    if data_parallel(mesh) == 1:
        return replicated(mesh)
    return NamedSharding(mesh, P(*(None,) * axis, DATA_AXIS))


def _heads_mesh(mesh: Mesh):
    """The mesh a kernel's ``shard_map`` over ``"tp"`` names: inside the runner's
    ``shard_map`` over ``"dp"``, the context's (``"dp"`` already manual), else ``mesh``."""
    context = jax.sharding.get_abstract_mesh()
    return mesh if context.empty else context


def _by_heads(
    function,
    mesh: Mesh,
    head_args: int,
    num_args: int,
    num_outputs: int,
    heads_leading: tuple[int, ...] = (),
):
    """``function`` under ``shard_map``: its first ``head_args`` arguments (``[T, N, ...]``)
    split by heads (axis 1), the rest of its ``num_args`` replicated; each output split by
    heads. The arguments and outputs numbered in ``heads_leading`` (arguments first, then
    outputs) are ``[N, T, ...]``: split on axis 0."""
    heads, leading = P(None, TENSOR_AXIS), P(TENSOR_AXIS)

    def spec(k):
        return leading if k in heads_leading else heads

    def by_heads(*args):
        return jax.shard_map(
            function,
            mesh=_heads_mesh(mesh),
            in_specs=tuple(spec(k) for k in range(head_args)) + (P(),) * (num_args - head_args),
            out_specs=tuple(spec(num_args + k) for k in range(num_outputs)),
            axis_names={TENSOR_AXIS},
            check_vma=False,  # Pallas calls carry no replication information
        )(*args)

    return by_heads


def _by_experts(grouped_matmul, mesh: Mesh):
    """``grouped_matmul(lhs [M, K], rhs [L, E, K, N], group_sizes [E], group_offset=l * E)``
    (layer l's experts of a stack of L layers, as ``moe.routed_experts`` passes them; or
    ``[L * E, K, N]``) with the experts split over the mesh; ``lhs``, ``group_sizes`` and
    the result replicated.

    Rank r holds experts ``[r E/n, (r + 1) E/n)`` of every layer, whose rows (lhs is sorted
    by expert) are one range of lhs: it rolls that range to the top, multiplies it by its
    experts (the rows after them are padding, which the kernel sets to 0 without reading any
    weight), rolls the result back; the ranks' results, each zero outside its own rows, are
    summed."""

    def local(lhs, stacked, group_sizes, layer, scales, blocks):
        num_local = stacked.shape[1]
        first = jax.lax.axis_index(TENSOR_AXIS) * num_local
        expert = jnp.arange(group_sizes.shape[0])
        start = jnp.sum(jnp.where(expert < first, group_sizes, 0))
        sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, num_local)
        fp8 = {}
        if scales is not None:  # this rank's experts' scales, [L, E/n, ...] as their weights
            fp8 = dict(rhs_scale_inv=scales, blocks=blocks)
        out = grouped_matmul(
            jnp.roll(lhs, -start, axis=0),
            stacked,  # this rank's [L, E/n, K, N]
            sizes,
            group_offset=layer * num_local,
            **fp8,
        )
        return jnp.roll(out, start, axis=0)[None]

    def by_experts(lhs, rhs, group_sizes, *, group_offset=0, rhs_scale_inv=None, blocks=None):
        num_experts = group_sizes.shape[0]
        # [L, E, K, N], where E is split: the model's stack as it is (a reshape of a split
        # stack would gather it whole), or a flat one's axis unfolded.
        stacked = rhs.reshape(-1, num_experts, *rhs.shape[-2:])
        scales = None
        if rhs_scale_inv is not None:
            scales = rhs_scale_inv.reshape(-1, num_experts, *rhs_scale_inv.shape[-2:])
        layer = jnp.asarray(group_offset, jnp.int32) // num_experts
        experts = P(None, TENSOR_AXIS)
        run = jax.shard_map(
            functools.partial(local, blocks=blocks),
            mesh=_heads_mesh(mesh),
            in_specs=(P(), experts, P(), P(), experts),  # scales: None or as the weights
            out_specs=P(TENSOR_AXIS),
            axis_names={TENSOR_AXIS},
            check_vma=False,
        )
        return run(lhs, stacked, group_sizes, layer, scales).sum(axis=0)

    return by_experts


def _by_weight_split(fp8_matmul, mesh: Mesh):
    """A kernel set's ``fp8_matmul(x [M, K], weight [N, K] or a stack [L, N, K], scale_inv,
    *, blocks, layer, tensor_split)`` run on each rank's part of a weight split as
    ``tensor_split`` says (``layers.Linear``; the rules above place it so), under
    ``shard_map``: the Pallas kernel is opaque to the partitioner, which would otherwise
    gather the split weight whole onto every device at every call.

    - ``COLUMNS``: ``x`` whole on every rank, the weight and its scales split on N: each
      rank computes its columns of the output, which stays split;
    - ``ROWS``: ``x``'s columns and the weight's rows (and scales) split: each rank's
      partial product in x's dtype, summed across the ranks in it (``psum``: as XLA sums a
      split dot's partial products, in its output's dtype);
    - None, or one device on ``"tp"``: the weight whole on every rank: the kernel as it is.

    A stack stays whole along its layers, each rank reading its part of ``layer`` in place."""

    def split_matmul(x, weight, scale_inv, *, blocks, layer=None, tensor_split=None):
        layers.check_tensor_split(tensor_split)
        if tensor_split is None or mesh.shape[TENSOR_AXIS] == 1:  # (a psum over 1 is kept)
            return fp8_matmul(x, weight, scale_inv, blocks=blocks, layer=layer)
        split = _COLUMN_SPLIT if tensor_split == layers.COLUMNS else _ROW_SPLIT
        weights = P(*(None,) * (weight.ndim - 2), *split[::-1])  # [N, K], as the rules place it
        if tensor_split == layers.COLUMNS:
            rows, out = P(), P(None, TENSOR_AXIS)
        else:
            rows, out = P(None, TENSOR_AXIS), P()
        # A layer known at trace time stays a Python int (the kernel checks its range).
        operands = [] if layer is None or isinstance(layer, int) else [layer]

        def local(x, weight, scale_inv, *traced_layer):
            product = fp8_matmul(
                x,
                weight,
                scale_inv,
                blocks=blocks,
                layer=traced_layer[0] if traced_layer else layer,
            )
            if tensor_split == layers.COLUMNS:
                return product
            return jax.lax.psum(product, TENSOR_AXIS)

        return jax.shard_map(
            local,
            mesh=_heads_mesh(mesh),
            in_specs=(rows, weights, weights, *(P(),) * len(operands)),
            out_specs=out,
            axis_names={TENSOR_AXIS},
            check_vma=False,  # Pallas calls carry no replication information
        )(x, weight, scale_inv, *operands)

    return split_matmul


def sharded_kernels(kernel_set: kernels.KernelSet, mesh: Mesh) -> kernels.KernelSet:
    """``kernel_set`` with each kernel run under ``shard_map`` on ``mesh``: attention
    kernels per rank on its heads, the grouped matmul per rank on its experts, the FP8
    matmul on a rank's part of its weight. Same signatures."""

    def mla_decode(
        q_lat, q_pe, cache, block_table, seq_lens, *, scale, schedule=None, heads_major=False
    ):
        def local(q_lat, q_pe, cache, block_table, seq_lens, schedule):
            return kernel_set.mla_decode(
                q_lat,
                q_pe,
                cache,
                block_table,
                seq_lens,
                scale=scale,
                schedule=schedule,
                heads_major=heads_major,
            )

        # q_lat (argument 0) and out (output 0, numbered after the 6 arguments)
        leading = (0, 6) if heads_major else ()
        run = _by_heads(local, mesh, head_args=2, num_args=6, num_outputs=2, heads_leading=leading)
        return run(q_lat, q_pe, cache, block_table, seq_lens, schedule)

    def flash_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, schedule=None):
        def local(q, k, v, cu_seqlens_q, cu_seqlens_k, schedule):
            return kernel_set.flash_prefill(
                q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, schedule=schedule
            )

        run = _by_heads(local, mesh, head_args=3, num_args=6, num_outputs=2)
        return run(q, k, v, cu_seqlens_q, cu_seqlens_k, schedule)

    def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, *, out_dtype=None):
        local = functools.partial(kernel_set.merge_attn_states, out_dtype=out_dtype)
        run = _by_heads(local, mesh, head_args=4, num_args=4, num_outputs=2)
        return run(prefix_out, prefix_lse, suffix_out, suffix_lse)

    grouped_matmul = _by_experts(kernel_set.grouped_matmul, mesh)

    fp8_matmul = _by_weight_split(kernel_set.fp8_matmul, mesh)

    return kernels.KernelSet(
        mla_decode,
        flash_prefill,
        merge_attn_states,
        grouped_matmul,
        fp8_matmul,
        backend=kernel_set.backend,
    )
