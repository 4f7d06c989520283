"""The Pallas ragged flash-attention prefill and LSE merge against float64 NumPy, and the
module's chunked-prefill path on them.

Interpret mode on CPU (outputs start as NaN, so unwritten rows fail), Triton on a GPU.
Tolerances: float32 1e-5 relative; bfloat16 2e-2 (probabilities rounded to bf16 for PV).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import Step, mla_dims, mla_weights_np, randomize, rel_err
from flax import nnx

from kernels import merge, prefill
from mla_jax.attention import MLAAttention
from mla_jax.cache import init_cache
from mla_jax.config import MLAConfig, RopeConfig

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _cast(a, dtype):
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))


def _run(rng, lq, lk, *, causal, n=16, dqk=48, dv=16, dtype=jnp.float32, host=True, block_q=16):
    cu_q = np.cumsum([0, *lq]).astype(np.int32)
    cu_k = np.cumsum([0, *lk]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + 5, int(cu_k[-1]) + 3  # trailing padding rows
    q = _cast(rng.standard_normal((tq, n, dqk)), dtype)
    k = _cast(rng.standard_normal((tk, n, dqk)), dtype)
    v = _cast(rng.standard_normal((tk, n, dv)), dtype)
    schedule = prefill.plan(cu_q, tq, block_q) if host else None
    out, lse = prefill.flash_prefill(
        *(jnp.asarray(a, dtype) for a in (q, k, v)),
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
        scale=0.15,
        causal=causal,
        schedule=schedule,
        block_q=block_q,
        block_k=16,
    )
    want, want_lse = ref.attention(q, k, v, ref.ragged_mask(cu_q, cu_k, tq, tk, causal), 0.15)
    out, lse = np.asarray(jnp.asarray(out, jnp.float32)), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out, want) < TOL[dtype]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    live = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[live], want_lse[live], rtol=TOL[dtype], atol=TOL[dtype])
    assert (out[~live.any(1)] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_batches(rng, causal, dtype):
    """Lengths 1, tile-boundary (16, 32), one long among short ones, an empty sequence."""
    lq = [1, 16, 3, 70, 0, 32, 5]
    lk = [max(x, y) for x, y in zip(lq, [4, 16, 9, 70, 2, 40, 5], strict=True)]
    _run(rng, lq, lk, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_tq_differs_from_tk(rng, causal):
    """Queries aligned to the end of longer key runs (prefill on top of context)."""
    _run(rng, [5, 17, 2], [30, 17, 64], causal=causal)


@pytest.mark.parametrize("n,dqk,dv,block_q", [(32, 48, 32, 32), (16, 192, 128, 16)])
def test_heads_and_widths(rng, n, dqk, dv, block_q):
    """More heads; DeepSeek's 192 = 128 + 64 / 128 widths."""
    _run(rng, [40, 9], [40, 9], causal=True, n=n, dqk=dqk, dv=dv, block_q=block_q)


def test_device_side_schedule(rng):
    _run(rng, [33, 1, 12], [33, 1, 12], causal=True, host=False)


