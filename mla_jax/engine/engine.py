"""A small generation engine: continuous batching, chunked prefill, a fixed set of programs.

The engine checks requests, asks the scheduler (``scheduler.py``) for each step, turns it
into arrays (``batch.py``) and hands them to the model runner (``runner.py``); the sampled
tokens come back to the requests and the scheduler: data flows one way. With
``async_scheduling`` (the default) it builds and launches step n+1 before reading step n's
sampled tokens, as vLLM's asynchronous scheduling does, so the host's work overlaps the
device's; a request that ends on an EOS token is found one step late, and that step's token
for it is dropped. With prefix caching (the default) a request starts from the longest
prefix of its prompt that an earlier request left in the cache (``cache/block_manager.py``);
with data parallelism it joins the rank that caches the longest such prefix, if that rank has
room. While every running request decodes and no prompt could start, it runs a *window* of
``decode_window`` decode steps in one device program (``runner.py``) and reads the window's
tokens once; a step that may start a prompt (or preempt) runs alone, after the previous
window's tokens are read, so that time to first token does not wait on windows.

Every step is padded to one of the shapes ``EngineConfig.fixed_buckets`` lists (a ladder of
decode batch sizes, of prefill token counts, fixed prefill slots, block-table width and
context chunks), so a workload compiles only from that set, which ``precompile()`` compiles
ahead of time and JAX's persistent cache (``compilation.py``) keeps across processes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from mla_jax import kernels
from mla_jax.cache.block_manager import BlockManager
from mla_jax.cache.latent_cache import CacheFullError, cache_dtype, init_cache
from mla_jax.cache.metadata import Buckets, StepShape
from mla_jax.engine import allocator
from mla_jax.engine.batch import build_batch, pad_ranks, scratch_blocks
from mla_jax.engine.input_batch import InputBatch
from mla_jax.engine.request import Request, RequestError
from mla_jax.engine.runner import Compiled, ModelRunner, StepOutput, window_tokens
from mla_jax.engine.scheduler import Scheduled, Scheduler, WindowPlan
from mla_jax.kernels import fp8
from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic_decode
from mla_jax.kernels.decode.pallas_mosaic_gpu import BLOCK_H as MOSAIC_BLOCK_H
from mla_jax.model.config import ModelConfig
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.parallel import sharding

__all__ = ["Engine", "EngineConfig", "Request", "RequestError", "Stats", "StepRecord"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: the cache's geometry and dtype, a step's budget, the programs'
    shapes, the kernels, and the GPUs (tensor and data parallelism)."""

    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64
    max_num_prefills: int | None = None  # prompt chunks per step (default: up to 4)
    max_model_len: int | None = None  # longest sequence admitted (default: model_len())
    workspace_size: int = 8192  # cached-context rows gathered per chunk
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), bfloat16, float32 or fp8
    buckets: Buckets | None = None  # default: fixed_buckets(max_model_len)
    impl: str = "auto"  # kernels.select
    # Launch step n+1 before reading step n's tokens (host work overlaps the device's).
    async_scheduling: bool = True
    # Devices the heads, MLP columns, vocabulary and experts are split across (sharding.py).
    tensor_parallel: int = 1
    # Ranks (of tensor_parallel devices each) that each run their own requests over their
    # own num_blocks / data_parallel cache blocks; max_num_seqs and max_num_batched_tokens
    # bound each rank's step (sharding.py).
    data_parallel: int = 1
    # With data_parallel > 1: split the routed experts over all data_parallel x
    # tensor_parallel devices (each holds 1/D of them) instead of a whole TP share on every
    # DP rank; the MoE layers send every rank's tokens to the experts' devices and back
    # (sharding.py, expert_parallel.py).
    expert_parallel: bool = False
    # Keep full blocks by content and start a request from the longest cached prefix of its
    # prompt (cache/block_manager.py); each DP rank caches its own blocks.
    enable_prefix_caching: bool = True
    # Decode steps a window runs in one device program while every running request decodes
    # (the host's work then comes once a window); 1 (or None, the default) runs every step
    # alone.
    decode_window: int | None = None
    # Unroll the scans over the layers in the programs of decode-only steps and windows: on a
    # GPU XLA's runtime then launches a step as a few CUDA graphs instead of each layer's
    # kernels (on an H200 the call of a 27-layer batch-1 step took 0.56 ms instead of 2.34);
    # those programs' compile time grows with the depth. Programs with prompts keep the scan.
    unroll_decode_layers: bool = True

    def __post_init__(self):
        for name in (
            "block_size",
            "num_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "tensor_parallel",
            "data_parallel",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.expert_parallel and self.data_parallel == 1:
            raise ValueError(
                "expert_parallel needs data_parallel > 1 (with one DP rank, tensor parallelism "
                "already splits the experts over every device)"
            )
        if self.expert_parallel and self.tensor_parallel > 1 and sharding.gspmd_for_data_parallel():
            raise ValueError(
                f"expert_parallel with tensor_parallel > 1 does not compile on jax "
                f"{jax.__version__}: the GSPMD partitioner data parallelism uses there aborts "
                "on the experts split over dp x tp (use tensor_parallel=1, or jax 0.10 / 0.12)"
            )
        if self.num_blocks % self.data_parallel:
            raise ValueError(
                f"num_blocks ({self.num_blocks}) does not divide among "
                f"data_parallel={self.data_parallel} ranks"
            )
        scratch = scratch_blocks(self.block_size, self.data_parallel)
        if self.num_blocks // self.data_parallel <= scratch:
            raise ValueError(
                f"num_blocks ({self.num_blocks}) leaves no block to each of data_parallel="
                f"{self.data_parallel} ranks after its {scratch} scratch blocks"
            )
        cache_dtype(self.kv_cache_dtype, np.float32)  # refuses names the kernels don't take
        if self.decode_window is not None and self.decode_window <= 0:
            raise ValueError(f"decode_window must be positive, got {self.decode_window}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.workspace_size < self.block_size:
            raise ValueError(
                f"workspace_size ({self.workspace_size}) must hold at least one block "
                f"({self.block_size})"
            )
        if self.max_num_prefills is not None and not (
            0 < self.max_num_prefills <= self.workspace_size // self.block_size
        ):
            raise ValueError(
                f"max_num_prefills ({self.max_num_prefills}) must be positive and the "
                f"workspace ({self.workspace_size}) must hold a block ({self.block_size}) "
                "for each"
            )

    def window_steps(self) -> int:
        """Decode steps of a window: ``decode_window``, by default 1 (every step alone).
        Windows are opt-in: with decode programs unrolled over the layers the device, not
        the host, bounds a step on an H200 (``bench_serve.py``: the same step time alone and
        in windows of 8), and a window only delays a waiting prompt's start."""
        return 1 if self.decode_window is None else self.decode_window

    @property
    def prefill_slots(self) -> int:
        """Prompt chunks per step: ``max_num_prefills``, by default as many as the workspace
        holds a block for, up to 4."""
        return self.max_num_prefills or min(4, self.workspace_size // self.block_size)

    def model_len(self, max_position_embeddings: int) -> int:
        """The longest sequence admitted: ``max_model_len``, else the smaller of the model's
        ``max_position_embeddings`` and what the cache holds (it sets the block-table width
        every step carries, so a 160K-position model with a small cache stays cheap)."""
        cache_tokens = self.num_blocks // self.data_parallel * self.block_size  # a rank's
        return self.max_model_len or min(max_position_embeddings, cache_tokens)

    def fixed_buckets(self, max_model_len: int) -> Buckets:
        """The only shapes the engine runs: decode batches on a x4 ladder from 16 up to
        ``max_num_seqs``, prefill tokens a quarter of the budget or all of it,
        ``prefill_slots`` prefill slots, block tables as wide as ``max_model_len`` needs,
        and as many context chunks as such a context can take (the empty ones are skipped)."""
        decodes = [size for size in (16, 64, 256, 1024) if size < self.max_num_seqs]
        budget = self.max_num_batched_tokens
        tokens = sorted({budget} | ({budget // 4} if budget // 4 >= 16 else set()))
        share = self.workspace_size // self.prefill_slots // self.block_size * self.block_size
        return Buckets(
            decode_buckets=(*decodes, self.max_num_seqs),
            token_buckets=tuple(tokens),
            num_prefills=self.prefill_slots,
            table_width=-(-max_model_len // self.block_size),
            num_chunks=max(1, -(-(max_model_len - 1) // share)),
        )


class StepRecord(NamedTuple):
    """One step (or window: ``shape.steps`` decode steps) as the host saw it: its tokens,
    its shape, ``interval_s`` (since the previous step's launch: in a steady run, the step's
    wall time), and how the host spent that interval: ``host_s`` working (giving out an
    earlier step's tokens, scheduling, building and launching this one), of which
    ``call_s`` in the compiled program's call, and ``wait_s`` blocked reading an earlier
    step's tokens (the device still running it). Compilation is in none of them; without
    it, interval = host + wait (the first launch of a call: host since its scheduling began,
    interval 0). Of ``host_s`` also: ``batch_s`` building the ranks' batches
    (``build_batch``) and ``prepare_s`` the runner's metadata and packing
    (``ModelRunner.prepare``)."""

    decodes: int
    prefill_tokens: int
    shape: StepShape
    host_s: float
    interval_s: float
    steps: int = 1  # decode steps it runs: a window's longest request's (EOS may end it early)
    call_s: float = 0.0
    wait_s: float = 0.0
    batch_s: float = 0.0
    prepare_s: float = 0.0


@dataclasses.dataclass
class Stats:
    """What the engine did so far: steps, tokens, time, compilations, preemptions, prefix
    cache hits."""

    steps: int = 0
    prompt_tokens: int = 0  # computed (a preempted request's again when recomputed)
    cached_prompt_tokens: int = 0  # taken from the prefix cache instead of computed
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    compile_s: float = 0.0  # compiling, or loading from the compilation cache
    programs_from_cache: int = 0  # of the buckets, those loaded from the compilation cache
    first_token_s: float | None = None  # from generate()'s start to its first sampled token
    preemptions: int = 0  # requests whose blocks were taken, to be recomputed
    compiled: list[Compiled] = dataclasses.field(default_factory=list)  # programs, in order
    step_records: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Of the prompt tokens requests needed in the cache, the share found there."""
        needed = self.prompt_tokens + self.cached_prompt_tokens
        return self.cached_prompt_tokens / needed if needed else None

    @property
    def buckets(self) -> list[StepShape]:
        """The shapes of the programs compiled (or loaded) so far."""
        return [program.shape for program in self.compiled]

    def as_dict(self) -> dict:
        """The stats as JSON-ready numbers (``result.json``), with medians of decode steps."""
        run_s = max(self.elapsed_s - self.compile_s, 1e-9)
        decode_steps = [r for r in self.step_records if r.decodes and not r.prefill_tokens]
        hit_rate = self.prefix_cache_hit_rate
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache_hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "generated_tokens": self.generated_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "compile_s": round(self.compile_s, 4),
            "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 4),
            "tokens_per_s": round((self.prompt_tokens + self.generated_tokens) / run_s, 2),
            "decode_steps": len(decode_steps),
            # Per decode step: a window's time over its steps.
            "decode_step_ms": _median_ms([r.interval_s / r.steps for r in decode_steps[1:]]),
            "decode_host_ms": _median_ms([r.host_s / r.steps for r in decode_steps]),
            "decode_wait_ms": _median_ms([r.wait_s / r.steps for r in decode_steps]),
            "programs": len(self.buckets),
            "programs_from_cache": self.programs_from_cache,
            "preemptions": self.preemptions,
            "buckets": [s._asdict() for s in self.buckets],
        }


@dataclasses.dataclass
class InFlight:
    """A step on the device: each DP rank's scheduled chunks and where their tokens land."""

    scheduled: list[list[Scheduled]]
    output: StepOutput

    def previous_rows(self) -> dict[int, int]:
        """For each request (by ``id``) whose token this step samples, its row among its
        rank's sampled tokens: where the next step's pending token comes from."""
        return {
            id(entry.request): row
            for batch, rows in zip(self.scheduled, self.output.rows, strict=True)
            for entry, row in zip(batch, rows.tolist(), strict=True)
            if entry.samples
        }


def _median_ms(seconds: list[float]) -> float | None:
    return round(float(np.median(seconds)) * 1e3, 3) if seconds else None


def _refuse_unindexable_fp8_cache(cfg: EngineConfig, model_cfg: ModelConfig, dtype) -> None:
    """ValueError (one line, naming ``num_blocks``) for an FP8 cache whose e4m3 latent on a
    device fills (2 GiB, 4 GiB], where the Triton decode kernel would read past 2 GiB from
    the wrong address (``fp8.check_triton_indexable``): on a GPU, when that kernel may run,
    i.e. unless every decode takes the Mosaic GPU one (64 heads a device and more, in
    ``dtype``, on pages it runs). Caught here rather than when a step first compiles it."""
    if cfg.kv_cache_dtype != "fp8" or jax.default_backend() != "gpu":
        return
    mla = model_cfg.mla
    blocks = cfg.num_blocks // cfg.data_parallel
    latent = (model_cfg.num_layers * blocks, cfg.block_size, mla.kv_lora_rank)
    backend = kernels.select(cfg.impl).backend
    if backend == "reference":
        return
    if backend == "mosaic_gpu":
        heads = mla.num_heads // cfg.tensor_parallel
        rows = jax.ShapeDtypeStruct((1, heads, mla.kv_lora_rank), dtype)
        rope = jax.ShapeDtypeStruct((1, heads, mla.qk_rope_head_dim), dtype)
        cache = jax.ShapeDtypeStruct((*latent[:2], mla.cache_width), dtype)
        if heads >= MOSAIC_BLOCK_H and mosaic_decode.unsupported(rows, rope, cache) is None:
            return
    try:
        fp8.check_triton_indexable(jax.ShapeDtypeStruct(latent, fp8.FP8), "the latent")
    except ValueError as err:
        block_bytes = model_cfg.num_layers * cfg.block_size * mla.kv_lora_rank
        low, high = fp8.TRITON_WRAPPING_BYTES
        below = low // block_bytes * cfg.data_parallel
        above = (high // block_bytes + 1) * cfg.data_parallel
        raise ValueError(
            f"num_blocks {cfg.num_blocks} with kv_cache_dtype='fp8': {err}; take num_blocks "
            f"<= {below} or >= {above}"
        ) from None


def _refuse_float16_overflow(cfg: EngineConfig, model: DeepseekModel) -> None:
    """ValueError (one line) for an FP8 cache the Mosaic GPU decode's float16 wgmmas could
    overflow: where the model's ``kv_a_layernorm`` weights let a latent value pass
    ``FLOAT16_MAX_LATENT`` (``float16_latent_bound``: weights up to 2500 at rank 512).
    Checked when the engine is made, since under the step's jit the cache's scales are not
    known."""
    if cfg.kv_cache_dtype != "fp8" or kernels.select(cfg.impl).backend != "mosaic_gpu":
        return
    if not mosaic_decode.MosaicDecodeConfig().float16_mma:
        return
    weights = [
        node.weight[...]
        for path, node in nnx.iter_graph(model)
        if path and path[-1] == "kv_a_layernorm"
    ]
    largest = max(float(np.abs(np.asarray(w, np.float32)).max()) for w in weights)
    rank = model.cfg.mla.kv_lora_rank
    bound = mosaic_decode.float16_latent_bound(largest, rank)
    limit = mosaic_decode.FLOAT16_MAX_LATENT
    if bound > limit:
        raise ValueError(
            f"kv_cache_dtype='fp8': kv_a_layernorm weights up to {largest:g} let the latent "
            f"reach {bound:g} (sqrt({rank}) x the weight), past {limit:g}, which the Mosaic "
            "GPU decode's float16 wgmmas hold; use kv_cache_dtype='auto'"
        )


class Engine:
    """Runs requests to completion over a model and its paged latent cache."""

    def __init__(
        self,
        model: DeepseekModel,
        cfg: EngineConfig = EngineConfig(),
        *,
        seed: int = 0,
        log: Callable[[str], None] | None = None,
    ):
        self.model_cfg: ModelConfig = model.cfg
        self.cfg = cfg
        self.max_model_len = cfg.model_len(self.model_cfg.max_position_embeddings)
        if self.max_model_len > self.model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({self.model_cfg.max_position_embeddings})"
            )
        self.buckets = cfg.buckets or cfg.fixed_buckets(self.max_model_len)
        fixed = (self.buckets.num_prefills, self.buckets.table_width, self.buckets.num_chunks)
        if cfg.data_parallel > 1 and None in fixed:
            raise ValueError(
                "data parallelism needs buckets that fix num_prefills, table_width and "
                "num_chunks (EngineConfig.fixed_buckets), so that every rank's step has one shape"
            )
        # A step samples at most one token per decode slot and prefill slot.
        self.max_rows = self.buckets.decodes(cfg.max_num_seqs) + self.buckets.prefills(
            cfg.prefill_slots
        )
        _refuse_unindexable_fp8_cache(cfg, self.model_cfg, model.embed_tokens.embedding[...].dtype)
        _refuse_float16_overflow(cfg, model)
        mesh = cache_sharding = None
        if cfg.tensor_parallel > 1 or cfg.data_parallel > 1:
            sharding.check_divisible(
                self.model_cfg,
                cfg.tensor_parallel,
                cfg.data_parallel,
                cfg.expert_parallel,
                model.fp8_blocks,
            )
            mesh = sharding.make_mesh(cfg.tensor_parallel, cfg.data_parallel)
            cache_sharding = sharding.per_data_rank(mesh, axis=1)
        cache = init_cache(
            self.model_cfg.num_layers,
            cfg.num_blocks,
            cfg.block_size,
            self.model_cfg.mla.cache_width,
            cache_dtype(cfg.kv_cache_dtype, model.embed_tokens.embedding[...].dtype),
            kv_lora_rank=self.model_cfg.mla.kv_lora_rank,
            sharding=cache_sharding,
        )
        self.runner = ModelRunner(
            model,
            cache,
            block_size=cfg.block_size,
            workspace_size=cfg.workspace_size,
            max_rows=self.max_rows,
            impl=cfg.impl,
            seed=seed,
            mesh=mesh,
            expert_parallel=cfg.expert_parallel,
            unroll_decode_layers=cfg.unroll_decode_layers,
        )
        # One block manager and scheduler per DP rank, over its blocks less its scratch blocks.
        self.rank_blocks = cfg.num_blocks // cfg.data_parallel
        self.blocks_per_rank = self.rank_blocks - scratch_blocks(cfg.block_size, cfg.data_parallel)
        self.schedulers = [
            Scheduler(
                BlockManager(
                    self.blocks_per_rank,
                    cfg.block_size,
                    enable_caching=cfg.enable_prefix_caching,
                ),
                block_size=cfg.block_size,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                prefill_slots=cfg.prefill_slots,
            )
            for _ in range(cfg.data_parallel)
        ]
        # Each rank's block-table rows, kept across steps (only what changed is rewritten).
        self.input_batches = [InputBatch() for _ in range(cfg.data_parallel)]
        # Decode steps of a window (cfg.window_steps()); a benchmark may change it between
        # generate calls (a window's programs compile as it first runs them).
        self.decode_window = cfg.window_steps()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        allocator.check(self.log)
        self.stats = Stats()
        self._last_launch: float | None = None
        # Seconds the host has blocked reading sampled tokens, in all and by the last launch:
        # not host work (StepRecord).
        self.waited_s = self._waited_at_launch = 0.0

    # -- requests ----------------------------------------------------------------------

    def _check_all(self, requests: list[Request]) -> None:
        """Refuses, before anything runs, what is not a Request, a Request given twice (it
        would share its blocks with itself), one already finished and any ``_check`` refuses."""
        seen: dict[Request, int] = {}
        for i, req in enumerate(requests):
            if not isinstance(req, Request):
                raise RequestError(f"requests[{i}] is a {type(req).__name__}, not a Request")
            if req in seen:
                raise RequestError(
                    f"requests[{i}] is requests[{seen[req]}]: the same Request object twice "
                    "in one call"
                )
            seen[req] = i
            if req.finished:
                raise RequestError(
                    f"requests[{i}] already finished ({len(req.output_ids)} tokens generated); "
                    "give a new Request"
                )
            self._check(req)

    def _check(self, req: Request) -> None:
        req.check()  # its fields may have changed since it was made
        vocab, max_len = self.model_cfg.vocab_size, self.max_model_len
        if not req.prompt_ids:
            raise RequestError("a prompt needs at least one token")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        total = len(req.prompt_ids) + req.max_new_tokens
        where = f"prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total}"
        if total > self.model_cfg.max_position_embeddings:
            raise RequestError(
                f"{where} exceeds max_position_embeddings {self.model_cfg.max_position_embeddings}"
            )
        blocks = -(-total // self.cfg.block_size)
        if blocks > self.blocks_per_rank:
            where = " per DP rank" if self.cfg.data_parallel > 1 else ""
            raise CacheFullError(
                f"a request of {total} tokens needs {blocks} cache blocks of "
                f"{self.cfg.block_size}; the cache has {self.blocks_per_rank}{where}"
            )
        if total > max_len:
            raise RequestError(f"{where} exceeds max_model_len {max_len}")

    def _done(self, req: Request) -> bool:
        if len(req.output_ids) >= req.max_new_tokens:
            return True
        eos = self.model_cfg.eos_token_ids
        return not req.ignore_eos and bool(req.output_ids) and req.output_ids[-1] in eos

    # -- steps ---------------------------------------------------------------------------

    def _launch(
        self,
        scheduled: list[list[Scheduled]],
        previous: InFlight | None,
        started: float,
        buckets: Buckets | None = None,
        steps: int = 1,
    ) -> InFlight:
        """Starts each DP rank's scheduled chunks on the device (``started``: when its
        scheduling began; ``steps`` > 1: a window of decodes)."""
        buckets = buckets or self.buckets
        previous_rows = previous.previous_rows() if previous is not None else {}
        batch_start = time.perf_counter()
        batches = [
            build_batch(rank_scheduled, previous_rows, input_batch)
            for rank_scheduled, input_batch in zip(scheduled, self.input_batches, strict=True)
        ]
        batch_s = time.perf_counter() - batch_start
        decodes = sum(batch.num_decodes for batch in batches)
        tokens = sum(int(batch.query_lens.sum()) for batch in batches)
        longest = max((int(batch.steps.max(initial=1)) for batch in batches), default=1)
        real = None
        if len(batches) > 1:
            batches, real, buckets = pad_ranks(
                batches, buckets, blocks_per_rank=self.rank_blocks, block_size=self.cfg.block_size
            )
        output = self.runner.launch(batches, buckets, steps, self.model_cfg.eos_token_ids)
        if real is not None:
            output = output._replace(
                rows=[rows[part] for rows, part in zip(output.rows, real, strict=True)]
            )
        now = time.perf_counter()
        compile_s = 0.0
        for shape, seconds, from_cache in output.compiled:
            compile_s += seconds
            self.stats.compile_s += seconds
            self.stats.programs_from_cache += from_cache
            how = "loaded from the compilation cache" if from_cache else "compiled"
            self.log(f"{how} bucket {shape} in {seconds:.2f}s")
        self.stats.compiled += output.compiled
        # The host's time since the previous launch (the first: since its scheduling began,
        # with no step in flight to wait for).
        interval = waited = 0.0
        since = started
        if self._last_launch is not None:
            since = self._last_launch
            interval = now - since - compile_s
            waited = self.waited_s - self._waited_at_launch
        self.stats.step_records.append(
            StepRecord(
                decodes,
                tokens - decodes,
                output.shape,
                now - since - compile_s - waited,
                interval,
                longest,
                output.call_s,
                waited,
                batch_s,
                output.prepare_s,
            )
        )
        self._last_launch, self._waited_at_launch = now, self.waited_s
        return InFlight(scheduled, output)

    def _collect(self, in_flight: InFlight, t_start: float) -> None:
        """Reads a step's (or window's) sampled tokens, waiting for it, and gives them to its
        requests."""
        output = in_flight.output
        start = time.perf_counter()
        tokens = np.asarray(output.tokens)  # blocks until the device has run the step
        now = time.perf_counter()
        self.waited_s += now - start
        tokens, counts = window_tokens(tokens, len(in_flight.scheduled), output.shape.steps)
        generated = 0
        for rank, (batch, rows) in enumerate(zip(in_flight.scheduled, output.rows, strict=True)):
            # Each request's tokens and count as Python lists at once: indexing the arrays
            # request by request costs more.
            row_tokens = tokens[rank].T[rows].tolist()
            row_counts = counts[rank][rows].tolist()
            for entry, sampled, count in zip(batch, row_tokens, row_counts, strict=True):
                req = entry.request
                if not entry.samples:
                    continue
                req.num_pending -= entry.steps
                if req.finished:  # ended by an EOS found after this step was launched
                    continue
                if count < entry.steps:  # stopped at an EOS: the later steps wrote nothing
                    req.num_computed = entry.start + count
                req.output_ids += sampled[:count]
                req.token_times += [now] * count
                generated += count
                if self._done(req):
                    self.schedulers[rank].finish(req)
        self.stats.generated_tokens += generated
        if generated and self.stats.first_token_s is None:
            self.stats.first_token_s = now - t_start

    def step_shapes(self) -> list[StepShape]:
        """Every program this engine can run (its buckets fix every axis): each step shape,
        and with windows a window of each decode batch size."""
        shapes = self.buckets.step_shapes(self.cfg.workspace_size)
        if self.decode_window == 1:
            return shapes
        windows = [s._replace(steps=self.decode_window) for s in shapes if not s.prefills]
        return shapes + windows

    def precompile(self, steps: list[list[tuple[int, int]]] | None = None) -> list[StepShape]:
        """Compiles programs ahead of serving: by default all of ``step_shapes()``, else
        those of the given steps, each a list of ``(context_len, query_len)`` pairs, decodes
        (query_len 1) first, e.g. ``[[(1000, 1)] * 32, [(0, 512)]]``. Runs each once on
        dummy tokens in freshly allocated blocks, which go back to the block manager: call it
        while no request runs. Returns the buckets compiled to (``stats.buckets`` lists all
        so far). With data parallelism the steps run on the first rank, the others padded."""
        start = time.perf_counter()
        try:
            if steps is not None:
                return [self._dummy_step(pairs, self.buckets) for pairs in steps]
            shapes = []
            for shape in self.step_shapes():
                # One decode and one 2-token prompt, padded to this shape's sizes.
                pairs = [(1, 1)] * bool(shape.decodes) + [(0, 2)] * bool(shape.prefills)
                buckets = dataclasses.replace(
                    self.buckets,
                    decode_buckets=(shape.decodes or 1,),
                    token_buckets=(shape.tokens - shape.decodes or 1,),
                )
                shapes.append(self._dummy_step(pairs, buckets, shape.steps))
            return shapes
        finally:
            # Its compile time is in stats.compile_s, which rates subtract from elapsed_s.
            self.stats.elapsed_s += time.perf_counter() - start

    def _dummy_step(
        self, pairs: list[tuple[int, int]], buckets: Buckets, steps: int = 1
    ) -> StepShape:
        scheduler, batch = self.schedulers[0], []
        idle = [[] for _ in self.schedulers[1:]]
        try:
            for context_len, query_len in pairs:
                req = Request([0] * (context_len + query_len), max_new_tokens=steps)
                if not scheduler.grow(req, context_len + query_len + steps - 1):
                    raise CacheFullError("too few free cache blocks to precompile")
                batch.append(Scheduled(req, context_len, query_len, True, steps))
            launched = self._launch([batch, *idle], None, time.perf_counter(), buckets, steps)
            launched.output.tokens.block_until_ready()
            return launched.output.shape
        finally:
            self._last_launch = None
            for entry in batch:
                scheduler.release(entry.request)

    def generate(self, requests: list[Request], *, progress_every_s: float = 2.0) -> list[Request]:
        """Runs every request to completion; returns them in the given order. Bad requests
        are refused (``RequestError``) before any runs; an error while they run (a failed
        step, an interrupt) takes them all out of the engine, their blocks freed and their
        progress reset, before it propagates, so that the engine serves the next call."""
        self._check_all(requests)
        try:
            return self._run(requests, progress_every_s)
        except BaseException:
            self._withdraw(requests)
            raise
        finally:
            self._last_launch = None

    def _run(self, requests: list[Request], progress_every_s: float) -> list[Request]:
        """Queues ``requests`` and runs steps until every rank's queues are empty."""
        schedulers = self.schedulers
        for req in requests:
            schedulers[self._rank_for(req)].add(req)
        t_start = t_log = time.perf_counter()
        elapsed_before = self.stats.elapsed_s
        in_flight: InFlight | None = None
        while any(s.has_work for s in schedulers) or in_flight is not None:
            started = time.perf_counter()
            windows, in_flight = self._next_steps(in_flight, t_start)
            steps = self.decode_window if windows[0] is not None else 1
            batches = [
                self._schedule(s, window) if s.has_work else []
                for s, window in zip(schedulers, windows, strict=True)
            ]
            launched = None
            if any(batches):
                self.stats.steps += 1
                for req, start, count, *_ in (entry for batch in batches for entry in batch):
                    prompt_len = len(req.prompt_ids)
                    self.stats.prompt_tokens += max(min(start + count, prompt_len) - start, 0)
                launched = self._launch(batches, in_flight, started, steps=steps)
            elif in_flight is None and any(s.has_work for s in schedulers):
                # (With no work left, the window _next_steps read finished every request.)
                free = [s.block_manager.num_free for s in schedulers]
                raise CacheFullError(f"no request can be scheduled: {sum(free)} free blocks")
            if in_flight is not None:  # the device already has the next step, if any
                self._collect(in_flight, t_start)
            in_flight = launched
            if in_flight is not None and not self.cfg.async_scheduling:
                self._collect(in_flight, t_start)
                in_flight = None
            now = time.perf_counter()
            self.stats.elapsed_s = elapsed_before + now - t_start
            self.stats.preemptions = sum(s.preemptions for s in schedulers)
            self.stats.cached_prompt_tokens = sum(s.cached_prompt_tokens for s in schedulers)
            has_work = any(s.has_work for s in schedulers)
            if now - t_log >= progress_every_s or not (has_work or in_flight):
                t_log = now
                running = sum(len(s.running) for s in schedulers)
                self.log(self._progress(running, sum(len(s.waiting) for s in schedulers)))
        return requests

    def _next_steps(
        self, in_flight: InFlight | None, t_start: float
    ) -> tuple[list[WindowPlan | None], InFlight | None]:
        """Each rank's window for the next step (where every rank can run one and some
        request takes all its steps; else None each: a single step) and what stays in
        flight: a single step after a window reads the window's tokens first, as it may
        start, preempt or recompute a request with several of them pending."""
        steps, schedulers = self.decode_window, self.schedulers
        windows = [s.plan_window(steps) for s in schedulers] if steps > 1 else [None]
        if None not in windows and any(window.fills for window in windows):
            return windows, in_flight
        if in_flight is not None and in_flight.output.shape.steps > 1:
            self._collect(in_flight, t_start)
            in_flight = None
        return [None] * len(schedulers), in_flight

    @staticmethod
    def _schedule(scheduler: Scheduler, window: WindowPlan | None) -> list[Scheduled]:
        """A window's chunks where ``window`` plans one, else a single step's."""
        return scheduler.schedule() if window is None else scheduler.schedule_window(window)

    def _withdraw(self, requests: list[Request]) -> None:
        """Takes ``requests`` out of every rank's queues with their blocks and resets their
        progress; their tokens in flight are dropped (the steps that hold them write only
        to blocks now free, and later steps run after them on the device)."""
        withdrawn = set(requests)
        for scheduler in self.schedulers:
            scheduler.withdraw(withdrawn)
        for req in requests:
            req.num_computed = req.num_pending = 0

    def _rank_for(self, req: Request) -> int:
        """The DP rank ``req`` joins: of the ranks with room (fewer than ``max_num_seqs``
        requests running or waiting), the one caching the longest prefix of its prompt, the
        least loaded of those on a tie; with no prefix cached on any, the least loaded rank."""
        schedulers = self.schedulers
        loads = [len(s.running) + len(s.waiting) for s in schedulers]
        least_loaded = min(range(len(schedulers)), key=loads.__getitem__)
        if len(schedulers) == 1 or not self.cfg.enable_prefix_caching:
            return least_loaded
        cached = {
            rank: len(schedulers[rank].block_manager.match(req.prompt_ids))
            for rank in range(len(schedulers))
            if loads[rank] < self.cfg.max_num_seqs
        }
        best = max(cached, key=lambda rank: (cached[rank], -loads[rank]), default=None)
        return best if best is not None and cached[best] else least_loaded

    def _progress(self, running: int, waiting: int) -> str:
        s = self.stats.as_dict()
        hit_rate = s["prefix_cache_hit_rate"]
        cached = f"{s['cached_prompt_tokens']} cached" + (
            "" if hit_rate is None else f" (hit rate {hit_rate:.1%})"
        )
        return (
            f"step {s['steps']}: {running} running, {waiting} waiting | "
            f"{s['prompt_tokens']} prompt tokens computed, {cached}, "
            f"{s['generated_tokens']} generated; "
            f"{s['tokens_per_s']:.1f} tok/s (excluding {s['compile_s']:.1f}s compiling or loading "
            f"{len(self.stats.buckets)} buckets)"
        )
