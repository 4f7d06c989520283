"""Across GPUs: the serving benchmark's V2-Lite-shaped model on 1 GPU, tensor parallel, data
parallel attention and both (``tp2``, ``dp2``, ``dp2xtp2``, ...), and data parallel attention
with the routed experts over all GPUs (``dp2+ep``, ``dp2xtp2+ep``: ``--model v2-lite-moe``),
through ``Engine.generate``.

Per mode and workload: tokens/s, the decode step's wall time (median interval between step
launches), its device time on the busiest GPU and the time its GPUs spend in collective
kernels (NCCL, from a CUPTI trace of a second run of the same steps), the speedup over one
GPU and the scaling efficiency (speedup / GPUs), and each GPU's bytes of weights and cache.
Decode rows start from requests whose context is already in the cache, as bench_serve's;
with data parallelism a batch's requests are dealt to the DP ranks in turn (batch 64 at DP 2:
32 a rank, and each rank's decode ladder holds that size).

    python scripts/bench_multi.py --modes tp1,tp2,dp2 --quick --out $OUT

``--smoke``: the tiny model on 2 host devices (1 device, TP 2 and DP 2, reference kernels,
a few short requests; ``SMOKE_FLAGS``), results under --out only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from bench_serve import (
    MODELS,
    _decode_requests,
    _run_requests,
    _weight_bytes,
    profile,
)
from benchlib import _gpu_kernel_events, machine, parse_args, parser, save
from flax import nnx

from mla_jax.checkpoint.tiny import TINY
from mla_jax.engine import allocator
from mla_jax.engine.batch import scratch_blocks
from mla_jax.engine.engine import Engine, EngineConfig, Request
from mla_jax.model.deepseek import DeepseekModel

# Kernels of a collective: NCCL's own, whatever XLA names them.
_COLLECTIVE = re.compile(r"nccl|all.?reduce|all.?gather|reduce.?scatter|all.?to.?all", re.I)
COLUMNS = [
    "mode",
    "workload",
    "tokens/s",
    "step wall ms",
    "device ms (busiest GPU)",
    "collective ms per GPU",
    "speedup vs 1 GPU",
    "scaling efficiency",
    "weights + cache GB per GPU",
]
# The defaults of a smoke run (flags given still win).
SMOKE_FLAGS = dict(
    model="tiny",
    modes="tp1,tp2,dp2",
    batches="4",
    context=16,
    prefill="2x24",
    decode_steps=5,
    profiled_steps=2,
    impl="reference",
    block_size=16,
)


class Mode(NamedTuple):
    data_parallel: int
    tensor_parallel: int
    expert_parallel: bool = False  # the routed experts over all devices (EngineConfig's)

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel

    @property
    def label(self) -> str:
        if self.devices == 1:
            return "1 GPU"
        parts = [f"DP {self.data_parallel}"] * (self.data_parallel > 1)
        parts += [f"TP {self.tensor_parallel}"] * (self.tensor_parallel > 1)
        return " x ".join(parts) + " + EP" * self.expert_parallel


def _modes(text: str) -> list[Mode]:
    """``tp1,tp2,dp2,dp2xtp2,dp2+ep`` -> (data_parallel, tensor_parallel, expert_parallel) of
    each mode."""
    modes = []
    for mode in text.split(","):
        match = re.fullmatch(
            r"dp([1-9][0-9]*)(?:xtp([1-9][0-9]*))?(\+ep)?|tp([1-9][0-9]*)", mode.strip()
        )
        if match is None:
            raise argparse.ArgumentTypeError(
                f"mode {mode!r}: want tpN, dpM or dpMxtpN, the last two optionally +ep"
            )
        data_parallel, tensor_parallel, expert_parallel, tp_only = match.groups()
        tensor_parallel = int(tensor_parallel or tp_only or 1)
        modes.append(Mode(int(data_parallel or 1), tensor_parallel, bool(expert_parallel)))
    return modes


def _shape(text: str) -> tuple[int, int]:
    """``8x4096`` -> (8, 4096)."""
    match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"want COUNTxLENGTH, e.g. 8x4096, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def device_and_collective_ms(trace: dict, steps: int) -> tuple[float | None, float | None]:
    """Per step: the kernel time of the busiest GPU and the mean over GPUs of their time in
    collective kernels (which includes any wait for a slower peer); None without GPU events
    (a CPU run)."""
    per_gpu: dict[int, list[float]] = {}
    for event in _gpu_kernel_events(trace):
        totals = per_gpu.setdefault(event["pid"], [0.0, 0.0])
        totals[0] += event["dur"]
        totals[1] += event["dur"] if _COLLECTIVE.search(event["name"]) else 0.0
    if not per_gpu:
        return None, None
    busiest = max(total for total, _ in per_gpu.values())
    collective = float(np.mean([c for _, c in per_gpu.values()]))
    return busiest / 1e3 / steps, collective / 1e3 / steps


def _gb_per_device(engine: Engine) -> float:
    """Bytes of parameters and cache the first device holds."""
    arrays = [*engine.runner.params, engine.runner.cache]
    device = jax.devices()[0]
    held = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
    return held / 1e9


def _decode(engine: Engine, batch: int, context: int, steps: int, profiled: int) -> dict:
    records = engine.stats.step_records
    before = len(records)
    _decode_requests(engine, batch, context, steps)
    engine.generate([])
    # The first steps may compile; a steady step's wall time is the launch interval.
    step_ms = float(np.median([r.interval_s for r in records[before:][3:]])) * 1e3

    def again():
        _decode_requests(engine, batch, context, profiled)
        engine.generate([])
        return profiled

    device_ms, collective_ms = device_and_collective_ms(*profile(again))
    return dict(
        workload=f"decode {batch} x {context}",
        tokens_per_s=batch / step_ms * 1e3,
        step_ms=step_ms,
        device_ms=device_ms,
        collective_ms=collective_ms,
    )


# Device memory kept free beside weights and cache: activations, workspace, compiled programs.
_HEADROOM = 12e9


def _device_bytes() -> float:
    """Memory of one device (unbounded where the backend does not say, e.g. a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", np.inf))


def _does_not_fit(batch: int, context: int, cache_gb: float) -> dict:
    return dict(
        workload=f"decode {batch} x {context}",
        tokens_per_s=None,
        step_ms=None,
        device_ms=None,
        collective_ms=None,
        does_not_fit=f"cache needs {cache_gb:.0f} GB per GPU",
    )


def _prefill(engine: Engine, count: int, length: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)

    def requests() -> list[Request]:
        return [Request(rng.integers(0, vocab, length).tolist(), 1) for _ in range(count)]

    # One untimed run first: a program's first run pays one-time costs that compile time
    # does not count (NCCL sets up the collectives of an expert-parallel step then: 3x the
    # warm time on two H200s). Fresh prompts for the timed run, so the prefix cache has none.
    _run_requests(engine, requests())
    run = _run_requests(engine, requests())
    return dict(
        workload=f"prefill {count} x {length}",
        tokens_per_s=run["prompt"] / run["run_s"],
        step_ms=None,
        device_ms=None,
        collective_ms=None,
    )


def _cells(mode: Mode, measured: dict, base: dict | None, gb: float | None) -> list:
    speedup = None
    if base is not None and None not in (base["tokens_per_s"], measured["tokens_per_s"]):
        speedup = measured["tokens_per_s"] / base["tokens_per_s"]

    def rounded(value, digits=3):
        return "" if value is None else round(value, digits)

    if "does_not_fit" in measured:
        cells = [mode.label, measured["workload"], f"does not fit: {measured['does_not_fit']}"]
        return cells + [""] * (len(COLUMNS) - len(cells))
    return [
        mode.label,
        measured["workload"],
        round(measured["tokens_per_s"], 1),
        rounded(measured["step_ms"]),
        rounded(measured["device_ms"]),
        rounded(measured["collective_ms"]),
        rounded(speedup, 2),
        rounded(None if speedup is None else speedup / mode.devices, 2),
        rounded(gb, 2),
    ]


def main(argv: list[str] | None = None) -> str:
    allocator.prefer_cuda_async()  # before JAX starts its backend
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--model", choices=[*sorted(MODELS), "tiny"], default="v2-lite")
    ap.add_argument("--layers", type=int, help="override the model's depth")
    ap.add_argument(
        "--modes",
        type=_modes,
        default=[Mode(1, 1), Mode(1, 2)],
        help="e.g. tp1,tp2,tp4,dp2,dp4,dp2xtp2,dp2+ep (+ep: the routed experts over all GPUs)",
    )
    ap.add_argument("--batches", default="64,256", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="decode context length")
    ap.add_argument("--prefill", type=_shape, help="prompts x length (default 32x4096)")
    ap.add_argument("--decode-steps", type=int, help="timed decode steps (default 48)")
    ap.add_argument("--profiled-steps", type=int, help="traced decode steps (default 12)")
    ap.add_argument(
        "--quick", action="store_true", help="16 decode steps, 4 traced, prefill 8 x 4096"
    )
    ap.add_argument("--impl", choices=["pallas", "reference"], default="pallas")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument(
        "--no-publish",
        action="store_true",
        help="write the JSON only under --out (a trial run: benchmarks/ and the page untouched)",
    )
    args = parse_args(ap, argv)
    if args.smoke:
        ap.set_defaults(**SMOKE_FLAGS)
        args = ap.parse_args(argv)
    if args.no_publish and not args.out:
        ap.error("--no-publish needs --out")
    model_cfg = TINY if args.model == "tiny" else MODELS[args.model]
    if args.layers:
        model_cfg = dataclasses.replace(model_cfg, num_layers=args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    prefill = args.prefill or ((8, 4096) if args.quick else (32, 4096))
    steps = args.decode_steps or (16 if args.quick else 48)
    profiled = args.profiled_steps or (4 if args.quick else 12)

    model = DeepseekModel(model_cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    largest = max(batches)
    blocks_per_request = -(-(args.context + steps + profiled + 1) // args.block_size)
    settings = dict(
        block_size=args.block_size,
        max_num_seqs=largest,
        max_num_batched_tokens=min(8192, 2 * prefill[1]),
        max_model_len=max(args.context, prefill[1]) + steps + profiled + 1,
        workspace_size=max(args.block_size, min(32768, prefill[1])),
        impl=args.impl,
    )
    notes = _notes(model, model_cfg, args, steps, profiled)
    extra = {
        "model": dataclasses.asdict(model_cfg),
        "machine": machine(),
        "devices": jax.device_count(),
        "settings": settings,
    }
    measured, path = [], None  # (mode, GB per GPU, measurement)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    row_bytes = model_cfg.num_layers * args.block_size * model_cfg.mla.cache_width * 2
    for mode in args.modes:
        start = time.perf_counter()
        ranks = mode.data_parallel
        # A batch whose cache share does not fit a GPU beside its weights gets a row saying so
        # (a replicated cache under TP does not shrink with more GPUs; a DP rank's does).
        room = _device_bytes() - weight_bytes / mode.tensor_parallel - _HEADROOM
        fits = [b for b in batches if -(-b // ranks) * blocks_per_request * row_bytes <= room]
        for batch in sorted(set(batches) - set(fits)):
            need = -(-batch // ranks) * blocks_per_request * row_bytes / 1e9
            measured.append((mode, None, _does_not_fit(batch, args.context, need)))
            print(measured[-1], flush=True)
        # Each DP rank's cache holds its share of the decode batch or of the prompts.
        per_rank = max(
            -(-max(fits, default=1) // ranks) * blocks_per_request,
            -(-prefill[1] // args.block_size) * -(-8 // ranks),
        )
        cfg = EngineConfig(
            **settings,
            num_blocks=(per_rank + scratch_blocks(args.block_size, ranks)) * ranks,
            tensor_parallel=mode.tensor_parallel,
            data_parallel=ranks,
            expert_parallel=mode.expert_parallel,
        )
        # A rank's decode ladder also holds its share of each batch (no padding to the next).
        ladder = cfg.fixed_buckets(settings["max_model_len"])
        shares = {-(-batch // ranks) for batch in batches}
        ladder = dataclasses.replace(
            ladder, decode_buckets=tuple(sorted({*ladder.decode_buckets, *shares}))
        )
        engine = Engine(model, dataclasses.replace(cfg, buckets=ladder), log=lambda _: None)
        gb = _gb_per_device(engine)
        for batch in fits:
            measured.append((mode, gb, _decode(engine, batch, args.context, steps, profiled)))
            print(measured[-1], flush=True)
        measured.append((mode, gb, _prefill(engine, *prefill, model_cfg.vocab_size)))
        print(measured[-1], flush=True)
        stats = engine.stats.as_dict()
        print(
            f"{mode.label}: {stats['programs']} programs compiled in {stats['compile_s']:.1f} s, "
            f"mode done in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        del engine
        gc.collect()
        # Saved after every mode, so that a mode that fails leaves the others' rows.
        path = save(
            f"multi_{args.model}",
            f"Across GPUs: {args.model}-shaped model, 1 GPU vs tensor and data parallel",
            COLUMNS,
            _rows(measured),
            notes,
            extra=extra,
            out_dir=args.out,
            publish=not args.no_publish,
        )
    return path


def _rows(measured: list[tuple[Mode, float, dict]]) -> list[dict]:
    one_gpu = {m["workload"]: m for mode, _, m in measured if mode.devices == 1}
    return [
        {"cells": _cells(mode, m, one_gpu.get(m["workload"]), gb), "measured": m}
        for mode, gb, m in measured
    ]


def _notes(model, model_cfg, args, steps: int, profiled: int) -> list[str]:
    mla, experts = model_cfg.mla, model_cfg.moe
    moe = (
        ""
        if experts is None
        else f" (MoE layers: {experts.n_routed_experts} routed experts of "
        f"{experts.moe_intermediate_size}, top {experts.num_experts_per_tok})"
    )
    return [
        f"{model_cfg.num_layers} layers, hidden {mla.hidden_size}, {mla.num_heads} heads, "
        f"MLP {model_cfg.intermediate_size}{moe}, vocabulary {model_cfg.vocab_size}; random "
        f"bf16 weights ({_weight_bytes(model, 1) / 1e9:.2f} GB read by a 1-token step on one "
        f"GPU), page {args.block_size}, {args.impl} kernels, asynchronous scheduling; "
        f"{steps} timed decode steps, {profiled} traced.",
        "TP N: heads, MLP columns, routed experts and vocabulary split over N GPUs "
        "(mla_jax/parallel/sharding.py); the latent cache is replicated, so every GPU holds and "
        "reads all of it.",
        "DP M: each of M GPUs (groups of N GPUs with x TP N) runs its own requests over its own "
        "part of the cache, the weights replicated over the DP ranks (each rank runs the MLP "
        "and experts on its own tokens: no collective across DP ranks).",
        "+ EP: the routed experts split over all GPUs, each holding 1 / GPUs of them "
        "(mla_jax/parallel/expert_parallel.py): every MoE layer all-gathers the DP ranks' "
        "tokens and reduce-scatters the experts' float32 outputs back.",
        "Prefill: prompts arriving together, one token generated each; the second of two runs "
        "of fresh prompts (the first pays one-time costs, such as NCCL's set-up).",
        "Collective ms: time each GPU spends in NCCL kernels per step (the all-reduces of "
        "partial sums, two per dense layer and one for the embedding; the sampling's "
        "gathers), waits for the other GPU included. Speedup: tokens/s over the 1-GPU row of "
        "the same workload; scaling efficiency = speedup / GPUs.",
    ]


if __name__ == "__main__":
    main()
