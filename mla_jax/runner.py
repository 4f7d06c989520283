"""The model runner: a step's host arrays in, its sampled tokens out, one compiled program
per step shape.

Host cost per step is what keeps a decode step off its roofline, so a step crosses to the
device as little as possible: every int32 array of the step (the metadata, token ids,
sampling temperatures' bits, the step number) is packed into **one** buffer, one transfer,
and the compiled executable is called with that buffer, the flat list of parameters, the
cache (donated: one array, or an FP8 cache's three) and the previous step's sampled tokens;
nothing is flattened or hashed beyond the step's shape. Sampled tokens stay on the device,
where the next step reads the ones it needs (``source``), so the host reads them only to
return them to requests, while the device already runs the next step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import kernels
from kernels.fp8 import Fp8Cache

from . import sharding
from .compilation import cache_hits
from .metadata import AttentionMetadata, Buckets, StepShape, build_metadata
from .model import DeepseekModel
from .scheduler import Scheduled


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a step's packed int32 buffer divides into arrays (a program's static input)."""

    metadata: jax.tree_util.PyTreeDef  # of the metadata's arrays
    shapes: tuple[tuple[int, ...], ...]  # metadata arrays, then ids, source, temperatures, step

    def unpack(self, packed: jax.Array) -> tuple[AttentionMetadata, ...]:
        arrays, offset = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            arrays.append(packed[offset : offset + size].reshape(shape))
            offset += size
        num_metadata = self.metadata.num_leaves
        metadata = jax.tree.unflatten(self.metadata, arrays[:num_metadata])
        return (metadata, *arrays[num_metadata:])


@dataclasses.dataclass
class Launched:
    """A step in flight: its requests and the device array of its sampled tokens."""

    batch: list[Scheduled]
    rows: np.ndarray  # row of each request in ``tokens``
    tokens: jax.Array  # [max_rows] int32
    shape: StepShape


# XLA options for the step programs on GPUs, from a per-kernel breakdown of a decode step
# (H200, 2026-11-22, scripts/bench_serve.py; V2-Lite-shaped model, 64 x 512 / 256 x 4096):
# - no Triton gemm fusions: at small batches they padded the MLP weights (a 0.76 ms pad
#   fusion a step) and copied each layer's weights out of the stacked array (1.7 ms of
#   memcpy); cuBLAS reads them in place;
# - no dot merging: it concatenated gate/up and the q/kv projections' weights every step
#   (1.35 ms) to make one matmul of two;
# - dynamic-slice fusion: cuBLAS reads a layer's weights straight out of the stacked array.
# Together: device time 6.4 -> 3.7 ms and 15.9 -> 12.4 ms.
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_enable_dynamic_slice_fusion": True,
}


