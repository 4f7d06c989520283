"""The FP8 latent cache: quantization, the decode kernels over it, writes and dtype checks.

The decode kernels (Pallas, interpreted on CPU, and the pure-jnp reference) are compared with
float64 NumPy attention over the *dequantized* cache, so what is measured is the kernels' own
arithmetic, not the quantization: bf16 queries and probabilities, float32 accumulation. As in
test_decode_kernel.py, every cache row a request does not own is NaN (in all three parts of
the layout: kv_c, k_pe and scales) and table entries past a request's need are -1 or an id
far outside the cache.

Tolerances, from errors measured against float64 (8 seeds x page 1, 16, 64 x both Pallas
variants and the reference, CPU, 2026-11-22) with a margin of about 2x: out 3.5e-3 relative
L2 (measured <= 1.7e-3, as for a bf16 cache: the scales are powers of two, so applying them
to scores and probabilities rounds nothing), lse 8e-6 absolute (measured <= 3.3e-6) or 1e-6
relative, whichever is larger (at DeepSeek scale, compiled on an H200, an lse of 19 was off
by 8.05e-6, 4.2e-7 relative: a float32 ulp there is 1.9e-6). The
float16 conversion (``DecodeConfig.fp8_compute``) is held to the same: it measured the same
errors (<= 1.6e-3 and 2.2e-6, 6 seeds, page 16), which the bf16 output's rounding dominates.

Round trip: every element within e4m3's bound (see kernels/fp8.py),
``|x - dequantize(quantize(x))| <= 2^-4 |x| + 2^-10 scale``, and the bound is nearly reached
(the largest error over 2^-4 |x| is above 0.9), so a coarser rounding would fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_decode_kernel as bf16_tests
from conftest import refused_only_compiled, rel_err, triton_lowering_without_gpu

from mla_jax.cache.latent_cache import PAD_SLOT, cache_dtype, init_cache, write_cache
from mla_jax.checkpoint.loader import load_model
from mla_jax.checkpoint.tiny import tiny_checkpoint
from mla_jax.engine import engine as engine_module
from mla_jax.engine.engine import Engine, EngineConfig, Request
from mla_jax.kernels import decode, fp8, paged
from mla_jax.model.attention import LayerView

OUT_TOL, LSE_TOL, LSE_RTOL = 3.5e-3, 8e-6, 1e-6


def _latents(rng, shape, spread: int = 6) -> np.ndarray:
    """Normal values whose magnitude varies by up to 2^±spread between tokens and groups, so
    that the scales differ (a single scale would pass any per-group test)."""
    *lead, lkv = shape
    groups = fp8.num_groups(lkv)
    spread = 2.0 ** rng.integers(-spread, spread + 1, (*lead, groups))
    return rng.standard_normal(shape) * np.repeat(spread, fp8.GROUP, axis=-1)[..., :lkv]


def _dequantized(values: jnp.ndarray, scales: jnp.ndarray) -> np.ndarray:
    """float64 ``values x scale`` from the fp8 values and float32 scales (independent of
    ``fp8.dequantize``)."""
    lkv = values.shape[-1]
    full = np.repeat(np.asarray(scales, np.float64), fp8.GROUP, axis=-1)[..., :lkv]
    return np.asarray(values.astype(jnp.float32), np.float64) * full


@pytest.mark.parametrize("lkv", [512, 200, 32])
def test_quantize_round_trip_within_e4m3_bound(rng, lkv):
    x = _latents(rng, (96, lkv)).astype(np.float32)
    x[3] = 0.0  # an all-zero token
    x[5, :7] = [1e-30, -1e-30, 448.0, 1e30, 0.0, -3.0, 2.0**-20]
    values, scales = fp8.quantize(jnp.asarray(x))
    assert values.dtype == fp8.FP8 and scales.dtype == jnp.float32
    s = np.asarray(scales, np.float64)
    assert s.shape == (96, fp8.num_groups(lkv)) and (s > 0).all()
    assert (np.log2(s) == np.round(np.log2(s))).all()  # powers of two
    full = np.repeat(s, fp8.GROUP, axis=-1)[:, :lkv]
    ratio = np.abs(x) / full
    amax = np.pad(ratio, [(0, 0), (0, s.shape[1] * fp8.GROUP - lkv)]).reshape(96, -1, 128).max(-1)
    nonzero = amax > 0
    assert (amax[nonzero] >= 224).all() and (amax < fp8.E4M3_MAX).all()  # no saturation
    err = np.abs(_dequantized(values, scales) - x)
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * full
    assert (err <= bound).all()
    normal = ratio >= 2.0**-6
    assert (err[normal] / np.abs(x[normal])).max() > 0.9 * 2.0**-4
    # fp8.dequantize is exact in bf16 (power-of-two scales): the same numbers.
    k_pe = jnp.zeros((96, 4), jnp.bfloat16)
    got = np.asarray(fp8.dequantize(values, k_pe, scales).astype(jnp.float32))
    np.testing.assert_array_equal(got[:, :lkv], _dequantized(values, scales))


def _fp8_case(rng, lens, *, n=16, lkv=192, r=16, block_size=16):
    """``_case`` of test_decode_kernel with the cache quantized: an ``Fp8Cache`` whose
    unowned rows are NaN in every part, and its float64 dequantized twin."""
    q_lat, q_pe, cache, table, lens = bf16_tests._case(
        rng, lens, n=n, lkv=lkv, r=r, block_size=block_size, dtype=jnp.bfloat16
    )
    poisoned = np.isnan(cache[..., 0])
    # Magnitudes within 2^±2: scales differ, and scores stay in the range where softmax is
    # not one-hot (which would leave the values' path untested).
    latents = _latents(rng, cache[..., :lkv].shape, spread=2)
    values, scales = fp8.quantize(jnp.asarray(latents))
    k_pe = jnp.asarray(cache[..., lkv:], jnp.bfloat16)
    dequantized = np.concatenate(
        [_dequantized(values, scales), np.asarray(k_pe.astype(jnp.float32), np.float64)], -1
    )
    dequantized[poisoned] = np.nan
    nan = jnp.asarray(poisoned)[..., None]
    fp8_cache = fp8.Fp8Cache(
        jnp.where(nan, jnp.asarray(np.nan, fp8.FP8), values),
        k_pe,  # NaN already where unowned
        jnp.where(nan, np.nan, scales),
    )
    return (q_lat, q_pe, fp8_cache, table, lens), dequantized


def _run(args, *, impl, **kwargs):
    q_lat, q_pe, cache, table, lens = args
    fn = decode.mla_decode if impl == "pallas" else decode.reference.mla_decode
    if impl != "pallas":
        kwargs.pop("config", None)
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    return fn(bf16(q_lat), bf16(q_pe), cache, jnp.asarray(table), jnp.asarray(lens), **kwargs)


def _check(got, args, dequantized, scale):
    q_lat, q_pe, _, table, lens = args
    want = bf16_tests._expected(q_lat, q_pe, dequantized, table, lens, scale)
    out, lse = (np.asarray(jnp.asarray(a, jnp.float32)) for a in got)
    live = lens > 0
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out[live], want[0][live]) < OUT_TOL
    np.testing.assert_allclose(lse[live], want[1][live], rtol=LSE_RTOL, atol=LSE_TOL)
    assert (out[~live] == 0).all() and np.isneginf(lse[~live]).all()


def single_token_case(rng, *, n, lkv, r, scale_exponents=(-20, 20)):
    """Requests of one token each, whose latents run through every finite e4m3 bit pattern
    times power-of-two scales from 2^-20 to 2^20 (``scale_exponents``, both ends included):
    with one key a request's softmax is 1, so the decode's ``out`` is its token's
    dequantized latent row, exactly (bf16 holds every such value). Returns the decode's
    arguments (bf16 queries, an ``Fp8Cache`` of pages of 64 with NaN in every row no request
    owns) and the float64 rows ``out`` must equal."""
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    b = -(-finite.size // lkv) * 4
    patterns = rng.permutation(np.resize(finite, b * lkv)).reshape(b, lkv)
    values = jnp.asarray(patterns).view(fp8.FP8)
    low, high = scale_exponents
    scales = 2.0 ** rng.integers(low, high + 1, (b, fp8.num_groups(lkv))).astype(np.float32)
    block = 64
    kv_c = jnp.full((b, block, lkv), jnp.nan, fp8.FP8).at[:, 0].set(values)
    k_pe = jnp.full((b, block, r), jnp.nan, jnp.bfloat16).at[:, 0].set(0.0)
    scale_rows = jnp.full((b, block, scales.shape[1]), jnp.nan).at[:, 0].set(scales)
    cache = fp8.Fp8Cache(kv_c, k_pe, scale_rows)
    table = rng.permutation(b).astype(np.int32)[:, None]
    # The blocks are shuffled: request i owns block table[i], which holds latent row table[i].
    want = _dequantized(values, jnp.asarray(scales))[table[:, 0]]
    # Zero queries: every score is 0, so the one key's probability is exactly 1 however a
    # kernel rounds or contracts its softmax arithmetic (what is tested is the values' path).
    q_lat, q_pe = (jnp.zeros((b, n, d), jnp.bfloat16) for d in (lkv, r))
    return (q_lat, q_pe, cache, jnp.asarray(table), jnp.ones(b, jnp.int32)), want


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_single_keys_give_dequantized_rows_exactly(rng, impl):
    """Every finite e4m3 value and scales far apart, read back through a one-key softmax:
    the decode dequantizes exactly (the Triton kernel through its scaled probabilities)."""
    args, want = single_token_case(rng, n=16, lkv=128, r=16)
    if impl == "pallas":
        out, lse = decode.mla_decode(*args, scale=0.1)
    else:
        out, lse = decode.reference.mla_decode(*args, scale=0.1)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


@pytest.mark.parametrize(
    "impl,variant",
    [
        *bf16_tests.VARIANTS,
        pytest.param("pallas", {"fp8_compute": "float16"}, id="pallas-float16"),
    ],
)
@pytest.mark.parametrize("block_size", [1, 16, 32, 64, 128])
def test_fp8_lengths_and_block_sizes(rng, block_size, impl, variant):
    """test_decode_kernel's lengths (0, 1, block boundaries, ragged) and page sizes over an
    FP8 cache of two scale groups, the second one short (Lkv 192 = 128 + 64), in every
    launch variant and with the tiles converted to float16 instead of bf16."""
    bs = block_size
    lens = [0, 1, bs, 2 * bs, bs + 3, 3 * bs - 1, int(rng.integers(1, 4 * bs))]
    args, dequantized = _fp8_case(rng, lens, block_size=bs)
    got = _run(
        args,
        impl=impl,
        scale=0.11,
        schedule=decode.schedule_splits(args[-1], num_programs=3, block_k=32),
        config=dataclasses.replace(decode.DecodeConfig.for_shape(16, 7), block_k=32, **variant),
    )
    _check(got, args, dequantized, 0.11)


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_fp8_deepseek_dims(rng, impl):
    """Lkv 512 (four scale groups) + R 64, page 64, 24 heads (padded to 32, two blocks of
    16), split requests."""
    args, dequantized = _fp8_case(rng, [70, 1, 129, 0], n=24, lkv=512, r=64, block_size=64)
    config = dataclasses.replace(decode.DecodeConfig.for_shape(24, 4), block_k=32)
    schedule = decode.schedule_splits(args[-1], num_programs=5, block_k=32, num_items=9)
    got = _run(args, impl=impl, scale=0.07, config=config, schedule=schedule)
    _check(got, args, dequantized, 0.07)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="default"),
        pytest.param({"prefetch": True, "split_tail": False}, id="prefetch"),
        pytest.param({"fp8_compute": "float16"}, id="float16"),
    ],
)
@pytest.mark.parametrize("n", [16, 128])
def test_fp8_deepseek_scale_compiled(rng, n, variant):
    """test_decode_kernel's ragged batch of 64 requests up to 4096 tokens, over the FP8
    cache, on the scheduler's real program count, with the default config and the variants
    bench_decode.py --sweep fp8 times: GPU only."""
    lens = rng.integers(1, 4096, 64)
    lens[:3] = [4096, 1, 64]
    args, dequantized = _fp8_case(rng, lens, n=n, lkv=512, r=64, block_size=64)
    config = dataclasses.replace(decode.DecodeConfig.for_shape(n, 64), **variant)
    schedule = decode.schedule_splits(
        args[-1], num_programs=decode.num_programs(config, n), block_k=config.block_k
    )
    got = _run(args, impl="pallas", scale=0.07, config=config, schedule=schedule)
    _check(got, args, dequantized, 0.07)


def test_fp8_bad_inputs(rng):
    (q_lat, q_pe, cache, table, lens), _ = _fp8_case(rng, [20, 40])
    kw = dict(block_table=jnp.asarray(table), seq_lens=jnp.asarray(lens), scale=1.0)
    q = dict(q_lat=jnp.asarray(q_lat, jnp.bfloat16), q_pe=jnp.asarray(q_pe, jnp.bfloat16))
    with pytest.raises(ValueError, match="share a dtype, got float32, float32, bfloat16"):
        decode.mla_decode(jnp.asarray(q_lat), jnp.asarray(q_pe), cache, **kw)
    bad_scales = cache._replace(scales=cache.scales.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="scales float32"):
        decode.mla_decode(**q, kv_cache=bad_scales, **kw)
    with pytest.raises(ValueError, match="Fp8Cache parts"):
        decode.mla_decode(**q, kv_cache=cache._replace(scales=cache.scales[..., :1]), **kw)
    config = decode.DecodeConfig.for_shape(16, 2)
    with pytest.raises(ValueError, match="fp8_compute 'float8_e4m3fn' must be"):
        decode.mla_decode(
            **q,
            kv_cache=cache,
            config=dataclasses.replace(config, fp8_compute="float8_e4m3fn"),
            **kw,
        )
    with pytest.raises(ValueError, match="prefetch needs split_tail False"):
        decode.mla_decode(
            **q,
            kv_cache=cache,
            config=dataclasses.replace(config, prefetch=True, split_tail=True),
            **kw,
        )


def _rows(cache: fp8.Fp8Cache) -> np.ndarray:
    """Every row ``[num_blocks * block_size, Lkv + R]`` of one layer's FP8 cache,
    dequantized by ``paged.gather_rows`` (float32)."""
    num_blocks, block_size = cache.shape[:2]
    slots = num_blocks * block_size
    return np.asarray(
        paged.gather_rows(
            cache,
            jnp.arange(num_blocks, dtype=jnp.int32)[None],
            jnp.zeros(slots, jnp.int32),
            jnp.arange(slots),
            jnp.ones(slots, bool),
        ).astype(jnp.float32)
    )


def test_write_fp8_cache(rng):
    """Quantized kv_c, bf16 k_pe and the scales land in the slots of the layer written, in
    all three arrays of a stacked cache; the other layers and padding are untouched."""
    cache = init_cache(3, 5, 4, 200 + 8, "fp8", kv_lora_rank=200)
    assert cache.kv_c.shape == (3, 5, 4, 200) and cache.k_pe.shape == (3, 5, 4, 8)
    assert cache.scales.shape == (3, 5, 4, 2) and cache.shape == (3, 5, 4, 208)
    kv_c = _latents(rng, (4, 200)).astype(np.float32)
    k_pe = rng.standard_normal((4, 8)).astype(np.float32)
    slots = np.array([7, PAD_SLOT, 0, 19], np.int32)
    out = write_cache(
        cache, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots), layer=jnp.int32(1)
    )
    values, scales = fp8.quantize(jnp.asarray(kv_c))
    rows = _rows(jax.tree.map(lambda part: part[1], out))
    written = np.zeros(20, bool)
    for i in (0, 2, 3):
        written[slots[i]] = True
        np.testing.assert_array_equal(rows[slots[i], :200], _dequantized(values, scales)[i])
        np.testing.assert_array_equal(rows[slots[i], 200:], jnp.asarray(k_pe[i], jnp.bfloat16))
    assert (rows[~written] == 0).all()
    for layer in (0, 2):
        assert (_rows(jax.tree.map(lambda part, layer=layer: part[layer], out)) == 0).all()
    # One layer's [num_blocks, block_size] arrays, no layer axis: the same rows.
    single = write_cache(
        jax.tree.map(lambda part: part[0], cache),
        jnp.asarray(kv_c),
        jnp.asarray(k_pe),
        jnp.asarray(slots),
    )
    np.testing.assert_array_equal(_rows(single), rows)


def test_fp8_layer_view_reads_its_layer(rng):
    """``attention.LayerView`` over a stacked FP8 cache: decoding layer l through its
    ``[L * num_blocks, ...]`` blocks and offset block ids equals decoding layer l's own
    arrays (the reference kernel, whose FP8 path is tested above)."""
    (q_lat, q_pe, one_layer, table, lens), _ = _fp8_case(rng, [5, 17, 0])
    # Layers that differ in every part (k_pe, scales) and share the unowned (NaN) rows.
    layers = [
        one_layer._replace(k_pe=one_layer.k_pe * (1 - layer), scales=one_layer.scales * 2**layer)
        for layer in range(3)
    ]
    stacked = jax.tree.map(lambda *parts: jnp.stack(parts), *layers)
    for layer in range(3):
        view = LayerView(stacked, jnp.int32(layer))
        args = q_lat, q_pe, view.blocks, view.block_ids(jnp.asarray(table)), lens
        got = _run(args, impl="reference", scale=0.3)
        want = _run((q_lat, q_pe, layers[layer], table, lens), impl="reference", scale=0.3)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert not np.isnan(np.asarray(got[0])).any()


def test_fp8_cache_bytes_per_token():
    """FlashMLA's 656 bytes a token at DeepSeek's dims (bf16: 1152), per layer."""
    cache = init_cache(2, 2, 64, 576, "fp8", kv_lora_rank=512)
    assert cache.shape == (2, 2, 64, 576) and cache.dtype == jnp.bfloat16
    assert sum(a.nbytes for a in cache) == 2 * 2 * 64 * 656
    assert init_cache(2, 2, 64, 576, jnp.bfloat16).nbytes == 2 * 2 * 64 * 1152


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_checkpoint(str(tmp_path_factory.mktemp("cache") / "tiny")))[1]


def test_engine_serves_from_an_fp8_cache(tiny, rng):
    """The engine with its cache a pytree of three stacked arrays: a precompiled step
    donates all three arrays (no copy), and asynchronous scheduling with preemption (4
    requests that need 13 blocks of 16 share 6) gives the synchronous tokens. The tokens'
    accuracy is test_hf.py's (logits against a float32 cache)."""
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 33, 9, 20)]

    def run(async_scheduling):
        engine = Engine(
            tiny,
            EngineConfig(
                num_blocks=6,
                max_num_batched_tokens=64,
                impl="reference",
                kv_cache_dtype="fp8",
                async_scheduling=async_scheduling,
            ),
            log=lambda _: None,
        )
        first = engine.runner.cache
        assert isinstance(first, fp8.Fp8Cache) and first.kv_c.dtype == fp8.FP8
        engine.precompile([[(20, 1), (20, 1), (0, 20)]])
        assert all(part.is_deleted() for part in first)  # donated, not copied
        requests = engine.generate([Request(p, 24, ignore_eos=True) for p in prompts])
        assert engine.schedulers[0].block_manager.num_free == 6 and engine.stats.preemptions > 0
        return [r.output_ids for r in requests]

    want = run(False)
    got = run(True)
    assert got == want and all(len(out) == 24 for out in got)


