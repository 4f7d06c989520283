"""The Pallas paged MLA decode kernel against float64 NumPy attention.

Interpret mode on CPU, compiled through Triton on a GPU. Interpret mode starts every output
as NaN (JAX's uninitialized value, see test_outputs_start_poisoned), so a row the kernel
fails to write fails the comparison. Tolerances: float32 1e-5 relative (float32 dots and
exp2); bfloat16 2e-2 relative on out (probabilities are rounded to bf16 for the PV product)
and 2e-2 absolute on lse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import rel_err
from jax.experimental import pallas as pl

from kernels import decode

TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (2e-2, 2e-2)}


def _case(rng, lens, *, n=16, lkv=64, r=16, block_size=16, dtype=jnp.float32, extra_width=1):
    lens = np.asarray(lens, np.int32)
    width = int(-(-lens.max() // block_size)) + extra_width
    num_blocks = len(lens) * width + 3
    table = rng.permutation(num_blocks)[: len(lens) * width].reshape(len(lens), width)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    cache = cast(rng.standard_normal((num_blocks, block_size, lkv + r)))
    q_lat = cast(rng.standard_normal((len(lens), n, lkv)))
    q_pe = cast(rng.standard_normal((len(lens), n, r)))
    return q_lat, q_pe, cache, table.astype(np.int32), lens


def _expected(q_lat, q_pe, cache, table, lens, scale):
    lkv = q_lat.shape[-1]
    outs, lses = [], []
    for b in range(len(lens)):
        rows = cache[table[b]].reshape(-1, cache.shape[-1])[: lens[b]]
        q = np.concatenate([q_lat[b], q_pe[b]], -1)[None]
        o, lse = ref.attention(
            q, rows[:, None], rows[:, None, :lkv], np.ones((1, lens[b]), bool), scale
        )
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


def _check(got, want, lens, dtype):
    out, lse = (np.asarray(jnp.asarray(a, jnp.float32)) for a in got)
    want_out, want_lse = want
    rtol, atol = TOL[dtype]
    live = lens > 0
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out[live], want_out[live]) < rtol
    np.testing.assert_allclose(lse[live], want_lse[live], rtol=rtol, atol=atol)
    assert (out[~live] == 0).all() and np.isneginf(lse[~live]).all()


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lengths_and_block_sizes(rng, block_size, dtype):
    bs = block_size
    lens = [0, 1, bs, 2 * bs, bs + 3, 3 * bs - 1, int(rng.integers(1, 4 * bs))]
    args = _case(rng, lens, block_size=bs, dtype=dtype)
    schedule = decode.plan(args[-1], num_programs=3, block_k=32)
    got = decode.mla_decode(
        *(jnp.asarray(a, dtype) for a in args[:3]),
        *map(jnp.asarray, args[3:]),
        scale=0.11,
        schedule=schedule,
        config=decode.default_config(16, 7)._replace(block_k=32),
    )
    _check(got, _expected(*args, 0.11), args[-1], dtype)


@pytest.mark.parametrize(
    "n,block_h,num_programs",
    [(16, 16, 1), (16, 16, 40), (32, 16, 5), (32, 32, None), (64, 32, 12), (48, 16, 7)],
)
def test_heads_and_split_counts(rng, n, block_h, num_programs):
    """Every request in one program, up to many programs per request; the device-side
    fallback (no schedule: one program per request); several blocks of heads."""
    args = _case(rng, [130, 7, 64, 0, 201], n=n)
    config = decode.default_config(n, 5)._replace(block_h=block_h, block_k=32)
    kw = dict(scale=0.2, config=config)
    if num_programs:
        kw["schedule"] = decode.plan(
            args[-1],
            num_programs=num_programs,
            block_k=32,
            num_items=decode.max_items(5, num_programs),
        )
    got = decode.mla_decode(*map(jnp.asarray, args), **kw)
    _check(got, _expected(*args, 0.2), args[-1], jnp.float32)


def test_default_head_blocks_divide_the_heads():
    for n in (16, 32, 48, 64, 80, 96, 128, 256):
        cfg = decode.default_config(n, 8)
        assert n % cfg.block_h == 0 and cfg.block_h & (cfg.block_h - 1) == 0
        assert n % cfg.combine_block_h == 0


def test_deepseek_dims(rng):
    """Lkv 512 + R 64, page 64, bf16."""
    args = _case(rng, [70, 1, 129], lkv=512, r=64, block_size=64, dtype=jnp.bfloat16)
    got = decode.mla_decode(
        *(jnp.asarray(a, jnp.bfloat16) for a in args[:3]), *map(jnp.asarray, args[3:]), scale=0.07
    )
    _check(got, _expected(*args, 0.07), args[-1], jnp.bfloat16)


def test_plan_balances_tokens():
    """Programs get equal token shares (to a block, and a 10% snap onto request
    boundaries); each request's items tile it in order."""
    lens = np.array([16384, 10, 0, 3000, 1, 700])
    s = decode.plan(lens, num_programs=32, block_k=64)
    size = s.item_end - s.item_start
    per_prog = [size[s.prog_items[p] : s.prog_items[p + 1]].sum() for p in range(32)]
    share = int(np.ceil(lens.sum() / 32 / 64)) * 64
    assert max(per_prog) <= 1.1 * share and sum(per_prog) == lens.sum()  # snap: 10%
    assert (size > 0).all() and len(size) <= decode.max_items(len(lens), 32)
    for b in range(len(lens)):
        items = np.arange(s.req_items[b], s.req_items[b + 1])
        assert (s.item_req[items] == b).all()
        covered = [t for i in items for t in range(s.item_start[i], s.item_end[i])]
        assert covered == list(range(lens[b]))


def test_outputs_start_poisoned():
    """Guards the claim above: in interpret mode an output the kernel never writes is NaN."""
    out = pl.pallas_call(
        lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), interpret=True
    )()
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q_lat": a["q_lat"][0]}, "must be 3-D"),
        (lambda a: {**a, "kv_cache": a["kv_cache"][..., :-1]}, "rows are 79 wide"),
        (lambda a: {**a, "q_pe": a["q_pe"].astype(jnp.bfloat16)}, "share a dtype"),
        (lambda a: {**a, "q_lat": a["q_lat"][:, :8], "q_pe": a["q_pe"][:, :8]}, "multiple of 16"),
        (lambda a: {**a, "block_table": a["block_table"][:, :1]}, "too narrow"),
        (lambda a: {**a, "block_table": a["block_table"].astype(jnp.float32)}, "int32"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must be int32"),
        (lambda a: {**a, "block_table": a["block_table"] + 1000}, "ids outside"),
    ],
)
def test_bad_inputs(rng, mutate, match):
    q_lat, q_pe, cache, table, lens = _case(rng, [20, 40])
    a = dict(
        q_lat=jnp.asarray(q_lat),
        q_pe=jnp.asarray(q_pe),
        kv_cache=jnp.asarray(cache),
        block_table=jnp.asarray(table),
        seq_lens=jnp.asarray(lens),
    )
    with pytest.raises(ValueError, match=match):
        decode.mla_decode(**mutate(a), scale=1.0)
