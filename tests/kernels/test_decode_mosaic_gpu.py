"""The Mosaic GPU decode kernel (``kernels/decode/pallas_mosaic_gpu.py``) against float64
NumPy attention, with the poisoned caches of ``test_decode_kernel``: cache rows a request
does not own hold NaN (rows past its length in its last page too) and table entries past its
need hold -1 or an id outside the cache.

On the CPU the kernel runs in Mosaic GPU's interpret mode (jax >= 0.11), which simulates
its warpgroups, TMA copies, mbarriers and wgmmas, and fails a kernel that leaves an mbarrier
phase unobserved; it starts every output as NaN, so an output row the kernel does not write
fails the comparison. One primitive differs there: interpret mode cannot load a value into
a wgmma accumulator, so the rescaled accumulation ``acc * alpha + P @ V`` adds the product
after the wgmma instead of accumulating onto ``acc * alpha`` (``accumulate`` in the kernel);
the compiled path is proven by the tests marked ``gpu``. On a GPU every test runs compiled.

Tolerances: out uses the bf16 bound of ``test_decode_kernel`` (3e-3 relative; the same
rounding: bf16 probabilities and output, float32 scores and sums); lse gets its own, tighter
bound, 1e-5 absolute. Measured (2026-11-24): interpret mode, 6 seeds x 2 of these cases,
out <= 1.14e-3 and lse <= 2.9e-6; compiled on an H200 (exp2, log and reciprocals
approximate), against the XLA reference on bench_decode's cases, out <= 1.7e-3 and lse
<= 1.9e-6. Lazy rescaling (the default since 2026-11-28) raises out's error: a stale row
maximum leaves the dominant probability of a peaked row at 2^d (d in [0, 8)), rounded in
bf16, where the exact online softmax has it at exactly 1. Interpret mode, requests of 64 to
300 tokens at 64 heads (scale 0.2), seeds 0-2: 2.02-2.11e-3 lazy, 1.76e-3 exact, lse
unchanged (<= 1.9e-6); compiled (H200, bench_decode's cases against the XLA reference)
out <= 2.1e-3.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_decode_kernel as bf16_tests
import test_fp8_cache as fp8_tests
from conftest import rel_err

from mla_jax.kernels import fp8, online_softmax
from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic
from mla_jax.kernels.decode import pallas_triton

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if jax.default_backend() != "gpu" and not hasattr(plgpu, "InterpretGPUParams"):
    pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11", allow_module_level=True)

BF16 = jnp.bfloat16


def _run(args, *, scale, schedule=None, heads_major=False, **kwargs):
    """The kernel on ``args`` (batch-leading); with ``heads_major`` its q_lat goes in and
    its out comes back heads-leading, and is returned batch-leading."""
    q_lat, q_pe, cache, table, lens = args
    if heads_major:
        q_lat = np.swapaxes(q_lat, 0, 1)
    out, lse = mosaic.mla_decode(
        *(jnp.asarray(a, BF16) for a in (q_lat, q_pe, cache)),
        jnp.asarray(table),
        jnp.asarray(lens),
        scale=scale,
        schedule=schedule,
        heads_major=heads_major,
        **kwargs,
    )
    return (jnp.swapaxes(out, 0, 1) if heads_major else out), lse


LSE_TOL = 1e-5
# By default pairs of 64-head blocks over a bf16 cache run as clusters of two sharing each
# page copy (interpreted, the cluster barriers run as on a GPU, but each program copies its
# whole page itself); UNPAIRED runs each block alone, FP8_PAIRED pairs the FP8 cache's too.
UNPAIRED = mosaic.MosaicDecodeConfig(multicast=False)
FP8_PAIRED = mosaic.MosaicDecodeConfig(fp8_multicast=True)


def _check(args, scale, **kwargs):
    got = _run(args, scale=scale, **kwargs)
    want = bf16_tests._expected(*args, scale)
    bf16_tests._check(got, want, args[-1], BF16)
    live = args[-1] > 0
    np.testing.assert_allclose(np.asarray(got[1])[live], want[1][live], rtol=0, atol=LSE_TOL)


@pytest.mark.parametrize(
    "n,config,heads_major",
    [
        (8, None, False),
        (16, None, False),
        (64, None, False),
        (128, None, False),
        (256, None, False),
        pytest.param(128, UNPAIRED, False, id="128-unpaired"),
        pytest.param(16, None, True, id="16-heads-major"),
        pytest.param(128, None, True, id="128-heads-major"),
    ],
)
def test_heads_lengths_and_splits(rng, n, config, heads_major):
    """Empty, one-token, page-boundary and ragged requests, each split over several
    programs and merged; heads padded to the wgmma tile (8, 16) or whole tiles (64), pairs
    of 64-head blocks as clusters (multicast: one pair at 128 heads, two at 256), or each
    block alone (unpaired); q_lat and out heads-leading (``heads_major``), padded and
    paired."""
    lens = [0, 1, 64, 65, 190, int(rng.integers(1, 256))]
    args = bf16_tests._case(rng, lens, n=n, lkv=128, r=64, block_size=64, dtype=BF16)
    programs = 4
    schedule = pallas_triton.schedule_splits(
        args[-1],
        num_programs=programs,
        block_k=mosaic.PAGE,
        num_items=pallas_triton.max_items(len(lens), programs),
    )
    _check(args, 0.13, schedule=schedule, config=config, heads_major=heads_major)


def test_whole_requests_without_schedule(rng):
    """No schedule: each request whole in a program of its own (an odd page count, an even
    one, an empty request)."""
    args = bf16_tests._case(rng, [130, 0, 256, 7], n=16, lkv=128, r=64, block_size=64, dtype=BF16)
    _check(args, 0.2)


def test_kernel_plan_leaves_a_program_idle(rng):
    """``schedule``'s plan for three equal requests on four programs a head block: each
    request whole on a program of its own (no merge), the fourth program without items."""
    lens = [320] * 3
    args = bf16_tests._case(rng, lens, n=64, lkv=128, r=64, block_size=64, dtype=BF16)
    schedule = mosaic.schedule(args[-1], 64, num_sms=4, num_items=7)
    assert np.asarray(schedule.prog_items).tolist() == [0, 1, 2, 3, 3]
    _check(args, 0.15, schedule=schedule)


def test_items_starting_inside_a_page(rng):
    """A plan in 32-token steps starts items mid-page: the keys before an item's start in
    its first page are masked (and merged from the item that owns them)."""
    lens = [300, 97]
    args = bf16_tests._case(rng, lens, n=16, lkv=128, r=64, block_size=64, dtype=BF16)
    schedule = pallas_triton.schedule_splits(args[-1], num_programs=7, block_k=32)
    assert (np.asarray(schedule.item_start) % mosaic.PAGE != 0).any()
    _check(args, 0.2, schedule=schedule)


def test_schedule_of_longer_lengths_truncated(rng):
    """A decode window's schedule, built for lengths up to 64 keys longer and cut to the
    current ones (``truncate_schedule``): keys past a request's length are not read, and a
    request left with one non-empty item of several is still combined (wholeness is by item
    count, as the combine kernel decides it)."""
    lens = np.array([1, 63, 64, 65, 130, 0, 9])
    window = np.array([64, 8, 1, 64, 63, 0, 64])
    args = bf16_tests._case(rng, lens, n=16, lkv=128, r=64, block_size=64, dtype=BF16)
    schedule = pallas_triton.schedule_splits(
        lens + window, num_programs=4, block_k=mosaic.PAGE, num_items=11
    )
    cut = pallas_triton.truncate_schedule(
        jax.tree.map(jnp.asarray, schedule), jnp.asarray(lens, jnp.int32)
    )
    _check(args, 0.09, schedule=cut)
    items = np.asarray(cut.item_end) - np.asarray(cut.item_start)
    req_items = np.asarray(cut.req_items)
    assert any(
        (items[req_items[b] : req_items[b + 1]] == 0).any()
        and (items[req_items[b] : req_items[b + 1]] > 0).any()
        for b in range(len(lens))
    )


@pytest.mark.parametrize("lazy_rescale", [True, False])
def test_row_maxima_jumping_mid_request(rng, lazy_rescale):
    """Keys from token 150 on scaled by 4, so that the row maxima jump past
    ``online_softmax.RESCALE_SLACK`` there, mid-request and mid-item, while other chunks
    move no row past it: the lazily rescaled accumulator (and the exact one) against float64."""
    lens = [300, 190]
    q_lat, q_pe, cache, table, lens = bf16_tests._case(
        rng, lens, n=64, lkv=128, r=64, block_size=64, dtype=BF16
    )
    for b, length in enumerate(lens):
        for t in range(150, length):
            cache[table[b, t // 64], t % 64] *= 4
    args = (q_lat, q_pe, cache, table, lens)
    scale = 0.1
    # Request 0's running row maxima (log2 units) at the end of each 32-token chunk: the
    # chunk holding token 150 moves one past the slack, some other chunk none.
    keys = cache[table[0, :5]].reshape(-1, 192)[: lens[0]]
    scores = np.concatenate([q_lat[0], q_pe[0]], -1) @ keys.T * scale * np.log2(np.e)
    running = np.maximum.accumulate(scores, axis=1)[:, 31::32]
    jumps = np.diff(running, axis=1).max(axis=0) > online_softmax.RESCALE_SLACK
    first = 150 // 32 - 1  # (chunk i + 1 against chunk i)
    assert jumps[first] and not jumps.all(), jumps
    config = mosaic.MosaicDecodeConfig(lazy_rescale=lazy_rescale)
    schedule = pallas_triton.schedule_splits(lens, num_programs=3, block_k=mosaic.PAGE)
    _check(args, scale, schedule=schedule, config=config)


def test_deepseek_dims(rng):
    """Lkv 512 + R 64 (four 64-column tiles for each consumer's half of the output)."""
    args = bf16_tests._case(rng, [70, 1, 129], n=16, lkv=512, r=64, block_size=64, dtype=BF16)
    schedule = pallas_triton.schedule_splits(
        args[-1], num_programs=2, block_k=mosaic.PAGE, num_items=5
    )
    _check(args, 0.07, schedule=schedule)


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11),
    reason="compiled on jax 0.11 only (0.12's lowering refuses the output stores)",
)
@pytest.mark.parametrize("cache_kind", ["bf16", "fp8", "fp8-float16"])
@pytest.mark.parametrize(
    "n,config,heads_major",
    [
        (16, mosaic.MosaicDecodeConfig(), False),
        (128, mosaic.MosaicDecodeConfig(), False),
        # Pairs over the FP8 cache, none over bf16: with the defaults, every combination.
        pytest.param(
            128,
            mosaic.MosaicDecodeConfig(multicast=False, fp8_multicast=True),
            False,
            id="128-swapped",
        ),
        pytest.param(128, mosaic.MosaicDecodeConfig(), True, id="128-heads-major"),
    ],
)
def test_lowers_for_sm90(n, config, cache_kind, heads_major):
    """The compiled kernel's Mosaic GPU lowering, run on any machine (the arch defaults to
    sm90 off a GPU): layout inference, TMA alignment and shared memory (the kernel fills
    all but a few KB of it, with either cache, and with float16 wgmmas over FP8), the
    cluster's multicast copies and barriers, and heads-leading queries and outputs (a
    strided copy and strided stores), are checked there; only ptxas and the run need the
    GPU."""
    quantized, float16 = cache_kind != "bf16", cache_kind == "fp8-float16"
    b, heads, lkv = 4, mosaic.padded_heads(n), 512
    lens = np.array([300, 64, 1, 0])
    schedule = pallas_triton.schedule_splits(
        lens, num_programs=8, block_k=mosaic.PAGE, num_items=pallas_triton.max_items(b, 8)
    )
    schedule = jax.tree.map(jnp.asarray, schedule)
    f = jax.jit(
        lambda q_lat, q_pe, cache, row_factors, table, schedule: mosaic._decode_call(
            q_lat,
            q_pe,
            cache,
            row_factors,
            table,
            schedule,
            scale=0.07,
            programs=8,
            items=schedule.item_req.shape[0],
            config=config,
            interpret=False,
            heads_major=heads_major,
        )
    )
    page = (32, mosaic.PAGE)
    if quantized:
        cache = fp8.Fp8Cache(
            jax.ShapeDtypeStruct((*page, lkv), fp8.FP8),
            jax.ShapeDtypeStruct((*page, mosaic.ROPE), BF16),
            jax.ShapeDtypeStruct((*page, fp8.num_groups(lkv)), jnp.float32),
        )
    else:
        cache = jax.ShapeDtypeStruct((*page, lkv + mosaic.ROPE), BF16)
    args = (
        jax.ShapeDtypeStruct(
            (heads, b, lkv) if heads_major else (b, heads, lkv),
            jnp.float16 if float16 else BF16,
        ),
        jax.ShapeDtypeStruct((b, heads, mosaic.ROPE), BF16),
        cache,
        jax.ShapeDtypeStruct((b, heads), jnp.float32) if float16 else None,
        jax.ShapeDtypeStruct((b, 8), jnp.int32),
    )
    lowered = f.trace(*args, schedule).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret mode only")