def _sample(logits: jax.Array, temperatures: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy where temperature is 0, else a draw from softmax(logits / temperature)."""
    t = jnp.where(temperatures > 0, temperatures, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperatures > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class ModelRunner:
    """Owns the model's parameters (flat), the cache and the compiled programs. With a
    ``mesh`` (tensor parallelism, ``sharding.py``) the parameters are split across its
    devices, the cache and the step's inputs and sampled tokens replicated, and the kernels
    run per rank on its heads."""

    def __init__(
        self,
        model: DeepseekModel,
        cache: jax.Array | Fp8Cache,
        *,
        block_size: int,
        workspace_size: int,
        max_rows: int,
        impl: str,
        seed: int,
        mesh: Mesh | None = None,
    ):
        graphdef, state = nnx.split(model)
        self.params, param_tree = jax.tree.flatten(state)
        self.tokens = jnp.zeros(max_rows, jnp.int32)  # the last step's sampled tokens
        self.key = jax.random.key(seed)
        self.mesh = mesh
        num_heads = model.cfg.mla.num_heads  # per rank: the kernels see a rank's heads
        kernel_set = kernels.select(impl)
        if mesh is not None:
            num_heads //= mesh.size
            shardings = sharding.param_shardings(state, mesh)
            self.params = [
                jax.device_put(param, placement)
                for param, placement in zip(self.params, shardings, strict=True)
            ]
            cache, self.tokens, self.key = jax.device_put(
                (cache, self.tokens, self.key), sharding.replicated(mesh)
            )
            impl = sharding.sharded_kernels(kernel_set, mesh)
        self.cache = cache
        self.block_size = block_size
        self.num_blocks = cache.shape[1]
        self.workspace_size = workspace_size
        self.max_rows = max_rows  # sampled-token rows of the largest step
        self.kernel_plan = (
            kernels.KernelPlan.for_device(num_heads) if kernel_set is kernels.PALLAS else None
        )
        self.step_count = 0
        self.programs: dict[StepLayout, jax.stages.Compiled] = {}
        self.compiled: list[tuple[StepShape, float, bool]] = []  # shape, seconds, from cache

        def forward(layout: StepLayout, params, cache, packed, previous_tokens, key):
            md, input_ids, source, temperature_bits, step = layout.unpack(packed)
            # Pending tokens (sampled by the previous step, unread by the host) come from it.
            input_ids = jnp.where(source >= 0, previous_tokens[jnp.maximum(source, 0)], input_ids)
            model = nnx.merge(graphdef, jax.tree.unflatten(param_tree, params))
            logits, cache = model(input_ids, cache, md, impl=impl)
            temperatures = jax.lax.bitcast_convert_type(temperature_bits, jnp.float32)
            tokens = _sample(logits, temperatures, jax.random.fold_in(key, step[0]))
            return jnp.zeros(max_rows, jnp.int32).at[: tokens.shape[0]].set(tokens), cache

        self._forward = forward

    def prepare(
        self, batch: Sequence[Scheduled], previous: Launched | None, buckets: Buckets
    ) -> tuple[StepLayout, np.ndarray, np.ndarray, StepShape]:
        """Host side of a step: the packed buffer, its layout, each request's logits row
        and the step's shape. ``previous``: the step whose tokens are still pending."""
        width = max(len(entry.request.block_ids) for entry in batch)
        block_table = np.zeros((len(batch), width), np.int32)
        context_lens = np.empty(len(batch), np.int32)
        query_lens = np.empty(len(batch), np.int32)
        temperatures = np.empty(len(batch), np.float32)
        ids: list[int] = []
        pending: list[tuple[int, int]] = []  # (token index in the step, previous step's row)
        previous_rows = {}
        if previous is not None:
            previous_rows = {
                id(entry.request): row
                for entry, row in zip(previous.batch, previous.rows, strict=True)
                if entry.samples
            }
        for i, (req, start, count, _) in enumerate(batch):
            block_table[i, : len(req.block_ids)] = req.block_ids
            context_lens[i], query_lens[i] = start, count
            temperatures[i] = req.temperature
            chunk, offset = req.token_ids(start, start + count)
            if offset is not None:
                pending.append((len(ids) + offset, previous_rows[id(req)]))
            ids += chunk
        md = build_metadata(
            context_lens,
            query_lens,
            block_table,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            workspace_size=self.workspace_size,
            buckets=buckets,
            kernel_plan=self.kernel_plan,
        )
        num_tokens = md.positions.shape[0]
        rows = md.request_rows()
        token_rows = md.token_rows()
        input_ids = np.zeros(num_tokens, np.int32)
        input_ids[token_rows] = ids
        source = np.full(num_tokens, -1, np.int32)
        for index, row in pending:
            source[token_rows[index]] = row
        temperature_rows = np.zeros(md.logits_indices.shape[0], np.float32)
        temperature_rows[rows] = temperatures
        self.step_count += 1
        leaves, treedef = jax.tree.flatten(md)
        arrays = [
            *leaves,
            input_ids,
            source,
            temperature_rows.view(np.int32),
            np.array([self.step_count], np.int32),
        ]
        layout = StepLayout(treedef, tuple(a.shape for a in arrays))
        packed = np.concatenate([np.asarray(a, np.int32).ravel() for a in arrays])
        return layout, packed, rows, md.step_shape()

    def launch(
        self, batch: Sequence[Scheduled], previous: Launched | None, buckets: Buckets
    ) -> Launched:
        """Builds the step and starts it on the device; returns without waiting for it."""
        layout, packed, rows, shape = self.prepare(batch, previous, buckets)
        program = self.programs.get(layout) or self._compile(layout, packed, shape)
        self.tokens, self.cache = program(self.params, self.cache, packed, self.tokens, self.key)
        return Launched(list(batch), rows, self.tokens, shape)

    def _compile(self, layout: StepLayout, packed: np.ndarray, shape: StepShape):
        start, hits = time.perf_counter(), cache_hits()
        shardings = {}
        if self.mesh is not None:  # parameters as placed; the rest replicated
            replicated = sharding.replicated(self.mesh)
            shardings = dict(
                in_shardings=(
                    [p.sharding for p in self.params],
                    replicated,
                    replicated,
                    replicated,
                    replicated,
                ),
                out_shardings=(replicated, replicated),
            )
        jitted = jax.jit(lambda *args: self._forward(layout, *args), donate_argnums=1, **shardings)
        lowered = jitted.lower(self.params, self.cache, packed, self.tokens, self.key)
        options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
        program = lowered.compile(compiler_options=options)
        self.programs[layout] = program
        self.compiled.append((shape, time.perf_counter() - start, cache_hits() > hits))
        return program