def test_engine_refuses_an_fp8_cache_the_triton_decode_cannot_index(tiny, monkeypatch):
    """On a GPU with the Triton decode, an FP8 cache whose stacked e4m3 latent fills (2 GiB,
    4 GiB] is refused when the engine is made, naming num_blocks and the nearest counts that
    work (a block of every layer: layers x 16 tokens x Lkv bytes); one block fewer than the
    lower bound's next is taken by the check. Off a GPU, or with the references, nothing is
    refused (they index it right)."""
    cfg = tiny.cfg
    block_bytes = cfg.num_layers * 16 * cfg.mla.kv_lora_rank
    below, above = 2**31 // block_bytes, 2**32 // block_bytes + 1
    config = EngineConfig(num_blocks=below + 1, impl="triton", kv_cache_dtype="fp8")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    message = rf"num_blocks {below + 1} with kv_cache_dtype='fp8'.*<= {below} or >= {above}"
    with pytest.raises(ValueError, match=message):
        Engine(tiny, config, log=lambda _: None)
    with pytest.raises(ValueError, match=f"num_blocks {above - 1} "):
        Engine(tiny, dataclasses.replace(config, num_blocks=above - 1), log=lambda _: None)
    engine_module._refuse_unindexable_fp8_cache(
        dataclasses.replace(config, num_blocks=below), cfg, jnp.bfloat16
    )
    engine_module._refuse_unindexable_fp8_cache(
        dataclasses.replace(config, num_blocks=above), cfg, jnp.bfloat16
    )
    engine_module._refuse_unindexable_fp8_cache(
        dataclasses.replace(config, impl="reference"), cfg, jnp.bfloat16
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    engine_module._refuse_unindexable_fp8_cache(config, cfg, jnp.bfloat16)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "int8", "float16", "fp16"])
def test_unsupported_cache_dtypes_are_refused(name):
    accepted = "accepted are auto, bfloat16, float32, fp8"
    with pytest.raises(ValueError, match=f"unsupported kv cache dtype '{name}': {accepted}"):
        EngineConfig(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="unsupported cache dtype"):
        init_cache(1, 2, 4, 8, jnp.dtype(name) if name != "fp16" else jnp.float16)