def test_plan_covers_every_row_once():
    cu = np.array([0, 1, 17, 17, 90], np.int32)
    s = prefill.plan(cu, 100, 16)
    rows = np.concatenate([np.arange(a, b) for a, b in zip(s.tile_start, s.tile_end, strict=True)])
    assert sorted(rows.tolist()) == list(range(100))
    for t in range(len(s.tile_seq)):
        seq = s.tile_seq[t]
        lo, hi = (cu[seq], cu[seq + 1]) if seq < 4 else (90, 100)
        assert lo <= s.tile_start[t] <= s.tile_end[t] <= hi
    assert len(s.tile_seq) <= prefill.max_tiles(100, 4, 16)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, "must be 3-D"),
        (lambda a: {**a, "v": a["v"][..., :12]}, "power of two"),
        (lambda a: {**a, "k": a["k"][:, :8]}, "mismatched"),
        (lambda a: {**a, "v": a["v"].astype(jnp.bfloat16)}, "bfloat16 or float32"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].astype(jnp.float32)}, "int32"),
        (lambda a: {**a, "cu_seqlens_q": jnp.array([0, 30], jnp.int32)}, "at most 10"),
        (lambda a: {**a, "cu_seqlens_k": jnp.array([0, 5, 3], jnp.int32)}, "differ"),
    ],
)
def test_bad_inputs(rng, mutate, match):
    a = dict(
        q=jnp.asarray(rng.standard_normal((10, 16, 48)), jnp.float32),
        k=jnp.asarray(rng.standard_normal((20, 16, 48)), jnp.float32),
        v=jnp.asarray(rng.standard_normal((20, 16, 16)), jnp.float32),
        cu_seqlens_q=jnp.array([0, 10], jnp.int32),
        cu_seqlens_k=jnp.array([0, 20], jnp.int32),
    )
    with pytest.raises(ValueError, match=match):
        prefill.flash_prefill(**mutate(a), scale=1.0, causal=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge(rng, dtype):
    """Finite, -inf and mixed sides; a row count that is not a multiple of the block."""
    t, n, d = 37, 3, 32
    po, so = (_cast(rng.standard_normal((t, n, d)), dtype) for _ in range(2))
    pls, sls = (rng.standard_normal((t, n)).astype(np.float32) * 3 for _ in range(2))
    pls[:5, 0], sls[3:8, 0] = -np.inf, -np.inf
    out, lse = merge.merge_attn_states(
        jnp.asarray(po, dtype),
        jnp.asarray(pls),
        jnp.asarray(so, dtype),
        jnp.asarray(sls),
        block_rows=16,
    )
    out, lse = np.asarray(jnp.asarray(out, jnp.float32)), np.asarray(lse)
    want_lse = np.logaddexp(pls.astype(np.float64), sls)
    with np.errstate(invalid="ignore"):
        wp = np.nan_to_num(np.exp(pls - want_lse))[..., None]
        ws = np.nan_to_num(np.exp(sls - want_lse))[..., None]
    want = po * wp + so * ws
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isposinf(lse).any()
    assert rel_err(out, want) < TOL[dtype]
    both = np.isneginf(pls) & np.isneginf(sls)
    assert both.any() and np.isneginf(lse[both]).all() and (out[both] == 0).all()
    np.testing.assert_allclose(lse[~both], want_lse[~both], rtol=1e-5, atol=1e-5)


def test_merge_bad_inputs():
    a = jnp.zeros((4, 2, 8))
    with pytest.raises(ValueError, match="must match"):
        merge.merge_attn_states(a, jnp.zeros((4, 2)), a[:3], jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="float32"):
        merge.merge_attn_states(a, jnp.zeros((4, 2), jnp.bfloat16), a, jnp.zeros((4, 2)))


@pytest.mark.parametrize("budget,workspace", [(16, 16), (24, 64), (40, 32)])
def test_module_chunked_prefill_on_pallas(rng, budget, workspace):
    """Prompts fed ``budget`` tokens a step through MLAAttention on the Pallas kernels;
    cached context is gathered ``workspace`` rows at a time; vs dense float64 MLA."""
    cfg = MLAConfig(
        hidden_size=64,
        num_heads=16,
        q_lora_rank=32,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope=RopeConfig(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    p, dims = mla_weights_np(attn), mla_dims(cfg)
    bs, lens = 16, [50, 9]
    tables = rng.permutation(8)[:8].reshape(2, 4)
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    step = Step(bs, 8, workspace_size=workspace)
    cache = init_cache(1, 8, bs, cfg.cache_width, jnp.float32)[0]
    got, done = [[], []], [0, 0]
    while done != lens:
        live = [i for i in range(2) if done[i] < lens[i]]
        live.sort(key=lambda i: min(budget, lens[i] - done[i]) > 1)
        reqs = [(done[i], xs[i][done[i] : done[i] + budget]) for i in live]
        outs, cache = step(attn, cache, reqs, tables[live], impl="pallas")
        for i, out in zip(live, outs, strict=True):
            got[i].append(out)
            done[i] += len(out)
    for x, g in zip(xs, got, strict=True):
        assert rel_err(np.concatenate(g), ref.mla(p, dims, x, np.arange(len(x)))) < 2e-5
