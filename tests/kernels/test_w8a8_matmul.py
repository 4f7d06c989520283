"""The w8a8 matmul (``kernels/w8a8_matmul``) against float64 NumPy: the activations quantized
in NumPy from DeepSeek's formula (a float32 scale ``amax / 448`` per row and 128 columns,
values rounded to e4m3), both operands dequantized in float64, one product. The Mosaic GPU
kernel runs interpreted on the CPU (jax >= 0.11) and compiled on a GPU.

Tolerance: each output element within one bf16 spacing of the exact product of the quantized
operands, plus the accumulation's bound: e4m3 values are exact products, the scales multiply
each 128-deep step's sum, the steps are summed in float32 and the result is rounded once into
bf16. Interpreted, the sums are float32's: ``ACCUMULATION`` (2^-20) of sum |x||w| over K.
Hopper's e4m3 wgmma keeps about 14 bits of its running sum (DeepSeek-V3's report, 3.3.2: why
each step is its own wgmma here): each step's sum is off by up to ``WGMMA_STEP`` (2^-12) of
its own sum |x||w|, independently of the other steps', so the bound on a GPU is that
fraction of the steps' sums combined in L2: a statistical bound (the worst case adds the
steps' bounds), which holds with a margin of 1.38 where the steps are fewest. Compiled on an
H100 (2026-12-06, three seeds) the worst error past the bf16 spacing was at most 1.77e-4
(2^-12.5) of that L2 sum at K = 256 (two steps, 192,000 outputs of 300 x 640) and 7.5e-5
at K = 1024 and 7168; a bound of 2^-14 of the plain sum failed at K = 256 (1.25e-4 of it
there, 1.0e-5 at K = 7168).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mosaic_gpu_runs
from test_quantize_rows import quantized_rows

from mla_jax.kernels import quantize_rows
from mla_jax.kernels import w8a8_matmul as w8a8
from mla_jax.kernels.w8a8_matmul import pallas_mosaic_gpu as mosaic

BF16 = jnp.bfloat16
FP8 = jnp.float8_e4m3fn
Config = w8a8.W8A8MatmulConfig
ACCUMULATION = 2.0**-20
WGMMA_STEP = 2.0**-12


def _quantized_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] quantized per row and 128 columns, as float64 (``quantized_rows``)."""
    values, scales = quantized_rows(x)
    return values.astype(np.float64) * np.repeat(scales, 128, axis=1)