def test_outputs_start_poisoned():
    """Guards the claim above: in Mosaic GPU interpret mode an output the kernel never
    writes is NaN."""
    out = plgpu.kernel(
        lambda o_ref: None,
        out_type=jax.ShapeDtypeStruct((64,), BF16),
        interpret=plgpu.InterpretGPUParams(),
    )()
    assert np.isnan(np.asarray(out, np.float32)).all()


def test_other_inputs_run_the_triton_kernel(rng, caplog):
    """Page 16, float32 and R 16 fall back to the Triton kernel, each reason logged once."""
    args = bf16_tests._case(rng, [40, 3], n=8, lkv=64, r=16, block_size=16)
    with caplog.at_level(logging.WARNING, logger=mosaic.__name__):
        for _ in range(2):
            got = mosaic.mla_decode(*map(jnp.asarray, args), scale=0.3)
    bf16_tests._check(got, bf16_tests._expected(*args, 0.3), args[-1], jnp.float32)
    assert sum("page size 16" in r.message for r in caplog.records) == 1


def test_bad_inputs_are_refused_like_triton(rng):
    q_lat, q_pe, cache, table, lens = bf16_tests._case(
        rng, [20, 40], n=8, lkv=128, r=64, block_size=64, dtype=BF16
    )
    a = [jnp.asarray(x, BF16) for x in (q_lat, q_pe, cache)] + [jnp.asarray(table)]
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        mosaic.mla_decode(*a, jnp.asarray(lens[:1]), scale=1.0)
    with pytest.raises(ValueError, match="ids outside"):
        mosaic.mla_decode(*a[:3], a[3] + 1000, jnp.asarray(lens), scale=1.0)


