"""Serving benchmark: the whole engine (``Engine.generate``) on DeepSeek-shaped models with
random bf16 weights made on the GPU (``--fp8-weights``: the decoder's projections and experts
in float8_e4m3fn with 128 x 128 block scales, as an FP8 checkpoint kept FP8; every table's
name gets ``_fp8_weights``).

Rows: decode-heavy (batch 1, 16, 64, 256 at contexts 512 and 4096), prefill-heavy, and a
mixed ragged workload (64 requests arriving together, prompts 100-4000, 1-256 new tokens)
with time to first token and inter-token latency. Per row: tokens/s, the decode step's wall
time (median interval between step launches, unprofiled run), its device time (GPU kernel
time per step from a CUPTI trace of a second run), the host's time split into work
(scheduling, metadata, launch, giving out tokens; the program call apart) and waiting for the
device's tokens, the memory roofline and the ratio to it, programs compiled and compile
seconds.
A second table gives compile seconds per program against depth (2, 27, 61 layers).

Decode rows start from requests whose context is already in the cache (zero rows, written
by no prefill: the decode step reads them all the same) so that they time decode alone.

    python scripts/bench_serve.py --model v2-lite [--out DIR] [--smoke]

``--kv-cache-dtypes auto,fp8`` instead compares cache layouts (``serve_kv_cache_<model>``):
the decode rows (default 256 x 4096) on an engine per cache dtype, and how many concurrent
4096-token requests each layout fits in the memory of the first one's cache.

``--prefix`` instead compares the engine with and without prefix caching
(``serve_prefix_<model>``) on a shared-prefix workload (64 requests arriving together, a
2048-token prefix shared, 128 tokens of their own, 64 new tokens) and a multi-turn one (16
conversations of 4 turns, each turn's prompt the conversation so far): time to first token
p50/p99, prefill tokens computed, hit rate, tokens/s. ``--model tiny --impl reference`` runs
it small on a CPU (a check of the script; ``--no-publish --out DIR`` keeps it out of
BENCHMARKS.md):

    python scripts/bench_serve.py --model v2-lite --prefix

``--smoke``: the serving tables for the tiny model (the built-in tiny checkpoint's shape)
with a few short requests on the CPU, on the reference kernels (bench_decode,
bench_prefill, bench_e2e and bench_moe run the Pallas ones interpreted), then the
cache-layout comparison of auto and fp8; results under --out only. (``--prefix`` runs on
the tiny model in ``tests/scripts/test_bench_serve.py``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe import V2_LITE as V2_LITE_MOE
from benchlib import _gpu_kernel_events, copy_bandwidth, machine, parse_args, parser, save
from flax import nnx

from mla_jax.cache.latent_cache import cache_dtype
from mla_jax.checkpoint.tiny import TINY
from mla_jax.engine import allocator, compilation
from mla_jax.engine.engine import Engine, EngineConfig, Request
from mla_jax.model.config import ModelConfig, preset
from mla_jax.model.deepseek import DeepseekModel

MODELS = {
    # DeepSeek-V2-Lite's attention with a dense MLP in place of its MoE (2.61 B parameters).
    "v2-lite": ModelConfig(
        model_type="deepseek_v2",
        vocab_size=102400,
        num_layers=27,
        intermediate_size=10944,
        max_position_embeddings=163840,
        mla=preset("deepseek-v2-lite"),
    ),
    # DeepSeek-V2-Lite whole: layer 0 dense, 26 MoE layers (64 routed experts, top 6, 2 shared;
    # 15.7 B parameters).
    "v2-lite-moe": ModelConfig(
        model_type="deepseek_v2",
        vocab_size=102400,
        num_layers=27,
        intermediate_size=10944,
        max_position_embeddings=163840,
        mla=preset("deepseek-v2-lite"),
        n_routed_experts=V2_LITE_MOE.n_routed_experts,
        first_k_dense_replace=1,
        moe=V2_LITE_MOE,
    ),
    # DeepSeek-V3's attention (128 heads, q LoRA 1536, hidden 7168) with its dense-layer MLP.
    "v3": ModelConfig(
        model_type="deepseek_v3",
        vocab_size=129280,
        num_layers=24,
        intermediate_size=18432,
        max_position_embeddings=163840,
        mla=preset("deepseek-v3"),
    ),
}
# The columns of a serving row: throughput, the decode step's wall time and how the host
# spent it, and the step against its roofline.
STEP_COLUMNS = [
    "tokens/s",
    "step wall ms",
    "device ms",
    "host ms",
    "call ms",
    "wait ms",
    "host ms, 1 step",
    "ITL p50 / p99 ms, 1 step",
    "roofline ms",
    "wall / roofline",
]


class PrefixWorkloads(NamedTuple):
    """The sizes of the prefix-caching workloads (tokens, random ids)."""

    shared_requests: int  # shared-prefix: requests arriving together
    shared_prefix: int  # the prefix they share
    own_tokens: int  # then each request's own tokens
    shared_new_tokens: int  # tokens each generates
    conversations: int  # multi-turn: conversations, each turn of all of them arriving together
    turns: int
    first_message: int  # a conversation's first prompt
    user_message: int  # a later turn's new tokens, after the previous answer
    answer_tokens: int  # tokens generated each turn


PREFIX_WORKLOADS = PrefixWorkloads(64, 2048, 128, 64, 16, 4, 1024, 256, 64)
TINY_PREFIX_WORKLOADS = PrefixWorkloads(8, 128, 16, 8, 4, 3, 64, 16, 8)
PREFIX_COLUMNS = [
    "workload",
    "prefix caching",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "prompt tokens",
    "prefill tokens computed",
    "hit rate",
    "output tok/s",
    "prompt + output tok/s",
]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the benchmark's workloads and engine, or a smoke run's."""

    decode_rows: tuple[tuple[int, int], ...]  # (batch, context)
    decode_steps: int  # timed decode steps a row
    profiled_steps: int  # traced decode steps a row
    prefill: tuple[int, int]  # prompts, length
    mixed: tuple[int, int, int, int]  # requests, shortest and longest prompt, most new tokens
    compile_depths: str  # default of --compile-depths
    compile_steps: tuple  # the steps the compile table precompiles: lists of (context, new)
    capacity_tokens: int  # the request length the cache-layout comparison counts
    # EngineConfig settings of the serving tables. Prefix caching is off: their workloads
    # share no prefix, and the decode rows' contexts are zero rows, not the cache of any
    # tokens.
    engine: dict

    @property
    def page(self) -> int:
        return self.engine["block_size"]

    @property
    def kernels(self) -> str:
        """The engine's kernels, as a note names them."""
        return {"pallas": "Pallas", "reference": "reference"}[self.engine["impl"]]

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(**{**self.engine, **overrides})


