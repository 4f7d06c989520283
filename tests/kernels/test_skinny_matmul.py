"""The skinny matmul (``kernels/skinny_matmul``) against float64 NumPy products: the Mosaic GPU
kernel (interpreted on the CPU, jax >= 0.11; compiled on a GPU) and its reference, over bf16
and FP8 weights.

Tolerance: each output element within one bf16 spacing of the exact product, plus the
float32 accumulation's own bound (2^-20 x sum |x||w| over K): the kernel rounds a float32
sum once into bf16, so a correct result is one of the two bf16 values around the exact one.
The same holds over an FP8 weight, whose values the kernel never rounds (e4m3 is exact in
float16, x's rows are scaled into float16 by powers of two, and the scales multiply float32
products); the reference, which rounds the dequantized weight into bf16, gets 2^-8 x sum
|x||w| more. A stacked weight's other layers (and their scales) hold NaN, so a read outside
the layer fails the comparison.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mosaic_gpu_runs

from mla_jax.kernels import fp8_blocks
from mla_jax.kernels import skinny_matmul as skinny
from mla_jax.kernels.skinny_matmul import pallas_mosaic_gpu as mosaic

BF16 = jnp.bfloat16
FP8 = jnp.float8_e4m3fn
Blocks = fp8_blocks.Fp8Blocks
Config = skinny.SkinnyMatmulConfig


def _case(rng, m, k, n, layers=None):
    """x [m, k] and a weight [k, n] (or [layers, k, n] whose every layer but the last is
    NaN), bf16, with the layer the product reads."""
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    if layers is None:
        return x, jnp.asarray(w, BF16), None
    stacked = np.full((layers, k, n), np.nan)
    stacked[-1] = w
    return x, jnp.asarray(stacked, BF16), layers - 1


def _fp8_case(rng, m, k, n, blocks, layers=None):
    """x [m, k] bf16, an FP8 weight [k, n] spanning e4m3's range with random (not power of
    two) float32 block scales, both stacked as ``_case``'s (other layers NaN), the layer,
    and the weight's exact float64 value."""
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    w = np.asarray(jnp.asarray(np.clip(rng.standard_normal((k, n)) * 64, -448, 448), FP8))
    scale = rng.uniform(0.5, 2.0, blocks.scale_shape(k, n)).astype(np.float32) / 64 / k**0.5
    exact = np.asarray(
        fp8_blocks.dequantize(jnp.asarray(w), jnp.asarray(scale), blocks), np.float64
    )
    if layers is None:
        return x, jnp.asarray(w), jnp.asarray(scale), None, exact
    weights = np.full((layers, k, n), np.nan, np.float32)
    scales = np.full((layers, *scale.shape), np.nan, np.float32)
    weights[-1], scales[-1] = w.astype(np.float32), scale
    return x, jnp.asarray(weights, FP8), jnp.asarray(scales), layers - 1, exact


def _check(got, x, weight, layer, rounded_weight=0.0):
    """``got`` against ``x @ weight`` in float64 (``weight``: a stack read at ``layer``, or
    the exact float64 value of an FP8 one), within the module's bound (plus
    ``rounded_weight`` x sum |x||w|)."""
    w = np.asarray(weight if layer is None else weight[layer], np.float64)
    x = np.asarray(x, np.float64)
    want = x @ w
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) * 2.0**16
    bound = spacing + (2.0**-20 + rounded_weight) * (np.abs(x) @ np.abs(w))
    excess = np.abs(got - want) - bound
    assert np.isfinite(got).all() and excess.max() <= 0, f"worst excess {excess.max():.3g}"


@mosaic_gpu_runs
@pytest.mark.parametrize(
    "m,k,n,config,layers",
    [
        (1, 256, 128, Config(splits=1), None),  # one slice, bf16 out
        (5, 512, 192, Config(splits=2), None),  # 64-column blocks, rows not a multiple of 8
        (64, 256, 128, Config(splits=4, stages=1), 3),  # a full tile, a slice a step
        (3, 384, 256, Config(block_k=128, stages=2), 2),  # 128-deep steps, a slice each
        (17, 512, 128, None, 4),  # launch's own plan: 8 slices of a step
        (9, 256, 384, Config(block_n=192, splits=1), 2),  # 192-column blocks, 4 steps
    ],
)
def test_matches_float64(rng, m, k, n, config, layers):
    """Row counts from one to a full tile, one and several slices of K (float32 parts
    summed), block sizes and stacked weights read at their layer."""
    x, weight, layer = _case(rng, m, k, n, layers)
    got = skinny.skinny_matmul(x, weight, layer=layer, config=config)
    _check(got, x, weight, layer)


