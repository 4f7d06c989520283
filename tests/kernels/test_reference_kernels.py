"""The pure-jnp reference kernels against float64 NumPy (the same oracles the Pallas
kernel tests use). float32 inputs: relative error 1e-5."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import rel_err

from mla_jax.kernels import decode, grouped_matmul, merge, prefill

TOL = 1e-5


@pytest.mark.parametrize(
    "kernel,reference",
    [
        (decode.mla_decode, decode.reference.mla_decode),
        (prefill.flash_prefill, prefill.reference.flash_prefill),
        (merge.merge_attn_states, merge.reference.merge_attn_states),
        (grouped_matmul.grouped_matmul, grouped_matmul.reference.grouped_matmul),
    ],
)
def test_reference_takes_the_kernels_arguments(kernel, reference):
    """Each reference is a drop-in for its kernel: the same parameter names, kinds and
    defaults, so that a call written for one runs the other."""

    def parameters(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert parameters(reference) == parameters(kernel)


def test_mla_decode(rng):
    lkv, r, n, bs, num_blocks = 32, 16, 4, 4, 20
    lens = np.array([0, 1, 4, 7, 16])
    table = rng.permutation(num_blocks)[:20].reshape(5, 4)
    cache = rng.standard_normal((num_blocks, bs, lkv + r)).astype(np.float32)
    q_lat = rng.standard_normal((5, n, lkv)).astype(np.float32)
    q_pe = rng.standard_normal((5, n, r)).astype(np.float32)
    out, lse = decode.reference.mla_decode(
        jnp.asarray(q_lat),
        jnp.asarray(q_pe),
        jnp.asarray(cache),
        jnp.asarray(table),
        jnp.asarray(lens, jnp.int32),
        scale=0.3,
    )
    for b in range(5):
        rows = cache[table[b]].reshape(-1, lkv + r)[: lens[b]]
        q = np.concatenate([q_lat[b], q_pe[b]], -1)[None]
        o, l = ref.attention(
            q, rows[:, None], rows[:, None, :lkv], np.ones((1, lens[b]), bool), 0.3
        )
        if lens[b] == 0:
            assert (np.asarray(out[b]) == 0).all() and np.isneginf(np.asarray(lse[b])).all()
        else:
            assert rel_err(out[b], o[0]) < TOL and rel_err(lse[b], l[0]) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_flash_prefill(rng, causal):
    lq, lk = [3, 0, 9, 1], [5, 2, 9, 4]
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    tq, tk = cu_q[-1] + 3, cu_k[-1] + 2  # padding rows
    q = rng.standard_normal((tq, 4, 24)).astype(np.float32)
    k = rng.standard_normal((tk, 4, 24)).astype(np.float32)
    v = rng.standard_normal((tk, 4, 8)).astype(np.float32)
    out, lse = prefill.reference.flash_prefill(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(cu_q, jnp.int32),
        jnp.asarray(cu_k, jnp.int32),
        scale=0.2,
        causal=causal,
    )
    o, l = ref.attention(q, k, v, ref.ragged_mask(cu_q, cu_k, tq, tk, causal), 0.2)
    assert rel_err(out, o) < TOL
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(l))
    fin = np.isfinite(l)
    assert rel_err(np.asarray(lse)[fin], l[fin]) < TOL


def test_merge_with_empty_sides(rng):
    t, n, d = 6, 3, 8
    po, so = (rng.standard_normal((t, n, d)).astype(np.float32) for _ in range(2))
    pl_, sl = (rng.standard_normal((t, n)).astype(np.float32) for _ in range(2))
    pl_[0], sl[1] = -np.inf, -np.inf
    pl_[2], sl[2] = -np.inf, -np.inf
    out, lse = merge.reference.merge_attn_states(*map(jnp.asarray, (po, pl_, so, sl)))
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isposinf(lse).any()
    np.testing.assert_allclose(out[0], so[0], rtol=1e-6)
    np.testing.assert_allclose(out[1], po[1], rtol=1e-6)
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()
    m = np.logaddexp(pl_[3:].astype(np.float64), sl[3:])
    w = np.exp(pl_[3:] - m)[..., None]
    assert rel_err(out[3:], po[3:] * w + so[3:] * (1 - w)) < TOL
    assert rel_err(lse[3:], m) < TOL
