"""The engine and the generate script on the built-in tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from mla_jax.cache.latent_cache import CacheFullError
from mla_jax.checkpoint.loader import load_model
from mla_jax.checkpoint.tiny import tiny_checkpoint
from mla_jax.engine.engine import Engine, EngineConfig, Request
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


def test_one_compilation_per_bucket(tiny, rng):
    logs = []
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 30, 12)]
    engine, _ = _run(tiny, prompts, max_num_batched_tokens=16, log=logs.append)
    buckets = engine.stats.buckets
    assert len(set(buckets)) == len(buckets) == len(engine.runner.programs)
    assert sum("compiled bucket" in m for m in logs) == len(buckets)
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
    assert sum("compiled bucket" in m for m in logs) == 2


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
    """64 requests arriving together, prompts of 100-4000 tokens, 1-256 new tokens: every
    step falls in the engine's fixed set, which has 8 programs."""
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
        max_position_embeddings=4352,
    )
    model = DeepseekModel(cfg, rngs=nnx.Rngs(0))
    prompts = [rng.integers(0, 64, n).tolist() for n in rng.integers(100, 4001, 64)]
    new_tokens = rng.integers(1, 257, 64)
    engine = Engine(model, EngineConfig(num_blocks=64 * 272, impl="reference"), log=lambda _: None)
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
