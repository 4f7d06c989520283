"""Automatic prefix caching in the engine, float32, on a transformers test checkpoint (V3:
8 heads, q LoRA, YaRN): requests that start from a cached prefix give transformers' greedy
tokens, and take exactly the cached tokens the block-aligned shared prefixes allow.

Block size 4 and a budget of 16 tokens a step: prompts are prefilled in chunks, the cached
prefix is context that the chunked-context path gathers. Each ``generate`` call's requests
can reuse what earlier calls left; within a call, what a request reuses from another one of
the same call depends on the schedule, so the exact counts below come from earlier calls.
DP 2 runs in ``tests/parallel/test_sharding.py`` (fake devices need a fresh process).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import _BASE_SEED, generate_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_checkpoints import greedy_tokens, write_checkpoint  # noqa: E402

from mla_jax.checkpoint.loader import load_model  # noqa: E402
from mla_jax.engine.engine import Engine, EngineConfig, Request  # noqa: E402

BLOCK = 4
VOCAB = 96  # the test checkpoints'
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(path, our model, transformers' greedy tokens of a prompt, memoized)."""
    path = tmp_path_factory.mktemp("prefix") / "v3"
    seed = int(np.random.default_rng([_BASE_SEED, 24]).integers(2**31))
    hf = write_checkpoint("v3", path, seed)

    @functools.cache
    def greedy(prompt: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> list[int]:
        return greedy_tokens(hf, prompt, new_tokens)

    return path, load_model(path)[1], greedy


def _engine(model, **overrides) -> Engine:
    cfg = dict(
        block_size=BLOCK,
        num_blocks=64,
        max_num_batched_tokens=16,
        workspace_size=32,
        max_model_len=64,
        impl="reference",
    )
    return Engine(model, EngineConfig(**{**cfg, **overrides}), log=lambda _: None)


def _generate(engine: Engine, prompts, new_tokens: int = NEW_TOKENS) -> tuple[list, int]:
    """Each prompt's generated tokens, and the prompt tokens the call took from the cache."""
    before = engine.stats.cached_prompt_tokens
    requests = engine.generate([Request(list(p), new_tokens) for p in prompts])
    return [r.output_ids for r in requests], engine.stats.cached_prompt_tokens - before


def _cacheable(shared: int, prompt_len: int) -> int:
    """Tokens a prompt takes from the cache when its first ``shared`` tokens are cached:
    whole blocks, and its last token always computed."""
    return min(shared, prompt_len - 1) // BLOCK * BLOCK


def test_shared_prefixes(v3, rng):
    """A prefix ending inside a block, a prompt cached whole (one block-aligned, one not), a
    prompt continuing an earlier request's output, an unrelated one."""
    _, model, greedy = v3
    engine = _engine(model)
    prefix = rng.integers(0, VOCAB, 10).tolist()  # 2 blocks and 2 tokens
    first = prefix + rng.integers(0, VOCAB, 9).tolist()
    [out], cached = _generate(engine, [first])
    assert out == greedy(tuple(first)) and cached == 0
    # `first` left its prompt and the outputs it fed back (all but the last) in the cache.
    computed = first + out[:-1]
    continued = first + out[:3] + rng.integers(0, VOCAB, 2).tolist()
    prompts = [
        prefix + rng.integers(0, VOCAB, 6).tolist(),  # shares 10 tokens: 8 cached
        first,  # cached whole: computes its last 3 tokens
        first[:16],  # cached whole, 4 blocks: computes its last block
        continued,  # its first 22 tokens were computed by `first`
        rng.integers(0, VOCAB, 7).tolist(),
    ]
    outs, cached = _generate(engine, prompts)
    assert outs == [greedy(tuple(p)) for p in prompts]
    shared = [10, len(first), 16, 22, 0]
    want = [_cacheable(min(s, len(computed)), len(p)) for s, p in zip(shared, prompts, strict=True)]
    assert want == [8, 16, 12, 20, 0] and cached == sum(want)
    stats = engine.stats.as_dict()
    assert stats["cached_prompt_tokens"] == sum(want)
    prompt_tokens = len(first) + sum(map(len, prompts))
    assert stats["prompt_tokens"] == prompt_tokens - sum(want)
    assert stats["prefix_cache_hit_rate"] == round(sum(want) / prompt_tokens, 4)


def test_multi_turn_conversation(v3, rng):
    """Each turn's prompt is the conversation so far: the previous turns, prompts and
    answers, come from the cache."""
    _, model, greedy = v3
    engine = _engine(model)
    conversation: list[int] = []
    computed = 0  # tokens of the conversation in the cache
    for turn in range(4):
        conversation += rng.integers(0, VOCAB, 5 + turn).tolist()
        [answer], cached = _generate(engine, [conversation])
        assert answer == greedy(tuple(conversation)), turn
        assert cached == _cacheable(computed, len(conversation)), turn
        computed = len(conversation) + len(answer) - 1  # the last answer token is not fed
        conversation += answer


def test_eviction_then_reuse_of_the_blocks(v3, rng):
    """A request that needs every block evicts the cached ones and writes its own data into
    them; a prompt with the evicted prefix computes it again; the new data is matched."""
    _, model, greedy = v3
    engine = _engine(model, num_blocks=12, max_model_len=48)
    manager = engine.schedulers[0].block_manager
    prefix = rng.integers(0, VOCAB, 12).tolist()
    first = prefix + rng.integers(0, VOCAB, 5).tolist()
    [out], _ = _generate(engine, [first])
    assert out == greedy(tuple(first))
    old_blocks = manager.match(first + out)  # 17 + 3 tokens computed: 5 blocks
    assert len(old_blocks) == 5 and manager.evictions == 0
    filling = rng.integers(0, VOCAB, 44).tolist()  # 44 + 4 new: all 12 blocks
    assert _generate(engine, [filling])[0] == [greedy(tuple(filling))]
    assert manager.match(first) == [] and manager.evictions == 5
    # Evicted blocks now hold `filling`'s rows, found by its tokens (its first 11 blocks).
    assert set(old_blocks) & set(manager.match(filling))
    again = prefix + rng.integers(0, VOCAB, 6).tolist()
    outs, cached = _generate(engine, [again])
    assert outs == [greedy(tuple(again))] and cached == 0
    # `again` (6 blocks) took the free one and evicted 5 of `filling`'s, the tail first:
    # its first 6 blocks are left, of which a 20-token prompt takes 4.
    outs, cached = _generate(engine, [filling[:20]])
    assert outs == [greedy(tuple(filling[:20]))] and cached == 16


def test_preempting_a_request_that_holds_shared_blocks(v3, rng):
    """Three requests share a cached 3-block prefix in a cache too small for them all: the
    newest are preempted (the shared blocks stay with the others, their own full blocks
    stay cached) and recomputed from what is cached; every request gets its greedy tokens
    and every block comes back."""
    _, model, greedy = v3
    engine = _engine(model, num_blocks=10, max_model_len=40)
    prefix = rng.integers(0, VOCAB, 12).tolist()
    first = prefix + rng.integers(0, VOCAB, 2).tolist()
    assert _generate(engine, [first], 2)[0] == [greedy(tuple(first), 2)]
    prompts = [prefix + rng.integers(0, VOCAB, 2).tolist() for _ in range(3)]
    outs, cached = _generate(engine, prompts, 12)  # 3 + 3 x 4 blocks: 15 > 10
    assert outs == [greedy(tuple(p), 12) for p in prompts]
    assert engine.stats.preemptions > 0
    # Each first admission takes the prefix; each readmission takes at least as much.
    assert cached >= 3 * 12 + engine.stats.preemptions * 12
    assert engine.schedulers[0].block_manager.num_free == 10


def test_fp8_cache(v3, rng):
    """The FP8 cache: a cached prefix's quantized rows (values, scales, rope part) are reused
    as they are. Within a chunk, new tokens attend each other's unquantized rows, and their
    context through the cache's FP8 rows, so the tokens depend on where chunks start: with a
    12-token budget, every prompt is computed from a 12-token (3-block) context whether it
    is cached or not, and the tokens with and without prefix caching are the same."""
    _, model, _ = v3
    prefix = rng.integers(0, VOCAB, 14).tolist()
    waves = [[prefix + rng.integers(0, VOCAB, n).tolist()] for n in (3, 6, 2)]
    runs = {}
    for caching in (True, False):
        engine = _engine(
            model, kv_cache_dtype="fp8", max_num_batched_tokens=12, enable_prefix_caching=caching
        )
        runs[caching] = [_generate(engine, wave) for wave in waves]
    assert [outs for outs, _ in runs[True]] == [outs for outs, _ in runs[False]]
    assert [cached for _, cached in runs[True]] == [0, 12, 12]
    assert [cached for _, cached in runs[False]] == [0, 0, 0]


def test_generate_script_flag_and_stats(v3, rng):
    """``generate.py`` caches by default (the second prompt finds the first's prefix: it is
    admitted after the first's three 8-token chunks) and ``--no-prefix-caching`` turns it
    off; the tokens are transformers' either way, result.json has the counts."""
    path, _, greedy = v3
    prefix = rng.integers(0, VOCAB, 20).tolist()
    prompts = [prefix + rng.integers(0, VOCAB, 4).tolist() for _ in range(2)]
    argv = ["--model", str(path), "--max-new-tokens", str(NEW_TOKENS), "--impl", "reference"]
    argv += ["--block-size", "4", "--workspace-size", "16", "--max-num-batched-tokens", "8"]
    argv += ["--no-compilation-cache"]
    for prompt in prompts:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    want = [greedy(tuple(p)) for p in prompts]
    for flags, cached in (([], 20), (["--no-prefix-caching"], 0)):
        result = generate_script().main(argv + flags)
        assert [o["generated_ids"] for o in result["outputs"]] == want
        stats = result["stats"]
        assert stats["cached_prompt_tokens"] == cached
        assert stats["prompt_tokens"] == 48 - cached
        assert stats["prefix_cache_hit_rate"] == round(cached / 48, 4)
