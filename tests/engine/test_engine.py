"""The engine and the generate script on the built-in tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, rel_err
from flax import nnx
from teacher_forcing import teacher_forced_logits

from mla_jax.cache.latent_cache import CacheFullError
from mla_jax.checkpoint.loader import load_model
from mla_jax.checkpoint.tiny import tiny_checkpoint
from mla_jax.engine.engine import Engine, EngineConfig, Request, RequestError
from mla_jax.model.config import MLAConfig, ModelConfig
from mla_jax.model.deepseek import DeepseekModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_checkpoint(str(tmp_path_factory.mktemp("cache") / "tiny"))
    return load_model(path)[1]


def _run(model, prompts, *, log=None, **kw):
    cfg = dict(block_size=16, num_blocks=64, impl="reference")
    cfg.update(kw)
    engine = Engine(model, EngineConfig(**cfg), seed=kw.pop("seed", 0), log=log or (lambda _: None))
    return engine, engine.generate([Request(p, 5) for p in prompts])


def test_outputs_do_not_depend_on_batching(tiny, rng):
    """Token budget (chunked prefill), workspace (context chunks), concurrency and cache size
    change the schedule, never the greedy tokens."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (1, 40, 7, 90, 3)]
    _, base = _run(tiny, prompts, max_num_batched_tokens=512)
    for kw in (
        dict(max_num_batched_tokens=24, workspace_size=32),
        dict(max_num_batched_tokens=64, max_num_seqs=2),
        dict(max_num_batched_tokens=40, num_blocks=7, block_size=16),  # requests wait for blocks
    ):
        _, reqs = _run(tiny, prompts, **kw)
        assert [r.output_ids for r in reqs] == [r.output_ids for r in base], kw


def _programs_logged(logs: list[str]) -> int:
    """Programs the engine logged as compiled or loaded from the persistent compilation
    cache (another test, or another pytest worker, may have compiled the same one)."""
    starts = ("compiled bucket", "loaded from the compilation cache bucket")
    return sum(m.startswith(starts) for m in logs)


def test_one_compilation_per_bucket(tiny, rng):
    logs = []
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 30, 12)]
    engine, _ = _run(tiny, prompts, max_num_batched_tokens=16, log=logs.append)
    buckets = engine.stats.buckets
    assert len(set(buckets)) == len(buckets) == len(engine.runner.programs)
    assert _programs_logged(logs) == len(buckets)
    assert any("tok/s" in m for m in logs)