def _case(rng, m, k, n):
    """bf16 x [m, k] (one 128-column group of zeros in row 0, one whose amax / 448 is a power
    of two in row 1 where there is one), an e4m3 weight [n, k] spanning
    its range, random float32 block scales, and the weight's exact float64 value."""
    x = rng.standard_normal((m, k))
    x[0, :128] = 0.0
    if m > 1:
        x[1, 128:256] = np.clip(x[1, 128:256], -3.0, 3.0)
        x[1, 130] = 3.5  # 448 x 2^-7: its own scale's top value, 448
    x = jnp.asarray(x, BF16)
    weight = jnp.asarray(np.clip(rng.standard_normal((n, k)) * 64, -448, 448), FP8)
    scale_inv = rng.uniform(0.5, 2.0, (n // 128, k // 128)).astype(np.float32) / 64 / k**0.5
    exact = np.asarray(weight, np.float64) * np.kron(scale_inv, np.ones((128, 128)))
    return x, weight, jnp.asarray(scale_inv), exact


def _check(got, x, exact_weight, *, quantized=True, accumulation=None):
    """``got [M, N]`` against x (``quantized``: rounded as w8a8 rounds it) times the exact
    weight, in float64: within one bf16 spacing plus the accumulation's bound, a fraction
    ``accumulation`` of sum |x||w| where given (else ``ACCUMULATION`` of it interpreted, and
    compiled ``WGMMA_STEP`` of the 128-deep steps' sums |x||w| combined in L2)."""
    lhs = np.asarray(x, np.float32).astype(np.float64)
    lhs = _quantized_rows(lhs) if quantized else lhs
    want = lhs @ exact_weight.T
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) * 2.0**16
    magnitudes, weight_magnitudes = np.abs(lhs), np.abs(exact_weight)
    if accumulation is None and jax.default_backend() == "gpu":
        steps = range(0, lhs.shape[1], 128)
        step_sums = (
            magnitudes[:, s : s + 128] @ weight_magnitudes[:, s : s + 128].T for s in steps
        )
        rounding = WGMMA_STEP * np.sqrt(sum(step_sum**2 for step_sum in step_sums))
    else:
        accumulation = ACCUMULATION if accumulation is None else accumulation
        rounding = accumulation * (magnitudes @ weight_magnitudes.T)
    excess = np.abs(got - want) - spacing - rounding
    assert np.isfinite(got).all() and excess.max() <= 0, f"worst excess {excess.max():.3g}"


@mosaic_gpu_runs
@pytest.mark.parametrize(
    "m,k,n,config",
    [
        (1, 256, 128, None),  # the launch's own slices, one row
        (5, 384, 256, Config(splits=3)),  # three slices of a step each, float32 parts
        (64, 512, 128, Config(stages=2, splits=2)),  # a full tile, two stages of two steps
        (64, 512, 128, Config(depth=1, splits=1)),  # a product a pipeline step
        (130, 256, 256, Config(stages=2)),  # 128-row tiles (two warpgroups), the last of 2 rows
        (130, 256, 256, Config(splits=1)),  # one slice: the output in bf16 from the kernel
        # 3 row tiles x 5 column blocks in bands of 2, 2 and 1: every tile written once
        (300, 256, 640, Config(band=2, splits=1)),
    ],
)
def test_matches_float64(rng, m, k, n, config):
    x, weight, scale_inv, exact = _case(rng, m, k, n)
    _check(w8a8.w8a8_matmul(x, weight, scale_inv, config=config), x, exact)


@mosaic_gpu_runs
@pytest.mark.parametrize("traced", [False, True])
def test_stacked_weight_at_layer(rng, traced):
    """A stack ``[L, N, K]`` read at ``layer`` (a Python int, or traced as a scan's index):
    the other layers hold NaN, which any read of them would put into the product."""
    x, weight, scale_inv, exact = _case(rng, 3, 256, 256)
    poison = jnp.full_like(weight, jnp.nan)
    stack = jnp.stack([poison, weight, poison])
    scales = jnp.stack([jnp.full_like(scale_inv, jnp.nan), scale_inv, scale_inv])
    if traced:
        run = jax.jit(lambda x, w, s, i: w8a8.w8a8_matmul(x, w, s, layer=i))
        got = run(x, stack, scales, jnp.int32(1))
    else:
        got = w8a8.w8a8_matmul(x, stack, scales, layer=1)
    _check(got, x, exact)
    _check(w8a8.reference.w8a8_matmul(x, stack, scales, layer=1), x, exact)


def test_reference_matches_float64(rng):
    x, weight, scale_inv, exact = _case(rng, 7, 384, 256)
    _check(w8a8.reference.w8a8_matmul(x, weight, scale_inv), x, exact)


def test_quantization_error_against_bf16_activations(rng):
    """What w8a8 trades: against the bf16 activations' product the e4m3 rounding of x costs
    about 2.5% (relative L2) on normal inputs; measured here so that a change in the
    quantization shows."""
    x, weight, scale_inv, exact = _case(rng, 16, 1024, 256)
    got = np.asarray(w8a8.reference.w8a8_matmul(x, weight, scale_inv), np.float64)
    want = np.asarray(x, np.float64) @ exact.T
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0.02 < error < 0.033, error


@mosaic_gpu_runs
def test_hopper_set_runs_projections_on_w8a8(rng, monkeypatch, caplog):
    """The Hopper set's FP8 matmul: a stack's traced layer on w8a8 at decode's rows and at
    more (the other layer NaN); float32 x, a weight of partial blocks, blocks other than
    128 x 128 and few rows of a shallow K on the Triton kernel (weight-only: the product of
    x as it is), the choices said once."""
    from mla_jax import kernels
    from mla_jax.kernels import fp8_blocks

    calls = []
    kernel = w8a8.w8a8_matmul
    monkeypatch.setattr(
        w8a8, "w8a8_matmul", lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    )

    def run(x, weight, scale_inv, layer, blocks):
        return kernels.MOSAIC_GPU.fp8_matmul(x, weight, scale_inv, blocks=blocks, layer=layer)

    run = jax.jit(run, static_argnames="blocks")
    whole = fp8_blocks.Fp8Blocks(128, 128)
    for m, n, blocks, dtype, on_w8a8 in (
        (w8a8.FEW_ROWS + 1, 256, whole, BF16, True),
        (w8a8.WARPGROUP_ROWS + 8, 256, whole, BF16, True),
        (16, 256, whole, jnp.float32, False),
        (16, 192, whole, BF16, False),
        (16, 256, fp8_blocks.Fp8Blocks(64, 128), BF16, False),
        (w8a8.FEW_ROWS, 256, whole, BF16, False),  # few rows of a shallow K
    ):
        calls.clear()
        x, weight, scale_inv, exact = _case(rng, m, 256, -(-n // 128) * 128)
        x = x.astype(dtype)
        weight, exact = weight[:n], exact[:n]  # 192: a partial block of 64 rows
        if blocks != whole:  # the same weight, its scales repeated per 64 rows
            scale_inv = jnp.repeat(scale_inv, 2, axis=0)
        stack = jnp.stack([jnp.full_like(weight, jnp.nan), weight])
        scales = jnp.stack([jnp.full_like(scale_inv, jnp.nan), scale_inv])
        with caplog.at_level("WARNING", logger="mla_jax.kernels"):
            got = run(x, stack, scales, jnp.int32(1), blocks)
        if on_w8a8:
            _check(got, x, exact)
        else:  # x as it is; the dequantized weight rounded to bf16 (half a spacing, 2^-9)
            _check(got, x, exact, quantized=False, accumulation=2.0**-9)
        assert calls == ([1] if on_w8a8 else []), (m, n, blocks, dtype)
    assert "fp8_matmul: w8a8 (x quantized to e4m3" in caplog.text
    assert "[192, 256] not on w8a8 (weight [192, 256] is not whole 128 x 128" in caplog.text
    assert f"{w8a8.FEW_ROWS} rows of depth 256: up to {w8a8.FEW_ROWS} of depth" in caplog.text
    assert "[256, 256] not on w8a8 (its weight blocks are not 128 x 128)" in caplog.text


@pytest.mark.parametrize(
    "m,k,n,num_sms,config,want",
    [
        (64, 16384, 7168, 132, Config(), 2),  # 56 column blocks: 112 programs
        (64, 7168, 18432, 132, Config(), 1),  # 144 column blocks: 144 programs
        (64, 7168, 1536, 132, Config(), 8),  # 12 column blocks: the most slices of 56 steps
        (64, 384, 128, 132, Config(), 1),  # 3 steps: of SPLITS only 1 divides them
        (64, 512, 128, 132, Config(splits=2), 2),
        (8192, 16384, 7168, 132, Config(), 1),  # 64 row tiles x 56 column blocks
        (256, 16384, 7168, 132, Config(), 1),  # 2 row tiles x 56: 112 programs
        (1, 16384, 7168, 66, Config(), 1),  # half the multiprocessors: 56 programs
    ],
)
def test_splits(m, k, n, num_sms, config, want):
    assert mosaic.splits(m, k, n, config, num_sms) == want


@pytest.mark.parametrize(
    "m,steps,slices,depth,want",
    [
        (64, 128, 4, 1, 6),  # 24.25 KB a step beside a 32 KB float32 tile: 6 fit
        (8192, 128, 1, 1, 5),  # 32.5 KB a step beside a 32 KB bf16 tile: 5 fit
        (8192, 128, 2, 1, 4),  # beside a 64 KB float32 tile: 4
        (64, 8, 4, 1, 2),  # a slice's 2 steps
        (64, 128, 4, 2, 3),  # two products a step, 48.5 KB: 3 fit
        (8192, 128, 1, 2, 2),  # 65 KB a step: 2 fit
        (64, 8, 4, 2, 1),  # a slice's 2 steps are one pipeline step
    ],
)
def test_stages(m, steps, slices, depth, want):
    assert mosaic.stages(m, steps, slices, Config(), depth) == want


@pytest.mark.parametrize("steps,depth,want", [(56, 2, 2), (3, 2, 1), (56, 1, 1)])
def test_step_depth(steps, depth, want):
    """Two products a pipeline step where a slice's steps are even, else one."""
    assert mosaic.step_depth(steps, Config(depth=depth)) == want


@pytest.mark.parametrize(
    "x,weight,scales,config,message",
    [
        ((0, 256), (128, 256), (1, 2), None, "x has no rows"),
        ((4, 256), (128, 384), (1, 3), None, r"x's K \(256\) is not the weight's \(384\)"),
        ((4, 200), (128, 200), (1, 2), None, r"weight \[128, 200\] is not whole 128 x 128"),
        ((4, 256), (128, 256), (2, 2), None, r"scale_inv \[2, 2\] is not the weight's block"),
        ((4, 256), (128, 256), (1, 2), Config(splits=3), "3 slices of K do not divide its 2"),
    ],
)
def test_refuses(x, weight, scales, config, message):
    args = (jnp.zeros(x, BF16), jnp.zeros(weight, FP8), jnp.ones(scales, jnp.float32))
    with pytest.raises(ValueError, match=message):
        w8a8.w8a8_matmul(*args, config=config)


def test_refuses_configs():
    with pytest.raises(ValueError, match="depth 1 or 2, got 6, 0 and 2"):
        Config(band=0)
    with pytest.raises(ValueError, match="depth 1 or 2, got 6, 8 and 3"):
        Config(depth=3)


def test_refuses_stacks_without_layer_and_layers_out_of_range():
    x, scales = jnp.zeros((4, 256), BF16), jnp.ones((2, 1, 2), jnp.float32)
    stack = jnp.zeros((2, 128, 256), FP8)
    with pytest.raises(ValueError, match=r"weight \[N, K\], got x"):
        w8a8.w8a8_matmul(x, stack, scales)
    with pytest.raises(ValueError, match="layer 2 is not in"):
        w8a8.w8a8_matmul(x, stack, scales, layer=2)
    with pytest.raises(ValueError, match=r"weight \[L, N, K\] \(a stack, with layer\)"):
        w8a8.w8a8_matmul(x, stack[0], scales[0], layer=0)


def test_refuses_dtypes():
    x, weight, scales = jnp.zeros((4, 256), BF16), jnp.zeros((128, 256), FP8), jnp.ones((1, 2))
    for args in ((x.astype(jnp.float32), weight, scales), (x, weight.astype(BF16), scales)):
        with pytest.raises(ValueError, match="bfloat16 x, a float8_e4m3fn weight and float32"):
            w8a8.w8a8_matmul(*args)


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11),
    reason="the Mosaic GPU lowering this kernel is written for needs jax >= 0.11",
)
@pytest.mark.parametrize("m", [64, 8192])
def test_lowers_for_sm90(m, monkeypatch):
    """The sm90 lowering (e4m3 wgmmas, TMA shapes, shared memory, the scales' row layout)
    of V3's o_proj at decode's 64 rows (slices of K, float32 parts) and a prefill's 8192
    (128-row tiles on two warpgroups, bf16 out), on any machine (jax 0.11, which the GPUs
    run, and 0.12); only ptxas and the run need the GPU. x is quantized by
    ``quantize_rows``' reference here: its Triton kernel lowers only where a GPU is."""
    monkeypatch.setattr(mosaic, "quantize_rows", quantize_rows.reference.quantize_rows)
    f = jax.jit(functools.partial(w8a8.w8a8_matmul, interpret=False))
    lowered = f.trace(
        jax.ShapeDtypeStruct((m, 16384), BF16),
        jax.ShapeDtypeStruct((7168, 16384), FP8),
        jax.ShapeDtypeStruct((56, 128), jnp.float32),
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11),
    reason="the Mosaic GPU lowering this kernel is written for needs jax >= 0.11",
)
@pytest.mark.parametrize("m", [512, 65536])
def test_grouped_lowers_for_sm90(m, monkeypatch):
    """The grouped form's sm90 lowering at V3's routed experts' gate_up (256 experts, 2048
    x 2 outputs) over decode's 64 tokens x 8 (64-row tiles) and a prefill's 8192 x 8 (x
    quantized by the reference, as above)."""
    monkeypatch.setattr(mosaic, "quantize_rows", quantize_rows.reference.quantize_rows)
    f = jax.jit(functools.partial(w8a8.grouped_w8a8_matmul, interpret=False))
    lowered = f.trace(
        jax.ShapeDtypeStruct((m, 7168), BF16),
        jax.ShapeDtypeStruct((256, 4096, 7168), FP8),
        jax.ShapeDtypeStruct((256, 32, 56), jnp.float32),
        jax.ShapeDtypeStruct((256,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, Config(splits=1)])
def test_prefill_rows_compiled(rng, config):
    """A prefill's 300 rows of V3's MLP gate_proj (three 128-row tiles on two warpgroups,
    the last partial), in slices of K (float32 parts) and in one (bf16 out)."""
    x, weight, scale_inv, exact = _case(rng, 300, 7168, 18432)
    _check(
        jax.jit(functools.partial(w8a8.w8a8_matmul, config=config))(x, weight, scale_inv), x, exact
    )


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(16384, 7168), (7168, 1536), (7168, 18432)])
def test_deepseek_shapes_compiled(rng, m, k, n):
    """V3's projections at decode's row counts (GPU only: too large to interpret)."""
    x, weight, scale_inv, exact = _case(rng, m, k, n)
    _check(jax.jit(w8a8.w8a8_matmul)(x, weight, scale_inv), x, exact)


