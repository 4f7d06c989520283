"""The MLA module against dense float64 NumPy MLA (no cache, no absorption), on the
reference kernels and on the Pallas kernels (interpreted on CPU, compiled on a GPU).

float32 end to end; the tolerance 2e-5 relative covers float32 rounding through ~6
chained matmuls and softmax of O(1)-scaled values (observed errors are ~1e-6). Caches start
as NaN wherever no request owns a row, so a read of a row that is not the request's own
(padding, a stale tail, an unowned block, an unused workspace row) fails the comparison.
The small config has 4 heads, rope 8, v 12: the Pallas kernels run on padded tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import Step, mla_dims, mla_weights_np, randomize, rel_err, small_mla
from flax import nnx

from mla_jax import kernels
from mla_jax.cache.latent_cache import init_cache
from mla_jax.cache.packing import packed_metadata
from mla_jax.kernels.decode import pallas_triton
from mla_jax.model.attention import MLAAttention

TOL = 2e-5
IMPLS = ["reference", "pallas"]


def _module(cfg, rng):
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    return attn, mla_weights_np(attn), mla_dims(cfg)


def _tables(rng, num_reqs, width, num_blocks):
    """Random, non-contiguous, non-overlapping block tables."""
    return rng.permutation(num_blocks)[: num_reqs * width].reshape(num_reqs, width)


def _nan_cache(cfg, num_blocks, block_size):
    """A cache with nothing written yet: every row NaN."""
    return jnp.full((num_blocks, block_size, cfg.cache_width), jnp.nan, jnp.float32)


def _context_cache(rng, cfg, tables, context_lens, num_blocks, block_size):
    """Random rows at each request's context positions, NaN everywhere else."""
    cache = np.full((num_blocks, block_size, cfg.cache_width), np.nan, np.float32)
    for table, length in zip(tables, context_lens, strict=True):
        positions = np.arange(length)
        cache[table[positions // block_size], positions % block_size] = rng.standard_normal(
            (length, cfg.cache_width)
        )
    return jnp.asarray(cache)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_lora", [True, False])
def test_prefill_matches_dense_mla(rng, q_lora, impl):
    cfg = small_mla(q_lora=q_lora)
    attn, p, dims = _module(cfg, rng)
    lens = [1, 7, 12]  # the 1-token prompt runs as a decode
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    step = Step(block_size=4, num_blocks=16)
    cache = _nan_cache(cfg, 16, 4)
    outs, cache = step(attn, cache, [(0, x) for x in xs], _tables(rng, 3, 4, 16), impl=impl)
    for x, out in zip(xs, outs, strict=True):
        assert rel_err(out, ref.mla(p, dims, x, np.arange(len(x)))) < TOL


@pytest.mark.parametrize(
    "yarn,interleaved,impl",
    [(True, True, "reference"), (False, False, "reference"), (True, False, "pallas")],
)
def test_absorbed_decode_matches_non_absorbed_attention(rng, yarn, interleaved, impl):
    """Decodes over random cached latents: the absorbed path (MQA over the latent cache)
    equals MHA over keys/values up-projected from the same cache rows. On Pallas the
    schedule (4 multiprocessors) splits the 150-token request across programs and keeps
    the others whole; the decode bucket (8) pads 4 of its rows."""
    cfg = small_mla(yarn=yarn, interleaved=interleaved)
    attn, p, dims = _module(cfg, rng)
    bs, width, ctx = 4, 38, [0, 3, 4, 13, 150]
    num_blocks = width * len(ctx)
    tables = _tables(rng, len(ctx), width, num_blocks)
    cache = _context_cache(rng, cfg, tables, ctx, num_blocks, bs)
    xs = [rng.standard_normal((1, cfg.hidden_size)).astype(np.float32) for _ in ctx]
    outs, new_cache = Step(bs, num_blocks)(
        attn, cache, list(zip(ctx, xs, strict=True)), tables, impl=impl
    )
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
        cache = _nan_cache(cfg, num_blocks, block_size)
        outs, cache = step(attn, cache, [(0, x[:n]) for n, x in zip(lens, xs, strict=True)], tables)
        for i in range(2):
            reqs = [(n + i, x[n + i : n + i + 1]) for n, x in zip(lens, xs, strict=True)]
            more, cache = step(attn, cache, reqs, tables)
            outs += more
        results.append(outs)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "budget,workspace,impl",
    [
        (5, 8, "reference"),
        (8, 4, "reference"),
        (16, 64, "reference"),
        (3, 12, "reference"),
        (5, 8, "pallas"),
        (16, 64, "pallas"),
    ],
)
def test_chunked_prefill_matches_dense(rng, budget, workspace, impl):
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
    cache = _nan_cache(cfg, num_blocks, bs)
    got = [[] for _ in lens]
    done = [0, 0]
    while done != lens:
        live = [i for i in range(2) if done[i] < lens[i]]
        live.sort(key=lambda i: min(budget, lens[i] - done[i]) > 1)  # decodes first
        reqs = [(done[i], xs[i][done[i] : done[i] + budget]) for i in live]
        outs, cache = step(attn, cache, reqs, tables[live], impl=impl)
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
    # two decodes, a prefill with cached context, a fresh prefill
    ctx = [9, 0, 5, 0]
    cache = _context_cache(rng, cfg, tables, ctx, num_blocks, bs)
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in (1, 1, 6, 11)]
    step = Step(bs, num_blocks, workspace_size=8)
    together, _ = step(attn, cache, list(zip(ctx, xs, strict=True)), tables)
    for i in range(4):
        alone, _ = step(attn, cache, [(ctx[i], xs[i])], tables[i : i + 1])
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_then_decode_matches_full_forward(rng, impl):
    cfg = small_mla(q_lora=False)
    attn, p, dims = _module(cfg, rng)
    bs, n_prompt, n_decode = 16, 13, 6
    x = rng.standard_normal((n_prompt + n_decode, cfg.hidden_size)).astype(np.float32)
    tables = np.array([[3, 1]])
    step = Step(bs, 4)
    cache = _nan_cache(cfg, 4, bs)
    outs, cache = step(attn, cache, [(0, x[:n_prompt])], tables, impl=impl)
    for t in range(n_prompt, n_prompt + n_decode):
        more, cache = step(attn, cache, [(t, x[t : t + 1])], tables, impl=impl)
        outs += more
    assert rel_err(np.concatenate(outs), ref.mla(p, dims, x, np.arange(len(x)))) < TOL