def test_cache_dtype_names():
    assert cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert cache_dtype("float32", jnp.bfloat16) == jnp.float32
    assert cache_dtype("fp8", jnp.float32) == "fp8"
    with pytest.raises(ValueError, match="'auto' \\(the model's float16\\)"):
        cache_dtype("auto", jnp.float16)


@triton_lowering_without_gpu
def test_triton_decode_lowers_for_cuda():
    """The Triton decode over an FP8 cache, lowered for a GPU on any machine (interpret mode
    runs its ops as jnp, so only a lowering meets Pallas' Triton rules there); Triton's
    compile needs the GPU."""
    config = decode.DecodeConfig.for_shape(16, 2)
    f = jax.jit(
        lambda q_lat, q_pe, cache, table, lens: decode.mla_decode(
            q_lat, q_pe, cache, table, lens, scale=0.07, config=config, interpret=False
        )
    )
    args = _abstract_decode_args(blocks=8)
    assert "triton" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract_decode_args(blocks: int, b: int = 2, n: int = 16) -> tuple:
    """Abstract ``mla_decode`` arguments over an FP8 cache of ``blocks`` pages of 64 tokens
    (DeepSeek's 512 + 64), ``b`` requests of ``n`` heads, tables 4 pages wide."""
    lkv, r, page = 512, 64, 64
    cache = fp8.Fp8Cache(
        jax.ShapeDtypeStruct((blocks, page, lkv), fp8.FP8),
        jax.ShapeDtypeStruct((blocks, page, r), jnp.bfloat16),
        jax.ShapeDtypeStruct((blocks, page, fp8.num_groups(lkv)), jnp.float32),
    )
    return (
        jax.ShapeDtypeStruct((b, n, lkv), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, n, r), jnp.bfloat16),
        cache,
        jax.ShapeDtypeStruct((b, 4), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )


@pytest.mark.parametrize(("blocks", "refused"), [(65536, False), (65537, True), (131073, False)])
def test_triton_decode_refuses_wrapping_offsets(blocks, refused):
    """The Triton decode refuses an FP8 cache whose e4m3 latent fills (2 GiB, 4 GiB] (a
    stacked cache's ``L x blocks`` as ``LayerView`` passes it): its lowering would index it
    with 32-bit offsets that wrap past 2 GiB (``fp8.check_triton_indexable``). 65536 pages
    of 64 x 512 are exactly 2^31 bytes; 131073 are past 2^32 (64-bit offsets). Interpret
    mode indexes it right and takes it."""

    def run(interpret):
        return jax.eval_shape(
            lambda q_lat, q_pe, cache, table, lens: decode.mla_decode(
                q_lat, q_pe, cache, table, lens, scale=0.07, interpret=interpret
            ),
            *_abstract_decode_args(blocks),
        )

    refused_only_compiled(run, refused, r"kv_cache.kv_c float8_e4m3fn\[65537, 64, 512\]")


@pytest.mark.parametrize(
    ("heads", "block_size", "dtype", "refused"),
    [
        (128, 64, jnp.bfloat16, False),  # every decode on the Mosaic GPU kernel
        (16, 64, jnp.bfloat16, True),  # small batches on the Triton one
        (128, 16, jnp.bfloat16, True),  # pages the Mosaic GPU kernel does not run
        (128, 64, jnp.float32, True),  # a float32 model: Triton
    ],
)
def test_fp8_cache_refusal_follows_the_hopper_decode(
    heads, block_size, dtype, refused, monkeypatch
):
    """On Hopper (the Mosaic GPU set) the engine refuses the (2 GiB, 4 GiB] FP8 cache only
    where the Triton decode may run: under 64 heads a device, or where the Mosaic GPU kernel
    does not run the inputs (``pallas_mosaic_gpu.unsupported``), as ``_hopper_decode`` picks."""
    from types import SimpleNamespace

    from mla_jax import kernels
    from mla_jax.kernels import mosaic_gpu
    from mla_jax.model.config import preset

    mla = dataclasses.replace(preset("deepseek-v3"), num_heads=heads)
    model_cfg = SimpleNamespace(mla=mla, num_layers=61)
    block_bytes = 61 * block_size * mla.kv_lora_rank
    config = EngineConfig(
        block_size=block_size, num_blocks=2**31 // block_bytes + 1, kv_cache_dtype="fp8"
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "select", lambda impl: kernels.MOSAIC_GPU)
    monkeypatch.setattr(mosaic_gpu, "device_unsupported", lambda: None)
    if refused:
        with pytest.raises(ValueError, match="with kv_cache_dtype='fp8'"):
            engine_module._refuse_unindexable_fp8_cache(config, model_cfg, dtype)
    else:
        engine_module._refuse_unindexable_fp8_cache(config, model_cfg, dtype)


