"""The FP8 weight-only matmuls (``fp8_matmul``, and ``grouped_matmul`` with an FP8 rhs: the
Pallas kernels interpreted, and their references) against float64 NumPy: the weight
dequantized in float64 from its fp8 values and block scales (``cdiv`` grids with partial
edge blocks, the fused gate_up's two grids), then multiplied. Both take the weights and
their scale grids in HF's layout, ``[N, K]`` and ``[N-grid, K-grid]`` (a stack of them for
the grouped matmul): the oracle dequantizes them from the ``[K, N]`` arrays they were
transposed from.

Tolerances (max abs error over max |oracle|): float32 activations 1e-6 (float32 products of
exactly dequantized tiles; measured <= 6e-7 over seeds 0-2), bfloat16 7e-3 (bf16 rounding
of x, of the dequantized tile and of the output; measured <= 4.1e-3).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import refused_only_compiled, triton_lowering_without_gpu

from mla_jax.kernels import fp8_blocks, tuned
from mla_jax.kernels import fp8_matmul as fm
from mla_jax.kernels import grouped_matmul as gm

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 7e-3}
MATMULS = {
    "pallas": fm.fp8_matmul,
    "reference": fm.reference.fp8_matmul,
    "fastest": fm.fastest,
    "dequantized_dot": lambda x, w, s, *, blocks, layer=None, config=None: (
        fm.reference.dequantized_dot(x, w, s, blocks=blocks, layer=layer)
    ),
}
GROUPED = {"pallas": gm.grouped_matmul, "reference": gm.reference.grouped_matmul}


def _numpy_dequantize(weight, scale_inv, blocks: fp8_blocks.Fp8Blocks) -> np.ndarray:
    """float64 ``[K, N]`` from an fp8 weight and its scales, block by block."""
    weight = np.asarray(weight).astype(np.float64)
    scale_inv = np.asarray(scale_inv, np.float64)
    depth, width = weight.shape
    part = width // blocks.parts
    per_part = -(-part // blocks.block_out)
    out = np.empty_like(weight)
    for k in range(depth):
        for n in range(width):
            column = (n // part) * per_part + (n % part) // blocks.block_out
            out[k, n] = weight[k, n] * scale_inv[k // blocks.block_in, column]
    return out


def _fp8_weight(rng, shape, blocks: fp8_blocks.Fp8Blocks):
    """Random fp8 values over e4m3's range and random positive block scales."""
    weight = np.asarray(rng.uniform(-448, 448, shape), ml_dtypes.float8_e4m3fn)
    *lead, depth, width = shape
    grid = (*lead, *blocks.scale_shape(depth, width))
    scale = rng.uniform(0.5, 2.0, grid) / (448 * np.sqrt(depth))
    return jnp.asarray(weight), jnp.asarray(scale, jnp.float32)


def _fp8_weight_nk(rng, shape, blocks: fp8_blocks.Fp8Blocks):
    """``_fp8_weight``'s ``[..., K, N]`` values and scales for ``shape [..., K, N]``,
    transposed into HF's layout: ``weight [..., N, K]``, ``scale_inv [..., N-grid,
    K-grid]``."""
    weight, scale = _fp8_weight(rng, shape, blocks)
    return jnp.swapaxes(weight, -1, -2), jnp.swapaxes(scale, -1, -2)


def _oracle_nk(x, weight, scale_inv, blocks: fp8_blocks.Fp8Blocks) -> np.ndarray:
    """float64 ``x [M, K] @ W^T`` for ``weight [N, K]`` and its ``[N-grid, K-grid]`` scales
    (``_fp8_weight_nk``'s): dequantized as the ``[K, N]`` arrays they were made from."""
    dense = _numpy_dequantize(np.asarray(weight).T, np.asarray(scale_inv).T, blocks)
    return np.asarray(x, np.float64) @ dense