@mosaic_gpu_runs
def test_traced_layer(rng):
    """The layer as a traced int32 (a scan's layer index), bf16 and FP8 weights: the kernel
    reads it from global memory; the stacks' other layers are NaN."""
    x, weight, layer = _case(rng, 5, 256, 128, layers=3)
    run = jax.jit(lambda x, w, i: skinny.skinny_matmul(x, w, layer=i, config=Config(splits=2)))
    _check(run(x, weight, jnp.int32(layer)), x, weight, layer)
    blocks = Blocks(128, 128)
    x, weight, scale_inv, layer, exact = _fp8_case(rng, 5, 256, 128, blocks, layers=2)
    run = jax.jit(
        lambda x, w, s, i: skinny.skinny_matmul(x, w, scale_inv=s, blocks=blocks, layer=i)
    )
    _check(run(x, weight, scale_inv, jnp.int32(layer)), x, exact, None)


def test_reference_matches_float64(rng):
    x, weight, layer = _case(rng, 7, 192, 96, layers=3)
    _check(skinny.reference.skinny_matmul(x, weight, layer=layer), x, weight, layer)


@mosaic_gpu_runs
@pytest.mark.parametrize(
    "m,k,n,blocks,config,layers",
    [
        (5, 256, 128, Blocks(128, 128), Config(splits=1), None),  # one slice, both consumers
        (16, 512, 256, Blocks(128, 128), Config(fp8_warpgroups=1), 2),  # one consumer, stacked
        # two parts of three 64-column blocks; 3 steps: the second consumer takes one
        (9, 384, 384, Blocks(64, 128, parts=2), Config(splits=1), 3),
        (64, 256, 128, Blocks(128, 64), Config(splits=2), None),  # 64-deep scale blocks
    ],
)
def test_fp8_matches_float64(rng, m, k, n, blocks, config, layers):
    """FP8 weights with block scales: one and several slices of K, one and two compute
    warpgroups taking alternate steps (an odd number of steps among them), scale grids of
    one and two parts, stacked weights read at their layer."""
    x, weight, scale_inv, layer, exact = _fp8_case(rng, m, k, n, blocks, layers)
    got = skinny.skinny_matmul(
        x, weight, scale_inv=scale_inv, blocks=blocks, layer=layer, config=config
    )
    _check(got, x, exact, None)


def test_fp8_reference_matches_float64(rng):
    blocks = Blocks(64, 64)
    x, weight, scale_inv, layer, exact = _fp8_case(rng, 7, 192, 128, blocks, layers=2)
    got = skinny.reference.skinny_matmul(x, weight, scale_inv=scale_inv, blocks=blocks, layer=layer)
    _check(got, x, exact, None, rounded_weight=2.0**-8)


@pytest.mark.parametrize(
    "k,n,config,want",
    [
        # V2-Lite's gate: 57 blocks of 192 in 2 slices fill 114 of 132 multiprocessors in one
        # wave, where 171 blocks of 64 would take two
        (2048, 10944, Config(), mosaic.Launch(192, 64, 5, 2)),
        # its down projection: 171 steps, 3 slices of 32 blocks of 64 in one wave
        (10944, 2048, Config(), mosaic.Launch(64, 64, 16, 3)),
        (512, 576, Config(), mosaic.Launch(64, 64, 1, 8)),  # 8 steps: a slice each, one in flight
        (7168, 1536, Config(stages=8), mosaic.Launch(192, 64, 8, 16)),  # V3's q_a_proj
        (2048, 3072, Config(splits=2, block_k=128), mosaic.Launch(64, 128, 8, 2)),  # as given
        (256, 128, Config(stages=8), mosaic.Launch(64, 64, 8, 4)),  # fewer steps than stages
        (2048, 3072, Config(block_n=128, stages=2, splits=1), mosaic.Launch(128, 64, 2, 1)),
    ],
)
def test_launch(k, n, config, want):
    """``launch`` on V2-Lite's and V3's projection shapes: the plan whose most loaded
    multiprocessor reads the fewest bytes (one program an SM at a time), the fewest slices
    among near ties; fields given are kept."""
    assert mosaic.launch(16, k, n, config, num_sms=132) == want