# Timed decode steps a row: six windows of 16 (the first two, which record their CUDA
# graphs, are not timed); a row's profiled steps are one window.
FULL_DECODE_STEPS = 96
FULL = Sizes(
    decode_rows=tuple((b, ctx) for ctx in (512, 4096) for b in (1, 16, 64, 256)),
    decode_steps=FULL_DECODE_STEPS,
    profiled_steps=16,
    prefill=(32, 4096),
    mixed=(64, 100, 4000, 256),
    compile_depths="2,27,61",
    compile_steps=([(100, 1)] * 64, [(0, 2048)]),
    capacity_tokens=4096,
    engine=dict(
        block_size=64,
        num_blocks=256 * (4096 + 2 * FULL_DECODE_STEPS + 64) // 64 + 64,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        workspace_size=32768,
        max_model_len=8192,
        impl="pallas",
        enable_prefix_caching=False,
    ),
)
SMOKE = Sizes(
    decode_rows=((1, 16), (4, 16)),
    decode_steps=48,  # 3 windows of 16: 1 steady
    profiled_steps=2,
    prefill=(2, 24),
    mixed=(3, 4, 24, 4),
    compile_depths="1",
    compile_steps=([(8, 1)] * 4, [(0, 24)]),
    capacity_tokens=32,
    engine=dict(
        block_size=16,
        num_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        workspace_size=32,
        max_model_len=64,
        impl="reference",
        enable_prefix_caching=False,
    ),
)


# DeepSeek-V3's weight_block_size: the blocks of --fp8-weights.
FP8_WEIGHT_BLOCKS = (128, 128)


def new_model(cfg: ModelConfig, fp8_weights: bool) -> DeepseekModel:
    """A model of ``cfg`` with random bf16 weights, or with ``fp8_weights`` its decoder's
    projections and experts float8_e4m3fn (their random initial values cast, unit block
    scales of ``FP8_WEIGHT_BLOCKS``), run as an FP8 checkpoint kept FP8 is."""
    blocks = FP8_WEIGHT_BLOCKS if fp8_weights else None
    return DeepseekModel(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=blocks)


def weights_note(fp8_weights: bool) -> str:
    """How a table's weights were made (``new_model``)."""
    if fp8_weights:
        return (
            "random weights, the decoder's projections and experts float8_e4m3fn with "
            f"{FP8_WEIGHT_BLOCKS[0]} x {FP8_WEIGHT_BLOCKS[1]} block scales (kept FP8), the "
            "rest bf16"
        )
    return "random bf16 weights"


def table_name(kind: str, model: str, fp8_weights: bool) -> str:
    """A table's name: ``serve_<model>``, ``serve_kv_cache_<model>`` and so on, then
    ``_fp8_weights`` for ``--fp8-weights``."""
    return f"{kind}_{model}" + ("_fp8_weights" if fp8_weights else "")


def shaped(model: str, fp8_weights: bool) -> str:
    """``v3-shaped model`` (``with FP8 weights``), as a table's title says it."""
    return f"{model}-shaped model" + (" with FP8 weights" if fp8_weights else "")


def _weight_bytes(model: DeepseekModel, tokens: int) -> float:
    """Bytes of the weights a step of ``tokens`` tokens reads: all but the embedding table (a
    step gathers only its tokens' rows of it) and, in MoE layers, only the routed experts the
    tokens choose: their expected number if each token picks ``k`` of ``E`` experts uniformly,
    ``E (1 - (1 - k/E)^tokens)`` (random weights route near-uniformly)."""
    state = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    total -= model.embed_tokens.embedding[...].nbytes
    moe = model.cfg.moe
    for (_, _, is_moe), layers in zip(model.runs, model.layers, strict=True):
        if is_moe:
            experts = layers.mlp.experts
            routed = experts.gate_up_proj[...].nbytes + experts.down_proj[...].nbytes
            e, k = moe.n_routed_experts, moe.num_experts_per_tok
            chosen = e * (1 - (1 - k / e) ** tokens)
            total -= routed * (1 - chosen / e)
    return total


def _decode_requests(engine: Engine, batch: int, context: int, steps: int) -> list[Request]:
    """``batch`` running requests, each with ``context`` tokens already in the cache and
    ``steps`` decode steps to go, placed straight into the schedulers (in turn, with data
    parallelism). Each request's token is random, so that an MoE layer routes the batch's
    tokens to different experts."""
    rng = np.random.default_rng(batch)
    vocab = engine.model_cfg.vocab_size
    requests = []
    for i in range(batch):
        scheduler = engine.schedulers[i % len(engine.schedulers)]
        ids = [1] * context + [int(rng.integers(vocab))]
        req = Request(ids, max_new_tokens=steps, ignore_eos=True)
        if not scheduler.grow(req, context + steps + 1):
            raise RuntimeError("the benchmark's cache is too small")
        req.num_computed = context
        scheduler.running.append(req)
        requests.append(req)
    return requests