def _grouped_case(rng, sizes, m, k, n, num_matrices, offset):
    """bf16 lhs [m, k], a stack of ``num_matrices`` e4m3 weights [n, k] with their scales, of
    which the groups ``sizes`` use ``offset`` on; the others hold NaN (weights and scales),
    which any read of them would put into the product. Returns the exact weights too."""
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    weights, scales, exact = [], [], []
    for g in range(num_matrices):
        _, weight, scale_inv, exact_weight = _case(rng, 1, k, n)
        if not offset <= g < offset + len(sizes):
            weight, scale_inv = jnp.full_like(weight, jnp.nan), jnp.full_like(scale_inv, jnp.nan)
        weights.append(weight)
        scales.append(scale_inv)
        exact.append(exact_weight)
    return x, jnp.stack(weights), jnp.stack(scales), exact


def _check_grouped(got, x, exact, sizes, offset, **kwargs):
    """Each group's rows against ``_check`` with its weight; the rows after the groups 0."""
    got = np.asarray(got, np.float64)
    assert got.shape == (x.shape[0], exact[0].shape[0])
    start = 0
    for g, size in enumerate(sizes):
        if size:
            rows = slice(start, start + size)
            _check(got[rows], x[rows], exact[offset + g], **kwargs)
        start += size
    assert not got[start:].any()