def _check_at_deepseek_scale(rng, lens, n, config=None, heads_major=False):
    """Requests of ``lens`` at DeepSeek's dims, page 64, split over the kernel's own
    program count: too slow to interpret, so GPU only."""
    args = bf16_tests._case(rng, lens, n=n, lkv=512, r=64, block_size=64, dtype=BF16)
    programs = mosaic.num_programs(n)
    schedule = pallas_triton.schedule_splits(
        args[-1],
        num_programs=programs,
        block_k=mosaic.PAGE,
        num_items=pallas_triton.max_items(len(lens), programs),
    )
    _check(args, 0.07, schedule=schedule, config=config, heads_major=heads_major)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,heads_major", [(8, False), (16, False), (64, False), (128, False), (16, True), (128, True)]
)
def test_deepseek_scale_compiled(rng, n, heads_major):
    """A ragged batch of 64 requests up to 4096 tokens (q_lat and out in either layout)."""
    lens = rng.integers(1, 4096, 64)
    lens[:4] = [4096, 1, 64, 0]
    _check_at_deepseek_scale(rng, lens, n, heads_major=heads_major)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 128])
def test_one_request_among_padding_rows_compiled(rng, n):
    """One 16384-token request and 15 empty rows (the engine's smallest decode batch): split
    over every program and merged on that batch's default launch."""
    _check_at_deepseek_scale(rng, [16384] + [0] * 15, n)


