"""Decode windows (``EngineConfig.decode_window``): several decode steps in one device
program give the tokens of one step at a time, float32 on the CPU.

On a transformers test checkpoint (V3: 8 heads, q LoRA, YaRN; block size 4): greedy tokens
of windows of 1 and 8 steps equal transformers', requests finishing mid-window by
``max_new_tokens`` and by EOS, and the blocks a window fills are cached (a later prompt
reusing them gets transformers' tokens), EOS at a block's end included; the FP8 cache. On
the tiny model: preemption (only between windows), prompts arriving while windows run,
seeded sampling (a window's step takes the one-step path's key), the Pallas kernels
(interpreted: the decode schedule of a window's last lengths cut to each step's), the
programs a window adds, the host's work once a window (not once a step) and loops of known
trip count (no wait for the device in a window's launch on a GPU). DP 2 runs in
``tests/parallel/test_sharding.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import pytest
from conftest import _BASE_SEED

from mla_jax.checkpoint.loader import load_model
from mla_jax.checkpoint.tiny import tiny_checkpoint
from mla_jax.engine import engine as engine_module
from mla_jax.engine import runner as runner_module
from mla_jax.engine.engine import Engine, EngineConfig, Request

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_checkpoints import greedy_tokens, write_checkpoint  # noqa: E402

BLOCK = 4
VOCAB = 96  # the test checkpoints'


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(our model, transformers' greedy tokens of a prompt, memoized)."""
    path = tmp_path_factory.mktemp("window") / "v3"
    seed = int(np.random.default_rng([_BASE_SEED, 31]).integers(2**31))
    hf = write_checkpoint("v3", path, seed)

    greedy = functools.cache(functools.partial(greedy_tokens, hf))

    return load_model(path)[1], greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_checkpoint(str(tmp_path_factory.mktemp("cache") / "tiny")))[1]


def _engine(model, window: int, eos: tuple[int, ...] = (), **overrides) -> Engine:
    cfg = dict(
        block_size=BLOCK,
        num_blocks=64,
        max_num_batched_tokens=16,
        workspace_size=32,
        max_model_len=64,
        impl="reference",
        decode_window=window,
    )
    engine = Engine(model, EngineConfig(**{**cfg, **overrides}), log=lambda _: None)
    engine.model_cfg = dataclasses.replace(engine.model_cfg, eos_token_ids=eos)
    return engine


def _windows(engine: Engine) -> int:
    """Windows the engine ran (launches of more than one decode step)."""
    return sum(record.shape.steps > 1 for record in engine.stats.step_records)


def test_windows_give_transformers_greedy_tokens(v3, rng):
    """Windows of 8 give window 1's tokens and transformers': requests end mid-window by
    max_new_tokens (3, 7, 12, 21 tokens: the first from the prompt's step, then windows of
    up to 8); a second call's prompts extend the first's outputs and start from the blocks
    the windows filled (cached after each window), every block freed at the end."""
    model, greedy = v3
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 9, 2, 13)]
    new_tokens = (3, 7, 12, 21)
    outs, cached = {}, {}
    for window in (1, 8):
        engine = _engine(model, window)
        first = engine.generate([Request(p, n) for p, n in zip(prompts, new_tokens, strict=True)])
        again = [p + r.output_ids + [7] for p, r in zip(prompts, first, strict=True)]
        before = engine.stats.cached_prompt_tokens
        second = engine.generate([Request(p, 9) for p in again])
        cached[window] = engine.stats.cached_prompt_tokens - before
        outs[window] = [r.output_ids for r in first + second]
        assert engine.schedulers[0].block_manager.num_free == 64
        assert (_windows(engine) > 0) == (window > 1)
    want = [greedy(tuple(p), n) for p, n in zip(prompts, new_tokens, strict=True)]
    want += [greedy(tuple(p), 9) for p in again]
    assert outs[8] == outs[1] == want
    # Each second prompt takes every whole block of the first call's tokens in the cache:
    # all but the last one sampled (no step computed it).
    computed = [len(p) + n - 1 for p, n in zip(prompts, new_tokens, strict=True)]
    assert cached[8] == cached[1] == sum(n // BLOCK * BLOCK for n in computed)


def test_eos_mid_window(v3, rng):
    """A request that samples EOS mid-window ends there (its later tokens dropped, as a
    single step would), one with ignore_eos goes on; the EOS token ends a block, which a
    later prompt starting with those tokens reuses only if its rows were written: the device
    stops writing after EOS, and the host counts only what it wrote."""
    model, greedy = v3
    # A prompt with a token not seen before whose position ends a block, inside the first
    # window (tokens 1-8) but not at its last step.
    for length in range(3, 12):
        prompt = rng.integers(0, VOCAB, length).tolist()
        out = greedy(tuple(prompt), 16)
        ends = [j for j in range(1, 7) if out[j] not in out[:j] and (length + j + 1) % BLOCK == 0]
        if ends:
            break
    eos_at = ends[0]
    eos = out[eos_at]
    other = rng.integers(0, VOCAB, 9).tolist()
    runs = {}
    for window in (1, 8):
        engine = _engine(model, window, eos=(eos,))
        first = engine.generate([Request(prompt, 16), Request(other, 12, ignore_eos=True)])
        reuse = prompt + first[0].output_ids + [3, 1]
        second = engine.generate([Request(reuse, 5, ignore_eos=True)])
        runs[window] = [r.output_ids for r in first + second]
        assert engine.schedulers[0].block_manager.num_free == 64
    assert runs[8] == runs[1]
    assert runs[8][0] == out[: eos_at + 1]
    assert runs[8][1] == greedy(tuple(other), 12)
    assert runs[8][2] == greedy(tuple(reuse), 5)


def test_fp8_cache(v3, rng):
    """The FP8 cache: windows of 1 and 8 give the same tokens."""
    model, _ = v3
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (7, 3, 12)]
    outs = {
        window: [
            r.output_ids
            for r in _engine(model, window, kv_cache_dtype="fp8").generate(
                [Request(p, n) for p, n in zip(prompts, (10, 17, 5), strict=True)]
            )
        ]
        for window in (1, 8)
    }
    assert outs[8] == outs[1]


