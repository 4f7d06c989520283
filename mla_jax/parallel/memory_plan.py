"""Memory plan: the bytes each device holds of a model's weights and of its latent cache under
a layout of N devices, computed (not estimated) from the shapes ``jax.eval_shape`` gives the
model's parameters and cache and the shard shapes of the layout's shardings on an
``AbstractMesh``: nothing is allocated and no device is needed.

Layouts (``Layout``) on a ``("dp", "tp")`` mesh of M x N devices:

- ``tp8`` (M = 1) and ``dp2xtp4`` ... (``--tp N``, ``--dp M --tp N``). Parameters take
  ``sharding.partition_spec`` (split on ``"tp"``, replicated over ``"dp"``); the cache is
  split on its block axis over ``"dp"`` (``sharding.per_data_rank``) and replicated over
  ``"tp"``.
- ``dp8+ep``, ``dp4xtp2+ep`` ... (``--dp M --tp N --ep``): DP attention with the routed
  experts split over all M x N devices (SGLang's DP attention with expert parallelism):
  ``sharding.partition_spec(..., expert_parallel=True)``, the routed experts' expert axis
  over ``("dp", "tp")`` (attention, dense MLPs, shared experts, embedding and ``lm_head``
  as without it: split on ``"tp"``, replicated over ``"dp"``).

Weights are counted in the model's dtype, or as the runtime keeps an FP8 checkpoint's
(``--fp8-weights keep``; ``is_fp8_weight``: every projection of the decoder layers but
``kv_b_proj``, the routed experts included) as ``float8_e4m3fn`` plus their float32
``weight_scale_inv`` block scales, each scale grid split as its weight is. The cache of a
request of T tokens is ``cdiv(T, block_size)`` blocks on its DP rank, in the model's dtype
or in ``kernels.fp8``'s layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax.cache.latent_cache import cache_dtype, init_cache
from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization
from mla_jax.engine.batch import scratch_blocks
from mla_jax.model.config import ModelConfig
from mla_jax.model.deepseek import DeepseekModel, stacked_runs
from mla_jax.parallel import sharding
from mla_jax.parallel.sharding import DATA_AXIS, TENSOR_AXIS

MIB = 1 << 20
GIB = 1 << 30
# The block scales DeepSeek's FP8 checkpoints use, for a config that has none.
DEEPSEEK_FP8 = FP8BlockQuantization((128, 128))
_ROUTED_EXPERTS = (("experts", "gate_up_proj"), ("experts", "down_proj"))
# The decoder layers' projections the runtime keeps FP8 (attention, dense MLP, shared
# experts): not kv_b_proj, which the loader dequantizes into W_UK / W_UV (``MLAAttention``:
# per-head up-projections, not linears of the hidden states).
_PROJECTIONS = (
    "q_proj",
    "fused_qkv_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class Node(NamedTuple):
    """A host of ``devices`` identical GPUs of ``device_bytes`` memory each."""

    name: str
    devices: int
    device_bytes: int


# The total memory CUDA reports for each GPU (nvidia-smi): sold as 141 GB and 80 GB.
NODES = (
    Node("8 x H200", 8, 143771 * MIB),
    Node("8 x H100", 8, 81559 * MIB),
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """M = ``data_parallel`` ranks of N = ``tensor_parallel`` devices; with
    ``expert_parallel`` the routed experts split over all M x N devices (``--ep``)."""

    data_parallel: int
    tensor_parallel: int
    expert_parallel: bool = False

    def __post_init__(self):
        for name in ("data_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel

    @property
    def name(self) -> str:
        """``tp8``, ``dp2xtp4``, ``dp8``, ``dp8+ep`` ..."""
        m, n = self.data_parallel, self.tensor_parallel
        name = f"tp{n}" if m == 1 else f"dp{m}" if n == 1 else f"dp{m}xtp{n}"
        return name + ("+ep" if self.expert_parallel else "")

    def mesh(self) -> AbstractMesh:
        return AbstractMesh((self.data_parallel, self.tensor_parallel), (DATA_AXIS, TENSOR_AXIS))

    def partition_spec(self, path: Sequence[str], ndim: int) -> P:
        """The parameter's spec: the runtime's (``sharding.partition_spec``)."""
        return sharding.partition_spec(path, ndim, self.expert_parallel)

    def cache_spec(self) -> P:
        """The cache's spec (``[L, blocks, block_size, C]``): ``sharding.per_data_rank`` on the
        block axis."""
        return sharding.per_data_rank(self.mesh(), axis=1).spec


def layouts(devices: int) -> list[Layout]:
    """Every layout of ``devices`` devices: TP over all, each DP M x TP N with M x N =
    ``devices``, and each of those with M > 1 with the routed experts over all ranks."""
    splits = [(m, devices // m) for m in range(1, devices + 1) if devices % m == 0]
    without = [Layout(m, n) for m, n in splits]
    return without + [Layout(m, n, True) for m, n in splits if m > 1]


class Tensor(NamedTuple):
    """A parameter (or an FP8 weight's scales) as ``jax.eval_shape`` sees it. ``spec_path``:
    the parameter whose partition spec it takes (a scale grid: its weight's)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    spec_path: tuple[str, ...]


def is_fp8_weight(path: Sequence[str]) -> bool:
    """Whether the runtime keeps the parameter at ``path`` of an FP8 checkpoint as FP8 with
    block scales (``--fp8-weights keep``): every projection of the decoder layers
    (attention but ``kv_b_proj``, dense MLP, shared experts) and the routed experts; not
    ``W_UK`` / ``W_UV`` (``kv_b_proj``, dequantized at load), the router, norms, embedding or
    ``lm_head``."""
    path = tuple(path)
    if path[0] != "layers":
        return False
    return path[-2:] in _ROUTED_EXPERTS or (path[-1] == "kernel" and path[-2] in _PROJECTIONS)


def fp8_scale_shape(
    path: Sequence[str], shape: Sequence[int], quantization: FP8BlockQuantization
) -> tuple[int, ...]:
    """The ``weight_scale_inv`` grid of an FP8 weight of ``shape`` in HF's layout ``[...,
    out, in]``, as the runtime keeps it: ``[..., cdiv(out, bo), cdiv(in, bi)]``; a routed
    experts' ``gate_up_proj`` holds gate and up one after the other, each with its own grid:
    ``2 x cdiv(I, bo)`` rows."""
    bo, bi = quantization.weight_block_size
    *lead, n_out, n_in = shape
    halves = 2 if tuple(path[-2:]) == ("experts", "gate_up_proj") else 1
    return (*lead, halves * math.ceil(n_out // halves / bo), math.ceil(n_in / bi))


def parameter_tensors(
    cfg: ModelConfig, dtype, quantization: FP8BlockQuantization | None = None
) -> list[Tensor]:
    """The model's parameters from ``jax.eval_shape`` of ``DeepseekModel(cfg)`` in ``dtype``;
    with ``quantization``, each ``is_fp8_weight`` parameter as float8_e4m3fn followed by its
    float32 scales (path ``..., <name>_scale_inv``), as the runtime keeps them: a
    projection's ``kernel [in, out]`` as its HF ``weight [out, in]`` (``layers.Linear``), a
    routed experts' stack in HF's layout (``moe.Experts``)."""
    abstract = nnx.eval_shape(lambda: DeepseekModel(cfg, param_dtype=dtype, rngs=nnx.Rngs(0)))
    state = nnx.split(abstract)[1]
    tensors = []
    for path, leaf in zip(sharding.param_paths(state), jax.tree.leaves(state), strict=True):
        if quantization is None or not is_fp8_weight(path):
            tensors.append(Tensor(path, leaf.shape, np.dtype(leaf.dtype), path))
            continue
        # HF's [out, in]: a projection's kernel [in, out] becomes its weight, a routed
        # experts' stack [..., in, out] is transposed in place
        shape = (*leaf.shape[:-2], *leaf.shape[:-3:-1])
        if path[-1] == "kernel":
            path = (*path[:-1], "weight")
        tensors.append(Tensor(path, shape, np.dtype(jnp.float8_e4m3fn), path))
        scale_path = (*path[:-1], path[-1] + "_scale_inv")
        scale = fp8_scale_shape(path, shape, quantization)
        tensors.append(Tensor(scale_path, scale, np.dtype(np.float32), path))
    return tensors


def shard_bytes(shape: Sequence[int], dtype, placed: NamedSharding, what: str) -> int:
    """Bytes of one device's shard of an array of ``shape`` placed by ``placed``; raises
    ValueError naming ``what`` when an axis does not split evenly."""
    try:
        shard = placed.shard_shape(tuple(shape))
    except ValueError:
        raise ValueError(
            f"{what} {list(shape)} does not split evenly by {placed.spec} over "
            f"{dict(placed.mesh.shape)}"
        ) from None
    return math.prod(shard) * np.dtype(dtype).itemsize


def weight_bytes(
    tensors: Sequence[Tensor], layout: Layout, quantization: FP8BlockQuantization | None = None
) -> int:
    """Bytes of ``tensors`` on each device under ``layout`` (every device holds the same).
    An FP8 weight split across devices must split on whole ``quantization`` blocks, so that
    each device holds its blocks' scales; otherwise ValueError names it."""
    mesh = layout.mesh()
    shapes = {tensor.path: tensor.shape for tensor in tensors}
    total = 0
    for tensor in tensors:
        spec = NamedSharding(mesh, layout.partition_spec(tensor.spec_path, len(tensor.shape)))
        total += shard_bytes(tensor.shape, tensor.dtype, spec, "/".join(tensor.path))
        if tensor.path != tensor.spec_path:  # a scale grid
            weight = shapes[tensor.spec_path]
            shard = spec.shard_shape(weight)
            bo, bi = quantization.weight_block_size
            # A split axis must split on block edges: [..., out, in] for a projection's
            # weight, [..., in, out] for the routed experts'.
            rows, columns = (bo, bi) if tensor.spec_path[-1] == "weight" else (bi, bo)
            for size, whole, block in (
                (shard[-2], weight[-2], rows),
                (shard[-1], weight[-1], columns),
            ):
                if size != whole and size % block:
                    raise ValueError(
                        f"{'/'.join(tensor.spec_path)} {list(weight)}: a device's shard "
                        f"{list(shard)} under {spec.spec} is not whole {rows} x {columns} blocks"
                    )
    return total


def cache_bytes(
    cfg: ModelConfig,
    layout: Layout,
    tokens_per_rank: int,
    *,
    block_size: int,
    kv_cache_dtype: str,
    model_dtype,
) -> int:
    """Bytes on each device of a latent cache holding ``tokens_per_rank`` tokens (rounded up
    to blocks) on each DP rank: ``jax.eval_shape`` of ``init_cache`` (the bf16 / float32
    array or the ``Fp8Cache``'s three) under ``layout.cache_spec()``."""
    blocks = layout.data_parallel * math.ceil(tokens_per_rank / block_size)
    m = cfg.mla
    abstract = jax.eval_shape(
        lambda: init_cache(
            cfg.num_layers,
            blocks,
            block_size,
            m.cache_width,
            cache_dtype(kv_cache_dtype, model_dtype),
            kv_lora_rank=m.kv_lora_rank,
        )
    )
    placed = NamedSharding(layout.mesh(), layout.cache_spec())
    return sum(
        shard_bytes(part.shape, part.dtype, placed, "the cache")
        for part in jax.tree.leaves(abstract)
    )


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layout with one kind of weights.

    weights: the model's dtype (``"bfloat16"``) or ``"fp8"`` (the ``is_fp8_weight``
    parameters in FP8 with their scales, the rest in the model's dtype). weight_bytes: on
    each device. token_bytes: per cache dtype, the bytes a token's cache rows take on each
    device holding them; ``token_copies`` devices hold them (its DP rank's TP ranks).
    requests: per (node name, cache dtype), the requests of ``request_tokens`` the node
    holds beside the weights and headroom; None where the weights alone do not fit.
    refused: why the layout cannot hold the model (then the rest is empty). runs: how many
    layers each of the model's stacks holds under the layout (``deepseek.stacked_runs``:
    kept FP8 stacks split out of the sizes the Triton kernels cannot index).
    """

    layout: Layout
    weights: str
    weight_bytes: int = 0
    token_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    token_copies: int = 0
    requests: dict[tuple[str, str], int | None] = dataclasses.field(default_factory=dict)
    refused: str | None = None
    runs: tuple[int, ...] = ()


def plan(
    cfg: ModelConfig,
    devices: int,
    *,
    dtype=jnp.bfloat16,
    request_tokens: int = 4096,
    block_size: int = 16,
    headroom: float = 0.1,
    nodes: Sequence[Node] = NODES,
    kv_cache_dtypes: Sequence[str] = ("auto", "fp8"),
) -> list[PlanRow]:
    """The memory plan of ``cfg`` on ``devices`` devices: a row per layout (``layouts``; with
    the routed experts over all ranks only for a model that has some) and kind of weights
    (``dtype``, then FP8 with ``cfg.quantization``'s blocks, or DeepSeek's 128 x 128 for an
    unquantized config). For each of ``nodes`` with ``devices`` GPUs: the
    requests of ``request_tokens`` tokens each device holds after the weights, its DP rank's
    scratch blocks (``batch.scratch_blocks``) and ``headroom`` (a fraction of its memory
    kept for activations, workspaces and XLA's own), times the DP ranks."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom}")
    dtype = jnp.dtype(dtype)
    quantization = cfg.quantization or DEEPSEEK_FP8
    kinds = {
        dtype.name: (parameter_tensors(cfg, dtype), None),
        "fp8": (parameter_tensors(cfg, dtype, quantization), quantization),
    }
    nodes = [node for node in nodes if node.devices == devices]
    rows = []
    for layout in layouts(devices):
        if layout.expert_parallel and cfg.moe is None:
            continue  # no routed experts: the same as its layout without
        for kind, (tensors, blocks) in kinds.items():
            try:
                _check_layout(cfg, layout)
                weights = weight_bytes(tensors, layout, blocks)
            except ValueError as e:
                rows.append(PlanRow(layout, kind, refused=str(e)))
                continue
            scratch = scratch_blocks(block_size, layout.data_parallel) * block_size
            token_bytes, requests = {}, {}
            for kv in kv_cache_dtypes:
                cache = functools.partial(
                    cache_bytes,
                    cfg,
                    layout,
                    block_size=block_size,
                    kv_cache_dtype=kv,
                    model_dtype=dtype,
                )
                token_bytes[kv] = cache(block_size) / block_size
                fixed = weights + (cache(scratch) if scratch else 0)
                for node in nodes:
                    free = math.floor(node.device_bytes * (1 - headroom)) - fixed
                    fits = free // cache(request_tokens) * layout.data_parallel
                    requests[node.name, kv] = fits if free >= 0 else None
            runs = stacked_runs(
                cfg, None if blocks is None else blocks.weight_block_size, _placement(layout)
            )
            rows.append(
                PlanRow(
                    layout,
                    kind,
                    weights,
                    token_bytes,
                    layout.tensor_parallel,
                    requests,
                    runs=tuple(count for _, count, _ in runs),
                )
            )
    return rows


def _placement(layout: Layout):
    """``load_model``'s ``placement(path, ndim)`` under ``layout``: each parameter's sharding
    on the layout's abstract mesh."""

    def placement(path, ndim: int) -> NamedSharding:
        return NamedSharding(layout.mesh(), layout.partition_spec(list(map(str, path)), ndim))

    return placement


def _check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """ValueError (one line) unless the layout's TP divides what it splits, and its devices
    the routed experts they split (``sharding.check_divisible``, as the runtime refuses)."""
    sharding.check_divisible(
        cfg, layout.tensor_parallel, layout.data_parallel, layout.expert_parallel
    )


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters (``jax.eval_shape`` of ``DeepseekModel``)."""
    return sum(math.prod(t.shape) for t in parameter_tensors(cfg, jnp.bfloat16))


def format_plan(
    rows: Sequence[PlanRow],
    *,
    request_tokens: int,
    kv_cache_dtypes: Sequence[str] = ("auto", "fp8"),
) -> str:
    """The plan as a Markdown table: a row per layout and kind of weights, a column of
    requests per node the rows were planned for."""
    nodes = list(dict.fromkeys(name for row in rows for name, _ in row.requests))
    caches = " / ".join(_cache_name(kv) for kv in kv_cache_dtypes)
    header = ["layout", "weights", "layers stacked as", "weights GiB/device"]
    header += [f"cache bytes/token/device ({caches})", "devices holding a token"]
    header += [f"{request_tokens}-token requests on {node} ({caches})" for node in nodes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.layout.name, row.weights]
        if row.refused:
            cells += [f"refused: {row.refused}"] + [""] * (len(header) - 3)
        else:
            cells += [
                " + ".join(map(str, row.runs)),
                f"{row.weight_bytes / GIB:.1f}",
                " / ".join(f"{row.token_bytes[kv]:,.0f}" for kv in kv_cache_dtypes),
                str(row.token_copies),
            ]
            for node in nodes:
                counts = [row.requests[node, kv] for kv in kv_cache_dtypes]
                fits = all(count is not None for count in counts)
                cells.append(" / ".join(map(str, counts)) if fits else "weights do not fit")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cache_name(kv_cache_dtype: str) -> str:
    return "model dtype" if kv_cache_dtype == "auto" else kv_cache_dtype