@pytest.mark.parametrize("n,pairs", [(64, None), (128, 1), (256, 2)])
def test_multicast_pairs_head_blocks(monkeypatch, n, pairs):
    """Over a bf16 cache (``multicast``, the default), calls of an even number of 64-head
    blocks launch a cluster of two programs per pair of blocks (grid: pairs x programs),
    compiled and interpreted; one block, or multicast off, launch no cluster."""
    launches = []
    kernel = mosaic.plgpu.kernel
    monkeypatch.setattr(
        mosaic.plgpu,
        "kernel",
        lambda body, **kwargs: launches.append(kwargs) or kernel(body, **kwargs),
    )
    lkv, b = 128, 2
    args = (
        jax.ShapeDtypeStruct((b, n, lkv), BF16),
        jax.ShapeDtypeStruct((b, n, mosaic.ROPE), BF16),
        jax.ShapeDtypeStruct((4, mosaic.PAGE, lkv + mosaic.ROPE), BF16),
        None,
        jax.ShapeDtypeStruct((b, 2), jnp.int32),
        jax.tree.map(
            jnp.asarray,
            pallas_triton.schedule_splits(np.array([70, 3]), num_programs=3, block_k=64),
        ),
    )
    for config, interpret in (
        (mosaic.MosaicDecodeConfig(), False),
        (UNPAIRED, False),
        (mosaic.MosaicDecodeConfig(), True),
    ):
        launches.clear()
        jax.eval_shape(
            functools.partial(
                mosaic._decode_call,
                scale=0.1,
                programs=3,
                items=args[-1].item_req.shape[0],
                config=config,
                interpret=interpret,
                heads_major=False,
            ),
            *args,
        )
        (launch,) = launches
        if config.multicast and pairs is not None:
            assert launch["grid"] == (pairs, 3) and launch["cluster"] == (2,)
        else:
            assert launch["grid"] == (n // mosaic.BLOCK_H, 3) and "cluster" not in launch


@pytest.mark.gpu
@pytest.mark.parametrize("n", [128, 256])
def test_multicast_deepseek_scale_compiled(rng, n):
    """test_deepseek_scale_compiled at 256 heads (two clusters a program index) and at 128
    heads with each head block alone (unpaired)."""
    lens = rng.integers(1, 4096, 64)
    lens[:4] = [4096, 1, 64, 0]
    _check_at_deepseek_scale(rng, lens, n, None if n == 256 else UNPAIRED)


# The FP8 cache (``fp8.Fp8Cache``, test_fp8_cache's cases: latent magnitudes that differ by
# up to 2^±2 between tokens and scale groups, NaN in every part of the rows a request does
# not own, table entries past its need -1 or far outside the cache) against float64
# attention over the dequantized cache. The kernel dequantizes exactly (power-of-two
# scales), so its rounding is the bf16 cache's: FP8_OUT_TOL relative L2 on out, and on lse
# LSE_TOL absolute plus FP8_LSE_RTOL relative (these latents' scores put lse near 19 at
# DeepSeek scale, where a float32 ulp is 1.9e-6). Measured (2026-11-25): interpret mode,
# the interpreted cases below over seeds 0-3, out <= 1.84e-3 and lse <= 5.9e-6; compiled on
# an H200 (approximate exp2 and log), lse up to 1.9e-5 off at lse ~19 (1.05e-6 relative).
FP8_OUT_TOL, FP8_LSE_RTOL = 3e-3, 1e-6


def _check_fp8(
    rng,
    lens,
    *,
    n,
    lkv,
    scale,
    schedule=None,
    programs=None,
    block_k=mosaic.PAGE,
    config=None,
    row_exponents=(0, 0),
    heads_major=False,
):
    """``row_exponents``: each query row (latent and rope) times a power of two drawn from
    that range; ``heads_major``: q_lat in and out back heads-leading."""
    args, dequantized = fp8_tests._fp8_case(rng, lens, n=n, lkv=lkv, r=mosaic.ROPE, block_size=64)
    q_lat, q_pe, cache, table, lens = args
    rows = 2.0 ** rng.integers(row_exponents[0], row_exponents[1] + 1, (len(lens), n, 1))
    q_lat, q_pe = np.asarray(q_lat) * rows, np.asarray(q_pe) * rows
    if programs is not None:
        schedule = pallas_triton.schedule_splits(
            lens,
            num_programs=programs,
            block_k=block_k,
            num_items=pallas_triton.max_items(len(lens), programs),
        )
    queries = jnp.asarray(q_lat, BF16), jnp.asarray(q_pe, BF16)
    assert mosaic.unsupported(*queries, cache) is None  # no fallback to Triton
    if heads_major:
        queries = jnp.swapaxes(queries[0], 0, 1), queries[1]
    got = mosaic.mla_decode(
        *queries,
        cache,
        jnp.asarray(table),
        jnp.asarray(lens),
        scale=scale,
        schedule=schedule,
        config=config,
        heads_major=heads_major,
    )
    if heads_major:
        got = jnp.swapaxes(got[0], 0, 1), got[1]
    want = bf16_tests._expected(q_lat, q_pe, dequantized, table, lens, scale)
    out, lse = (np.asarray(jnp.asarray(a, jnp.float32)) for a in got)
    live = lens > 0
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out[live], want[0][live]) < FP8_OUT_TOL
    np.testing.assert_allclose(lse[live], want[1][live], rtol=FP8_LSE_RTOL, atol=LSE_TOL)
    assert (out[~live] == 0).all() and np.isneginf(lse[~live]).all()
    return schedule