@pytest.mark.parametrize(
    "m,k,n,config,want",
    [
        # V3's o_proj over FP8: 128-column blocks (a scale block), 128-deep steps, 2 slices
        (16, 16384, 7168, Config(), mosaic.Launch(128, 128, 8, 2, 2)),
        # at 64 rows x's tiles take the shared memory: 5 stages
        (64, 16384, 7168, Config(), mosaic.Launch(128, 128, 5, 2, 2)),
        (16, 7168, 1536, Config(fp8_warpgroups=1), mosaic.Launch(128, 128, 7, 8, 1)),  # 7 steps
        (16, 1536, 24576, Config(block_n=64, block_k=64), mosaic.Launch(64, 64, 24, 1, 2)),
    ],
)
def test_launch_fp8(m, k, n, config, want):
    """Over FP8 weights with 128 x 128 scale blocks: the widest column block and step a
    scale block holds (a step's chain costs about the same narrower), two compute
    warpgroups; fields given are kept."""
    assert mosaic.launch(m, k, n, config, 132, Blocks(128, 128)) == want


def test_launch_cost_counts_waves():
    """A second wave of programs costs a whole program's bytes, however few run in it."""
    one = mosaic.Launch(192, 64, 4, 2)  # 114 programs
    two = mosaic.Launch(64, 64, 4, 1)  # 171 programs
    assert mosaic.cost(16, 2048, 10944, one, 132) < mosaic.cost(16, 2048, 10944, two, 132)
    assert mosaic.cost(16, 2048, 10944, two, 171) < mosaic.cost(16, 2048, 10944, two, 170)


@pytest.mark.parametrize(
    "x,weight,layer,config,message",
    [
        ((1, 64), (2, 2, 64, 64), None, None, "x [M, K] and weight"),
        ((1, 64), (64, 64), None, None, "bfloat16 x and a bfloat16 or float8_e4m3fn weight"),
        ((65, 64), (64, 64), None, None, "1 to 64 rows of x"),
        ((2, 128), (64, 64), None, None, "x's K (128) is not the weight's (64)"),
        ((2, 64), (3, 64, 64), None, None, "a layer index goes with a stacked"),
        ((2, 64), (64, 64), 0, None, "a layer index goes with a stacked"),
        ((2, 64), (3, 64, 64), 3, None, "layer 3 is not in [0, 3)"),
        ((2, 64), (3, 64, 64), 0.5, None, "layer must be an integer scalar"),
        ((2, 64), (64, 96), None, None, "N 96 does not split into blocks of 64"),
        ((2, 96), (96, 64), None, None, "K 96 does not split into steps of 64"),
        ((2, 192), (192, 64), None, Config(splits=2), "2 slices of K do not divide its 3"),
        ((2, 64), (64, 64), None, Config(block_n=96), "block_n 96 is not a multiple of 64"),
        ((2, 64), (64, 64), None, Config(stages=0), "stages (0) and splits (None) must be"),
        ((2, 64), (64, 64), None, Config(block_k=32), "K 64 does not split into steps of 32"),
        (
            (2, 256),
            (256, 128),
            None,
            Config(block_n=128, block_k=128, stages=8),
            "need 280576 bytes",
        ),
    ],
)
def test_refuses(x, weight, layer, config, message):
    """Shapes, dtypes, layers and launches it does not take, each refused in one line that
    names it (by the kernel and the reference alike where the arguments are the cause)."""
    x_dtype = jnp.float32 if message.startswith("bfloat16") else BF16  # float32 x
    args = jnp.zeros(x, x_dtype), jnp.zeros(weight, BF16)
    with pytest.raises(ValueError, match=re.escape(message)):
        skinny.skinny_matmul(*args, layer=layer, config=config)
    if config is None and "split" not in message:
        with pytest.raises(ValueError, match=re.escape(message)):
            skinny.reference.skinny_matmul(*args, layer=layer)