def test_engine_refuses_latents_past_the_float16_decode(tiny, monkeypatch):
    """With the Mosaic GPU set, the engine refuses an FP8 cache when the model's
    kv_a_layernorm weights let a latent value pass what the decode's float16 wgmmas hold
    (scales above 2^7), and takes one whose bound is just inside (1% and 2% off, past the
    weights' bf16 rounding); the Triton set is not checked."""
    from flax import nnx

    from mla_jax import kernels
    from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic

    rank = tiny.cfg.mla.kv_lora_rank
    inside = mosaic.FLOAT16_MAX_LATENT / mosaic.float16_latent_bound(1.0, rank) * 0.99
    config = EngineConfig(num_blocks=64, impl="mosaic_gpu", kv_cache_dtype="fp8")
    sets = {"mosaic_gpu": kernels.MOSAIC_GPU, "triton": kernels.TRITON}
    monkeypatch.setattr(kernels, "select", sets.get)
    norms = [node for path, node in nnx.iter_graph(tiny) if path and path[-1] == "kv_a_layernorm"]
    assert norms
    saved = [n.weight[...] for n in norms]
    try:
        norms[-1].weight[...] = saved[-1].at[..., 3].set(-inside)
        engine_module._refuse_float16_overflow(config, tiny)
        norms[-1].weight[...] = saved[-1].at[..., 3].set(-inside * 1.02)
        with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8': kv_a_layernorm weights up"):
            engine_module._refuse_float16_overflow(config, tiny)
        engine_module._refuse_float16_overflow(dataclasses.replace(config, impl="triton"), tiny)
    finally:
        for n, w in zip(norms, saved, strict=True):
            n.weight[...] = w