def profile(run) -> tuple[dict, int]:
    """The perfetto trace (CUPTI kernel events on GPUs) of ``run()``, and what it returns
    (its step count)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        steps = run()
        jax.profiler.stop_trace()
        [path] = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            return json.load(f), steps


def _device_ms_per_step(run) -> tuple[float, dict, dict]:
    """GPU kernel time of ``run()``'s steps from a CUPTI trace: total, per kernel
    (``kernel_breakdown``) and per kind (``kernel_kinds``), divided by the steps ``run``
    returns."""
    trace, steps = profile(run)
    events = _gpu_kernel_events(trace)
    return (*kernel_breakdown(events, steps), kernel_kinds(events, steps))


# Kinds of GPU kernel by name, the first that matches: cuBLAS's and XLA's matmuls, copies,
# slices and memsets (what a step should not need), XLA's other fusions (elementwise,
# reductions, sorts); the rest are the Pallas kernels.
KERNEL_KINDS = (
    ("matmuls", ("nvjet", "gemm", "cublas", "xmma", "cutlass")),
    ("copies, slices and memsets", ("memcpy", "memset", "copy", "slice")),
    ("XLA fusions", ("loop_", "input_", "fusion", "wrapped_", "sort", "cub::", "concatenate")),
)


def kernel_kinds(events: list[dict], steps: int) -> dict:
    """Milliseconds and launches a step of kernel ``events`` (CUPTI, ``dur`` in
    microseconds) over ``steps`` steps, by ``KERNEL_KINDS`` (the rest: ``Pallas``)."""
    per_kernel, launches = _per_kernel(events)
    kinds: dict[str, dict] = {}
    for name, us in per_kernel.items():
        lower = name.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in lower for m in marks)), "Pallas")
        entry = kinds.setdefault(kind, {"ms": 0.0, "launches": 0.0})
        entry["ms"] += us / 1e3 / steps
        entry["launches"] += launches[name] / steps
    return {k: {f: round(v, 4) for f, v in entry.items()} for k, entry in kinds.items()}


def breakdown_note(rows: list[dict], weight_bytes: float, bandwidth_gbs: float) -> str | None:
    """Where the first decode row's device step goes, by kernel kind, against its roofline
    (None when no row was profiled): the table's explanation of its small-batch ratios."""
    row = next((r for r in rows if r.get("device_kernel_kinds")), None)
    if row is None:
        return None
    kinds = row["device_kernel_kinds"]
    parts = [
        f"{kind} {entry['ms']:.2f} ms in {entry['launches']:.0f} launches"
        for kind, entry in sorted(kinds.items(), key=lambda item: -item[1]["ms"])
    ]
    note = (
        f"Where the device step of {row['cells'][0]} goes ({row['cells'][3]} ms against a "
        f"{row['cells'][-2]} ms roofline): {', '.join(parts)}"
    )
    matmul_ms = kinds.get("matmuls", {}).get("ms")
    if matmul_ms:
        gbs = weight_bytes / 1e9 / (matmul_ms / 1e3)
        others = [entry for kind, entry in kinds.items() if kind != "matmuls"]
        others_ms = sum(entry["ms"] for entry in others)
        others_launches = sum(entry["launches"] for entry in others)
        bound_ms = weight_bytes / 1e9 / bandwidth_gbs * 1e3 + others_ms
        note += (
            f"; the step's weights over its matmuls' time stream at {gbs:.0f} GB/s, "
            f"{gbs / bandwidth_gbs:.0%} of the copy bandwidth; with every matmul at the copy "
            f"bandwidth the step would take {bound_ms:.2f} ms "
            f"({bound_ms / row['cells'][-2]:.2f}x the roofline), the other kernels' "
            f"{others_ms:.2f} ms in {others_launches:.0f} launches unchanged"
        )
    return note + "."


def kernel_family(name: str) -> str:
    """A kernel's name without the number XLA gives each instance of a fusion
    (``loop_slice_fusion_17`` -> ``loop_slice_fusion``): an unrolled step compiles each
    layer's fusions under names of their own, which would scatter a per-layer cost."""
    return re.sub(r"(?<=[a-z])(_\d+)+$", "", name)


def _per_kernel(events: list[dict]) -> tuple[dict[str, float], dict[str, int]]:
    """Microseconds and launches of kernel ``events`` (CUPTI, ``dur`` in microseconds) by
    kernel name, XLA's numbered instances of a fusion together (``kernel_family``)."""
    per_kernel: dict[str, float] = {}
    launches: dict[str, int] = {}
    for e in events:
        name = kernel_family(e["name"])
        per_kernel[name] = per_kernel.get(name, 0.0) + e["dur"]
        launches[name] = launches.get(name, 0) + 1
    return per_kernel, launches


def kernel_breakdown(events: list[dict], steps: int) -> tuple[float, dict]:
    """Milliseconds a step of kernel ``events`` (CUPTI, ``dur`` in microseconds) over
    ``steps`` steps: in all, and per kernel name (``kernel_family``), the ten largest, then
    the rest together as ``other (N kernels, K launches a step)``: what a step's time is made
    of, to the end."""
    per_kernel, launches = _per_kernel(events)
    total_ms = sum(per_kernel.values()) / 1e3 / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    kernels = {name[:80]: round(us / 1e3 / steps, 4) for name, us in ranked[:10]}
    rest = ranked[10:]
    if rest:
        count = sum(launches[name] for name, _ in rest) / steps
        label = f"other ({len(rest)} kernels, {count:.0f} launches a step)"
        kernels[label] = round(sum(us for _, us in rest) / 1e3 / steps, 4)
    return total_ms, kernels


