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

from mla_jax import kernels
from mla_jax.cache.metadata import AttentionMetadata, Buckets, StepShape, build_metadata
from mla_jax.engine.compilation import cache_hits
from mla_jax.engine.scheduler import Request, Scheduled
from mla_jax.kernels.fp8 import Fp8Cache
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.parallel import sharding


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
    ``mesh`` (``sharding.py``) the parameters are split across its ``"tp"`` devices and the
    kernels run per rank on its heads; the cache and a step's inputs and sampled tokens are
    replicated over ``"tp"`` and, with a ``"dp"`` axis, split over it: each DP rank runs its
    own batch on its own ``num_blocks`` cache blocks (of the ``cache``'s ``dp * num_blocks``),
    block ids local to it."""

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
        self.data_parallel = sharding.data_parallel(mesh)
        ranks = self.data_parallel
        # The last step's sampled tokens, max_rows per DP rank.
        self.tokens = jnp.zeros(ranks * max_rows, jnp.int32)
        self.key = jax.random.key(seed)
        self.mesh = mesh
        num_heads = model.cfg.mla.num_heads  # per rank: the kernels see a rank's heads
        kernel_set = kernels.select(impl)
        if mesh is not None:
            num_heads //= mesh.shape[sharding.AXIS]
            shardings = sharding.param_shardings(state, mesh)
            self.params = [
                jax.device_put(param, placement)
                for param, placement in zip(self.params, shardings, strict=True)
            ]
            self.key = jax.device_put(self.key, sharding.replicated(mesh))
            # The cache comes placed (the engine makes it in place: split over the DP ranks
            # it may not fit one device whole).
            self.tokens = jax.device_put(self.tokens, sharding.over_ranks(mesh))
            impl = sharding.sharded_kernels(kernel_set, mesh)
        self.cache = cache
        self.block_size = block_size
        self.num_blocks = cache.shape[1] // ranks  # a rank's (all of them without DP)
        self.scratch_blocks = scratch_blocks(block_size, ranks)
        self.workspace_size = workspace_size
        self.max_rows = max_rows  # sampled-token rows of the largest step, per DP rank
        self.kernel_plan = kernels.KernelPlan.for_impl(kernel_set, num_heads)
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

        if ranks > 1:
            by_rank = jax.sharding.PartitionSpec(sharding.DATA_AXIS)
            by_block = jax.sharding.PartitionSpec(None, sharding.DATA_AXIS)
            replicated = jax.sharding.PartitionSpec()

            def rank_forward(layout, params, cache, packed, previous_tokens, key):
                # One rank's step: its [1, len] row of the packed buffers, its cache blocks,
                # its previous tokens; its own sampling stream.
                key = jax.random.fold_in(key, jax.lax.axis_index(sharding.DATA_AXIS))
                return forward(layout, params, cache, packed[0], previous_tokens, key)

            def data_parallel_forward(layout: StepLayout, params, cache, packed, tokens, key):
                return jax.shard_map(
                    lambda *args: rank_forward(layout, *args),
                    mesh=mesh,
                    in_specs=(replicated, by_block, by_rank, by_rank, replicated),
                    out_specs=(by_rank, by_block),
                    axis_names={sharding.DATA_AXIS},  # "tp" stays with the partitioner
                    check_vma=False,
                )(params, cache, packed, tokens, key)

            self._forward = data_parallel_forward
        else:
            self._forward = forward

    def _common_buckets(self, batches: Sequence[Sequence[Scheduled]], buckets: Buckets) -> Buckets:
        """``buckets`` with one-entry decode and prefill-token ladders, the sizes the rank
        with the most decodes and the one with the most prefill tokens need: every rank's
        step takes the same shape (its other axes are fixed: the engine checks it)."""
        decodes = max(sum(entry.count == 1 for entry in batch) for batch in batches)
        tokens = max(sum(entry.count for entry in batch if entry.count > 1) for batch in batches)
        return dataclasses.replace(
            buckets,
            decode_buckets=(buckets.decodes(max(decodes, 1)),),
            token_buckets=(buckets.prefill_tokens(max(tokens, 2)),),
        )

    def _padded(
        self, batch: Sequence[Scheduled], *, decodes: bool, prefills: bool
    ) -> tuple[list, slice]:
        """``batch`` with a padding decode in front if it has none and the step has
        (``decodes``), a padding prompt at the end likewise (``prefills``), each in this
        rank's scratch blocks; and the slice of the real requests in it."""
        scratch = np.arange(self.num_blocks - self.scratch_blocks, self.num_blocks, dtype=np.int32)
        own_decodes = any(entry.count == 1 for entry in batch)
        own_prefills = any(entry.count > 1 for entry in batch)
        front = [] if own_decodes or not decodes else [_padding(scratch[:1], 1)]
        back = [] if own_prefills or not prefills else [_padding(scratch[1:], 2)]
        return [*front, *batch, *back], slice(len(front), len(front) + len(batch))

    def prepare(
        self,
        batches: Sequence[Sequence[Scheduled]],
        previous: Launched | None,
        buckets: Buckets,
    ) -> tuple[StepLayout, np.ndarray, np.ndarray, StepShape]:
        """Host side of a step: the packed buffer (``[len]``, or ``[dp, len]`` with data
        parallelism), its layout, each request's row of the sampled tokens (in the order of
        the batches, concatenated: rank r's rows are offset by ``r * max_rows``) and the
        step's shape. ``batches``: each DP rank's requests (one batch without DP);
        ``previous``: the step whose tokens are still pending."""
        if len(batches) != self.data_parallel:
            raise ValueError(f"{len(batches)} batches for {self.data_parallel} DP ranks")
        self.step_count += 1
        previous_rows = {}
        if previous is not None:
            previous_rows = {
                id(entry.request): row % self.max_rows
                for entry, row in zip(previous.batch, previous.rows, strict=True)
                if entry.samples
            }
        if self.data_parallel == 1:
            return self._prepare_rank(batches[0], previous_rows, buckets)
        common = self._common_buckets(batches, buckets)
        entries = [entry for batch in batches for entry in batch]
        decodes = any(entry.count == 1 for entry in entries)
        prefills = any(entry.count > 1 for entry in entries)
        layouts, packed, rows, shapes = set(), [], [], set()
        for rank, batch in enumerate(batches):
            padded, real = self._padded(batch, decodes=decodes, prefills=prefills)
            layout, rank_packed, rank_rows, shape = self._prepare_rank(
                padded, previous_rows, common
            )
            layouts.add(layout)
            shapes.add(shape)
            packed.append(rank_packed)
            rows.append(rank_rows[real] + rank * self.max_rows)
        if len(layouts) != 1:  # the buckets fix every axis: a bug if they differ
            raise RuntimeError(f"the DP ranks' steps differ in shape: {sorted(shapes)}")
        return layouts.pop(), np.stack(packed), np.concatenate(rows), shapes.pop()

    def _prepare_rank(
        self, batch: Sequence[Scheduled], previous_rows: dict[int, int], buckets: Buckets
    ) -> tuple[StepLayout, np.ndarray, np.ndarray, StepShape]:
        """One rank's step: its packed buffer, layout, request rows and shape."""
        width = max(len(entry.request.block_ids) for entry in batch)
        block_table = np.zeros((len(batch), width), np.int32)
        context_lens = np.empty(len(batch), np.int32)
        query_lens = np.empty(len(batch), np.int32)
        temperatures = np.empty(len(batch), np.float32)
        ids: list[int] = []
        pending: list[tuple[int, int]] = []  # (token index in the step, previous step's row)
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
        self,
        batches: Sequence[Sequence[Scheduled]],
        previous: Launched | None,
        buckets: Buckets,
    ) -> Launched:
        """Builds the step (``batches``: each DP rank's requests) and starts it on the
        device; returns without waiting for it."""
        layout, packed, rows, shape = self.prepare(batches, previous, buckets)
        program = self.programs.get(layout) or self._compile(layout, packed, shape)
        self.tokens, self.cache = program(self.params, self.cache, packed, self.tokens, self.key)
        batch = [entry for rank_batch in batches for entry in rank_batch]
        return Launched(batch, rows, self.tokens, shape)

    def _compile(self, layout: StepLayout, packed: np.ndarray, shape: StepShape):
        start, hits = time.perf_counter(), cache_hits()
        shardings = {}
        if self.mesh is not None:  # parameters, cache and sampled tokens as placed
            inputs = sharding.over_ranks(self.mesh)  # the packed buffers: a row per DP rank
            shardings = dict(
                in_shardings=(
                    [p.sharding for p in self.params],
                    self.cache.sharding,
                    inputs,
                    self.tokens.sharding,
                    sharding.replicated(self.mesh),
                ),
                out_shardings=(self.tokens.sharding, self.cache.sharding),
            )
        jitted = jax.jit(lambda *args: self._forward(layout, *args), donate_argnums=1, **shardings)
        lowered = jitted.lower(self.params, self.cache, packed, self.tokens, self.key)
        options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
        program = lowered.compile(compiler_options=options)
        self.programs[layout] = program
        self.compiled.append((shape, time.perf_counter() - start, cache_hits() > hits))
        return program


def scratch_blocks(block_size: int, data_parallel: int) -> int:
    """Blocks at the end of each DP rank's cache that no request gets: a rank's padding
    requests (a decode, a 2-token prompt) write there when another rank's step has a part it
    lacks. None without data parallelism."""
    return 0 if data_parallel == 1 else 1 + -(-2 // block_size)


def _padding(block_ids: np.ndarray, count: int) -> Scheduled:
    """A padding request of ``count`` tokens from position 0 in ``block_ids``: a decode (1)
    or a prompt (2); greedy, its sampled token never read."""
    return Scheduled(Request([0] * count, 1, block_ids=block_ids), 0, count, False)
