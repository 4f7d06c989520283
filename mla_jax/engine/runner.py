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

A *window* runs several decode steps in one program (a ``lax.fori_loop`` of the window's
steps): each step's model call, sampling (``_sample``, with the key the one-step path would
use for that step's number), stop checks (EOS where the request stops at it, and the steps
the host gave it, which its ``max_new_tokens`` and so the model length bound) and the advance
of its positions, cache slots and lengths happen on the device; a stopped request computes
on but writes nothing. The loop runs all its steps, even once every request has stopped: XLA's
GPU runtime runs a loop whose trip count it cannot prove by copying its condition to the host
and waiting for it each iteration, which holds the host in the launch until the device has
run nearly the whole window; a fixed trip count lets the launch return at once (the engine
runs a window only where some request takes all of its steps, so only an EOS leaves steps
idle).
The host builds the window's metadata once, for its last step's lengths: the block tables
hold every block the window writes (the scheduler allocated them up front), and the decode
kernel's split-KV schedule for those lengths is cut to each step's on the device
(``kernels.decode.truncate_schedule``; a schedule rebuilt on the device would cost more than
the few keys a request gains in a window unbalance it). The host then reads each request's
tokens of the whole window at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mla_jax import kernels
from mla_jax.cache.latent_cache import PAD_SLOT
from mla_jax.cache.metadata import AttentionMetadata, Buckets, StepShape, build_metadata
from mla_jax.engine.batch import StepBatch
from mla_jax.engine.compilation import cache_hits
from mla_jax.kernels.fp8 import Fp8Cache
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a step's packed int32 buffer divides into arrays, and the decode steps it runs
    (a program's static input)."""

    metadata: jax.tree_util.PyTreeDef  # of the metadata's arrays
    # Metadata arrays, then ids, source, temperatures, step; a window's steps and EOS stops.
    shapes: tuple[tuple[int, ...], ...]
    steps: int = 1  # decode steps: more than one makes a window
    eos_token_ids: tuple[int, ...] = ()  # what a window stops a request at

    def unpack(self, packed: jax.Array) -> tuple[AttentionMetadata, ...]:
        """``(metadata, input_ids, source, temperature_bits, step)`` from the buffer, and a
        window's ``(steps, stops_at_eos)`` after them."""
        arrays, offset = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            arrays.append(packed[offset : offset + size].reshape(shape))
            offset += size
        num_metadata = self.metadata.num_leaves
        metadata = jax.tree.unflatten(self.metadata, arrays[:num_metadata])
        return (metadata, *arrays[num_metadata:])


class Compiled(NamedTuple):
    """A program the runner compiled (or loaded from the persistent compilation cache)."""

    shape: StepShape
    seconds: float
    from_cache: bool


class StepOutput(NamedTuple):
    """A step started on the device: where each rank's requests find their sampled tokens.

    rows: each DP rank's ``[R]`` rows (in its batch's order) of its sampled tokens; rank r's
      tokens are ``tokens[r * max_rows : (r + 1) * max_rows]``.
    tokens: ``[dp * max_rows]`` int32 on the device, not waited for; a window's are
      ``[dp * (steps + 1) * max_rows]``: per rank, each step's row of tokens, then each
      request's count of tokens before it stopped (``window_tokens``).
    shape: the step's program shape (``shape.steps``: its decode steps).
    compiled: the programs this step compiled first.
    call_s: seconds in the compiled program's call (the launch: the input's transfer and,
      on a GPU, the kernels' launches; more means the call waited for the device).
    prepare_s: seconds in ``prepare`` (the metadata, the kernels' schedules, the packing).
    """

    rows: list[np.ndarray]
    tokens: jax.Array
    shape: StepShape
    compiled: list[Compiled]
    call_s: float
    prepare_s: float = 0.0


# XLA options for the step programs on GPUs (scripts/bench_serve.py's per-kernel breakdown
# shows what each removes; BENCHMARKS.md has the figures):
# - no Triton gemm fusions: at small batches they pad the MLP weights and copy each layer's
#   weights out of the stacked array every step; cuBLAS reads them in place;
# - no dot merging: it concatenates gate/up and the q/kv projections' weights every step to
#   make one matmul of two;
# - dynamic-slice fusion: cuBLAS reads a layer's weights straight out of the stacked array.
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_enable_dynamic_slice_fusion": True,
}