def _cache_bytes_per_token(engine: Engine) -> float:
    """Bytes a token takes in the engine's cache, all layers (every array of the layout)."""
    total = sum(part.nbytes for part in jax.tree.leaves(engine.runner.cache))
    return total / (engine.cfg.num_blocks * engine.cfg.block_size)


class DecodeTimes(NamedTuple):
    """A decode row's timed run: its wall seconds, medians in milliseconds per decode step
    (a window's over its steps) of the launch interval and of the host's time in it
    (``engine.StepRecord``: working, of which calling the program, and waiting), and the
    p50 and p99 of the intervals between a request's tokens reaching the host (a window's
    arrive together); ``host_parts_ms``: medians of the host's work by part (building the
    batch, the runner's prepare, the call, the rest: giving out tokens, scheduling)."""

    wall_s: float
    step_ms: float
    host_ms: float
    call_ms: float
    wait_ms: float
    itl_ms: tuple[float, float]
    host_parts_ms: dict[str, float]


def _timed_decode(engine, batch, context, sizes: Sizes) -> DecodeTimes:
    """``sizes.decode_steps`` decode steps of ``batch`` requests at ``context``, timed."""
    stats = engine.stats
    before = len(stats.step_records)
    requests = _decode_requests(engine, batch, context, sizes.decode_steps)
    t0 = time.perf_counter()
    engine.generate([])
    wall_s = time.perf_counter() - t0
    records = stats.step_records[before:]
    # The first launch's interval is from the previous row's, and the second's holds no
    # token read (the first step is still in flight); single steps after them may compile
    # (excluded from every time). A steady step's wall time is the launch interval.
    steady = records[3 if engine.decode_window == 1 else 2 :]

    def median_ms(field: str) -> float:
        return float(np.median([getattr(r, field) / r.steps for r in steady])) * 1e3

    def rest(r) -> float:
        return r.host_s - r.batch_s - r.prepare_s - r.call_s

    parts = {"batch": "batch_s", "prepare": "prepare_s", "call": "call_s"}
    host_parts = {name: round(median_ms(field), 4) for name, field in parts.items()}
    host_parts["rest"] = round(float(np.median([rest(r) / r.steps for r in steady])) * 1e3, 4)

    # Each request's token intervals after the first launches' tokens (the records' steady
    # part; every request takes all of a window's steps here).
    skipped = sum(r.steps for r in records[: len(records) - len(steady)])
    intervals = np.concatenate([np.diff(r.token_times)[skipped:] for r in requests])
    return DecodeTimes(
        wall_s,
        median_ms("interval_s"),
        median_ms("host_s"),
        median_ms("call_s"),
        median_ms("wait_s"),
        tuple(float(x) for x in np.percentile(intervals, [50, 99]) * 1e3),
        host_parts,
    )