# The FP8 cache's latent wgmmas in bf16 and in float16 (``float16_mma``, by default from
# ``float16_min_batch`` requests up; here at any batch).
FLOAT16 = mosaic.MosaicDecodeConfig(float16_min_batch=1)
MMA_CONFIGS = [
    pytest.param(mosaic.MosaicDecodeConfig(float16_mma=False), id="bf16-mma"),
    pytest.param(FLOAT16, id="float16-mma"),
]


@pytest.mark.parametrize("config", MMA_CONFIGS)
@pytest.mark.parametrize("n", [16, 64, 128])
def test_fp8_heads_lengths_and_splits(rng, n, config):
    """test_heads_lengths_and_splits over the FP8 cache, Lkv 256: two scale groups, one in
    each warpgroup's half of the columns; 16 heads padded to the 64-row tile."""
    lens = [0, 1, 64, 65, 190, int(rng.integers(1, 256))]
    _check_fp8(rng, lens, n=n, lkv=256, scale=0.13, programs=4, config=config)


def test_fp8_multicast_heads_lengths_and_splits(rng):
    """The same at 128 heads with both head blocks as a cluster (fp8_multicast: each
    staging page copied once for both programs), float16 wgmmas."""
    lens = [0, 1, 64, 65, 190, int(rng.integers(1, 256))]
    config = mosaic.MosaicDecodeConfig(float16_min_batch=1, fp8_multicast=True)
    _check_fp8(rng, lens, n=128, lkv=256, scale=0.13, programs=4, config=config)