@pytest.mark.parametrize(
    "weight,scales,blocks,config,message",
    [
        ((256, 128), None, None, None, "scale_inv and blocks go with a float8_e4m3fn weight"),
        ((256, 192), (2, 2), Blocks(128, 128), None, "is not whole blocks of"),
        ((256, 128), (8, 1), Blocks(128, 32), Config(block_k=64), "steps of 64 do not divide"),
        ((256, 128), (2, 1), Blocks(128, 128), Config(fp8_warpgroups=3), "fp8_warpgroups"),
        ((256, 128), (3, 2), Blocks(64, 128), None, "does not fit [256, 128]"),
    ],
)
def test_fp8_refuses(weight, scales, blocks, config, message):
    """An FP8 weight without its scales, partial scale blocks, steps that straddle a scale
    block, a bad compute warpgroup count and a scale grid of the wrong shape: one line
    each."""
    x = jnp.zeros((4, weight[0]), BF16)
    scale_inv = None if scales is None else jnp.ones(scales, jnp.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        skinny.skinny_matmul(
            x, jnp.zeros(weight, FP8), scale_inv=scale_inv, blocks=blocks, config=config
        )


def test_unsupported_names_the_shape():
    x = jax.ShapeDtypeStruct((4, 96), BF16)
    assert skinny.unsupported(x, jax.ShapeDtypeStruct((96, 64), BF16)).startswith("K 96")
    x = jax.ShapeDtypeStruct((4, 128), BF16)
    reason = skinny.unsupported(x, jax.ShapeDtypeStruct((128, 128), BF16))
    assert reason == mosaic.mosaic_gpu.device_unsupported()
    x = jax.ShapeDtypeStruct((4, 128), jnp.float32)
    assert skinny.unsupported(x, jax.ShapeDtypeStruct((128, 128), BF16)) == (
        "x is float32, not bfloat16"
    )


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11),
    reason="compiled on jax 0.11 only (the Mosaic GPU kernels' jax on a GPU)",
)
@pytest.mark.parametrize(
    "m,k,n,layers,config",
    [
        (1, 2048, 10944, 27, None),  # V2-Lite's gate (and up): 192-column blocks, stacked
        (5, 10944, 2048, 27, None),  # its down projection: 3 slices, float32 parts
        (64, 2048, 3072, None, Config(block_k=128)),  # 6 stages: 208 KB of shared memory
        (16, 512, 576, None, None),
    ],
)
def test_lowers_for_sm90(m, k, n, layers, config):
    """The sm90 lowering (layout inference, TMA shapes, shared memory) of decode-sized
    projections, on any machine; only ptxas and the run need the GPU."""
    f = jax.jit(
        functools.partial(
            skinny.skinny_matmul,
            layer=None if layers is None else layers - 1,
            config=config,
            interpret=False,
        )
    )
    weight = jax.ShapeDtypeStruct((k, n) if layers is None else (layers, k, n), BF16)
    lowered = f.trace(jax.ShapeDtypeStruct((m, k), BF16), weight).lower(
        lowering_platforms=("cuda",)
    )
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(2048, 10944), (10944, 2048), (2048, 3072), (512, 576)])
def test_deepseek_shapes_compiled(rng, m, k, n):
    """V2-Lite's projections at decode's row counts, stacked as the model stacks them (GPU
    only: too large to interpret)."""
    x, weight, layer = _case(rng, m, k, n, layers=2)
    _check(
        jax.jit(functools.partial(skinny.skinny_matmul, layer=layer))(x, weight), x, weight, layer
    )


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11),
    reason="compiled on jax 0.11 only (the Mosaic GPU kernels' jax on a GPU)",
)
@pytest.mark.parametrize("m,k,n,config", [(64, 16384, 7168, None), (3, 7168, 1536, Config())])
def test_fp8_lowers_for_sm90(m, k, n, config):
    """The sm90 lowering over FP8 weights (V3's o_proj at 64 rows, stacked; its q_a_proj):
    the e4m3 tiles' 32-byte swizzle, their float16 conversion and the two compute
    warpgroups."""
    blocks = Blocks(128, 128)
    f = jax.jit(
        functools.partial(
            skinny.skinny_matmul, blocks=blocks, layer=1, config=config, interpret=False
        )
    )
    weight = jax.ShapeDtypeStruct((2, k, n), FP8)
    scales = jax.ShapeDtypeStruct((2, *blocks.scale_shape(k, n)), jnp.float32)
    lowered = f.trace(jax.ShapeDtypeStruct((m, k), BF16), weight, scale_inv=scales).lower(
        lowering_platforms=("cuda",)
    )
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,n", [(16384, 7168), (7168, 1536), (1536, 24576), (7168, 18432)])
def test_fp8_deepseek_shapes_compiled(rng, m, k, n):
    """V3's projections over FP8 weights with 128 x 128 scale blocks at decode's row counts,
    stacked (GPU only: too large to interpret)."""
    blocks = Blocks(128, 128)
    x, weight, scale_inv, layer, exact = _fp8_case(rng, m, k, n, blocks, layers=2)
    f = jax.jit(functools.partial(skinny.skinny_matmul, blocks=blocks, layer=layer))
    _check(f(x, weight, scale_inv=scale_inv), x, exact, None)
