"""Shared by the bench_*.py scripts: their command line, how they time, where results go,
what machine ran them, and the BENCHMARKS.md page rendered from every result file (the page
is never edited by hand).

A smoke run (``--smoke --out DIR``) checks a script end to end in seconds on the CPU: the
script picks its tiny shapes, and this module makes the run CPU-only (the Pallas kernels
interpreted, ``SMOKE_DEVICES`` host devices for the multi-device modes), times every function
with ``SMOKE_REPS`` calls, and writes results under DIR only, never to benchmarks/ or the
page. CI runs every script this way (``tests/scripts/test_smoke.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import gzip
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.kernels import fp8_blocks, mosaic_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks")
PAGE = os.path.join(ROOT, "BENCHMARKS.md")
SMOKE_REPS = 1  # calls of each function in a smoke run (no warm-up: a check, not a timing)
SMOKE_DEVICES = 2  # host devices of a smoke run: room for tensor and data parallel modes
SMOKE_TRIALS = 2  # trials of each sweep in a smoke run: its first and its last

_smoke = False  # set by parse_args for a --smoke run


def random_fp8_weight(
    key: jax.Array, shape: tuple[int, ...], blocks: fp8_blocks.Fp8Blocks, *, nk: bool = False
) -> tuple[jax.Array, jax.Array]:
    """A random FP8 weight of ``shape`` (``[..., K, N]``, or HF's ``[..., N, K]`` where
    ``nk``), float8_e4m3fn spanning e4m3's range, and random float32 block scales of its
    grid (``blocks.scale_shape``, or ``scale_shape_nk``), the dequantized weight about
    ``1 / sqrt(K)``."""
    weight_key, scale_key = jax.random.split(key)
    weight = jnp.clip(64 * jax.random.normal(weight_key, shape), -448, 448)
    *lead, rows, columns = shape
    depth, grid = (
        (columns, blocks.scale_shape_nk(rows, columns))
        if nk
        else (rows, blocks.scale_shape(rows, columns))
    )
    scale = jax.random.uniform(scale_key, (*lead, *grid), jnp.float32, 0.5, 2.0) / 64 / depth**0.5
    return weight.astype(fp8_blocks.FP8), scale


def machine() -> str:
    """The accelerator if there is one (nvidia-smi), else the CPU model."""
    try:
        gpu = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            .stdout.strip()
            .splitlines()
        )
        if gpu:
            return gpu[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


def _gpu_kernel_events(trace: dict) -> list[dict]:
    """Kernel executions (CUPTI) of the GPU streams in a perfetto trace."""
    events = trace["traceEvents"]
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"]["name"]
    }
    streams = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e["pid"] in gpu_pids
        and "Stream" in e["args"]["name"]
    }
    return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


class Timing(NamedTuple):
    """How one function was timed, kept whole in the JSON so that a reader can check the
    median against the raw calls."""

    us: float  # median microseconds per call
    method: str  # "cupti": summed kernel durations; "wall": wall clock
    kernels: dict  # kernel name -> median microseconds per call (cupti only)
    samples: list[float]  # microseconds of every timed call, in call order
    warmup: int  # untimed rounds through the argument sets before the timed calls
    rotation: int  # distinct argument sets the calls cycle through (L2 kept cold)
    # cupti only: microseconds from a call's first kernel's start to its last kernel's end,
    # every call. Beyond ``samples`` it holds the GPU's idle gaps inside the call (launches,
    # a loop's condition read by the host).
    spans: tuple[float, ...] = ()

    @classmethod
    def of(
        cls,
        samples: list[float],
        method: str,
        *,
        warmup: int,
        rotation: int,
        kernels=None,
        spans=None,
    ):
        median = float(np.median(samples))
        return cls(median, method, kernels or {}, samples, warmup, rotation, tuple(spans or ()))

    def record(self) -> dict:
        """The JSON form: method, repetitions, warm-up, rotation, raw and median times (and
        the calls' spans where CUPTI timed them)."""
        record = {
            "method": self.method,
            "reps": len(self.samples),
            "warmup": self.warmup,
            "rotation": self.rotation,
            "median_us": round(self.us, 2),
            "samples_us": [round(t, 2) for t in self.samples],
            "kernels_us": {k: round(v, 2) for k, v in self.kernels.items()},
        }
        if self.spans:
            record["span_median_us"] = round(float(np.median(self.spans)), 2)
            record["spans_us"] = [round(t, 2) for t in self.spans]
        return record


def _traced_calls(calls: list[tuple[str, object, tuple]]) -> dict[str, list[list[dict]]]:
    """Runs ``(label, fn, args)`` calls in order inside one profiler trace; ``label -> [the
    kernel events (CUPTI) of each of its calls]``."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for i, (label, fn, args) in enumerate(calls):
            with jax.profiler.TraceAnnotation(f"bench_call|{label}|{i}"):
                jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        [path] = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    kernels = _gpu_kernel_events(trace)
    per_label: dict[str, list[list[dict]]] = {}
    for c in trace["traceEvents"]:
        if c.get("name", "").startswith("bench_call|"):
            mine = [k for k in kernels if c["ts"] <= k["ts"] < c["ts"] + c["dur"]]
            per_label.setdefault(c["name"].split("|")[1], []).append(mine)
    return per_label


def kernel_medians(per_call_events: list[list[dict]]) -> dict[str, float]:
    """Each kernel's microseconds a call: the median over the calls of the sum of its
    instances in each (a kernel that runs several times a call at different sizes, as the
    chunked context's attention does, is not its median instance times its count)."""
    names = {k["name"] for mine in per_call_events for k in mine}
    return {
        name: float(
            np.median(
                [sum(k["dur"] for k in mine if k["name"] == name) for mine in per_call_events]
            )
        )
        for name in names
    }


def call_spans(per_call_events: list[list[dict]]) -> list[float]:
    """Each call's microseconds from its first kernel's start to its last kernel's end."""
    return [
        float(max(k["ts"] + k["dur"] for k in mine) - min(k["ts"] for k in mine))
        for mine in per_call_events
    ]


def _cupti_us(fn, arg_sets: list[tuple], reps: int) -> tuple[list[float], dict, list] | None:
    """Per-call summed kernel durations, the per-kernel medians and the calls' spans from a
    profiler trace, or None when the trace holds no kernel events."""
    calls = [("fn", fn, arg_sets[i % len(arg_sets)]) for i in range(reps)]
    per_call_events = _traced_calls(calls).get("fn", [])
    per_call = [float(sum(k["dur"] for k in mine)) for mine in per_call_events]
    if len(per_call) != reps or min(per_call) <= 0:
        print("warning: no kernel events in the trace; timing wall clock")
        return None
    return per_call, kernel_medians(per_call_events), call_spans(per_call_events)


def time_many(
    fns: dict, reps: int, on_failure=None, *, smoke: bool = False
) -> dict[str, tuple[float, list[str]]]:
    """Candidates of a tuning or exploration run: ``name -> (jitted fn, argument sets)``,
    each compiled (in parallel threads) and called once per argument set, then all called
    ``reps`` times (cycling through their sets) inside one profiler trace. Returns ``name ->
    (median summed kernel microseconds per call, the names of its kernels)``; wall clock and
    no kernel names off a GPU. A candidate that fails to compile or run is left out, printed
    and passed to ``on_failure(name, exception)``; in a smoke run (``smoke``, or a script's
    ``--smoke``) it is raised, and only the first ``SMOKE_TRIALS`` candidates run."""
    smoke = smoke or _smoke
    if smoke:
        fns = dict(list(fns.items())[:SMOKE_TRIALS])

    def compile_one(item):
        name, (fn, args) = item
        try:
            return name, fn.lower(*args[0]).compile(), None
        except Exception as e:  # noqa: BLE001
            return name, None, e

    ready = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for name, fn, err in pool.map(compile_one, fns.items()):
            args = fns[name][1]
            try:
                if err is not None:
                    raise err
                for a in args:
                    jax.block_until_ready(fn(*a))
                ready[name] = (fn, args)
            except Exception as e:  # noqa: BLE001
                if smoke:
                    raise
                print(f"  {name}: failed, {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                if on_failure is not None:
                    on_failure(name, e)
    if jax.default_backend() != "gpu":
        return {
            name: (float(np.median(_wall_us(fn, args, reps))), [])
            for name, (fn, args) in ready.items()
        }
    calls = [
        (name, fn, args[i % len(args)]) for name, (fn, args) in ready.items() for i in range(reps)
    ]
    return {
        name: (
            float(np.median([sum(k["dur"] for k in mine) for mine in per_call])),
            sorted({k["name"] for k in per_call[-1]}),
        )
        for name, per_call in _traced_calls(calls).items()
    }


def _wall_us(fn, arg_sets: list[tuple], reps: int) -> list[float]:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def time_us(fn, arg_sets: list[tuple], *, reps: int = 30, warmup: int = 2) -> Timing:
    """Median device time of ``fn(*args)``, warm, rotating through ``arg_sets`` (distinct
    buffers, so that data left in L2 by one call does not serve the next). On a GPU it is the
    summed duration of the call's kernels as CUPTI timestamps them (the profiler's device
    events); elsewhere, wall clock around ``block_until_ready``. A smoke run makes at most
    ``SMOKE_REPS`` calls on the first argument set, with no warm-up call."""
    if _smoke:
        arg_sets, reps, warmup = arg_sets[:1], min(reps, SMOKE_REPS), 0
    for _ in range(warmup):
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    how = dict(warmup=warmup, rotation=len(arg_sets))
    if jax.default_backend() == "gpu":
        cupti = _cupti_us(fn, arg_sets, reps)
        if cupti is not None:
            return Timing.of(cupti[0], "cupti", kernels=cupti[1], spans=cupti[2], **how)
    return Timing.of(_wall_us(fn, arg_sets, reps), "wall", **how)


class CopyBandwidth(NamedTuple):
    gbs: float  # bytes read + written per second, in GB/s
    method: str
    timing: Timing  # of one copy

    def record(self) -> dict:
        return {"GB/s": round(self.gbs, 1), "method": self.method, "timing": self.timing.record()}


def _torch_copy(n: int) -> Timing | None:
    """A device-to-device ``copy_`` of ``n`` float32 timed with CUDA events, or None without
    PyTorch's CUDA."""
    try:
        import torch

        x = torch.randn(n, device="cuda")
    except (ImportError, RuntimeError, AssertionError):
        return None
    y = torch.empty_like(x)
    warmup = 3
    for _ in range(warmup):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return Timing.of(times, "cuda_events", warmup=warmup, rotation=1)


def copy_bandwidth(gib: float = 2.0) -> CopyBandwidth:
    """The device's copy bandwidth (bytes read + written per second) and how it was taken:
    on a GPU, a device-to-device ``copy_`` timed with CUDA events when PyTorch is there (what
    the driver's copy engine path reaches), else a float32 elementwise pass through XLA. A
    smoke run copies 1 MiB."""
    if _smoke:
        gib = 2**-10
    n = int(gib * 2**30) // 4
    nbytes = 2 * n * 4
    if jax.default_backend() == "gpu":
        t = _torch_copy(n)
        if t is not None:
            return CopyBandwidth(nbytes / t.us / 1e3, "torch copy_ with CUDA events", t)
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
    t = time_us(jax.jit(lambda x: x + 1), [(x,) for x in xs], reps=10)
    return CopyBandwidth(nbytes / t.us / 1e3, "XLA float32 elementwise pass", t)


class DonatedCache:
    """A step that owns its cache: each call donates the cache and keeps the one the step
    returns, as ``Engine.step`` does (a donated buffer cannot be passed again). ``step(state,
    x, cache, metadata)`` returns ``(y, cache)``."""

    def __init__(self, step, cache):
        self.step = step
        self.cache = cache

    def __call__(self, state, x, metadata):
        y, self.cache = self.step(state, x, self.cache, metadata)
        return y, self.cache


def parser(doc: str, *, sweeps: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The bench scripts' command line: ``--out DIR`` (also write the JSON there),
    ``--smoke`` (a CPU check of the whole script in seconds, results only under --out) and,
    where a script has ``sweeps``, ``--sweep [NAME]`` (time kernel variants instead of the
    tables; NAME one of ``sweeps``, the first by default). A script adds its own flags, then
    calls ``parse_args``."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", metavar="DIR", help="also write the JSON here")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check the script end to end on the CPU in seconds: tiny shapes, Pallas kernels "
        f"interpreted, {SMOKE_REPS} call of each function (no warm-up), each sweep on "
        f"{SMOKE_TRIALS} trials; results only under --out (needs it)",
    )
    if sweeps:
        ap.add_argument(
            "--sweep",
            nargs="?",
            const=sweeps[0],
            choices=sweeps,
            help=f"time kernel variants instead of the tables (default: {sweeps[0]})",
        )
    return ap


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``ap``'s arguments; for ``--smoke``, the run is set up as one (before any array
    exists): CPU only, with ``SMOKE_DEVICES`` devices, few timed calls, results under --out
    only."""
    global _smoke
    args = ap.parse_args(argv)
    if args.smoke:
        if not args.out:
            ap.error("--smoke needs --out DIR (a smoke run never writes benchmarks/)")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", SMOKE_DEVICES)
        # Interpreted kernels make large programs; unoptimized machine code halves their
        # compile time, which is most of a smoke run.
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
        mosaic_gpu.widen_cpu_pool()  # interpret mode's warpgroups, one pool thread each
        _smoke = True
    return args


def run(args: argparse.Namespace, tables, sweeps: dict) -> None:
    """A script with sweeps: ``tables()``, or with ``--sweep NAME`` only ``sweeps[NAME]()``;
    a smoke run runs the tables and then every sweep."""
    if args.sweep:
        sweeps[args.sweep]()
        return
    tables()
    if _smoke:
        for name in sweeps:
            print(f"smoke: sweep {name}", flush=True)
            sweeps[name]()


def sweep(name: str, trials: list, out_dir: str | None) -> None:
    """Runs ``(info, variant, measure)`` trials (``measure()`` returns a dict of results); a
    variant Triton rejects is recorded, not fatal. Writes ``<name>_sweep.json`` under
    ``out_dir`` (never into BENCHMARKS.md). A smoke run runs ``SMOKE_TRIALS`` trials spread
    evenly from the first to the last (a sweep's sets of variants come one after another);
    Triton compiles nothing there, so any error is the script's and fatal."""
    if _smoke:
        last = len(trials) - 1
        picks = {round(i * last / (SMOKE_TRIALS - 1)) for i in range(SMOKE_TRIALS)}
        trials = [trials[i] for i in sorted(picks)]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir or ".", f"{name}_sweep.json")
    rows = []
    for i, (info, variant, measure) in enumerate(trials):
        try:
            result = {**info, **jsonable(measure())}
        except Exception as e:  # noqa: BLE001 (a variant the compiler rejects)
            if _smoke:
                raise
            result = {**info, "error": f"{type(e).__name__}: {e}"[:300]}
        result["variant"] = variant
        rows.append(result)
        print(json.dumps(result), flush=True)
        # Written after every trial: a run cut short keeps what it measured.
        with open(path, "w") as f:
            json.dump(
                {
                    "device": machine(),
                    "date": datetime.date.today().isoformat(),
                    "rows": rows,
                    **({"smoke": True} if _smoke else {}),
                    **({} if i == len(trials) - 1 else {"incomplete": True}),
                },
                f,
                indent=1,
            )


def jsonable(result: dict) -> dict:
    """``result`` with its Timing values in their JSON form."""
    return {k: v.record() if isinstance(v, Timing) else v for k, v in result.items()}


def row(cells: list, **timings: Timing) -> dict:
    """A result row: the table cells, and every timing behind them in full (method, raw
    samples, per-kernel breakdown), keyed by what was timed (``pallas=``, ``cudnn=``, ...)."""
    return {"cells": cells, "timings": {name: t.record() for name, t in timings.items()}}


def _cells(result_row) -> list:
    """The table cells of a row; rows written before timings were kept are bare lists."""
    return result_row["cells"] if isinstance(result_row, dict) else result_row


def _dumps(result: dict) -> str:
    """Indented JSON with each list of numbers (the raw samples) on one line."""
    text = json.dumps(result, indent=1)
    return re.sub(
        r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text
    )


def save(
    name: str,
    title: str,
    columns: list[str],
    rows: list[dict],
    notes: list[str],
    extra: dict | None = None,
    out_dir: str | None = None,
    publish: bool = True,
) -> str:
    """Writes ``benchmarks/<name>.json`` (and a copy under ``out_dir``), re-renders the page.
    ``rows`` are made by ``row``. ``publish=False`` (a trial run) or a smoke run: only
    ``out_dir`` gets the JSON (marked ``"smoke": true`` in a smoke run), the repository's
    results and page are left alone."""
    publish = publish and not _smoke
    result = {
        "title": title,
        "device": machine(),
        "date": datetime.date.today().isoformat(),
        "columns": columns,
        "rows": rows,
        "notes": notes,
        **(extra or {}),
        **({"smoke": True} if _smoke else {}),
    }
    if not publish and out_dir is None:
        raise ValueError("a result saved with publish=False needs an out_dir")
    folders = {out_dir or RESULTS} | ({RESULTS} if publish else set())
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            f.write(_dumps(result) + "\n")
    if publish:
        render()
    return os.path.join(RESULTS if publish else out_dir, f"{name}.json")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _span(values: list) -> str:
    """``"30"`` when all values agree, ``"10-30"`` (numbers) or ``"cupti/wall"`` otherwise."""
    distinct = sorted(set(values))
    if len(distinct) == 1:
        return str(distinct[0])
    if all(isinstance(v, int) for v in distinct):
        return f"{distinct[0]}-{distinct[-1]}"
    return "/".join(map(str, distinct))


_HOW = ("method", "reps", "warmup", "rotation")


def _timing_note(rows: list) -> list[str]:
    """One note naming how each kind of time in the table was taken, from the timings the
    rows keep (none for rows written before they kept them)."""
    kept = [t for r in rows if isinstance(r, dict) for t in r.get("timings", {}).items()]
    parts = []
    for name in dict.fromkeys(name for name, _ in kept):
        records = [t for n, t in kept if n == name]
        field = {key: _span([t[key] for t in records]) for key in _HOW}
        parts.append(
            f"{name}: {field['method']}, median of {field['reps']} calls after "
            f"{field['warmup']} warm-up rounds, cycling through {field['rotation']} argument "
            "set(s)"
        )
    if not parts:
        return []
    spans = any("spans_us" in t for _, t in kept)
    kept_too = " and spans (first kernel's start to last kernel's end)" if spans else ""
    return [
        f"Timing (the JSON keeps each row's raw samples, and per-kernel medians{kept_too} "
        "where CUPTI timed it): " + "; ".join(parts) + "."
    ]


def render() -> None:
    """BENCHMARKS.md from every ``benchmarks/*.json``."""
    parts = [
        "# Benchmarks\n",
        "Generated by `scripts/bench_*.py` from `benchmarks/*.json`; do not edit by hand.",
        "Every table names the device and the date it was measured on.\n",
    ]
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        parts.append(f"## {r['title']}\n")
        parts.append(
            f"Device: {r['device']}. Date: {r['date']}. Source: `{os.path.relpath(path, ROOT)}`.\n"
        )
        parts.append("| " + " | ".join(r["columns"]) + " |")
        parts.append("|" + "---|" * len(r["columns"]))
        for result_row in r["rows"]:
            parts.append("| " + " | ".join(_cell(v) for v in _cells(result_row)) + " |")
        parts.append("")
        parts.extend(f"- {n}" for n in r["notes"] + _timing_note(r["rows"]))
        parts.append("")
    with open(PAGE, "w") as f:
        f.write("\n".join(parts))