@pytest.mark.parametrize("config", MMA_CONFIGS)
def test_fp8_items_starting_inside_a_page(rng, config):
    """A plan in 32-token steps: items start mid-page and end mid-page, an item's pages
    dequantized with its own end (and the next item's first page after it)."""
    schedule = _check_fp8(
        rng, [300, 97], n=16, lkv=128, scale=0.2, programs=7, block_k=32, config=config
    )
    assert (np.asarray(schedule.item_start) % mosaic.PAGE != 0).any()


def test_fp8_deepseek_dims(rng):
    """Lkv 512 + R 64: four scale groups, two in each warpgroup's half, each program over
    several pages and items; one request whole (no schedule)."""
    _check_fp8(rng, [70, 1, 129, 0], n=16, lkv=512, scale=0.07, programs=2)
    _check_fp8(rng, [150], n=16, lkv=512, scale=0.07)


@pytest.mark.parametrize("heads_major", [False, True], ids=["batch-major", "heads-major"])
@pytest.mark.parametrize("config", MMA_CONFIGS)
def test_fp8_queries_of_any_magnitude(rng, config, heads_major):
    """Query rows from 2^-12 to 2^12 times their draw, in one head block: each row's own
    power of two into float16's range (float16 MMA), undone in its softmax; the rows'
    factors follow heads-leading queries (``heads_major``) to their own rows."""
    _check_fp8(
        rng,
        [70, 130],
        n=64,
        lkv=256,
        scale=0.02,
        programs=3,
        config=config,
        row_exponents=(-12, 12),
        heads_major=heads_major,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        *MMA_CONFIGS,
        pytest.param(FP8_PAIRED, id="multicast"),  # (64 requests: the float16 wgmmas)
    ],
)
@pytest.mark.parametrize("n", [16, 64, 128])
def test_fp8_deepseek_scale_compiled(rng, n, config):
    """test_deepseek_scale_compiled over the FP8 cache: a ragged batch of 64 requests up to
    4096 tokens on the kernel's own program count (GPU only); at 128 heads q_lat and out
    heads-leading."""
    lens = rng.integers(1, 4096, 64)
    lens[:4] = [4096, 1, 64, 0]
    _check_fp8(
        rng,
        lens,
        n=n,
        lkv=512,
        scale=0.07,
        programs=mosaic.num_programs(n),
        config=config,
        heads_major=n == 128,
    )


