"""The MLA module against dense float64 NumPy MLA (no cache, no absorption).

float32 end to end; the tolerance 2e-5 relative covers float32 rounding through ~6
chained matmuls and softmax of O(1)-scaled values (observed errors are ~1e-6).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import Step, mla_dims, mla_weights_np, randomize, rel_err, small_mla
from flax import nnx

from mla_jax.attention import MLAAttention
from mla_jax.cache import init_cache

TOL = 2e-5


def _module(cfg, rng):
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    return attn, mla_weights_np(attn), mla_dims(cfg)


def _tables(rng, num_reqs, width, num_blocks):
    """Random, non-contiguous, non-overlapping block tables."""
    return rng.permutation(num_blocks)[: num_reqs * width].reshape(num_reqs, width)


@pytest.mark.parametrize("q_lora", [True, False])
def test_prefill_matches_dense_mla(rng, q_lora):
    cfg = small_mla(q_lora=q_lora)
    attn, p, dims = _module(cfg, rng)
    lens = [1, 7, 12]  # the 1-token prompt runs as a decode
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    step = Step(block_size=4, num_blocks=16)
    cache = init_cache(1, 16, 4, cfg.cache_width, jnp.float32)[0]
    outs, cache = step(attn, cache, [(0, x) for x in xs], _tables(rng, 3, 4, 16))
    for x, out in zip(xs, outs, strict=True):
        assert rel_err(out, ref.mla(p, dims, x, np.arange(len(x)))) < TOL


@pytest.mark.parametrize("yarn,interleaved", [(True, True), (False, False)])
def test_absorbed_decode_matches_non_absorbed_attention(rng, yarn, interleaved):
    """Decodes over random cached latents: the absorbed path (MQA over the latent cache)
    equals MHA over keys/values up-projected from the same cache rows."""
    cfg = small_mla(yarn=yarn, interleaved=interleaved)
    attn, p, dims = _module(cfg, rng)
    bs, num_blocks, ctx = 4, 32, [0, 3, 4, 13]
    tables = _tables(rng, len(ctx), 4, num_blocks)
    cache = jnp.asarray(rng.standard_normal((num_blocks, bs, cfg.cache_width)), jnp.float32)
    xs = [rng.standard_normal((1, cfg.hidden_size)).astype(np.float32) for _ in ctx]
    outs, new_cache = Step(bs, num_blocks)(attn, cache, list(zip(ctx, xs, strict=True)), tables)
    rows = np.asarray(new_cache).reshape(num_blocks * bs, -1)
    for c, x, table, out in zip(ctx, xs, tables, outs, strict=True):
        slots = table[np.arange(c + 1) // bs] * bs + np.arange(c + 1) % bs
        kv_c, k_pe = ref.mla_latents(p, dims, x, [c])
        assert rel_err(rows[slots[-1]], np.concatenate([kv_c, k_pe], -1)[0]) < TOL
        q_nope, q_pe = ref.mla_queries(p, dims, x, [c])
        lat = rows[slots]
        want = ref.mla_attend(
            p,
            dims,
            q_nope,
            q_pe,
            lat[:, : cfg.kv_lora_rank],
            lat[:, cfg.kv_lora_rank :],
            np.ones((1, c + 1), bool),
        )
        assert rel_err(out, want) < TOL


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_matches_contiguous(rng, block_size):
    """A prompt then two decodes, over random block tables vs. one contiguous table."""
    cfg = small_mla()
    attn, _, _ = _module(cfg, rng)
    lens = [5, 20]
    width = -(-(max(lens) + 2) // block_size)
    num_blocks = 2 * width + 3
    xs = [rng.standard_normal((n + 2, cfg.hidden_size)).astype(np.float32) for n in lens]
    results = []
    for tables in (_tables(rng, 2, width, num_blocks), np.arange(2 * width).reshape(2, width)):
        step = Step(block_size, num_blocks)
        cache = init_cache(1, num_blocks, block_size, cfg.cache_width, jnp.float32)[0]
        outs, cache = step(attn, cache, [(0, x[:n]) for n, x in zip(lens, xs, strict=True)], tables)
        for i in range(2):
            reqs = [(n + i, x[n + i : n + i + 1]) for n, x in zip(lens, xs, strict=True)]
            more, cache = step(attn, cache, reqs, tables)
            outs += more
        results.append(outs)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget,workspace", [(5, 8), (8, 4), (16, 64), (3, 12)])
def test_chunked_prefill_matches_dense(rng, budget, workspace):
    """Prompts fed ``budget`` tokens a step; cached context is gathered ``workspace`` rows
    at a time (several chunks per step), LSE-merged with the new tokens."""
    cfg = small_mla()
    attn, p, dims = _module(cfg, rng)
    bs, lens = 4, [23, 9]
    width = -(-max(lens) // bs)
    num_blocks = 2 * width
    tables = _tables(rng, 2, width, num_blocks)
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    step = Step(bs, num_blocks, workspace_size=workspace)
    cache = init_cache(1, num_blocks, bs, cfg.cache_width, jnp.float32)[0]
    got = [[] for _ in lens]
    done = [0, 0]
    while done != lens:
        live = [i for i in range(2) if done[i] < lens[i]]
        live.sort(key=lambda i: min(budget, lens[i] - done[i]) > 1)  # decodes first
        reqs = [(done[i], xs[i][done[i] : done[i] + budget]) for i in live]
        outs, cache = step(attn, cache, reqs, tables[live])
        for i, out in zip(live, outs, strict=True):
            got[i].append(out)
            done[i] += len(out)
    for x, g in zip(xs, got, strict=True):
        assert rel_err(np.concatenate(g), ref.mla(p, dims, x, np.arange(len(x)))) < TOL


def test_mixed_step_matches_each_request_alone(rng):
    cfg = small_mla()
    attn, _, _ = _module(cfg, rng)
    bs, num_blocks = 4, 40
    tables = _tables(rng, 4, 6, num_blocks)
    cache = jnp.asarray(rng.standard_normal((num_blocks, bs, cfg.cache_width)), jnp.float32)
    # two decodes, a prefill with cached context, a fresh prefill
    ctx = [9, 0, 5, 0]
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in (1, 1, 6, 11)]
    step = Step(bs, num_blocks, workspace_size=8)
    together, _ = step(attn, cache, list(zip(ctx, xs, strict=True)), tables)
    for i in range(4):
        alone, _ = step(attn, cache, [(ctx[i], xs[i])], tables[i : i + 1])
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-6)


def test_prefill_then_decode_matches_full_forward(rng):
    cfg = small_mla(q_lora=False)
    attn, p, dims = _module(cfg, rng)
    bs, n_prompt, n_decode = 16, 13, 6
    x = rng.standard_normal((n_prompt + n_decode, cfg.hidden_size)).astype(np.float32)
    tables = np.array([[3, 1]])
    step = Step(bs, 4)
    cache = init_cache(1, 4, bs, cfg.cache_width, jnp.float32)[0]
    outs, cache = step(attn, cache, [(0, x[:n_prompt])], tables)
    for t in range(n_prompt, n_prompt + n_decode):
        more, cache = step(attn, cache, [(t, x[t : t + 1])], tables)
        outs += more
    assert rel_err(np.concatenate(outs), ref.mla(p, dims, x, np.arange(len(x)))) < TOL


def test_bfloat16_prefill_close_to_dense(rng):
    """bf16 weights, activations and cache: ~3 significant digits per op, so 2e-2."""
    cfg = small_mla()
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    p, dims = mla_weights_np(attn), mla_dims(cfg)
    x = rng.standard_normal((10, cfg.hidden_size)).astype(np.float32)
    cache = init_cache(1, 8, 4, cfg.cache_width, jnp.bfloat16)[0]
    x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    outs, _ = Step(4, 8)(attn, cache, [(0, x_bf16)], np.array([[5, 2, 7]]))
    assert rel_err(outs[0], ref.mla(p, dims, x_bf16, np.arange(10))) < 2e-2