def window_tokens(tokens: np.ndarray, ranks: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's ``StepOutput.tokens`` read on the host as ``[dp, steps, max_rows]`` tokens and
    ``[dp, max_rows]`` counts of tokens each row keeps (1 each after a one-step batch)."""
    if steps == 1:
        tokens = tokens.reshape(ranks, 1, -1)
        return tokens, np.ones(tokens[:, 0].shape, np.int32)
    tokens = tokens.reshape(ranks, steps + 1, -1)
    return tokens[:, :steps], tokens[:, steps]


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
    block ids local to it. With ``expert_parallel`` (a ``"dp"`` axis) the routed experts
    split over all of the mesh's devices and the MoE layers send every DP rank's tokens to
    them (``expert_parallel.py``). With ``unroll_decode_layers`` the programs of decode-only
    steps and windows unroll the scans over the layers (``DeepseekModel.__call__``)."""

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
        expert_parallel: bool = False,
        unroll_decode_layers: bool = True,
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
            num_heads //= mesh.shape[sharding.TENSOR_AXIS]
            shardings = sharding.param_shardings(state, mesh, expert_parallel)
            self.params = [
                jax.device_put(param, placement)
                for param, placement in zip(self.params, shardings, strict=True)
            ]
            self.key = jax.device_put(self.key, sharding.replicated(mesh))
            # The cache comes placed (the engine makes it in place: split over the DP ranks
            # it may not fit one device whole).
            self.tokens = jax.device_put(self.tokens, sharding.per_data_rank(mesh))
            impl = sharding.sharded_kernels(kernel_set, mesh)
        self.cache = cache
        self.block_size = block_size
        self.num_blocks = cache.shape[1] // ranks  # a rank's (all of them without DP)
        self.workspace_size = workspace_size
        self.max_rows = max_rows  # sampled-token rows of the largest step, per DP rank
        self.kernel_plan = kernels.KernelPlan.for_impl(
            kernel_set,
            num_heads,
            quantized_cache=isinstance(cache, Fp8Cache),
            page_size=block_size,
        )
        self.step_count = 0
        self.programs: dict[StepLayout, jax.stages.Compiled] = {}
        # The MoE layers' tokens cross the DP ranks (each holds a range of the experts).
        expert_axis = sharding.DATA_AXIS if expert_parallel else None

        def forward(layout: StepLayout, params, cache, packed, previous_tokens, key):
            """One step, or a window (``layout.steps`` > 1): ``(tokens, cache)``, or
            ``(last tokens, window tokens, cache)``."""
            metadata, input_ids, source, temperature_bits, step, *window = layout.unpack(packed)
            # Pending tokens (sampled by the previous step, unread by the host) come from it.
            input_ids = jnp.where(source >= 0, previous_tokens[jnp.maximum(source, 0)], input_ids)
            model = nnx.merge(graphdef, jax.tree.unflatten(param_tree, params))
            temperatures = jax.lax.bitcast_convert_type(temperature_bits, jnp.float32)
            if layout.steps > 1:
                return window_forward(
                    layout, model, cache, metadata, input_ids, temperatures, step, key, *window
                )
            logits, cache = model(
                input_ids,
                cache,
                metadata,
                impl=impl,
                expert_axis=expert_axis,
                unroll_layers=unroll_decode_layers and metadata.prefill is None,
            )
            tokens = _sample(logits, temperatures, jax.random.fold_in(key, step[0]))
            return jnp.zeros(max_rows, jnp.int32).at[: tokens.shape[0]].set(tokens), cache

        def window_forward(
            layout, model, cache, metadata, input_ids, temperatures, step, key, steps, stops
        ):
            """A decode window. ``metadata``: its last step's (each row ``steps - 1`` tokens
            on); ``steps [Bd]``: each row's steps (0 on padding); ``stops [Bd]``: 1 where it
            stops at EOS. A row writes and samples while live; a stopped row writes nothing
            and keeps its length. Returns each row's last live token (the next step's
            pending one), the ``[steps + 1, max_rows]`` tokens and counts (flat), the cache."""
            # XLA re-records a CUDA graph whenever a buffer it holds has moved, and the
            # loop body is one graph of the whole model: it is to hold only the parameters,
            # the cache and the temporary buffer (kept in place by the allocator, see
            # engine.allocator), not the call's input or outputs, new buffers each call. So
            # the outputs exist before the loop (the barrier orders them first: everything
            # the loop reads comes through it), and XLA cannot lend their buffers to the
            # loop's temporaries (its buffer assignment had put a decode kernel's outputs in
            # the last tokens' buffer); and the body reads copies of the input's slices.
            # (Measured as a whole: with these and the allocator, XLA's log shows the body
            # recorded once; the copies alone were not measured.)
            outputs = (
                jnp.zeros((layout.steps + 1, max_rows), jnp.int32),
                jnp.zeros(max_rows, jnp.int32),
            )
            outputs, read = jax.lax.optimization_barrier(
                (outputs, (metadata, input_ids, temperatures, step, steps, stops))
            )
            metadata, input_ids, temperatures, step, steps, stops = read
            decode = metadata.decode
            table = decode.block_table
            rows = jnp.arange(table.shape[0])
            behind = jnp.maximum(steps - 1, 0)
            eos = jnp.asarray(layout.eos_token_ids, jnp.int32)

            def at(positions, seq_lens, live):
                slots = table[rows, positions // block_size] * block_size + positions % block_size
                schedule = decode.schedule
                if schedule is not None:
                    schedule = kernels.decode.truncate_schedule(schedule, seq_lens)
                return dataclasses.replace(
                    metadata,
                    positions=positions,
                    slot_mapping=jnp.where(live, slots, PAD_SLOT),
                    decode=dataclasses.replace(decode, seq_lens=seq_lens, schedule=schedule),
                )

            def one_step(s, carry):
                ids, positions, seq_lens, last, tokens, counts, cache, live = carry
                metadata = at(positions, seq_lens, live)
                # Every rank runs every step (a known trip count), so the MoE layers'
                # collectives under expert parallelism see all ranks; a stopped row writes
                # nothing.
                logits, cache = model(
                    ids,
                    cache,
                    metadata,
                    impl=impl,
                    expert_axis=expert_axis,
                    unroll_layers=unroll_decode_layers,
                )
                sampled = _sample(logits, temperatures, jax.random.fold_in(key, step[0] + s))
                last = jnp.where(live, sampled, last)
                tokens = tokens.at[s].set(sampled)
                counts = counts + live
                at_eos = (stops > 0) & (sampled[:, None] == eos).any(-1)
                next_live = live & ~at_eos & (s + 1 < steps)
                advance = next_live.astype(jnp.int32)
                return (
                    sampled,
                    positions + advance,
                    seq_lens + advance,
                    last,
                    tokens,
                    counts,
                    cache,
                    next_live,
                )

            num_rows = table.shape[0]
            start = (
                input_ids,
                metadata.positions - behind,
                decode.seq_lens - behind,
                input_ids,
                jnp.zeros((layout.steps, num_rows), jnp.int32),
                jnp.zeros(num_rows, jnp.int32),
                cache,
                steps > 0,
            )
            # Static bounds: a loop of known trip count (see the module's docstring).
            _, _, _, last, tokens, counts, cache, _ = jax.lax.fori_loop(
                0, layout.steps, one_step, start
            )
            window, last_tokens = outputs
            window = window.at[: layout.steps, :num_rows].set(tokens)
            window = window.at[layout.steps, :num_rows].set(counts)
            return last_tokens.at[:num_rows].set(last), window.reshape(-1), cache

        if ranks > 1:
            split_rows = jax.sharding.PartitionSpec(sharding.DATA_AXIS)
            by_block = jax.sharding.PartitionSpec(None, sharding.DATA_AXIS)
            replicated = jax.sharding.PartitionSpec()

            def rank_forward(layout, params, cache, packed, previous_tokens, key):
                # One rank's step: its [1, len] row of the packed buffers, its cache blocks,
                # its previous tokens; its own sampling stream.
                key = jax.random.fold_in(key, jax.lax.axis_index(sharding.DATA_AXIS))
                return forward(layout, params, cache, packed[0], previous_tokens, key)

            # Each rank's parameters: whole, or with expert parallelism its range of the
            # routed experts (split further over its "tp" devices by the partitioner).
            rank_params = [sharding.data_rank_spec(placed) for placed in shardings]

            def data_parallel_forward(layout: StepLayout, params, cache, packed, tokens, key):
                outputs = (split_rows,) * (1 + (layout.steps > 1))  # tokens (and a window's)
                return jax.shard_map(
                    lambda *args: rank_forward(layout, *args),
                    mesh=mesh,
                    in_specs=(rank_params, by_block, split_rows, split_rows, replicated),
                    out_specs=(*outputs, by_block),
                    axis_names={sharding.DATA_AXIS},  # "tp" stays with the partitioner
                    check_vma=False,
                )(params, cache, packed, tokens, key)

            self._forward = data_parallel_forward
        else:
            self._forward = forward

    def prepare(
        self,
        batches: Sequence[StepBatch],
        buckets: Buckets,
        steps: int = 1,
        eos_token_ids: tuple[int, ...] = (),
    ) -> tuple[StepLayout, np.ndarray, list[np.ndarray], StepShape]:
        """Host side of a step: its layout, the packed buffer (``[len]``, or ``[dp, len]``
        with data parallelism), each rank's rows of the sampled tokens and the step's shape.
        ``batches``: each DP rank's batch (one without DP), all of one shape under
        ``buckets`` (``batch.pad_ranks`` makes them so). ``steps`` > 1: a window of that many
        decode steps (decodes only; each request runs its ``batch.steps``), stopping a
        request at ``eos_token_ids`` where its ``stops_at_eos``."""
        if len(batches) != self.data_parallel:
            raise ValueError(f"{len(batches)} batches for {self.data_parallel} DP ranks")
        first_step = self.step_count + 1  # a window's steps take the numbers that follow
        self.step_count += steps
        window = (steps, tuple(eos_token_ids)) if steps > 1 else None
        prepared = [self._prepare_rank(batch, buckets, first_step, window) for batch in batches]
        layouts = {layout for layout, *_ in prepared}
        if len(layouts) != 1:  # the engine pads the ranks to one shape: a bug if they differ
            shapes = sorted({shape for *_, shape in prepared})
            raise RuntimeError(f"the DP ranks' steps differ in shape: {shapes}")
        packed = [rank_packed for _, rank_packed, _, _ in prepared]
        rows = [rank_rows for _, _, rank_rows, _ in prepared]
        packed = packed[0] if self.data_parallel == 1 else np.stack(packed)
        return layouts.pop(), packed, rows, prepared[0][3]

    def _prepare_rank(
        self,
        batch: StepBatch,
        buckets: Buckets,
        first_step: int,
        window: tuple[int, tuple[int, ...]] | None,
    ) -> tuple[StepLayout, np.ndarray, np.ndarray, StepShape]:
        """One rank's step: its layout, packed buffer, request rows and shape. ``window``:
        ``(steps, eos_token_ids)`` of a window, whose metadata is its last step's."""
        context_lens = batch.context_lens
        if window is not None:
            if batch.num_prefill_tokens:
                raise ValueError("a window runs decodes only")
            context_lens = context_lens + np.maximum(batch.steps - 1, 0)
        metadata = build_metadata(
            context_lens,
            batch.query_lens,
            batch.block_table,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            workspace_size=self.workspace_size,
            buckets=buckets,
            kernel_plan=self.kernel_plan,
        )
        num_tokens = metadata.positions.shape[0]
        rows = metadata.request_rows()
        token_rows = metadata.token_rows()
        input_ids = np.zeros(num_tokens, np.int32)
        input_ids[token_rows] = batch.input_ids
        source = np.full(num_tokens, -1, np.int32)
        source[token_rows] = batch.source
        temperatures = np.zeros(metadata.logits_indices.shape[0], np.float32)
        temperatures[rows] = batch.temperatures
        leaves, treedef = jax.tree.flatten(metadata)
        arrays = [
            *leaves,
            input_ids,
            source,
            temperatures.view(np.int32),
            np.array([first_step], np.int32),
        ]
        shape, steps, eos_token_ids = metadata.step_shape(), 1, ()
        if window is not None:
            steps, eos_token_ids = window
            shape = shape._replace(steps=steps)
            row_steps = np.zeros(len(temperatures), np.int32)
            row_steps[rows] = batch.steps
            stops = np.zeros(len(temperatures), np.int32)
            stops[rows] = batch.stops_at_eos
            arrays += [row_steps, stops]
        layout = StepLayout(treedef, tuple(a.shape for a in arrays), steps, eos_token_ids)
        packed = np.concatenate([np.asarray(a, np.int32).ravel() for a in arrays])
        return layout, packed, rows, shape

    def launch(
        self,
        batches: Sequence[StepBatch],
        buckets: Buckets,
        steps: int = 1,
        eos_token_ids: tuple[int, ...] = (),
    ) -> StepOutput:
        """Builds the step (``batches``: each DP rank's; ``steps`` > 1: a window, see
        ``prepare``) and starts it on the device; returns without waiting for it."""
        start = time.perf_counter()
        layout, packed, rows, shape = self.prepare(batches, buckets, steps, eos_token_ids)
        prepare_s = time.perf_counter() - start
        compiled = []
        program = self.programs.get(layout)
        if program is None:
            program, record = self._compile(layout, packed, shape)
            compiled.append(record)
        start = time.perf_counter()
        *tokens, self.cache = program(self.params, self.cache, packed, self.tokens, self.key)
        call_s = time.perf_counter() - start
        # A step's sampled tokens; a window's last live ones, then the whole window's.
        self.tokens = tokens[0]
        return StepOutput(rows, tokens[-1], shape, compiled, call_s, prepare_s)

    def _compile(self, layout: StepLayout, packed: np.ndarray, shape: StepShape):
        start, hits = time.perf_counter(), cache_hits()
        shardings = {}
        if self.mesh is not None:  # parameters, cache and sampled tokens as placed
            inputs = sharding.per_data_rank(self.mesh)  # the packed buffers: a row per DP rank
            shardings = dict(
                in_shardings=(
                    [p.sharding for p in self.params],
                    self.cache.sharding,
                    inputs,
                    self.tokens.sharding,
                    sharding.replicated(self.mesh),
                ),
                out_shardings=(
                    *(self.tokens.sharding,) * (1 + (layout.steps > 1)),  # a window's too
                    self.cache.sharding,
                ),
            )
        jitted = jax.jit(lambda *args: self._forward(layout, *args), donate_argnums=1, **shardings)
        lowered = jitted.lower(self.params, self.cache, packed, self.tokens, self.key)
        options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
        program = lowered.compile(compiler_options=options)
        self.programs[layout] = program
        return program, Compiled(shape, time.perf_counter() - start, cache_hits() > hits)