@pytest.mark.parametrize(
    "config,scale_exponents",
    [
        pytest.param(mosaic.MosaicDecodeConfig(float16_mma=False), (-20, 20), id="bf16-mma"),
        # float16's range: e4m3's largest value 448 x 2^7 = 57344 < 65504, its smallest
        # 2^-9 x 2^-15 = float16's smallest subnormal.
        pytest.param(FLOAT16, (-15, 7), id="float16-mma"),
    ],
)
def test_fp8_single_keys_give_dequantized_rows_exactly(rng, config, scale_exponents):
    """Every finite e4m3 value, with scales from 2^-20 to 2^20 (float16 MMA: 2^-15 to 2^7,
    what float16 holds), read back through one-key softmaxes: the in-kernel dequantization
    (in ``CONVERT_LAYOUT``'s registers, times the scale rows) is exact, as the interpreter and
    the GPU compute it."""
    args, want = fp8_tests.single_token_case(
        rng, n=16, lkv=512, r=mosaic.ROPE, scale_exponents=scale_exponents
    )
    assert mosaic.unsupported(*args[:3]) is None  # no fallback to Triton
    out, _ = mosaic.mla_decode(*args, scale=0.1, config=config)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


def test_float16_mma_hands_scales_past_its_range_to_bf16(rng, caplog, monkeypatch):
    """A concrete FP8 cache with a scale above FLOAT16_MAX_SCALE (values float16 cannot
    hold) runs the bf16 wgmmas, said once, and gives the dequantized rows exactly."""
    from mla_jax.kernels import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "_logged", set())  # said once a process: say it here
    args, want = fp8_tests.single_token_case(
        rng, n=16, lkv=512, r=mosaic.ROPE, scale_exponents=(7, 9)
    )
    with caplog.at_level(logging.WARNING):
        out, _ = mosaic.mla_decode(*args, scale=0.1, config=FLOAT16)
    assert "overflow float16: the latent wgmmas run in bf16" in caplog.text
    got = np.asarray(out.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


@pytest.mark.parametrize(("batch", "float16"), [(63, False), (64, True)])
def test_float16_mma_from_its_batch(batch, float16, monkeypatch):
    """By default the float16 wgmmas (and their query preparation) run from
    ``float16_min_batch`` requests up; checked on the traced program (whether the
    queries reach the kernel as float16)."""
    seen = []
    call = mosaic._decode_call
    monkeypatch.setattr(
        mosaic,
        "_decode_call",
        lambda q_lat, *a, **k: seen.append(q_lat.dtype) or call(q_lat, *a, **k),
    )
    lkv, blocks = 128, 2
    cache = fp8.Fp8Cache(
        jnp.zeros((blocks, mosaic.PAGE, lkv), fp8.FP8),
        jnp.zeros((blocks, mosaic.PAGE, mosaic.ROPE), BF16),
        jnp.ones((blocks, mosaic.PAGE, fp8.num_groups(lkv)), jnp.float32),
    )
    args = (
        jax.ShapeDtypeStruct((batch, 64, lkv), BF16),
        jax.ShapeDtypeStruct((batch, 64, mosaic.ROPE), BF16),
        cache,
        jax.ShapeDtypeStruct((batch, 1), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    jax.eval_shape(lambda q, r, c, t, s: mosaic.mla_decode(q, r, c, t, s, scale=0.1), *args)
    assert seen == [jnp.float16 if float16 else BF16]
