"""The paged MLA decode kernels (Pallas and the pure-jnp reference) against float64 NumPy
attention.

Interpret mode on CPU, compiled through Triton on a GPU. Interpret mode starts every output
as NaN (JAX's uninitialized value, see test_outputs_start_poisoned), so a row the kernel
fails to write fails the comparison. Every case poisons what a request does not own: cache
rows outside ``[0, seq_len)`` of its blocks hold NaN, and block-table entries past what a
request needs hold -1 or an id far outside the cache. A kernel that reads any of them
returns NaN.

Tolerances, from the errors measured against float64 (8 seeds, CPU, 2026-11-22) with a
margin of about 2x: float32, relative L2 error of out 1e-5 (measured < 2e-6: float32 dots
and exp2), lse 1e-5 absolute; bfloat16 inputs, out 3e-3 (measured <= 1.2e-3: probabilities
and the output are rounded to bf16) and lse 2e-5 absolute (measured <= 5e-6: scores are
accumulated in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import rel_err
from jax.experimental import pallas as pl

from mla_jax.kernels import decode

TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (3e-3, 2e-5)}
# A block id no cache has: reading through it is an out-of-bounds access.
HUGE_ID = 2**30


def _case(rng, lens, *, n=16, lkv=64, r=16, block_size=16, dtype=jnp.float32, extra_width=1):
    """Random queries and cache over random block tables, with every row the requests do
    not own set to NaN and table entries past each request's need set to -1 or HUGE_ID."""
    lens = np.asarray(lens, np.int32)
    width = int(-(-lens.max() // block_size)) + extra_width
    num_blocks = len(lens) * width + 3
    table = rng.permutation(num_blocks)[: len(lens) * width].reshape(len(lens), width)
    cast = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    cache = cast(rng.standard_normal((num_blocks, block_size, lkv + r)))
    owned = np.zeros((num_blocks, block_size), bool)
    for b, length in enumerate(lens):
        positions = np.arange(length)
        owned[table[b, positions // block_size], positions % block_size] = True
        needed = -(-length // block_size)
        table[b, needed:] = -1 if b % 2 else HUGE_ID
    cache[~owned] = np.nan
    q_lat = cast(rng.standard_normal((len(lens), n, lkv)))
    q_pe = cast(rng.standard_normal((len(lens), n, r)))
    return q_lat, q_pe, cache, table.astype(np.int32), lens


def _expected(q_lat, q_pe, cache, table, lens, scale):
    lkv = q_lat.shape[-1]
    outs, lses = [], []
    for b in range(len(lens)):
        needed = -(-lens[b] // cache.shape[1])
        rows = cache[table[b, :needed]].reshape(-1, cache.shape[-1])[: lens[b]]
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
    out_tol, lse_tol = TOL[dtype]
    live = lens > 0
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out[live], want_out[live]) < out_tol
    np.testing.assert_allclose(lse[live], want_lse[live], rtol=0, atol=lse_tol)
    assert (out[~live] == 0).all() and np.isneginf(lse[~live]).all()


def _run(args, *, dtype=jnp.float32, impl="pallas", heads_major=False, **kwargs):
    """The kernel on ``args`` (batch-leading); with ``heads_major`` its q_lat goes in and
    its out comes back heads-leading, and is returned batch-leading."""
    q_lat, q_pe, cache, table, lens = args
    fn = decode.mla_decode if impl == "pallas" else decode.reference.mla_decode
    if impl != "pallas":
        kwargs.pop("config", None)
    if heads_major:
        q_lat = np.swapaxes(q_lat, 0, 1)
        kwargs["heads_major"] = True
    out, lse = fn(
        *(jnp.asarray(a, dtype) for a in (q_lat, q_pe, cache)),
        jnp.asarray(table),
        jnp.asarray(lens),
        **kwargs,
    )
    return (jnp.swapaxes(out, 0, 1) if heads_major else out), lse


# Pallas launch variants beside the reference: one masked loop, full steps unmasked with
# the last one in a branch, and one masked loop whose next step's tiles are loaded early.
VARIANTS = [
    pytest.param("pallas", {}, id="pallas"),
    pytest.param("pallas", {"split_tail": True}, id="pallas-split_tail"),
    pytest.param("pallas", {"prefetch": True}, id="pallas-prefetch"),
    pytest.param("reference", {}, id="reference"),
]


@pytest.mark.parametrize("impl,variant", VARIANTS)
@pytest.mark.parametrize("block_size", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lengths_and_block_sizes(rng, block_size, dtype, impl, variant):
    """Empty, one-token, block-boundary and ragged lengths over every page size, with
    poisoned unowned rows and padded table entries; every way of running the steps."""
    bs = block_size
    lens = [0, 1, bs, 2 * bs, bs + 3, 3 * bs - 1, int(rng.integers(1, 4 * bs))]
    args = _case(rng, lens, block_size=bs, dtype=dtype)
    got = _run(
        args,
        dtype=dtype,
        impl=impl,
        scale=0.11,
        schedule=decode.schedule_splits(args[-1], num_programs=3, block_k=32),
        config=dataclasses.replace(decode.DecodeConfig.for_shape(16, 7), block_k=32, **variant),
    )
    _check(got, _expected(*args, 0.11), args[-1], dtype)


@pytest.mark.parametrize("heads_major", [False, True], ids=["batch-major", "heads-major"])
@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize(
    "n,lkv,r",
    [(1, 5, 3), (4, 24, 8), (8, 32, 16), (24, 40, 12), (48, 64, 16), (128, 16, 2)],
)
def test_any_heads_and_widths(rng, n, lkv, r, impl, heads_major):
    """Head counts of tensor-parallel shards (8, 4, 1 heads) and widths that are no power
    of two run, padded to Triton tiles inside the kernel; split requests merged; q_lat and
    out in either layout (``heads_major``: padded, read, written and merged heads-leading)."""
    args = _case(rng, [37, 1, 0, 90], n=n, lkv=lkv, r=r, block_size=16)
    got = _run(
        args,
        impl=impl,
        heads_major=heads_major,
        scale=0.2,
        schedule=decode.schedule_splits(args[-1], num_programs=5, block_k=32, num_items=9),
        config=dataclasses.replace(decode.DecodeConfig.for_shape(n, 4), block_k=32),
    )
    _check(got, _expected(*args, 0.2), args[-1], jnp.float32)


@pytest.mark.parametrize(
    "n,block_h,num_programs",
    [(16, 16, 1), (16, 16, 40), (32, 16, 5), (32, 32, None), (64, 32, 12), (48, 16, 7)],
)
def test_heads_and_split_counts(rng, n, block_h, num_programs):
    """Every request in one program, up to many programs per request; the device-side
    fallback (no schedule: one program per request); several blocks of heads."""
    args = _case(rng, [130, 7, 64, 0, 201], n=n)
    config = dataclasses.replace(decode.DecodeConfig.for_shape(n, 5), block_h=block_h, block_k=32)
    kw = dict(scale=0.2, config=config)
    if num_programs:
        kw["schedule"] = decode.schedule_splits(
            args[-1],
            num_programs=num_programs,
            block_k=32,
            num_items=decode.max_items(5, num_programs),
        )
    _check(_run(args, **kw), _expected(*args, 0.2), args[-1], jnp.float32)


def test_one_request_split_among_padding_rows(rng):
    """The engine's smallest decode batch (16 rows) holding one request split over many
    programs beside empty rows, on that batch's default launch: the merge takes its items
    in several steps."""
    lens = [700] + [0] * 15
    args = _case(rng, lens)
    config = dataclasses.replace(decode.DecodeConfig.for_shape(16, len(lens)), block_k=16)
    schedule = decode.schedule_splits(
        args[-1], num_programs=48, block_k=16, num_items=decode.max_items(len(lens), 48)
    )
    assert int(schedule.req_items[1]) > 2 * config.combine_block_items
    got = _run(args, scale=0.2, config=config, schedule=schedule)
    _check(got, _expected(*args, 0.2), args[-1], jnp.float32)


def test_default_head_blocks_divide_the_padded_heads():
    for n in (1, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 256):
        cfg = decode.DecodeConfig.for_shape(n, 8)
        heads = decode.padded_heads(n)
        assert heads >= n and heads % 16 == 0 and heads - n < 16
        assert heads % cfg.block_h == 0 and cfg.block_h & (cfg.block_h - 1) == 0
        assert cfg.block_h >= 16 and heads % cfg.combine_block_h == 0


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_deepseek_dims(rng, impl):
    """Lkv 512 + R 64, page 64, bf16."""
    args = _case(rng, [70, 1, 129], lkv=512, r=64, block_size=64, dtype=jnp.bfloat16)
    got = _run(args, dtype=jnp.bfloat16, impl=impl, scale=0.07)
    _check(got, _expected(*args, 0.07), args[-1], jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_major", [False, True], ids=["batch-major", "heads-major"])
@pytest.mark.parametrize("n", [16, 128])
def test_deepseek_scale_compiled(rng, n, heads_major):
    """A ragged batch of 64 requests up to 4096 tokens at DeepSeek's dims and page 64 on
    the scheduler's real program count: too slow to interpret, so GPU only."""
    lens = rng.integers(1, 4096, 64)
    lens[:3] = [4096, 1, 64]
    args = _case(rng, lens, n=n, lkv=512, r=64, block_size=64, dtype=jnp.bfloat16)
    config = decode.DecodeConfig.for_shape(n, 64)
    programs = decode.num_programs(config, n)
    got = _run(
        args,
        dtype=jnp.bfloat16,
        scale=0.07,
        config=config,
        schedule=decode.schedule_splits(args[-1], num_programs=programs, block_k=config.block_k),
        heads_major=heads_major,
    )
    _check(got, _expected(*args, 0.07), args[-1], jnp.bfloat16)


def _loads(s, block_k: int, item_cost: int, num_programs: int) -> list[int]:
    """Each program's ``block_k`` steps (a step an item only partly covers counts whole) plus
    ``item_cost`` for each item, counted item by item from the schedule's arrays."""
    loads = []
    for p in range(num_programs):
        items = range(s.prog_items[p], s.prog_items[p + 1])
        steps = sum(-(-int(s.item_end[i]) // block_k) - s.item_start[i] // block_k for i in items)
        loads.append(steps + item_cost * len(items))
    return loads


def _tiles_each_request(s, lens) -> None:
    for b in range(len(lens)):
        items = np.arange(s.req_items[b], s.req_items[b + 1])
        assert (s.item_req[items] == b).all()
        covered = [t for i in items for t in range(s.item_start[i], s.item_end[i])]
        assert covered == list(range(lens[b]))


def test_plan_balances_tokens():
    """Programs get equal token shares (to a block, and a 10% snap onto request
    boundaries); each request's items tile it in order."""
    lens = np.array([16384, 10, 0, 3000, 1, 700])
    s = decode.schedule_splits(lens, num_programs=32, block_k=64)
    size = s.item_end - s.item_start
    per_prog = [size[s.prog_items[p] : s.prog_items[p + 1]].sum() for p in range(32)]
    share = int(np.ceil(lens.sum() / 32 / 64)) * 64
    assert max(per_prog) <= 1.1 * share and sum(per_prog) == lens.sum()  # snap: 10%
    assert (size > 0).all() and len(size) <= decode.max_items(len(lens), 32)
    _tiles_each_request(s, lens)


@pytest.mark.parametrize(
    "lens, programs, used",
    [
        ([16384] * 64, 66, 64),  # 66 shares would split 55 requests (119 items)
        ([4096] * 128, 66, 64),  # two whole requests a program
        ([320] * 3, 4, 3),
        ([4096] + [0] * 15, 66, 64),  # one request: its one-page items stay on every program
        ([4096] * 32, 66, 64),  # halves: cheaper than whole requests on 32 programs
    ],
)
def test_plan_with_item_cost(lens, programs, used):
    """With ``item_cost``, equal requests run whole on fewer programs where splitting them
    costs more than it balances; the plan's largest load (steps plus the cost of its items)
    is never above the plain plan's, and every request is still tiled in order."""
    lens = np.array(lens)
    plain = decode.schedule_splits(lens, num_programs=programs, block_k=64)
    s = decode.schedule_splits(
        lens, num_programs=programs, block_k=64, item_cost=8, num_items=len(lens) + programs
    )
    _tiles_each_request(s, lens)
    loads = _loads(s, 64, 8, programs)
    assert sum(load > 0 for load in loads) == used
    assert max(loads) <= max(_loads(plain, 64, 8, programs))
    assert (
        decode.schedule_splits(lens, num_programs=programs, block_k=64, item_cost=0)[0].tolist()
        == plain[0].tolist()
    )


def test_plan_with_item_cost_on_ragged_lengths(rng):
    """Random ragged batches (empty requests among them): the plan with ``item_cost`` tiles
    every request and its largest load is at most the plain plan's."""
    for _ in range(20):
        lens = rng.integers(0, 5000, int(rng.integers(1, 200)))
        programs = int(rng.integers(1, 133))
        plain = decode.schedule_splits(lens, num_programs=programs, block_k=64)
        s = decode.schedule_splits(lens, num_programs=programs, block_k=64, item_cost=8)
        _tiles_each_request(s, lens)
        assert max(_loads(s, 64, 8, programs)) <= max(_loads(plain, 64, 8, programs))


@pytest.mark.parametrize("variant", [{}, {"prefetch": True}], ids=["pallas", "pallas-prefetch"])
def test_schedule_of_longer_lengths_truncated(rng, variant):
    """A multi-step decode window builds the schedule for its last step's lengths (up to 8
    more keys a request) and cuts it to each step's (``truncate_schedule``): the keys past a
    request's current length (poisoned, and its blocks past them -1 or far outside the
    cache) are not read, and a request whose cut schedule keeps one non-empty item of
    several is still combined."""
    lens = np.array([1, 15, 16, 17, 40, 25, 0, 9])
    window = np.array([8, 8, 3, 8, 1, 8, 0, 8])  # keys each request gains in the window
    args = _case(rng, lens)
    schedule = decode.schedule_splits(lens + window, num_programs=4, block_k=16, num_items=12)
    cut = decode.truncate_schedule(
        jax.tree.map(jnp.asarray, schedule), jnp.asarray(lens, jnp.int32)
    )
    config = dataclasses.replace(decode.DecodeConfig.for_shape(16, 8), block_k=16, **variant)
    got = _run(args, scale=0.09, schedule=cut, config=config)
    _check(got, _expected(*args, 0.09), args[-1], jnp.float32)
    # The cut left some request with empty items beside a non-empty one (the combine case).
    items = np.asarray(cut.item_end) - np.asarray(cut.item_start)
    req_items = np.asarray(cut.req_items)
    assert any(
        (items[req_items[b] : req_items[b + 1]] == 0).any()
        and (items[req_items[b] : req_items[b + 1]] > 0).any()
        for b in range(len(lens))
    )


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
        (lambda a: {**a, "q_lat": a["q_lat"][:, :0], "q_pe": a["q_pe"][:, :0]}, ">= 1"),
        (
            lambda a: {
                **a,
                "config": dataclasses.replace(decode.DecodeConfig.for_shape(16, 2), block_h=8),
            },
            "block_h",
        ),
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