@mosaic_gpu_runs
@pytest.mark.parametrize(
    "sizes,m,k,n,offset",
    [
        # decode's few rows a group (64-row tiles), an empty group, 3 padding rows after
        ([2, 0, 5, 1], 11, 256, 256, 1),
        # 128-row tiles: a group across tiles from an unaligned row, one of a single row
        ([70, 1, 140], 215, 256, 128, 0),
    ],
)
def test_grouped_matches_float64(rng, sizes, m, k, n, offset):
    """Each group's rows times its own weight (the unused ones poisoned), the padding rows
    after the groups zero."""
    x, weights, scales, exact = _grouped_case(rng, sizes, m, k, n, offset + len(sizes) + 1, offset)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = w8a8.grouped_w8a8_matmul(x, weights, scales, group_sizes, group_offset=offset)
    _check_grouped(got, x, exact, sizes, offset)
    reference = w8a8.reference.grouped_w8a8_matmul(
        x, weights, scales, group_sizes, group_offset=offset
    )
    _check_grouped(reference, x, exact, sizes, offset)


@mosaic_gpu_runs
def test_grouped_traced_offset_and_sizes(rng):
    """Under jit, the group sizes and offset traced (as the MoE layer passes them)."""
    sizes = [3, 9]
    x, weights, scales, exact = _grouped_case(rng, sizes, 12, 128, 128, 4, 2)
    run = jax.jit(w8a8.grouped_w8a8_matmul)
    got = run(x, weights, scales, jnp.asarray(sizes, jnp.int32), group_offset=jnp.int32(2))
    _check_grouped(got, x, exact, sizes, 2)