def test_seeded_sampling_is_reproducible(tiny, rng):
    prompts = [rng.integers(0, 512, 6).tolist()]

    def sample(seed):
        engine = Engine(
            tiny, EngineConfig(num_blocks=8, impl="reference"), seed=seed, log=lambda _: None
        )
        return engine.generate([Request(prompts[0], 12, temperature=1.5)])[0].output_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_bad_requests(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=2, block_size=16, impl="reference"))
    with pytest.raises(CacheFullError, match="needs 3 cache blocks of 16; the cache has 2"):
        engine.generate([Request(list(range(40)), 5)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([Request([3, 600], 5)])
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([Request([], 5)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([Request([1], 2000)])
    with pytest.raises(ValueError, match="workspace_size"):
        EngineConfig(block_size=16, workspace_size=8)


def test_generate_script(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, MLA_JAX_CACHE=str(tmp_path / "cache"))
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "generate.py"),
        "--model",
        "tiny",
        "--prompt-ids",
        "3,14,15",
        "--prompt-ids",
        "9,2,6,5,3,5,8,9,7,9,3,2,3,8,4,6",
        "--max-new-tokens",
        "4",
        "--max-num-batched-tokens",
        "8",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [o["prompt_ids"] for o in result["outputs"]] == [
        [3, 14, 15],
        [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6],
    ]
    assert all(len(o["generated_ids"]) == 4 for o in result["outputs"])
    assert result["stats"]["generated_tokens"] == 8 and result["stats"]["buckets"]
    assert "compiled bucket" in proc.stderr and "tok/s" in proc.stderr
    # A second run finds every program in the persistent compilation cache.
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    stats = json.loads(out.read_text())["stats"]
    assert stats["programs"] == stats["programs_from_cache"] == len(result["stats"]["buckets"])
    assert "compiled bucket" not in again.stderr and "from the compilation cache" in again.stderr
    bad = subprocess.run(
        cmd[:4] + ["--prompt-ids", "1,x", "--max-new-tokens", "2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "comma-separated integers" in bad.stderr


def test_pallas_kernels_give_the_reference_tokens(tiny, rng):
    """The engine on the Pallas kernels (interpret mode here, Triton on a GPU) with its host
    schedules: chunked prefill, context chunks, split-KV decode."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 37, 1)]
    kw = dict(max_num_batched_tokens=16, workspace_size=256, num_blocks=16)
    outs = {
        impl: [r.output_ids for r in _run(tiny, prompts, impl=impl, **kw)[1]]
        for impl in ("reference", "pallas")
    }
    assert outs["pallas"] == outs["reference"]


def test_precompile_covers_later_steps(tiny):
    logs = []
    engine = Engine(tiny, EngineConfig(num_blocks=8, impl="reference"), log=logs.append)
    shapes = engine.precompile([[(0, 7)], [(7, 1)]])
    assert engine.stats.buckets == shapes and engine.schedulers[0].block_manager.num_free == 8
    engine.generate([Request(list(range(1, 8)), max_new_tokens=3)])
    assert engine.stats.buckets == shapes  # nothing new compiled
    assert _programs_logged(logs) == 2


def test_generate_script_with_text_prompt(tmp_path):
    """--prompt goes through the checkpoint's tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    model_dir = tiny_checkpoint(str(tmp_path / "tiny"))
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 512)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tiny" / "tokenizer.json"))
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "generate.py"),
        "--model",
        model_dir,
        "--prompt",
        "w3 w14 w15",
        "--max-new-tokens",
        "3",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(out.read_text())["outputs"]
    assert result["prompt_ids"] == [3, 14, 15] and len(result["generated_ids"]) == 3
    assert result["generated_text"].split() == [
        f"w{t}" if t else "[UNK]" for t in result["generated_ids"]
    ]


def test_precompile_compiles_every_program(tiny, rng):
    """precompile() with no argument compiles the engine's whole set; serving adds none."""
    cfg = EngineConfig(
        num_blocks=64,
        max_num_seqs=20,
        max_num_batched_tokens=64,
        workspace_size=128,
        impl="reference",
    )
    engine = Engine(tiny, cfg, log=lambda _: None)
    shapes = engine.precompile()
    assert shapes == engine.step_shapes() == engine.stats.buckets and len(shapes) == 8
    assert engine.schedulers[0].block_manager.num_free == 64
    prompts = [rng.integers(0, 512, n).tolist() for n in (1, 40, 7, 90, 3, 200)]
    engine.generate([Request(p, 5) for p in prompts])
    assert engine.stats.buckets == shapes
    # Compiling ahead counts as engine time: the rate excludes it from a time that holds it.
    stats = engine.stats
    assert stats.elapsed_s >= stats.compile_s > 0
    tokens = stats.prompt_tokens + stats.generated_tokens
    assert stats.as_dict()["tokens_per_s"] == round(tokens / (stats.elapsed_s - stats.compile_s), 2)


def test_ragged_workload_compiles_at_most_8_programs(rng):
    """64 requests arriving together, prompts of 25-1000 tokens (up to 8 budgets of 128 and
    3 context chunks), 1-256 new tokens: every step falls in the engine's fixed set, which
    has 8 programs."""
    cfg = ModelConfig(
        model_type="deepseek_v3",
        vocab_size=64,
        num_layers=1,
        intermediate_size=32,
        mla=MLAConfig(
            hidden_size=32,
            num_heads=2,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        max_position_embeddings=1280,
    )
    model = DeepseekModel(cfg, rngs=nnx.Rngs(0))
    prompts = [rng.integers(0, 64, n).tolist() for n in rng.integers(25, 1001, 64)]
    new_tokens = rng.integers(1, 257, 64)
    engine_cfg = EngineConfig(
        num_blocks=64 * 80,
        max_num_batched_tokens=128,
        workspace_size=2048,
        impl="reference",
    )
    engine = Engine(model, engine_cfg, log=lambda _: None)
    engine.generate([Request(p, int(n)) for p, n in zip(prompts, new_tokens, strict=True)])
    assert len(engine.stats.buckets) <= 8
    assert set(engine.stats.buckets) <= set(engine.step_shapes())
    assert len(engine.runner.programs) == len(engine.stats.buckets)


def test_decodes_run_before_prompt_chunks(tiny):
    """A running prompt chunk earlier in the list does not take the budget from a decode."""
    engine = Engine(tiny, EngineConfig(num_blocks=16, max_num_batched_tokens=8, impl="reference"))
    prompt, decode = Request(list(range(1, 30)), 2), Request([1, 2, 3], 2)
    decode.output_ids, decode.num_computed = [5], 3
    for req in (prompt, decode):
        req.block_ids = np.asarray(engine.schedulers[0].block_manager.allocate(2))
    engine.schedulers[0].running += [prompt, decode]
    batch = engine.schedulers[0].schedule()
    assert [(entry.request, entry.count) for entry in batch] == [(decode, 1), (prompt, 7)]


def test_preemption_recomputes_the_same_tokens(tiny, rng):
    """Blocks are taken as tokens arrive: 4 requests that need 16 blocks in all share 6, so
    the newest are preempted and recomputed; every request finishes with the greedy tokens
    of an unconstrained run."""
    prompts = [rng.integers(0, 512, 20).tolist() for _ in range(4)]

    def run(num_blocks):
        engine = Engine(
            tiny,
            EngineConfig(num_blocks=num_blocks, max_num_batched_tokens=64, impl="reference"),
            log=lambda _: None,
        )
        requests = engine.generate([Request(p, 40, ignore_eos=True) for p in prompts])
        return engine, [r.output_ids for r in requests]

    roomy, want = run(16)
    tight, got = run(6)
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions > 0
    assert got == want and all(len(out) == 40 for out in got)
    assert tight.schedulers[0].block_manager.num_free == 6


def test_async_scheduling_gives_the_sync_tokens(tiny, rng):
    """Launching step n+1 before step n's tokens are read changes nothing a request sees:
    pending tokens reach the next step on the device, a request that ends on EOS is cut at
    the same token (the extra step's token dropped), preemption included."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 33, 9, 20)]

    def run(async_scheduling, eos=()):
        engine = Engine(
            tiny,
            EngineConfig(
                num_blocks=6,
                max_num_batched_tokens=64,
                impl="reference",
                async_scheduling=async_scheduling,
            ),
            log=lambda _: None,
        )
        engine.model_cfg = dataclasses.replace(engine.model_cfg, eos_token_ids=eos)
        requests = engine.generate([Request(p, 24) for p in prompts])
        assert engine.schedulers[0].block_manager.num_free == 6
        return engine, [r.output_ids for r in requests]

    engine, want = run(False)
    assert engine.stats.preemptions > 0
    _, got = run(True)
    assert got == want
    eos = want[1][5]  # ends request 1 early (and any other that samples it)
    _, want_eos = run(False, (eos,))
    _, got_eos = run(True, (eos,))
    assert got_eos == want_eos and len(want_eos[1]) <= 6


def _quiet_engine(model, **kw) -> Engine:
    cfg = EngineConfig(**dict(num_blocks=16, impl="reference") | kw)
    return Engine(model, cfg, log=lambda _: None)


def _assert_clean(engine: Engine) -> None:
    """No request queued or holding a block."""
    for scheduler in engine.schedulers:
        assert not scheduler.waiting and not scheduler.running
        assert scheduler.block_manager.num_free == engine.blocks_per_rank


def _assert_serves_like_a_fresh_engine(engine: Engine, model, prompts) -> None:
    """A normal generation on ``engine`` gives a fresh engine's tokens and leaves it clean."""
    got = engine.generate([Request(p, 4, ignore_eos=True) for p in prompts])
    fresh = _quiet_engine(model).generate([Request(p, 4, ignore_eos=True) for p in prompts])
    assert [r.output_ids for r in got] == [r.output_ids for r in fresh]
    assert all(len(r.output_ids) == 4 for r in got)
    _assert_clean(engine)


def test_a_request_given_twice_is_refused_up_front(tiny, rng):
    """The same Request object twice in one call would share its blocks; it is refused
    before anything runs, naming both places, and the engine serves on as if never asked."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 12)]
    engine = _quiet_engine(tiny)
    first, second = Request(prompts[0], 3), Request(prompts[1], 3)
    with pytest.raises(RequestError) as error:
        engine.generate([first, second, first])
    assert str(error.value) == (
        "requests[2] is requests[0]: the same Request object twice in one call"
    )
    assert not first.output_ids and not second.output_ids and first.num_computed == 0
    _assert_clean(engine)
    _assert_serves_like_a_fresh_engine(engine, tiny, prompts)


def test_a_finished_request_is_refused_up_front(tiny, rng):
    prompts = [rng.integers(0, 512, n).tolist() for n in (7, 3)]
    engine = _quiet_engine(tiny)
    [done] = engine.generate([Request(prompts[0], 2)])
    assert done.finished
    with pytest.raises(RequestError) as error:
        engine.generate([Request(prompts[1], 2), done])
    assert str(error.value) == (
        "requests[1] already finished (2 tokens generated); give a new Request"
    )
    _assert_clean(engine)
    _assert_serves_like_a_fresh_engine(engine, tiny, prompts)


def test_what_is_not_a_request_is_refused_up_front(tiny):
    engine = _quiet_engine(tiny)
    with pytest.raises(RequestError) as error:
        engine.generate([Request([1, 2], 2), [3, 4]])
    assert str(error.value) == "requests[1] is a list, not a Request"
    _assert_clean(engine)


@pytest.mark.parametrize("failing_step", [1, 3])
def test_an_error_mid_generation_rolls_the_engine_back(tiny, rng, monkeypatch, failing_step):
    """A step that fails (here the runner's launch, as a device error would) ends the call
    with its error; the call's requests leave the queues and give back their blocks, and the
    engine then serves the next call with a fresh engine's tokens."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 30, 4)]
    engine = _quiet_engine(tiny, max_num_batched_tokens=16)
    launch, calls = engine.runner.launch, []

    def failing_launch(*args):
        calls.append(len(calls) + 1)
        if len(calls) == failing_step:
            raise RuntimeError("device lost")
        return launch(*args)

    monkeypatch.setattr(engine.runner, "launch", failing_launch)
    requests = [Request(p, 6) for p in prompts]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(requests)
    _assert_clean(engine)
    assert all(r.num_computed == r.num_pending == 0 and not len(r.block_ids) for r in requests)
    monkeypatch.setattr(engine.runner, "launch", launch)
    _assert_serves_like_a_fresh_engine(engine, tiny, prompts)


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny, rng, monkeypatch):
    """The prefix cache knows a block by content when its step is scheduled, before the
    step runs; a step that fails to launch never writes those rows, so the rollback forgets
    them: the same prompt afterwards takes nothing from the cache and gets a fresh engine's
    tokens (it read unwritten rows)."""
    prompt = rng.integers(0, 512, 40).tolist()  # two full blocks of 16
    engine = _quiet_engine(tiny)
    launch = engine.runner.launch

    def failing_launch(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", failing_launch)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([Request(prompt, 4)])
    _assert_clean(engine)
    assert engine.schedulers[0].block_manager.num_cached == 0
    monkeypatch.setattr(engine.runner, "launch", launch)
    _assert_serves_like_a_fresh_engine(engine, tiny, [prompt])
    assert engine.schedulers[0].cached_prompt_tokens == 0


@pytest.mark.parametrize("array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_integer_array_prompts_give_the_list_tokens(tiny, rng, array):
    prompts = [rng.integers(0, 512, n) for n in (6, 11)]
    engine = _quiet_engine(tiny)
    from_arrays = engine.generate([Request(array(p.astype(np.int32)), 4) for p in prompts])
    from_lists = _quiet_engine(tiny).generate([Request(p.tolist(), 4) for p in prompts])
    assert [r.output_ids for r in from_arrays] == [r.output_ids for r in from_lists]


def test_fields_changed_after_construction_are_checked_again(tiny):
    """The engine checks a request's fields when given it, not only when it was made."""
    engine = _quiet_engine(tiny)
    req = Request([1, 2, 3], 2)
    req.prompt_ids[1] = 3.5
    with pytest.raises(RequestError, match=r"prompt_ids\[1\] is 3.5 \(float\)"):
        engine.generate([req])
    req = Request([1, 2, 3], 2)
    req.temperature = float("nan")
    with pytest.raises(RequestError, match="temperature is nan"):
        engine.generate([req])
    _assert_clean(engine)


# How far an FP8-cache run's logits move with memory (preemption) and the token budget: the
# decode kernel takes bf16 queries where a prefill attends in the model's float32, so a
# token's logits depend, at bf16 rounding, on whether the tokens before it ran as decodes
# or in a prefill (a preempted request's recompute prefills tokens it had decoded; a
# one-token prompt chunk runs as a decode). Measured (4 x 20-token prompts, 40 forced
# tokens, 8 draws, prefix caching on, CPU, reference kernels, jax 0.10.2 and 0.12.0.1,
# 2026-12-05, the decode's W_UV product in float32): at most 0.0081 relative L2 per step
# under preemption and 0.0031 with an 8-token budget. With a prefill attending its own new
# tokens unquantized (``as_stored`` skipped), 0.026-0.031 under preemption (3 draws, jax
# 0.10.2). The tolerance is 1.6x the largest measured.
FP8_BATCHING_TOL = 0.013


def test_fp8_cache_logits_barely_depend_on_memory_and_batching(tiny, rng):
    """Every read of a token's latent from an FP8 cache, a prefill's own new tokens
    included, sees its stored (quantized) value, so a recompute after preemption and a
    prompt in other chunks read what the first pass read; what is left is the decode's
    bf16 queries (FP8_BATCHING_TOL)."""
    prompts = [rng.integers(0, 512, 20).tolist() for _ in range(4)]
    forced = [rng.integers(0, 512, 40).tolist() for _ in prompts]

    def run(num_blocks, budget):
        cfg = EngineConfig(
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            kv_cache_dtype="fp8",
            impl="reference",
        )
        return teacher_forced_logits(tiny, cfg, prompts, forced)

    (want, roomy), (tight, preempted), (chunked, _) = run(16, 64), run(6, 64), run(16, 8)
    assert roomy == 0 and preempted > 0
    for got in (tight, chunked):
        errors = [
            rel_err(step, want_step)
            for request, want_request in zip(got, want, strict=True)
            for step, want_step in zip(request, want_request, strict=True)
        ]
        assert max(errors) < FP8_BATCHING_TOL, max(errors)


@pytest.mark.parametrize("cache_dtype, quantized", [("auto", False), ("fp8", True)])
def test_kernel_plan_knows_the_cache(tiny, cache_dtype, quantized):
    """The runner plans the decode schedule for the kernel its cache gets: below 64 heads the
    Hopper set's decode kernel depends on whether the cache is FP8."""
    engine = Engine(
        tiny,
        EngineConfig(num_blocks=8, kv_cache_dtype=cache_dtype, impl="pallas"),
        log=lambda _: None,
    )
    assert engine.runner.kernel_plan.quantized_cache is quantized