def _grouped_oracle(lhs, weight, scale, sizes, blocks) -> np.ndarray:
    """float64 ``[sum(sizes), N]``: each group's rows of ``lhs`` times its dequantized
    weight (``weight [G, N, K]``, ``scale [G, N-grid, K-grid]``, ``_fp8_weight_nk``'s)."""
    want, start = np.zeros((sum(sizes), weight.shape[-2])), 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        want[rows] = _oracle_nk(lhs[rows], weight[g], scale[g], blocks)
        start += size
    return want


def _check(got, want, dtype):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / np.abs(want).max() < TOL[dtype]


def _spread_rows(rng, m: int, k: int) -> jnp.ndarray:
    """bf16 rows of magnitudes from 1e-8 to 1e8, past float16's range (65504) at the top and
    in its subnormals at the bottom: the float16 MMA must scale each row into range."""
    scale = np.logspace(-8, 8, m)[:, None]
    return jnp.asarray(rng.standard_normal((m, k)) * scale, jnp.bfloat16)


def _row_errors(got, want) -> np.ndarray:
    """Max abs error of each row over that row's max |oracle| (the rows' scales differ by
    16 orders of magnitude, so one global ratio would only test the largest)."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


# (M, K, N, blocks (bo, bi, parts), config): DeepSeek's 128 x 128 on a K that is no
# multiple of the block; the test checkpoint's 16 x 8 (blocks narrower than a K step: a scale
# per element); a fused gate_up of two grids whose width is no multiple of the block; split
# K; axes under 16 (padded).
CASES = {
    "deepseek-blocks": (5, 200, 160, (128, 128, 1), None),
    "narrow-blocks": (9, 40, 48, (16, 8, 1), None),
    "fused-parts": (33, 64, 48, (16, 16, 2), fm.Fp8MatmulConfig(16, 16, 16, 1, 4, 2)),
    "split-k": (3, 100, 72, (16, 32, 1), fm.Fp8MatmulConfig(16, 32, 16, 3, 4, 2)),
    "prefill-tiles": (130, 96, 40, (32, 32, 1), fm.Fp8MatmulConfig(32, 16, 32, 1, 4, 2)),
    "tiny": (2, 8, 12, (16, 8, 1), None),
    # Scales on each step's product (the tile only converted) on a K and an N that are no
    # multiples of the tiles, and the weight tile as the MMA's left operand.
    "scale-product": (
        21,
        100,
        72,
        (16, 32, 1),
        fm.Fp8MatmulConfig(16, 32, 16, 2, 4, 2, scale_product=True),
    ),
    "swap-ab": (
        21,
        100,
        72,
        (16, 32, 1),
        fm.Fp8MatmulConfig(32, 16, 32, 1, 4, 2, scale_product=True, swap_ab=True),
    ),
    # The weight tile as the MMA's left operand, dequantized whole (a scale per element of
    # a fused weight's two grids).
    "swap-ab-dequantized": (
        9,
        40,
        48,
        (16, 8, 2),
        fm.Fp8MatmulConfig(16, 16, 16, 2, 4, 2, swap_ab=True),
    ),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", list(MATMULS))
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_matmul(case, impl, dtype, rng):
    m, k, n, (bo, bi, parts), config = CASES[case]
    blocks = fp8_blocks.Fp8Blocks(bo, bi, parts)
    weight, scale = _fp8_weight_nk(rng, (k, n), blocks)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    kwargs = {"config": config} if config else {}
    got = MATMULS[impl](x, weight, scale, blocks=blocks, **kwargs)
    assert got.shape == (m, n) and got.dtype == dtype
    _check(got, _oracle_nk(x, weight, scale, blocks), dtype)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "static"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", list(MATMULS))
def test_fp8_matmul_reads_a_stacked_layer(impl, dtype, traced, rng):
    """A stack of layers' weights ``[L, N, K]`` with ``layer`` (traced, as under a scan over
    layers, or a Python int): that layer's product; the other layers' weights and scales are
    NaN, so a read of them would show."""
    m, k, n, layers = 5, 100, 72, 3
    blocks = fp8_blocks.Fp8Blocks(16, 32)
    weight, scale = _fp8_weight_nk(rng, (layers, k, n), blocks)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if traced:
        run = jax.jit(lambda x, w, s, layer: MATMULS[impl](x, w, s, blocks=blocks, layer=layer))
    else:
        run = functools.partial(MATMULS[impl], blocks=blocks)
    for layer in (0, layers - 1):
        others = np.arange(layers) != layer
        poisoned = weight.at[others].set(jnp.nan), scale.at[others].set(jnp.nan)
        got = run(x, *poisoned, layer=jnp.int32(layer) if traced else layer)
        assert got.shape == (m, n) and got.dtype == dtype
        _check(got, _oracle_nk(x, weight[layer], scale[layer], blocks), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", list(GROUPED))
def test_grouped_matmul_fp8_experts(impl, dtype, rng):
    """The experts outside the layer's (and for the kernel, the layer's experts 1 and 4,
    chosen by no row: ``ragged_dot`` multiplies every group) are poisoned: NaN fp8 weights
    and NaN scales, which a read would spread to the output."""
    sizes, offset, depth, width = [5, 0, 37, 1, 0, 20], 6, 40, 48
    blocks = fp8_blocks.Fp8Blocks(16, 8, parts=2)
    num = offset + len(sizes) + 2
    weight, scale = _fp8_weight_nk(rng, (num, depth, width), blocks)
    used = (0, 2, 3, 5) if impl == "pallas" else range(len(sizes))
    unused = [g for g in range(num) if g - offset not in used]
    weight = weight.at[jnp.asarray(unused)].set(jnp.nan)
    scale = scale.at[jnp.asarray(unused)].set(jnp.nan)
    rows = sum(sizes) + 3  # padding rows after the groups
    lhs = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    got = GROUPED[impl](
        lhs,
        weight,
        jnp.asarray(sizes, jnp.int32),
        group_offset=offset,
        rhs_scale_inv=scale,
        blocks=blocks,
    )
    want = np.zeros((rows, width))
    live = [g for g, size in enumerate(sizes) if size]
    want[: sum(sizes)] = _grouped_oracle(
        lhs,
        weight[offset + jnp.asarray(live)],
        scale[offset + jnp.asarray(live)],
        [sizes[g] for g in live],
        blocks,
    )
    _check(got, want, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[sum(sizes) :], 0)


@pytest.mark.parametrize("variant", ["scale_product", "swap_ab", "float16_mma"])
def test_grouped_matmul_fp8_variants(variant, rng):
    """FP8 experts with the scales on each step's product: the tile only converted, or also
    as the MMA's left operand, or in float16 against bf16 rows of 16 orders of magnitude
    (each row within bf16's tolerance of float64); a K that is no multiple of the step, a
    fused gate_up's two grids, padding rows after the groups (0)."""
    sizes, depth, width = [5, 0, 19, 3], 72, 48
    blocks = fp8_blocks.Fp8Blocks(16, 16, parts=2)
    weight, scale = _fp8_weight_nk(rng, (len(sizes), depth, width), blocks)
    rows = sum(sizes) + 2
    if variant == "float16_mma":
        dtype, lhs = jnp.bfloat16, _spread_rows(rng, rows, depth)
    else:
        dtype, lhs = jnp.float32, jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)
    config = gm.GroupedMatmulConfig(
        16,
        16,
        16,
        4,
        2,
        scale_product=variant != "float16_mma",
        swap_ab=variant == "swap_ab",
        float16_mma=variant == "float16_mma",
    )
    got = gm.grouped_matmul(
        lhs,
        weight,
        jnp.asarray(sizes, jnp.int32),
        rhs_scale_inv=scale,
        blocks=blocks,
        config=config,
    )
    want = _grouped_oracle(lhs, weight, scale, sizes, blocks)
    assert _row_errors(got[: sum(sizes)], want).max() < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(got, np.float32)[sum(sizes) :], 0)