def _tiny_engine(model, window: int, **overrides) -> Engine:
    cfg = dict(num_blocks=16, max_num_batched_tokens=64, impl="reference", decode_window=window)
    return Engine(model, EngineConfig(**{**cfg, **overrides}), log=lambda _: None)


def test_preemption_between_windows(tiny, rng):
    """4 requests that need 16 blocks share 6: requests are preempted and recomputed (by
    single steps: a window only runs when its blocks are free) and end with the greedy tokens
    of an unconstrained run without windows."""
    prompts = [rng.integers(0, 512, 20).tolist() for _ in range(4)]

    def run(window, num_blocks):
        engine = _tiny_engine(tiny, window, num_blocks=num_blocks)
        requests = engine.generate([Request(p, 40, ignore_eos=True) for p in prompts])
        assert engine.schedulers[0].block_manager.num_free == num_blocks
        return engine, [r.output_ids for r in requests]

    _, want = run(1, 16)
    tight, got = run(8, 6)
    assert tight.stats.preemptions > 0 and _windows(tight) > 0
    assert got == want


def test_prompts_arriving_while_windows_run(tiny, rng):
    """A prompt that arrives while windows run (added to the queue from the engine's log,
    which it calls every step here) starts in the next launch, a single step; so do prompts
    waiting for room (max_num_seqs 2) once a request ends mid-window. Tokens as without
    windows."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (4, 11, 6)]
    late = rng.integers(0, 512, 9).tolist()

    def run(window):
        calls = []
        requests = [Request(p, n) for p, n in zip(prompts, (5, 40, 14), strict=True)]
        arrival = Request(late, 10)

        def log(_):
            calls.append(len(engine.stats.step_records))
            if len(calls) == 4:  # after the fourth launch
                engine.schedulers[0].add(arrival)

        engine = _tiny_engine(tiny, window, max_num_seqs=2)
        engine.log = log
        engine.generate(requests, progress_every_s=0.0)
        return engine, [r.output_ids for r in [*requests, arrival]]

    _, want = run(1)
    engine, got = run(8)
    assert got == want
    records = engine.stats.step_records
    # Prompt chunks launched right after a window: the waiting and the arriving ones.
    after_windows = [
        b.prefill_tokens for a, b in zip(records, records[1:], strict=False) if a.shape.steps > 1
    ]
    assert sum(tokens > 0 for tokens in after_windows) >= 2, records


def test_seeded_sampling_matches_single_steps(tiny, rng):
    """A window's step samples with the key a single step of that number would: one
    request's seeded draws are the same with windows of 1 and 8."""
    prompt = rng.integers(0, 512, 6).tolist()
    outs = [
        _tiny_engine(tiny, window).generate([Request(prompt, 20, temperature=1.5)])[0].output_ids
        for window in (1, 8)
    ]
    assert outs[0] == outs[1]