def test_float16_latent_bound_holds(rng):
    """float16_latent_bound bounds what kv_a_layernorm's RMSNorm can output: a latent that
    is one spike (the worst case, |x_i| / rms(x) = sqrt(n)) times the largest weight stays
    within it, and quantizes to scales of at most FLOAT16_MAX_SCALE at the bound's edge."""
    from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic
    from mla_jax.model.layers import RMSNorm

    rank = 512
    weight = mosaic.FLOAT16_MAX_LATENT / mosaic.float16_latent_bound(1.0, rank)
    norm = RMSNorm(rank, 0.0, param_dtype=jnp.bfloat16)
    norm.weight[...] = jnp.full((rank,), weight, jnp.bfloat16)
    row = jnp.asarray(rng.normal(size=rank), jnp.bfloat16)
    x = jnp.zeros((2, rank), jnp.bfloat16).at[0, 7].set(3.0).at[1].set(row)
    latent = norm(x)
    bound = mosaic.float16_latent_bound(float(norm.weight[...].max()), rank)
    assert float(jnp.abs(latent.astype(jnp.float32)).max()) <= bound <= mosaic.FLOAT16_MAX_LATENT
    _, scales = fp8.quantize(latent)
    assert float(scales.max()) <= mosaic.FLOAT16_MAX_SCALE