def test_fastest_picks_by_rows(monkeypatch):
    """``fastest`` runs the Pallas kernel up to ``PALLAS_MAX_ROWS`` rows (or with a config),
    the dequantized dot above them: static, by shape."""
    calls = []
    monkeypatch.setattr(fm, "fp8_matmul", lambda *a, **k: calls.append("pallas"))
    monkeypatch.setattr(
        fm.reference, "dequantized_dot", lambda *a, **k: calls.append("dequantized")
    )
    blocks = fp8_blocks.Fp8Blocks(16, 16)
    weight, scale = jnp.zeros((16, 32), jnp.float8_e4m3fn), jnp.ones((1, 2), jnp.float32)
    for rows in (1, fm.PALLAS_MAX_ROWS, fm.PALLAS_MAX_ROWS + 1):
        fm.fastest(jnp.zeros((rows, 32), jnp.float32), weight, scale, blocks=blocks)
    config = fm.Fp8MatmulConfig()
    x = jnp.zeros((fm.PALLAS_MAX_ROWS + 1, 32), jnp.float32)
    fm.fastest(x, weight, scale, blocks=blocks, config=config)
    assert calls == ["pallas", "pallas", "dequantized", "pallas"]


def test_fastest_copies_out_a_layer_only_where_triton_would_wrap(monkeypatch):
    """``fastest`` hands the compiled kernel a stack and its ``layer`` (read in place),
    except a stack in (2 GiB, 4 GiB], whose layer it slices out (the kernel would index the
    stack with wrapping offsets: ``fp8.check_triton_indexable``); interpreted, the stack."""
    given = []

    def kernel(x, w, s, *, layer, **kwargs):
        given.append((w.ndim, layer is None))
        return jnp.zeros((x.shape[0], w.shape[-2]), x.dtype)

    monkeypatch.setattr(fm, "fp8_matmul", kernel)
    blocks = fp8_blocks.Fp8Blocks(128, 128)
    x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
    for layers, interpret in ((3, False), (130, False), (130, True)):  # 0.05 GB, 2.18 GB
        weight = jax.ShapeDtypeStruct((layers, 4096, 4096), fp8_blocks.FP8)
        scales = jax.ShapeDtypeStruct((layers, 32, 32), jnp.float32)
        jax.eval_shape(
            lambda x, w, s, i=interpret: fm.fastest(
                x, w, s, blocks=blocks, layer=jnp.int32(1), interpret=i
            ),
            x,
            weight,
            scales,
        )
    assert given == [(3, False), (2, True), (3, False)]


