"""A small generation engine: continuous batching, chunked prefill, a fixed set of programs.

Each step the scheduler takes every running decode (one token each) and then fills the rest
of the token budget with up to ``prefill_slots`` prompt chunks, so long prompts span
steps and come back with cached context. Cache blocks are allocated as tokens arrive; when
a decode finds none free, the newest running request is preempted (its blocks freed) and
later recomputed from its prompt and the tokens it had generated, as vLLM does. A request
waits while its next chunk finds no free block, and one that could never fit is refused.

Every step is padded to one of the shapes ``EngineConfig.fixed_buckets`` lists (a ladder of
decode batch sizes, of prefill token counts, fixed prefill slots, block-table width and
context chunks), so a workload compiles only from that set, which ``precompile()`` compiles
ahead of time and JAX's persistent cache (``mla_jax.compilation``) keeps across processes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels

from .cache import BlockAllocator, CacheFullError, cache_dtype, init_cache
from .compilation import cache_hits
from .config import ModelConfig
from .metadata import AttentionMetadata, Buckets, StepShape, build_metadata
from .model import DeepseekModel


class RequestError(ValueError):
    """A request the engine cannot run: empty prompt, token ids outside the vocabulary, too
    long for the model, bad sampling settings."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
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

    def __post_init__(self):
        for name in (
            "block_size",
            "num_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        cache_dtype(self.kv_cache_dtype, jnp.float32)  # refuses names the kernels don't take
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

    @property
    def prefill_slots(self) -> int:
        """Prompt chunks per step: ``max_num_prefills``, by default as many as the workspace
        holds a block for, up to 4."""
        return self.max_num_prefills or min(4, self.workspace_size // self.block_size)

    def model_len(self, max_position_embeddings: int) -> int:
        """The longest sequence admitted: ``max_model_len``, else the smaller of the model's
        ``max_position_embeddings`` and what the cache holds (it sets the block-table width
        every step carries, so a 160K-position model with a small cache stays cheap)."""
        cache_tokens = self.num_blocks * self.block_size
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


@dataclasses.dataclass(eq=False)  # a request is itself, whatever its fields hold
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    num_computed: int = 0  # tokens already in the cache
    num_preemptions: int = 0  # times its blocks were taken and its tokens recomputed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids ``[start, stop)`` of prompt + output."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(start - p, 0) : max(stop - p, 0)]


@dataclasses.dataclass
class Stats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    compile_s: float = 0.0  # compiling, or loading from the compilation cache
    programs_from_cache: int = 0  # of the buckets, those loaded from the compilation cache
    first_token_s: float | None = None  # from generate()'s start to its first sampled token
    preemptions: int = 0  # requests whose blocks were taken, to be recomputed
    buckets: list[StepShape] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        run_s = max(self.elapsed_s - self.compile_s, 1e-9)
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "compile_s": round(self.compile_s, 4),
            "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 4),
            "tokens_per_s": round((self.prompt_tokens + self.generated_tokens) / run_s, 2),
            "programs": len(self.buckets),
            "programs_from_cache": self.programs_from_cache,
            "preemptions": self.preemptions,
            "buckets": [s._asdict() for s in self.buckets],
        }


def _sample(logits: jax.Array, temperatures: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy where temperature is 0, else a draw from softmax(logits / temperature)."""
    t = jnp.where(temperatures > 0, temperatures, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperatures > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class Engine:
    """Runs requests to completion over a model and its paged latent caches."""

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
        self.graphdef, self.state = nnx.split(model)
        self.caches = init_cache(
            self.model_cfg.num_layers,
            cfg.num_blocks,
            cfg.block_size,
            self.model_cfg.mla.cache_width,
            cache_dtype(cfg.kv_cache_dtype, model.embed_tokens.embedding[...].dtype),
            kv_lora_rank=self.model_cfg.mla.kv_lora_rank,
        )
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.max_model_len = cfg.model_len(self.model_cfg.max_position_embeddings)
        if self.max_model_len > self.model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({self.model_cfg.max_position_embeddings})"
            )
        self.buckets = cfg.buckets or cfg.fixed_buckets(self.max_model_len)
        self.kernel_plan = (
            kernels.KernelPlan.for_device(self.model_cfg.mla.num_heads)
            if kernels.select(cfg.impl) is kernels.PALLAS
            else None
        )
        self.key = jax.random.key(seed)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stats = Stats()

        def forward(graphdef, state, caches, input_ids, md, temperatures, key):
            model = nnx.merge(graphdef, state)
            logits, caches = model(input_ids, caches, md, impl=cfg.impl)
            return _sample(logits, temperatures, key), caches

        # A function of this engine's own, so its jit cache holds exactly its buckets.
        self._step_fn = jax.jit(forward, static_argnums=0, donate_argnums=2)

    # -- requests ----------------------------------------------------------------------

    def _check(self, req: Request) -> None:
        vocab, max_len = self.model_cfg.vocab_size, self.max_model_len
        if not req.prompt_ids:
            raise RequestError("a prompt needs at least one token")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if req.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if req.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {req.temperature}")
        total = len(req.prompt_ids) + req.max_new_tokens
        where = f"prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total}"
        if total > self.model_cfg.max_position_embeddings:
            raise RequestError(
                f"{where} exceeds max_position_embeddings {self.model_cfg.max_position_embeddings}"
            )
        blocks = -(-total // self.cfg.block_size)
        if blocks > self.cfg.num_blocks:
            raise CacheFullError(
                f"a request of {total} tokens needs {blocks} cache blocks of "
                f"{self.cfg.block_size}; the cache has {self.cfg.num_blocks}"
            )
        if total > max_len:
            raise RequestError(f"{where} exceeds max_model_len {max_len}")

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Gives ``req`` the blocks ``num_tokens`` tokens need; False (and nothing taken)
        when too few are free."""
        need = -(-num_tokens // self.cfg.block_size) - len(req.block_ids)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            new = np.asarray(self.allocator.allocate(need), np.int32)
            req.block_ids = np.concatenate([req.block_ids, new])
        return True

    def _release(self, req: Request) -> None:
        self.allocator.free(req.block_ids.tolist())
        req.block_ids = np.zeros(0, np.int32)

    def _finished(self, req: Request) -> bool:
        if len(req.output_ids) >= req.max_new_tokens:
            return True
        eos = self.model_cfg.eos_token_ids
        return not req.ignore_eos and bool(req.output_ids) and req.output_ids[-1] in eos

    # -- scheduling ----------------------------------------------------------------------

    def _schedule(self, running: list[Request], waiting: deque[Request]):
        """``[(request, new_tokens)]`` for one step: every decode first, then up to
        ``prefill_slots`` prompt chunks (running prompts before new ones), within the
        token budget. A running request that finds no free block preempts the newest one
        (itself, if it is the newest) back to the front of ``waiting``; a new request only
        takes blocks that are free."""
        budget = self.cfg.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []

        def preempt_newest() -> Request:
            nonlocal budget
            victim = running.pop()
            for i, (req, n) in enumerate(batch):
                if req is victim:
                    del batch[i]
                    budget += n
                    break
            self._release(victim)
            victim.num_computed = 0
            victim.num_preemptions += 1
            self.stats.preemptions += 1
            waiting.appendleft(victim)
            return victim

        def add(req: Request, n: int, *, preempt: bool) -> bool:
            """Schedules ``n`` tokens of ``req`` if its blocks can grow to hold them."""
            nonlocal budget
            while not self._grow(req, req.num_computed + n):
                if not preempt or preempt_newest() is req:
                    return False
            batch.append((req, n))
            budget -= n
            return True

        def fitting(req: Request) -> int:
            """The tokens of ``req``'s next chunk that the budget and free blocks allow."""
            free = (len(req.block_ids) + self.allocator.num_free) * self.cfg.block_size
            return min(req.num_tokens - req.num_computed, budget, free - req.num_computed)

        for req in list(running):  # oldest first: preemption takes the newest
            if budget and req.num_tokens - req.num_computed == 1 and req in running:
                add(req, 1, preempt=True)
        chunks = 0
        for req in list(running):
            left = req.num_tokens - req.num_computed
            if budget and chunks < self.cfg.prefill_slots and left > 1 and req in running:
                # What the free blocks hold, or else a block's worth made free.
                n = fitting(req)
                n = n if n > 0 else min(left, budget, self.cfg.block_size)
                chunks += add(req, n, preempt=True) and n > 1
        while (
            waiting
            and budget
            and chunks < self.cfg.prefill_slots
            and len(running) < self.cfg.max_num_seqs
        ):
            n = fitting(waiting[0])
            if n <= 0 or not add(waiting[0], n, preempt=False):
                break
            running.append(waiting.popleft())
            chunks += n > 1
        batch.sort(key=lambda rn: rn[1] > 1)  # stable: 1-token chunks join the decodes
        return batch

    def _metadata(self, batch, buckets: Buckets) -> tuple[np.ndarray, AttentionMetadata]:
        width = max(len(req.block_ids) for req, _ in batch)
        block_table = np.zeros((len(batch), width), np.int32)
        context_lens = np.empty(len(batch), np.int32)
        query_lens = np.empty(len(batch), np.int32)
        ids = []
        for i, (req, n) in enumerate(batch):
            block_table[i, : len(req.block_ids)] = req.block_ids
            context_lens[i] = req.num_computed
            query_lens[i] = n
            ids += req.tokens(req.num_computed, req.num_computed + n)
        md = build_metadata(
            context_lens,
            query_lens,
            block_table,
            block_size=self.cfg.block_size,
            num_blocks=self.cfg.num_blocks,
            workspace_size=self.cfg.workspace_size,
            buckets=buckets,
            kernel_plan=self.kernel_plan,
        )
        input_ids = np.zeros(md.positions.shape[0], np.int32)
        input_ids[md.token_rows()] = ids
        return input_ids, md

    def step(self, batch, buckets: Buckets | None = None) -> tuple[np.ndarray, StepShape]:
        """Runs one scheduled batch; returns the sampled token of each request and the
        bucket it ran in (``buckets``: other than the engine's, for ``precompile``)."""
        input_ids, md = self._metadata(batch, buckets or self.buckets)
        shape = md.step_shape()
        rows = md.request_rows()
        temperatures = np.zeros(md.logits_indices.shape[0], np.float32)
        temperatures[rows] = [req.temperature for req, _ in batch]
        self.key, key = jax.random.split(self.key)
        args = jax.device_put((input_ids, md, temperatures))
        t0, hits = time.perf_counter(), cache_hits()
        tokens, self.caches = self._step_fn(self.graphdef, self.state, self.caches, *args, key)
        tokens = np.asarray(tokens)
        if shape not in self.stats.buckets:
            dt = time.perf_counter() - t0
            self.stats.buckets.append(shape)
            self.stats.compile_s += dt
            if cache_hits() > hits:
                self.stats.programs_from_cache += 1
                self.log(f"loaded bucket {shape} from the compilation cache in {dt:.2f}s")
            else:
                self.log(f"compiled bucket {shape} in {dt:.2f}s")
        return tokens[rows], shape

    def step_shapes(self) -> list[StepShape]:
        """Every program this engine can run (its buckets fix every axis)."""
        return self.buckets.step_shapes(self.cfg.workspace_size)

    def precompile(self, steps: list[list[tuple[int, int]]] | None = None) -> list[StepShape]:
        """Compiles programs ahead of serving: by default all of ``step_shapes()``, else
        those of the given steps, each a list of ``(context_len, query_len)`` pairs, decodes
        (query_len 1) first, e.g. ``[[(1000, 1)] * 32, [(0, 512)]]``. Runs each once on
        dummy tokens in freshly allocated blocks, which go back to the allocator: call it
        while no request runs. Returns the buckets compiled to (``stats.buckets`` lists all
        so far)."""
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
            shapes.append(self._dummy_step(pairs, buckets))
        return shapes

    def _dummy_step(self, pairs: list[tuple[int, int]], buckets: Buckets) -> StepShape:
        batch = []
        try:
            for context_len, query_len in pairs:
                req = Request([0] * (context_len + query_len), max_new_tokens=1)
                req.num_computed = context_len
                if not self._grow(req, context_len + query_len):
                    raise CacheFullError("too few free cache blocks to precompile")
                batch.append((req, query_len))
            return self.step(batch, buckets)[1]
        finally:
            for req, _ in batch:
                self._release(req)

    def generate(self, requests: list[Request], *, progress_every_s: float = 2.0) -> list[Request]:
        """Runs every request to completion; returns them in the given order."""
        for req in requests:
            self._check(req)
        waiting, running = deque(requests), []
        t_start = t_log = time.perf_counter()
        elapsed_before = self.stats.elapsed_s
        while waiting or running:
            batch = self._schedule(running, waiting)
            if not batch:
                raise CacheFullError(
                    f"no request can be scheduled: {self.allocator.num_free} free blocks"
                )
            tokens, _ = self.step(batch)
            self.stats.steps += 1
            for (req, n), tok in zip(batch, tokens, strict=True):
                prompt_len = len(req.prompt_ids)
                self.stats.prompt_tokens += max(
                    min(req.num_computed + n, prompt_len) - req.num_computed, 0
                )
                req.num_computed += n
                if req.num_computed < req.num_tokens:
                    continue  # a prompt (or recompute) chunk: its logits are not a sample
                req.output_ids.append(int(tok))
                self.stats.generated_tokens += 1
                if self.stats.first_token_s is None:
                    self.stats.first_token_s = time.perf_counter() - t_start
                if self._finished(req):
                    running.remove(req)
                    self._release(req)
            now = time.perf_counter()
            self.stats.elapsed_s = elapsed_before + now - t_start
            if now - t_log >= progress_every_s or not (waiting or running):
                t_log = now
                self.log(self._progress(len(running), len(waiting)))
        return requests

    def _progress(self, running: int, waiting: int) -> str:
        s = self.stats.as_dict()
        return (
            f"step {s['steps']}: {running} running, {waiting} waiting | "
            f"{s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens, "
            f"{s['tokens_per_s']:.1f} tok/s (excluding {s['compile_s']:.1f}s compiling or loading "
            f"{len(self.stats.buckets)} buckets)"
        )
