"""The Pallas ragged flash-attention prefill and LSE merge against float64 NumPy (the
module's chunked prefill on them is in test_attention.py).

Interpret mode on CPU (outputs start as NaN, so unwritten rows fail), Triton on a GPU.
Tolerances, from the errors measured against float64 (8 seeds, CPU, 2026-11-22) with a
margin of about 2x: float32, out 1e-5 relative (measured < 2e-6) and lse 1e-5 absolute;
bfloat16 inputs, out 4e-3 (measured <= 1.7e-3 for prefill and 1.6e-3 for the merge:
probabilities and outputs are rounded to bf16) and lse 1e-5 absolute (measured <= 1.5e-6).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import rel_err

from mla_jax.kernels import merge, prefill, tiling

TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (4e-3, 1e-5)}


def _cast(a, dtype):
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))


def _inputs(rng, lq, lk, *, n, dqk, dv, dtype, poison=False):
    """Packed ``q, k, v`` (float32 arrays holding ``dtype`` values) of sequences ``lq``
    (queries) and ``lk`` (keys) with trailing padding rows, and their offsets; ``poison``:
    the padding rows hold NaN (a kernel must not let them leak)."""
    cu_q = np.cumsum([0, *lq]).astype(np.int32)
    cu_k = np.cumsum([0, *lk]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + 5, int(cu_k[-1]) + 3  # trailing padding rows
    q = _cast(rng.standard_normal((tq, n, dqk)), dtype)
    k = _cast(rng.standard_normal((tk, n, dqk)), dtype)
    v = _cast(rng.standard_normal((tk, n, dv)), dtype)
    if poison:
        q, k, v = q.copy(), k.copy(), v.copy()
        q[cu_q[-1] :], k[cu_k[-1] :], v[cu_k[-1] :] = np.nan, np.nan, np.nan
    return q, k, v, cu_q, cu_k


def _expected(q, k, v, cu_q, cu_k, *, causal, scale):
    """Float64 ``(out, lse)`` of the ragged batch (padding rows: 0 and -inf)."""
    return ref.ragged_attention(q, k, v, cu_q, cu_k, causal, scale)


def _check(got, q, k, v, cu_q, cu_k, *, causal, scale, tol, want=None):
    """``got = (out, lse)`` against float64 attention (``want``, or ``_expected``): out
    within ``tol[0]`` relative, lse within ``tol[1]`` absolute, -inf exactly where a row has
    no key (and out 0 there)."""
    if want is None:
        want = _expected(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
    want, want_lse = want
    out, lse = np.asarray(jnp.asarray(got[0], jnp.float32)), np.asarray(got[1])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    out_tol, lse_tol = tol
    assert rel_err(out, want) < out_tol
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    live = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[live], want_lse[live], rtol=0, atol=lse_tol)
    assert (out[~live.any(1)] == 0).all()


def _run(rng, lq, lk, *, causal, n=16, dqk=48, dv=16, dtype=jnp.float32, host=True, block_q=16):
    q, k, v, cu_q, cu_k = _inputs(rng, lq, lk, n=n, dqk=dqk, dv=dv, dtype=dtype)
    schedule = prefill.schedule_query_tiles(cu_q, q.shape[0], block_q) if host else None
    got = prefill.flash_prefill(
        *(jnp.asarray(a, dtype) for a in (q, k, v)),
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
        scale=0.15,
        causal=causal,
        schedule=schedule,
        config=prefill.PrefillConfig(block_q=block_q, block_k=16),
    )
    _check(got, q, k, v, cu_q, cu_k, causal=causal, scale=0.15, tol=TOL[dtype])


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


@pytest.mark.parametrize(
    "n,dqk,dv,block_q",
    [(32, 48, 32, 32), (16, 192, 128, 16), (1, 12, 5, 16), (3, 40, 16, 16), (8, 32, 24, 32)],
)
def test_heads_and_widths(rng, n, dqk, dv, block_q):
    """More heads; DeepSeek's 192 = 128 + 64 / 128 widths; head counts of tensor-parallel
    shards and widths that are no power of two (padded to Triton tiles)."""
    _run(rng, [40, 9], [40, 9], causal=True, n=n, dqk=dqk, dv=dv, block_q=block_q)


def test_device_side_schedule(rng):
    _run(rng, [33, 1, 12], [33, 1, 12], causal=True, host=False)


def test_plan_covers_every_row_once():
    cu = np.array([0, 1, 17, 17, 90], np.int32)
    s = prefill.schedule_query_tiles(cu, 100, 16)
    rows = np.concatenate([np.arange(a, b) for a, b in zip(s.tile_start, s.tile_end, strict=True)])
    assert sorted(rows.tolist()) == list(range(100))
    for t in range(len(s.tile_segment)):
        seq = s.tile_segment[t]
        lo, hi = (cu[seq], cu[seq + 1]) if seq < 4 else (90, 100)
        assert lo <= s.tile_start[t] <= s.tile_end[t] <= hi
    assert len(s.tile_segment) <= tiling.max_tiles(100, 4, 16)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, "must be 3-D"),
        (lambda a: {**a, "v": a["v"][..., :0]}, ">= 1"),
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


@pytest.mark.parametrize("d", [32, 5, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge(rng, dtype, d):
    """Finite, -inf and mixed sides; a row count that is not a multiple of the block; any
    width."""
    t, n = 37, 3
    po, so = (_cast(rng.standard_normal((t, n, d)), dtype) for _ in range(2))
    pls, sls = (rng.standard_normal((t, n)).astype(np.float32) * 3 for _ in range(2))
    pls[:5, 0], sls[3:8, 0] = -np.inf, -np.inf
    out, lse = merge.merge_attn_states(
        jnp.asarray(po, dtype),
        jnp.asarray(pls),
        jnp.asarray(so, dtype),
        jnp.asarray(sls),
        config=merge.MergeConfig(block_rows=16),
    )
    out, lse = np.asarray(jnp.asarray(out, jnp.float32)), np.asarray(lse)
    want_lse = np.logaddexp(pls.astype(np.float64), sls)
    with np.errstate(invalid="ignore"):
        wp = np.nan_to_num(np.exp(pls - want_lse))[..., None]
        ws = np.nan_to_num(np.exp(sls - want_lse))[..., None]
    want = po * wp + so * ws
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isposinf(lse).any()
    out_tol, lse_tol = TOL[dtype]
    assert rel_err(out, want) < out_tol
    both = np.isneginf(pls) & np.isneginf(sls)
    assert both.any() and np.isneginf(lse[both]).all() and (out[both] == 0).all()
    np.testing.assert_allclose(lse[~both], want_lse[~both], rtol=0, atol=lse_tol)


def test_merge_float32_prefix_keeps_bf16_suffixes_exact(rng):
    """The module's context loop: a float32 running result merged with bf16 chunk results
    stays float32 (no rounding to bf16 between chunks)."""
    t, n, d = 9, 2, 16
    prefix = rng.standard_normal((t, n, d)).astype(np.float32)
    suffix = np.asarray(jnp.asarray(rng.standard_normal((t, n, d)), jnp.bfloat16))
    lses = [jnp.asarray(rng.standard_normal((t, n)), jnp.float32) for _ in range(2)]
    out, _ = merge.merge_attn_states(jnp.asarray(prefix), lses[0], jnp.asarray(suffix), lses[1])
    want_lse = np.logaddexp(*(np.asarray(x, np.float64) for x in lses))
    want = (
        prefix * np.exp(np.asarray(lses[0]) - want_lse)[..., None]
        + suffix.astype(np.float64) * np.exp(np.asarray(lses[1]) - want_lse)[..., None]
    )
    assert out.dtype == jnp.float32 and rel_err(out, want) < 1e-5


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_merge_writes_out_dtype(rng, impl):
    """``out_dtype``: a float32 running result merged with a bf16 chunk into bf16 (the
    context loop's last merge), rounded once from the float32 result."""
    kernel = merge.merge_attn_states if impl == "pallas" else merge.reference.merge_attn_states
    t, n, d = 9, 2, 16
    prefix = rng.standard_normal((t, n, d)).astype(np.float32)
    suffix = np.asarray(jnp.asarray(rng.standard_normal((t, n, d)), jnp.bfloat16))
    lses = [rng.standard_normal((t, n)).astype(np.float32) for _ in range(2)]
    want_lse = np.logaddexp(*(x.astype(np.float64) for x in lses))
    want = (
        prefix * np.exp(lses[0] - want_lse)[..., None]
        + suffix.astype(np.float64) * np.exp(lses[1] - want_lse)[..., None]
    )
    args = (jnp.asarray(prefix), jnp.asarray(lses[0]), jnp.asarray(suffix), jnp.asarray(lses[1]))
    out, lse = kernel(*args, out_dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    # Within bf16's half ulp (2^-8 of the value at most) and float32's error of each value.
    bound = 2**-8 * (1 + 1e-5) * np.abs(want)
    assert np.all(np.abs(np.asarray(out, np.float64) - want) <= bound)
    assert rel_err(lse, want_lse) < 1e-6


def test_merge_bad_inputs():
    a = jnp.zeros((4, 2, 8))
    with pytest.raises(ValueError, match="must match"):
        merge.merge_attn_states(a, jnp.zeros((4, 2)), a[:3], jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="float32"):
        merge.merge_attn_states(a, jnp.zeros((4, 2), jnp.bfloat16), a, jnp.zeros((4, 2)))