def _decode_row(engine, model, bandwidth, batch, context, sizes: Sizes) -> dict:
    times = _timed_decode(engine, batch, context, sizes)
    window = engine.decode_window
    engine.decode_window = 1  # the same steps one at a time: the host's work they save
    single = _timed_decode(engine, batch, context, sizes)
    engine.decode_window = window

    def profiled():
        _decode_requests(engine, batch, context, sizes.profiled_steps)
        engine.generate([])
        return sizes.profiled_steps

    device_ms, kernels, kinds = _device_ms_per_step(profiled)
    kv_bytes = batch * (context + sizes.decode_steps // 2) * _cache_bytes_per_token(engine)
    roofline_ms = (_weight_bytes(model, batch) + kv_bytes) / bandwidth / 1e6
    return {
        "cells": [
            f"decode {batch} x {context}",
            round(batch / times.step_ms * 1e3, 1),
            round(times.step_ms, 3),
            round(device_ms, 3),
            round(times.host_ms, 3),
            round(times.call_ms, 3),
            round(times.wait_ms, 3),
            round(single.host_ms, 3),
            " / ".join(f"{x:.3g}" for x in single.itl_ms),
            round(roofline_ms, 3),
            round(times.step_ms / roofline_ms, 2),
        ],
        "wall_s": round(times.wall_s, 3),
        # The host's work by part, per step: in windows, and one step at a time.
        "host_parts_ms": {"window": times.host_parts_ms, "single_steps": single.host_parts_ms},
        # The same steps one at a time: how their host time divides.
        "single_steps_ms": {
            "step": round(single.step_ms, 3),
            "host": round(single.host_ms, 3),
            "call": round(single.call_ms, 3),
            "wait": round(single.wait_ms, 3),
        },
        "itl_ms_p50_p99": {
            "window": [round(x, 3) for x in times.itl_ms],
            "single_steps": [round(x, 3) for x in single.itl_ms],
        },
        "device_kernels_ms": kernels,
        "device_kernel_kinds": kinds,
    }


def _run_requests(engine: Engine, requests: list[Request]) -> dict:
    """``requests`` run to completion, arriving together: seconds (compiling excluded),
    prompt tokens computed and taken from the prefix cache, tokens generated, each
    request's time to first token and the percentiles of it and of inter-token latency."""
    stats = engine.stats
    before = dataclasses.replace(stats)
    start = time.perf_counter()
    engine.generate(requests)
    elapsed = time.perf_counter() - start
    compile_s = stats.compile_s - before.compile_s
    run_s = elapsed - compile_s
    prompt = stats.prompt_tokens - before.prompt_tokens
    generated = stats.generated_tokens - before.generated_tokens
    ttft = [r.token_times[0] - start for r in requests]
    itl = np.concatenate([np.zeros(0)] + [np.diff(r.token_times) for r in requests])
    return dict(
        run_s=run_s,
        prompt=prompt,
        cached=stats.cached_prompt_tokens - before.cached_prompt_tokens,
        generated=generated,
        ttft_s=ttft,
        ttft_ms=np.percentile(ttft, [50, 99]) * 1e3,
        itl_ms=np.percentile(itl, [50, 99]) * 1e3 if itl.size else [np.nan, np.nan],
    )


def default_compile_depths(model: str, sizes: Sizes) -> str:
    """The compile table's depths when ``--compile-depths`` is not given: the run's for the
    V2-Lite shape (and the tiny model's smoke run), none for the other models, whose deepest
    layouts do not fit one GPU beside the serving table's engine (a V3-shaped model of 61
    layers is 75 GB of bf16 weights; it ran out of an H200's 141 GB after the serving table)."""
    return sizes.compile_depths if model in ("v2-lite", "tiny") else ""


def _compile_depths(
    base: ModelConfig, depths: list[int], sizes: Sizes, fp8_weights: bool
) -> list[dict]:
    """Seconds to compile one decode and one prefill program at each depth (no cache)."""
    rows = []
    for depth in depths:
        cfg = dataclasses.replace(base, num_layers=depth)
        model = new_model(cfg, fp8_weights)
        # A small cache: only the programs matter here.
        engine = Engine(model, sizes.engine_config(num_blocks=512), log=lambda _: None)
        engine.precompile([list(step) for step in sizes.compile_steps])
        seconds = [round(program.seconds, 2) for program in engine.stats.compiled]
        rows.append({"cells": [depth, *seconds]})
        print(f"compile at {depth} layers: {seconds}", flush=True)
        del engine, model
    return rows


def _kv_cache_comparison(
    dtypes: list[str],
    decode_rows: list[tuple[int, int]],
    name: str,
    model,
    model_cfg,
    bandwidth,
    sizes: Sizes,
    out_dir: str | None,
    fp8_weights: bool,
) -> None:
    """Decode rows on an engine per cache dtype, and each layout's capacity in
    ``sizes.capacity_tokens``-token requests within the memory of the first layout's cache;
    the table ``serve_kv_cache_<name>`` (``table_name``)."""
    page, capacity_tokens = sizes.page, sizes.capacity_tokens
    blocks_per_request = -(-capacity_tokens // page)
    rows, budget, first_requests = [], None, None
    for dtype in dtypes:
        engine = Engine(model, sizes.engine_config(kv_cache_dtype=dtype), log=print)
        token_bytes = _cache_bytes_per_token(engine)
        if budget is None:  # the first layout's cache
            budget = token_bytes * engine.cfg.num_blocks * page
        requests = int(budget // (token_bytes * page * blocks_per_request))
        if first_requests is None:
            first_requests = requests
        for batch, context in decode_rows:
            row = _decode_row(engine, model, bandwidth, batch, context, sizes)
            row["cells"] = [
                row["cells"][0],
                dtype,
                round(token_bytes / model_cfg.num_layers, 1),
                requests,
                round(requests / first_requests, 2),
                *row["cells"][1:],
            ]
            print(row, flush=True)
            rows.append(row)
        del engine  # its cache, before the next one's
    mla = model_cfg.mla
    save(
        table_name("serve_kv_cache", name, fp8_weights),
        f"Serving: KV cache layouts on a {shaped(name, fp8_weights)} (Engine.generate)",
        [
            "workload",
            "kv cache",
            "bytes/token/layer",
            f"{capacity_tokens}-token requests in budget",
            "vs first",
            *STEP_COLUMNS,
        ],
        rows,
        [
            f"{model_cfg.num_layers} layers, Lkv {mla.kv_lora_rank} + rope "
            f"{mla.qk_rope_head_dim}, {weights_note(fp8_weights)}, page {page}, {sizes.kernels} "
            "kernels; "
            "auto: the model's dtype (bf16); fp8: e4m3 latent, a float32 scale per 128 "
            "values, bf16 rope.",
            f"Budget: the memory of the first layout's cache in this run ({budget / 1e9:.2f} "
            f"GB, {sizes.engine['num_blocks']} blocks of {page}); a request of "
            f"{capacity_tokens} tokens takes {blocks_per_request} blocks. Bytes per token are "
            "those of the engine's cache arrays.",
            "Step wall, device, host, call, wait, ITL and roofline as in the serving table "
            "(roofline: weights + the KV bytes of the layout).",
        ],
        extra={"model": dataclasses.asdict(model_cfg), "machine": machine()},
        out_dir=out_dir,
    )


PREFIX_KINDS = ("shared", "multi-turn")


def _shared_prefix(engine: Engine, w: PrefixWorkloads, vocab: int) -> dict:
    """The shared-prefix workload's requests, arriving together (``_run_requests``)."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, vocab, w.shared_prefix).tolist()
    requests = [
        Request(
            prefix + rng.integers(0, vocab, w.own_tokens).tolist(),
            w.shared_new_tokens,
            ignore_eos=True,
        )
        for _ in range(w.shared_requests)
    ]
    return _run_requests(engine, requests)


def _multi_turn(engine: Engine, w: PrefixWorkloads, vocab: int) -> dict:
    """The multi-turn workload: each turn, every conversation's prompt (the conversation so
    far, then a new message) arrives together; ``_run_requests``' sums over the turns, and
    every request's time to first token from its own turn's start."""
    rng = np.random.default_rng(2)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    conversations = [tokens(w.first_message) for _ in range(w.conversations)]
    turns = []
    for turn in range(w.turns):
        if turn:
            conversations = [c + tokens(w.user_message) for c in conversations]
        requests = [Request(c, w.answer_tokens, ignore_eos=True) for c in conversations]
        turns.append(_run_requests(engine, requests))
        conversations = [c + r.output_ids for c, r in zip(conversations, requests, strict=True)]
    summed = {key: sum(t[key] for t in turns) for key in ("run_s", "prompt", "cached", "generated")}
    return {**summed, "ttft_s": [ttft for t in turns for ttft in t["ttft_s"]]}


def _prefix_row(label: str, caching: bool, run: dict) -> dict:
    ttft_ms = np.asarray(run["ttft_s"]) * 1e3
    prompt = run["prompt"] + run["cached"]
    p50, p99 = np.percentile(ttft_ms, [50, 99])
    return {
        "cells": [
            label,
            "on" if caching else "off",
            round(float(p50), 1),
            round(float(p99), 1),
            prompt,
            run["prompt"],
            f"{run['cached'] / prompt:.1%}",
            round(run["generated"] / run["run_s"], 1),
            round((prompt + run["generated"]) / run["run_s"], 1),
        ],
        "run_s": round(run["run_s"], 3),
        "cached_prompt_tokens": run["cached"],
        "ttft_ms": [round(float(t), 1) for t in ttft_ms],
    }


def _prefix_comparison(args, model, model_cfg) -> str:
    """The prefix-caching table: each of ``args.prefix``'s workloads on an engine without
    prefix caching and one with it (both precompiled: no compilation in the times)."""
    tiny = args.model == "tiny"
    w = TINY_PREFIX_WORKLOADS if tiny else PREFIX_WORKLOADS
    settings = dict(
        block_size=16 if tiny else FULL.page,
        num_blocks=128 if tiny else 4096,
        max_num_seqs=16 if tiny else 64,
        max_num_batched_tokens=512 if tiny else 8192,
        max_num_prefills=8 if tiny else 16,
        workspace_size=2048 if tiny else 32768,
        max_model_len=256 if tiny else 4096,
        impl=args.impl,
    )
    labels = {
        "shared": f"shared prefix: {w.shared_requests} requests, {w.shared_prefix} shared + "
        f"{w.own_tokens} own tokens, {w.shared_new_tokens} new",
        "multi-turn": f"multi-turn: {w.conversations} conversations x {w.turns} turns "
        f"({w.first_message} tokens, then {w.answer_tokens} answer + {w.user_message} new a "
        "turn)",
    }
    runs = {"shared": _shared_prefix, "multi-turn": _multi_turn}
    kinds = args.prefix.split(",")
    measured = {}
    compilation.enable_cache()  # the second engine loads the first's programs
    for caching in (False, True):
        config = FULL.engine_config(**settings, enable_prefix_caching=caching)
        engine = Engine(model, config, log=print)
        engine.precompile()
        for kind in kinds:
            run = runs[kind](engine, w, model_cfg.vocab_size)
            measured[kind, caching] = _prefix_row(labels[kind], caching, run)
            print(measured[kind, caching], flush=True)
        del engine
    mla = model_cfg.mla
    notes = [
        f"{model_cfg.num_layers} layers, hidden {mla.hidden_size}, {mla.num_heads} heads, "
        f"{weights_note(args.fp8_weights)}, {args.impl} kernels, asynchronous scheduling; page "
        f"{settings['block_size']}, {settings['max_num_batched_tokens']} tokens and up to "
        f"{settings['max_num_prefills']} prompt chunks a step, {settings['max_num_seqs']} "
        f"requests running at most, {settings['num_blocks']} cache blocks; every program "
        "compiled before the runs.",
        "Prompts are random token ids, answers ignore EOS; both engines get the same prompts "
        "(multi-turn: of the same lengths, each turn after the engine's own answers). "
        "Requests of a workload (of a turn, in the multi-turn one) arrive together. "
        "With caching, a request computes only what no earlier request left in the cache: "
        "requests admitted in the first steps compute the shared prefix each.",
        "TTFT: from the generate call's start to the host reading the request's first token "
        "(multi-turn: over every turn's requests, each from its turn's start). Prefill tokens "
        "computed: prompt tokens run through the model; hit rate: prompt tokens taken from "
        "the cache / prompt tokens. Tokens/s: per second of the whole run.",
    ]
    return save(
        table_name("serve_prefix", args.model, args.fp8_weights),
        f"Serving: prefix caching on a {shaped(args.model, args.fp8_weights)} (Engine.generate)",
        PREFIX_COLUMNS,
        [measured[kind, caching] for kind in kinds for caching in (False, True)],
        notes,
        extra={
            "model": dataclasses.asdict(model_cfg),
            "workloads": w._asdict(),
            "settings": settings,
            "machine": machine(),
        },
        out_dir=args.out,
        publish=not args.no_publish,
    )


def _prefix_kinds(text: str) -> str:
    """``--prefix shared,multi-turn``: names of PREFIX_KINDS, none repeated."""
    kinds = [kind.strip() for kind in text.split(",")]
    bad = [kind for kind in kinds if kind not in PREFIX_KINDS]
    if bad or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want a comma-separated subset of {','.join(PREFIX_KINDS)}"
        )
    return ",".join(kinds)


def _rows(text: str) -> list[tuple[int, int]]:
    """``64x512,256x4096`` -> [(64, 512), (256, 4096)]."""
    return [tuple(map(int, r.split("x"))) for r in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    allocator.prefer_cuda_async()  # before JAX starts its backend
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        choices=[*sorted(MODELS), "tiny"],
        help="default: v2-lite; tiny: --prefix or --smoke only (and --smoke's default)",
    )
    ap.add_argument("--layers", type=int, help="override the model's depth")
    ap.add_argument(
        "--compile-depths",
        help=f"'' to skip that table (default: {FULL.compile_depths} for v2-lite, "
        f"{SMOKE.compile_depths} with --smoke, none for the other models: "
        "default_compile_depths)",
    )
    ap.add_argument("--rows", default="decode,prefill,mixed")
    ap.add_argument("--decode-rows", help="e.g. 64x512,256x4096 (default: all)")
    ap.add_argument(
        "--kv-cache-dtypes",
        help="e.g. auto,fp8: compare cache layouts on the decode rows (default 256x4096) "
        "instead of the serving table",
    )
    ap.add_argument(
        "--prefix",
        type=_prefix_kinds,
        nargs="?",
        const=",".join(PREFIX_KINDS),
        help="compare prefix caching on and off on these workloads (default: all of "
        f"{','.join(PREFIX_KINDS)}) instead of the serving table",
    )
    ap.add_argument(
        "--impl", choices=["pallas", "reference"], default="pallas", help="kernels (--prefix)"
    )
    ap.add_argument(
        "--decode-window",
        type=int,
        default=16,
        help="decode steps a window runs (EngineConfig.decode_window) in the serving and "
        "cache-layout tables; their decode rows also time the host with single steps",
    )
    ap.add_argument(
        "--fp8-weights",
        action="store_true",
        help="the decoder's projections and experts in float8_e4m3fn with 128 x 128 block "
        "scales (new_model); the tables' names end in _fp8_weights",
    )
    ap.add_argument(
        "--no-publish",
        action="store_true",
        help="write the JSON only under --out (a trial run: benchmarks/ and the page untouched)",
    )
    args = parse_args(ap, argv)
    if args.decode_window < 1:
        ap.error(f"--decode-window must be >= 1, got {args.decode_window}")
    sizes = SMOKE if args.smoke else FULL
    sizes = dataclasses.replace(sizes, engine={**sizes.engine, "decode_window": args.decode_window})
    for dtype in (args.kv_cache_dtypes or "auto").split(","):
        try:
            cache_dtype(dtype, jnp.bfloat16)
        except ValueError as e:
            ap.error(f"--kv-cache-dtypes: {e}")
    if args.no_publish and not args.out:
        ap.error("--no-publish needs --out")
    if args.smoke and args.model not in (None, "tiny"):
        ap.error(f"--smoke runs the tiny model, not --model {args.model}")
    args.model = args.model or ("tiny" if args.smoke else "v2-lite")
    if args.model == "tiny" and not (args.prefix or args.smoke):
        ap.error("--model tiny runs only --prefix")
    if args.impl != "pallas" and not args.prefix:
        ap.error("--impl reference runs only --prefix (the serving table times the kernels)")
    if args.compile_depths is None:
        args.compile_depths = default_compile_depths(args.model, sizes)
    model_cfg = TINY if args.model == "tiny" else MODELS[args.model]
    if args.layers:
        model_cfg = dataclasses.replace(model_cfg, num_layers=args.layers)
    model = new_model(model_cfg, args.fp8_weights)
    if args.prefix:
        _prefix_comparison(args, model, model_cfg)
        return
    bandwidth = copy_bandwidth().gbs
    weight_bytes = _weight_bytes(model, 1)
    print(
        f"{args.model}: {model_cfg.num_layers} layers, {weight_bytes / 1e9:.2f} GB of weights "
        f"read by a 1-token step, copy bandwidth {bandwidth:.0f} GB/s",
        flush=True,
    )
    comparison = (args.model, model, model_cfg, bandwidth, sizes, args.out, args.fp8_weights)
    if args.kv_cache_dtypes:
        rows = _rows(args.decode_rows) if args.decode_rows else sizes.decode_rows[-1:]
        _kv_cache_comparison(args.kv_cache_dtypes.split(","), rows, *comparison)
        return
    engine = Engine(model, sizes.engine_config(), log=print)
    rows, kinds = [], args.rows.split(",")
    if "decode" in kinds:
        decode_rows = sizes.decode_rows
        if args.decode_rows:
            decode_rows = _rows(args.decode_rows)
        for batch, context in decode_rows:
            row = _decode_row(engine, model, bandwidth, batch, context, sizes)
            print(row, flush=True)
            rows.append(row)
    rng = np.random.default_rng(0)
    vocab = model_cfg.vocab_size
    if "prefill" in kinds:
        count, length = sizes.prefill
        requests = [Request(rng.integers(0, vocab, length).tolist(), 1) for _ in range(count)]
        r = _run_requests(engine, requests)
        rows.append(
            {
                "cells": [
                    f"prefill {count} x {length}",
                    round(r["prompt"] / r["run_s"], 1),
                    *[""] * (len(STEP_COLUMNS) - 1),
                ]
            }
        )
        print(rows[-1], r, flush=True)
    mixed = None
    if "mixed" in kinds:
        count, shortest, longest, most_new = sizes.mixed
        lengths = rng.integers(shortest, longest + 1, count)
        new = rng.integers(1, most_new + 1, count)

        def workload() -> list[Request]:
            """The mixed requests, fresh random prompts of the workload's lengths."""
            return [
                Request(rng.integers(0, vocab, n).tolist(), int(k), ignore_eos=True)
                for n, k in zip(lengths, new, strict=True)
            ]

        # A first run compiles the workload's programs: times to first token of the timed
        # run would otherwise be compile times.
        _run_requests(engine, workload())
        compiled_s = engine.stats.compile_s
        r = _run_requests(engine, workload())
        mixed = {
            "tokens_per_s": round((r["prompt"] + r["generated"]) / r["run_s"], 1),
            "ttft_ms_p50_p99": [round(float(x), 1) for x in r["ttft_ms"]],
            "itl_ms_p50_p99": [round(float(x), 2) for x in r["itl_ms"]],
            "compile_s": round(engine.stats.compile_s - compiled_s, 1),
        }
        rows.append(
            {
                "cells": [
                    f"mixed: {count} requests, prompts {shortest}-{longest}, 1-{most_new} new",
                    mixed["tokens_per_s"],
                    *[""] * (len(STEP_COLUMNS) - 1),
                ],
                **mixed,
            }
        )
        print(rows[-1], flush=True)
    stats = engine.stats.as_dict()
    moe = model_cfg.moe
    mlp = f"dense MLP {model_cfg.intermediate_size}"
    if moe:
        mlp = (
            f"layer 0 dense MLP {model_cfg.intermediate_size}, then MoE ({moe.n_routed_experts} "
            f"routed experts of width {moe.moe_intermediate_size}, top "
            f"{moe.num_experts_per_tok}, {moe.n_shared_experts} shared; Pallas grouped matmul)"
        )
    notes = [
        f"{model_cfg.num_layers} layers, hidden {model_cfg.mla.hidden_size}, "
        f"{model_cfg.mla.num_heads} heads, q LoRA {model_cfg.mla.q_lora_rank}, {mlp}; "
        f"{weights_note(args.fp8_weights)}, page {sizes.page}, {sizes.kernels} kernels, "
        "asynchronous scheduling, device allocator "
        f"{allocator.chosen()} (mla_jax.engine.allocator).",
        "Step wall: median interval between step launches (unprofiled run); device: GPU kernel "
        "time per step (CUPTI trace of a second run of the same steps; by kernel in the "
        "JSON's device_kernels_ms, an XLA fusion's numbered instances (each layer's, in an "
        "unrolled step) together, by kind, with launches a step, in device_kernel_kinds). "
        "The wall divides into "
        "host (the host working: giving out the tokens of an earlier step, scheduling, "
        "metadata, launch) and wait (the host blocked reading an earlier step's tokens, the "
        "device still running); call: of host, the compiled program's call (the input's "
        "transfer and the kernels' launches; more means the call re-recorded a CUDA graph, "
        "see mla_jax.engine.allocator, or waited for the device; earlier tables' host held "
        "a window's launch waiting for the device, its loop's condition read to the host "
        "each step). Decode steps run in windows of "
        f"{args.decode_window} steps (one device program, tokens read once a window; times "
        "per step: a window's over its steps); host ms, 1 step: the same steps run one at a "
        "time (their call and wait in the JSON's single_steps_ms; the host's work by part, "
        "batch building, the runner's prepare, the call and the rest, in host_parts_ms). "
        "ITL: p50 / p99 of the "
        "intervals between a request's tokens reaching the host, steps one at a time (the "
        "engine's default; in windows a window's tokens arrive together: the JSON's "
        "itl_ms_p50_p99).",
        f"Roofline: (weights a step reads, {weight_bytes / 1e9:.2f} GB at one token: all but "
        "the embedding table"
        + (
            "; in MoE layers only the routed experts the batch chooses, their expected number "
            "under uniform routing"
            if moe
            else ""
        )
        + f" + every KV row read) / copy bandwidth ({bandwidth:.0f} GB/s, same run).",
        f"Programs compiled: {stats['programs']} in {stats['compile_s']:.1f} s "
        "(no persistent cache).",
    ]
    breakdown = breakdown_note(rows, weight_bytes, bandwidth)
    if breakdown:
        notes.append(breakdown)
    if mixed:
        notes.append(
            "Mixed workload (the second of two runs of the same prompt lengths, fresh prompts: "
            f"the first compiled its programs; the second compiled for {mixed['compile_s']} s): "
            f"time to first token p50/p99 {mixed['ttft_ms_p50_p99']} ms, inter-token latency "
            f"p50/p99 {mixed['itl_ms_p50_p99']} ms."
        )
    save(
        table_name("serve", args.model, args.fp8_weights),
        f"Serving: {shaped(args.model, args.fp8_weights)} through Engine.generate",
        [
            "workload",
            *STEP_COLUMNS,
        ],
        rows,
        notes,
        extra={"model": dataclasses.asdict(model_cfg), "stats": stats, "machine": machine()},
        out_dir=args.out,
    )
    if args.smoke:  # a smoke run checks the cache-layout comparison too
        _kv_cache_comparison(["auto", "fp8"], sizes.decode_rows[-1:], *comparison)
    depths = [int(d) for d in args.compile_depths.split(",") if d]
    if depths:
        del engine, model
        decodes, [(_, prefill_tokens)] = sizes.compile_steps
        save(
            table_name("compile", args.model, args.fp8_weights),
            f"Compile seconds per program against depth ({shaped(args.model, args.fp8_weights)})",
            [
                "layers",
                f"decode {len(decodes)} program s",
                f"prefill {prefill_tokens} program s",
            ],
            _compile_depths(model_cfg, depths, sizes, args.fp8_weights),
            [
                "Layers are stacked and run by a lax.scan: in a prefill program XLA compiles one "
                "layer; a decode program unrolls the scan (EngineConfig.unroll_decode_layers: "
                "the GPU runtime then launches the step as a few CUDA graphs), so it compiles "
                "every layer. No persistent compilation cache."
            ],
            out_dir=args.out,
        )


if __name__ == "__main__":
    main()