def test_bfloat16_prefill_close_to_dense(rng):
    """bf16 weights, activations and cache: ~3 significant digits per op, through ~6
    chained products (measured 4-6e-3 over 8 seeds), so 1.5e-2."""
    cfg = small_mla()
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    p, dims = mla_weights_np(attn), mla_dims(cfg)
    x = rng.standard_normal((10, cfg.hidden_size)).astype(np.float32)
    cache = _nan_cache(cfg, 8, 4).astype(jnp.bfloat16)
    x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    outs, _ = Step(4, 8)(attn, cache, [(0, x_bf16)], np.array([[5, 2, 7]]))
    assert rel_err(outs[0], ref.mla(p, dims, x_bf16, np.arange(10))) < 1.5e-2


@pytest.mark.skipif(
    kernels.mosaic_gpu.device_unsupported() is not None
    and not hasattr(
        pytest.importorskip("jax.experimental.pallas.mosaic_gpu"), "InterpretGPUParams"
    ),
    reason="Mosaic GPU interpret mode needs jax >= 0.11",
)
def test_bfloat16_decode_on_the_mosaic_gpu_kernels(rng, monkeypatch):
    """The module's absorbed decode on the Hopper set, where its Mosaic GPU kernel runs (64
    heads, bf16, pages of 64, Lkv 128, rope 64): requests of 0, 63, 64 and 190 cached tokens
    against float64 MHA over the same cache rows (the Triton kernel, its fallback, is
    forbidden). bf16 weights, queries, cache and probabilities: the bound of
    ``test_bfloat16_prefill_close_to_dense`` (measured in interpret mode, seeds 0-3:
    2.2-6.2e-3)."""
    cfg = dataclasses.replace(
        small_mla(heads=64), kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=32
    )
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    p, dims = mla_weights_np(attn), mla_dims(cfg)

    def forbidden(*args, **kwargs):
        raise AssertionError("the Triton decode ran")

    monkeypatch.setattr(pallas_triton, "mla_decode", forbidden)
    monkeypatch.setattr(kernels.decode, "mla_decode", forbidden)
    bs, width, ctx = 64, 4, [0, 63, 64, 190]
    num_blocks = width * len(ctx)
    tables = _tables(rng, len(ctx), width, num_blocks)
    cache = _context_cache(rng, cfg, tables, ctx, num_blocks, bs).astype(jnp.bfloat16)
    rows = np.asarray(cache.astype(jnp.float32)).reshape(num_blocks * bs, -1)
    xs = [rng.standard_normal((1, cfg.hidden_size)) for _ in ctx]
    xs = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in xs]
    outs, new_cache = Step(bs, num_blocks)(
        attn, cache, list(zip(ctx, xs, strict=True)), tables, impl="mosaic_gpu"
    )
    new_rows = np.asarray(new_cache.astype(jnp.float32)).reshape(num_blocks * bs, -1)
    for c, x, table, out in zip(ctx, xs, tables, outs, strict=True):
        slots = table[np.arange(c + 1) // bs] * bs + np.arange(c + 1) % bs
        lat = np.concatenate([rows[slots[:-1]], new_rows[slots[-1:]]])
        q_nope, q_pe = ref.mla_queries(p, dims, x, [c])
        want = ref.mla_attend(
            p,
            dims,
            q_nope,
            q_pe,
            lat[:, : cfg.kv_lora_rank],
            lat[:, cfg.kv_lora_rank :],
            np.ones((1, c + 1), bool),
        )
        assert rel_err(out, want) < 1.5e-2


def test_bfloat16_many_context_chunks_cost_no_accuracy(rng):
    """A prefill on 256 cached tokens gathered 4 rows at a time (64 chunks) is as close to
    dense float64 MLA as with one chunk: the module keeps the running context result in
    float32. Measured (4 seeds): 64 chunks / 1 chunk = 0.89-0.99 with a float32 running
    result, 1.6-1.95 with a bf16 one."""
    cfg = small_mla()
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    p, dims = mla_weights_np(attn), mla_dims(cfg)
    n_context, n_new, bs, num_blocks = 256, 4, 4, 80
    x = rng.standard_normal((n_context + n_new, cfg.hidden_size))
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    table = rng.permutation(num_blocks)[: -(-(n_context + n_new) // bs)][None]
    want = ref.mla(p, dims, x, np.arange(len(x)))[n_context:]
    errors = []
    for workspace in (n_context, 4):
        step = Step(bs, num_blocks, workspace_size=workspace)
        cache = _nan_cache(cfg, num_blocks, bs).astype(jnp.bfloat16)
        _, cache = step(attn, cache, [(0, x[:n_context])], table)
        outs, _ = step(attn, cache, [(n_context, x[n_context:])], table)
        errors.append(rel_err(outs[0], want))
    assert errors[1] < 1.25 * errors[0]


@pytest.mark.parametrize(
    "layer,message",
    [
        (2, "layer 2 is outside the stacked cache's 2 layers [0, 2)"),
        (-1, "layer -1 is outside the stacked cache's 2 layers [0, 2)"),
        (np.int32(5), "layer 5 is outside the stacked cache's 2 layers [0, 2)"),
        (jnp.int32(2), "layer 2 is outside the stacked cache's 2 layers [0, 2)"),
        (1.0, "layer must be an integer (or a traced integer index), got 1.0 (float)"),
    ],
)
def test_a_layer_outside_the_cache_is_refused(rng, layer, message):
    """An index past the stacked cache's layers would drop the write and decode zeros; a
    concrete one is refused by name (a traced one, as in a scan, is the caller's)."""
    cfg = small_mla()
    attn, _, _ = _module(cfg, rng)
    cache = jnp.zeros((2, 4, 4, cfg.cache_width), jnp.float32)
    metadata = packed_metadata([0], [3], [[1]], num_heads=4, block_size=4, num_blocks=4)
    x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
    with pytest.raises(ValueError) as error:
        attn(x, cache, metadata, layer=layer, impl="reference")
    assert str(error.value) == message


def test_the_last_layer_of_a_stacked_cache_is_its_own(rng):
    """In range, each layer index writes and reads that layer only: the last layer's step
    equals the same step on a one-layer cache."""
    cfg = small_mla()
    attn, _, _ = _module(cfg, rng)
    metadata = packed_metadata([0], [3], [[1]], num_heads=4, block_size=4, num_blocks=4)
    x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
    stacked = jnp.zeros((2, 4, 4, cfg.cache_width), jnp.float32)
    out, stacked = attn(x, stacked, metadata, layer=jnp.int32(1), impl="reference")
    alone, single = attn(x, stacked[0], metadata, impl="reference")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(stacked[1]), np.asarray(single))
    assert not np.asarray(stacked[0]).any()


@pytest.mark.parametrize("dtype", ["fp8", jnp.bfloat16])
def test_a_prompt_in_chunks_over_a_rounding_cache_equals_it_whole(rng, dtype):
    """A cache that rounds (FP8, bf16 under this float32 module): a prompt's later tokens
    read its earlier ones as stored whether they share a prefill (its own new tokens) or
    come after them (from the cache), so chunking, as after a preemption's recompute,
    changes nothing beyond float32 rounding."""
    cfg = small_mla()
    attn, _, _ = _module(cfg, rng)
    step = Step(block_size=4, num_blocks=8)
    stacked = init_cache(1, 8, 4, cfg.cache_width, dtype, kv_lora_rank=cfg.kv_lora_rank)
    cache = jax.tree.map(lambda part: part[0], stacked)
    x = rng.standard_normal((11, cfg.hidden_size)).astype(np.float32)
    table = [[5, 2, 7]]
    [whole], _ = step(attn, cache, [(0, x)], table)
    [first], cache = step(attn, cache, [(0, x[:6])], table)
    [rest], _ = step(attn, cache, [(6, x[6:])], table)
    assert rel_err(first, whole[:6]) < TOL
    assert rel_err(rest, whole[6:]) < TOL


def test_fp8_fused_qkv_a_needs_whole_blocks_of_the_query_lora():
    """The fused q_a / kv_a weight's FP8 block grid is its parts' stacked: a query LoRA
    rank that is not whole output blocks is refused when the module is built, naming it;
    whole blocks build, with the parts' grids' columns."""
    cfg = small_mla()  # q_lora_rank 24
    with pytest.raises(ValueError, match=r"q_lora_rank 24 is not a multiple .* 16 output"):
        MLAAttention(cfg, rngs=nnx.Rngs(0), fp8_blocks=(16, 8))
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0), fp8_blocks=(8, 8))
    width = cfg.q_lora_rank + cfg.cache_width  # 24 + (32 + 8)
    assert attn.fused_qkv_a_proj.weight.shape == (width, cfg.hidden_size)  # HF's [out, in]
    assert attn.fused_qkv_a_proj.weight_scale_inv.shape == (24 // 8 + 40 // 8, 6)