def test_tuned_configs_are_used(monkeypatch):
    """``for_shape`` takes a measured config for its shape from ``kernels.tuned`` and falls
    back on its rules for the others; the committed tables hold valid configs."""
    for fields in tuned.FP8_MATMUL.values():
        fm.Fp8MatmulConfig(**fields)
    for fields in tuned.GROUPED_FP8.values():
        gm.GroupedMatmulConfig(**fields)
    mine = fm.Fp8MatmulConfig(16, 32, 64, 5, 2, 3, scale_product=True)
    monkeypatch.setattr(tuned, "FP8_MATMUL", {"16x640x96": dataclasses.asdict(mine)})
    assert fm.Fp8MatmulConfig.for_shape(3, 640, 96) == mine
    assert fm.Fp8MatmulConfig.for_shape(3, 640, 112).block_n == 64
    assert fm.Fp8MatmulConfig.for_shape(300, 640, 96) == fm.Fp8MatmulConfig()
    grouped = gm.GroupedMatmulConfig(16, 64, 128, 4, 6, swap_ab=True)
    monkeypatch.setattr(tuned, "GROUPED_FP8", {"decodex64x96": dataclasses.asdict(grouped)})
    assert gm.GroupedMatmulConfig.for_shape(20, 8, 64, 96, fp8=True) == grouped
    assert gm.GroupedMatmulConfig.for_shape(20, 8, 64, 96) != grouped  # bf16 weights
    prefill = gm.GroupedMatmulConfig.for_shape(2000, 8, 64, 96)  # the rules, bf16 weights
    assert gm.GroupedMatmulConfig.for_shape(2000, 8, 64, 96, fp8=True) == prefill