def test_pallas_kernels_in_windows(tiny, rng):
    """The Pallas kernels (interpreted) in windows of 4, the decode schedule built for a
    window's last lengths and cut to each step's: the reference kernels' tokens."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 37, 1)]
    kw = dict(max_num_batched_tokens=16, workspace_size=256)
    want = [
        r.output_ids for r in _tiny_engine(tiny, 1, **kw).generate([Request(p, 7) for p in prompts])
    ]
    engine = _tiny_engine(tiny, 4, impl="pallas", **kw)
    got = [r.output_ids for r in engine.generate([Request(p, 7) for p in prompts])]
    assert got == want and _windows(engine) > 0


def test_precompile_covers_windows(tiny, rng):
    """A window program for each decode batch size joins the fixed set (here 2 of them);
    serving compiles nothing more."""
    cfg = dict(num_blocks=64, max_num_seqs=20, max_num_batched_tokens=64, workspace_size=128)
    engine = _tiny_engine(tiny, 4, **cfg)
    shapes = engine.precompile()
    windows = [shape for shape in shapes if shape.steps == 4]
    assert shapes == engine.step_shapes() == engine.stats.buckets
    assert len(shapes) == 8 + 2 and sorted(s.decodes for s in windows) == [16, 20]
    assert engine.schedulers[0].block_manager.num_free == 64
    prompts = [rng.integers(0, 512, n).tolist() for n in (1, 40, 7, 90, 3, 200)]
    engine.generate([Request(p, 9) for p in prompts])
    assert engine.stats.buckets == shapes and _windows(engine) > 0


def _count_host_work(engine: Engine, monkeypatch) -> collections.Counter:
    """Counts, as ``engine`` runs, its schedulings, metadata builds, program calls and
    token reads."""
    counts = collections.Counter()

    def counted(name: str, fn: Callable) -> Callable:
        def counting(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return counting

    runner, compile_program = engine.runner, engine.runner._compile

    def compile_counted(layout, packed, shape):
        program, record = compile_program(layout, packed, shape)
        runner.programs[layout] = counted("program calls", program)
        return runner.programs[layout], record

    monkeypatch.setattr(runner, "_compile", compile_counted)
    monkeypatch.setattr(engine, "_schedule", counted("schedules", engine._schedule))
    build_metadata = counted("metadata builds", runner_module.build_metadata)
    monkeypatch.setattr(runner_module, "build_metadata", build_metadata)
    window_tokens = counted("token reads", engine_module.window_tokens)
    monkeypatch.setattr(engine_module, "window_tokens", window_tokens)
    return counts


def test_host_work_once_a_window(tiny, rng, monkeypatch):
    """The host schedules, builds metadata, calls the program and reads tokens once a
    launch, a window of 4 steps as a single step (work once a step in a window would
    multiply them): 2 requests of 13 tokens take a prompt step and 3 windows (4 launches
    for 13 decode steps), where single steps take 13 launches. Each launch interval is the
    host's work plus its wait for tokens."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 9)]
    for window, launches in ((1, 13), (4, 4)):
        engine = _tiny_engine(tiny, window)
        counts = _count_host_work(engine, monkeypatch)
        engine.generate([Request(p, 13, ignore_eos=True) for p in prompts])
        monkeypatch.undo()
        records = engine.stats.step_records
        assert sum(record.steps for record in records) == 13
        assert len(records) == launches and _windows(engine) == (window > 1) * 3
        # (A last scheduling may find every request's token pending: nothing to launch.)
        assert launches <= counts.pop("schedules") <= launches + 1
        names = ("metadata builds", "program calls", "token reads")
        assert counts == dict.fromkeys(names, launches), counts
        # Between launches the host works (the call among it) or waits for tokens.
        for record in records[1:]:
            assert record.host_s + record.wait_s == pytest.approx(record.interval_s)
            assert 0 < record.call_s < record.host_s and record.wait_s >= 0


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_window_loops_have_known_trip_counts(tiny, rng, unroll):
    """Every loop of the programs (a window's steps, the layers' scan) runs a trip count
    XLA knows, and a window branches nowhere: XLA's GPU runtime runs a loop of unknown trip
    count, or a conditional, by copying the condition to the host and waiting for it, which
    would hold the host in the window's launch until the device has run it. With
    ``unroll_decode_layers`` (the default) the programs of decode-only steps and windows have
    no loop over the layers (a window's one loop is its steps); a step with a prompt keeps
    the scan."""
    engine = _tiny_engine(tiny, 4, unroll_decode_layers=unroll)
    # The prompt's step, a window of 4, then one decode step alone.
    engine.generate([Request(rng.integers(0, 512, 6).tolist(), 6, ignore_eos=True)])
    assert _windows(engine) == 1
    programs = list(engine.runner.programs.values())
    shapes = engine.stats.buckets
    kinds = sorted((bool(shape.prefills), shape.steps) for shape in shapes)
    assert len(programs) == len(shapes) and kinds == [(False, 1), (False, 4), (True, 1)]
    # The loops that carry the cache: the layers' scan and a window's steps.
    cache = "[" + ",".join(map(str, engine.runner.cache.shape)) + "]"
    for shape, program in zip(shapes, programs, strict=True):
        lines = program.as_text().splitlines()
        loops = [line for line in lines if " while(" in line]
        assert all("known_trip_count" in line for line in loops), shape
        scans = 0 if unroll and not shape.prefills else 1
        assert sum(cache in line for line in loops) == scans + (shape.steps > 1), shape
        if shape.steps > 1:
            assert not any(" conditional(" in line for line in lines)


def test_bad_window():
    with pytest.raises(ValueError, match="decode_window must be positive, got 0"):
        EngineConfig(decode_window=0)