@pytest.mark.parametrize(
    "m,groups,want", [(128, 2, 64), (128, 3, 64), (129, 2, 128), (65536, 256, 128)]
)
def test_grouped_row_tile(m, groups, want):
    assert w8a8.grouped_row_tile(m, groups) == want


@pytest.mark.parametrize(
    "weight,sizes,offset,config,message",
    [
        ((256, 128), [4], 0, None, r"weight \[G, N, K\]"),
        ((2, 256, 128), [4, 1, 1], 0, None, "G <= 2"),
        ((2, 256, 128), [4], 2, None, "group_offset 2"),
        ((2, 256, 128), [9], 0, None, "sum to at most 8 rows"),
        ((2, 256, 128), [4], 0, Config(splits=2), "2 slices of K"),
    ],
)
def test_grouped_refuses(weight, sizes, offset, config, message):
    x = jnp.zeros((8, 128), BF16)
    w = jnp.zeros(weight, FP8)
    s = jnp.ones((*weight[:-2], weight[-2] // 128, 1), jnp.float32)
    with pytest.raises(ValueError, match=message):
        w8a8.grouped_w8a8_matmul(
            x, w, s, jnp.asarray(sizes, jnp.int32), group_offset=offset, config=config
        )


@mosaic_gpu_runs
def test_hopper_set_runs_fp8_experts_on_w8a8(rng, monkeypatch, caplog):
    """The Hopper set's grouped matmul: FP8 experts (a stack of two layers', the other layer
    NaN, read at a traced offset) with bf16 rows on w8a8's grouped form; float32 rows and
    blocks other than 128 x 128 on the Triton kernel (weight-only: the rows as they are),
    the choices said once."""
    from mla_jax import kernels
    from mla_jax.kernels import fp8_blocks

    calls = []
    kernel = w8a8.grouped_w8a8_matmul
    monkeypatch.setattr(
        w8a8,
        "grouped_w8a8_matmul",
        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
    )

    def run(lhs, weights, scales, sizes, offset, blocks):
        return kernels.MOSAIC_GPU.grouped_matmul(
            lhs, weights, sizes, group_offset=offset, rhs_scale_inv=scales, blocks=blocks
        )

    run = jax.jit(run, static_argnames="blocks")
    sizes = [5, 0, 9]
    x, weights, scales, exact = _grouped_case(rng, sizes, 16, 256, 256, 6, 3)
    whole = fp8_blocks.Fp8Blocks(128, 128)
    for blocks, dtype, on_w8a8 in (
        (whole, BF16, True),
        (whole, jnp.float32, False),
        (fp8_blocks.Fp8Blocks(64, 128), BF16, False),
    ):
        calls.clear()
        # the same weights, their scales repeated per 64 rows for 64-row blocks
        grid = scales if blocks == whole else jnp.repeat(scales, 2, axis=1)
        with caplog.at_level("WARNING", logger="mla_jax.kernels"):
            got = run(
                x.astype(dtype),
                weights.reshape(2, 3, 256, 256),
                grid.reshape(2, 3, *grid.shape[1:]),
                jnp.asarray(sizes, jnp.int32),
                jnp.int32(3),
                blocks,
            )
        if on_w8a8:
            _check_grouped(got, x, exact, sizes, 3)
        else:  # the rows as they are; the weight rounded to bf16 (half a spacing, 2^-9)
            _check_grouped(got, x, exact, sizes, 3, quantized=False, accumulation=2.0**-9)
        assert calls == ([1] if on_w8a8 else []), (blocks, dtype)
    assert "grouped_matmul: w8a8 (rows quantized to e4m3" in caplog.text
    assert "not on w8a8 (its weight blocks are not 128 x 128)" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(7168, 512), (2048, 1024)])
def test_grouped_deepseek_depths_compiled(rng, k, n):
    """V3's experts' depths (gate_up's 7168, down's 2048) over 8 experts with ragged rows:
    groups over several 128-row tiles, one of a row, an empty one, padding rows after them
    (GPU only: too large to interpret)."""
    sizes = [300, 0, 1, 129, 400, 64, 7, 250]
    x, weights, scales, exact = _grouped_case(rng, sizes, sum(sizes) + 5, k, n, 8, 0)
    run = jax.jit(w8a8.grouped_w8a8_matmul)
    _check_grouped(run(x, weights, scales, jnp.asarray(sizes, jnp.int32)), x, exact, sizes, 0)