def test_fp8_inputs_refused():
    """One-line errors naming the argument, shapes as given: the ``[N, K]`` weight's
    ``[N-grid, K-grid]`` scales expected, a ``[K, N]`` weight refused."""
    blocks = fp8_blocks.Fp8Blocks(16, 16)
    x = jnp.zeros((4, 32), jnp.float32)
    weight, scales = jnp.zeros((48, 32), jnp.float8_e4m3fn), jnp.ones((3, 2), jnp.float32)
    fit = r"weight scale_inv \[2, 3\] does not fit \[48, 32\] with .* \(expected \[3, 2\]\)"
    with pytest.raises(ValueError, match=fit):
        fm.fp8_matmul(x, weight, scales.T, blocks=blocks)
    with pytest.raises(ValueError, match="float8_e4m3fn with float32 scales"):
        fm.fp8_matmul(x, weight.astype(jnp.float32), scales, blocks=blocks)
    with pytest.raises(ValueError, match=r"weight \[48, 32\]: N is not 5 equal parts"):
        fm.fp8_matmul(x, weight, scales, blocks=fp8_blocks.Fp8Blocks(16, 16, parts=5))
    with pytest.raises(ValueError, match=r"weight \(32, 48\) \[N, K\]"):  # [K, N]
        fm.reference.fp8_matmul(x, weight.T, scales.T, blocks=blocks)
    with pytest.raises(ValueError, match=r"weight \(1, 48, 32\) \[N, K\]"):
        fm.fp8_matmul(x, weight[None], scales[None], blocks=blocks)
    with pytest.raises(ValueError, match=r"weight \(48, 32\) \[L, N, K\] \(a stack"):
        fm.fp8_matmul(x, weight, scales, blocks=blocks, layer=0)
    stack, stack_scales = weight[None], scales[None]
    with pytest.raises(ValueError, match=r"layer 1 is not in \[0, 1\)"):
        fm.reference.fp8_matmul(x, stack, stack_scales, blocks=blocks, layer=1)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        fm.fp8_matmul(x, stack, stack_scales, blocks=blocks, layer=jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="rhs_scale_inv and blocks go together"):
        gm.grouped_matmul(x, weight.T[None], jnp.asarray([4], jnp.int32), blocks=blocks)


@triton_lowering_without_gpu
def test_kernels_lower_for_cuda():
    """The dense and grouped kernels' Triton lowering for a GPU, run on any machine
    (interpret mode runs their ops as jnp, so only a lowering meets Pallas' Triton rules
    there); Triton's compile needs the GPU."""
    blocks = fp8_blocks.Fp8Blocks(128, 128)
    weight = jax.ShapeDtypeStruct((256, 512), fp8_blocks.FP8)  # [N, K]
    scales = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    dense = functools.partial(
        fm.fp8_matmul,
        blocks=blocks,
        config=fm.Fp8MatmulConfig(16, 64, 128, 2, 4, 4),
        interpret=False,
    )
    variants = [
        dict(scale_product=True, swap_ab=True),
        dict(swap_ab=True),
        dict(float16_mma=True),
    ]
    grouped = functools.partial(
        gm.grouped_matmul,
        blocks=blocks,
        config=gm.GroupedMatmulConfig(16, 64, 128, 4, 4, scale_product=True),
        interpret=False,
    )
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    stack = jax.ShapeDtypeStruct((3, 256, 512), fp8_blocks.FP8)
    stack_scales = jax.ShapeDtypeStruct((3, 2, 4), jnp.float32)
    experts = jax.ShapeDtypeStruct((3, 256, 512), fp8_blocks.FP8)  # [G, N, K]
    expert_scales = jax.ShapeDtypeStruct((3, 2, 4), jnp.float32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    for f, args in (
        (dense, (x, weight, scales)),
        *(
            (
                functools.partial(dense, config=fm.Fp8MatmulConfig(64, 64, 64, 1, 4, 3, **variant)),
                (x, weight, scales),
            )
            for variant in variants
        ),
        (lambda x, w, s, i: dense(x, w, s, layer=i), (x, stack, stack_scales, layer)),
        (
            lambda x, w, g, s: grouped(x, w, g, rhs_scale_inv=s),
            (x, experts, jax.ShapeDtypeStruct((3,), jnp.int32), expert_scales),
        ),
    ):
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_matmul_float16_mma(splits, rng):
    """``float16_mma``: bf16 x in float16 against e4m3 tiles, the scales on each step's
    product, every row within bf16's tolerance of float64 whatever its magnitude; a float32 x
    keeps its exact float32 MMA (the float32 tolerance)."""
    m, k, n = 21, 100, 72
    blocks = fp8_blocks.Fp8Blocks(16, 32)
    weight, scale = _fp8_weight_nk(rng, (k, n), blocks)
    config = fm.Fp8MatmulConfig(16, 32, 16, splits, 4, 2, float16_mma=True)
    x = _spread_rows(rng, m, k)
    got = fm.fp8_matmul(x, weight, scale, blocks=blocks, config=config)
    assert got.dtype == jnp.bfloat16
    assert _row_errors(got, _oracle_nk(x, weight, scale, blocks)).max() < TOL[jnp.bfloat16]
    x32 = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    got = fm.fp8_matmul(x32, weight, scale, blocks=blocks, config=config)
    _check(got, _oracle_nk(x32, weight, scale, blocks), jnp.float32)


def test_float16_rows_scale_exactly_into_range(rng):
    """Each row's largest magnitude lands in [2^14, 2^15); the factors undo the scaling
    exactly (powers of two, bf16's 8 bits inside float16's 11); a zero row stays zero."""
    from mla_jax.kernels import matmul_steps

    x = np.asarray(_spread_rows(rng, 9, 40), np.float32)
    x[4] = 0
    scaled, factors = matmul_steps.float16_rows(jnp.asarray(x, jnp.bfloat16))
    assert scaled.dtype == jnp.float16 and factors.shape == (9,)
    top = np.abs(np.asarray(scaled, np.float32)).max(axis=1)
    live = np.arange(9) != 4
    assert ((top[live] >= 2**14) & (top[live] < 2**15)).all() and top[4] == 0
    back = np.asarray(scaled, np.float64) * np.asarray(factors, np.float64)[:, None]
    kept = np.abs(x) >= 2.0**-29 * np.abs(x).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(back[kept], x[kept])


@pytest.mark.parametrize(
    ("shape", "refused"),
    [
        ((256, 2048, 7168), True),  # V3's FP8 down_proj of one layer: 3.76 GB
        ((128, 2048, 8192), False),  # exactly 2^31 bytes: offsets below 2^31
        ((257, 2048, 8192), False),  # above 2^32 bytes: 64-bit offsets
    ],
)
def test_triton_kernels_refuse_wrapping_offsets(shape, refused):
    """An FP8 operand of (2 GiB, 4 GiB] is refused by the Triton kernels (their lowering
    would index it with wrapping 32-bit offsets: an H200 read experts past 2^31 bytes from an
    illegal address), checked at trace time on abstract arrays; interpret mode and the
    references, which index it right, take it."""
    blocks = fp8_blocks.Fp8Blocks(128, 128)
    e, k, n = shape
    rhs = jax.ShapeDtypeStruct((e, n, k), fp8_blocks.FP8)
    scales = jax.ShapeDtypeStruct((e, *blocks.scale_shape_nk(n, k)), jnp.float32)
    lhs = jax.ShapeDtypeStruct((32, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)

    def grouped(interpret):
        return jax.eval_shape(
            lambda x, w, g, s: gm.grouped_matmul(
                x, w, g, rhs_scale_inv=s, blocks=blocks, interpret=interpret
            ),
            lhs,
            rhs,
            sizes,
            scales,
        )

    dense_w = jax.ShapeDtypeStruct((n, e * k), fp8_blocks.FP8)
    dense_s = jax.ShapeDtypeStruct(blocks.scale_shape_nk(n, e * k), jnp.float32)
    x = jax.ShapeDtypeStruct((16, e * k), jnp.bfloat16)

    def dense(interpret):
        return jax.eval_shape(
            lambda x, w, s: fm.fp8_matmul(x, w, s, blocks=blocks, interpret=interpret),
            x,
            dense_w,
            dense_s,
        )

    for run in (grouped, dense):
        refused_only_compiled(run, refused, r"within \(2 GiB, 4 GiB\].*32-bit offsets")
