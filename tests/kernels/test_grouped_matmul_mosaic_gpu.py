"""The Mosaic GPU grouped matmul (``grouped_matmul/pallas_mosaic_gpu.py``: interpreted on the
CPU, jax >= 0.11; compiled on a GPU) against float64 NumPy products over each group's rows.

Tolerance: each output element within one bf16 spacing of the exact product, plus the
float32 accumulation's bound (2^-20 x sum |lhs||rhs| over K): the kernel rounds a float32 sum
once into bf16. Rows after the last group must be exactly 0; the weights of groups a product
must not read are NaN. (FP8 experts run on ``w8a8_matmul``'s grouped form:
``test_w8a8_matmul.py``.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mosaic_gpu_runs

from mla_jax.kernels import grouped_matmul as gm
from mla_jax.kernels.grouped_matmul import pallas_mosaic_gpu as mosaic

BF16 = jnp.bfloat16
Config = mosaic.MosaicGroupedMatmulConfig
SMALL = Config(block_m=64, block_n=64, block_k=64)


def _weights(rng, groups, k, n):
    """``rhs [groups, k, n]`` bf16 and the float64 value the kernel multiplies."""
    rhs = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), BF16)
    return rhs, np.asarray(rhs, np.float64)


def _check(got, lhs, exact_rhs, sizes):
    """``got [M, N]`` against each group's rows times its float64 weight, rows after the
    groups 0, within the module's bound."""
    lhs = np.asarray(lhs, np.float64)
    got = np.asarray(got, np.float64)
    want = np.zeros(got.shape)
    magnitude = np.zeros(got.shape)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for g in range(len(sizes)):
        rows = slice(offsets[g], offsets[g + 1])
        want[rows] = lhs[rows] @ exact_rhs[g]
        magnitude[rows] = np.abs(lhs[rows]) @ np.abs(exact_rhs[g])
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) * 2.0**16
    excess = np.abs(got - want) - (spacing + 2.0**-20 * magnitude)
    assert np.isfinite(got).all() and excess.max() <= 0, f"worst excess {excess.max():.3g}"
    np.testing.assert_array_equal(got[offsets[-1] :], 0)


# (group sizes, rows after them, K, N, config): groups starting off the 8-row grid, an empty
# group, a group over several tiles, a tile copied from M - block_m, M not a multiple of 8,
# fewer rows than a tile, only padding rows, the default launch; two column blocks with the
# row tiles in bands of 1 (the default: column block first) and of 3 (the last band runs
# past the last tile: its extra programs must not read past the schedule, which interpret
# mode checks); 128-row tiles whose second half is multiplied only where they have rows.
CASES = {
    "unaligned-groups": ([5, 0, 70, 1, 37], 9, 128, 128, SMALL),
    "two-column-blocks": ([5, 0, 70, 1, 37], 9, 128, 256, SMALL),
    "band-of-three": ([5, 0, 70, 1, 37], 9, 128, 256, dataclasses.replace(SMALL, band=3)),
    "end-of-rows": ([3, 60], 0, 64, 128, SMALL),
    "long-group": ([200], 3, 192, 128, Config(block_m=128, block_n=64, block_k=64)),
    "fewer-rows-than-a-tile": ([2, 3], 0, 64, 128, SMALL),
    "only-padding": ([0, 0], 16, 64, 128, SMALL),
    "default-launch": ([130, 0, 7], 13, 128, 256, None),
    "skip-empty-half": (
        [200, 0, 7, 130],
        3,
        128,
        256,
        Config(block_m=128, block_n=64, block_k=64, skip_empty_half=True),
    ),
}


@mosaic_gpu_runs
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_matches_float64(rng, case):
    sizes, padding, k, n, config = CASES[case]
    lhs = jnp.asarray(rng.standard_normal((sum(sizes) + padding, k)), BF16)
    rhs, exact = _weights(rng, len(sizes), k, n)
    got = mosaic.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), config=config)
    assert got.shape == (lhs.shape[0], n) and got.dtype == BF16
    _check(got, lhs, exact, sizes)


@mosaic_gpu_runs
def test_traced_offset_reads_only_its_groups(rng):
    """Group sizes and the offset traced (a scan's layer of ``[3, 4, K, N]`` experts), the
    schedule planned on the device; the other layers' weights are NaN."""
    sizes = [9, 0, 20, 3]
    lhs = jnp.asarray(rng.standard_normal((40, 128)), BF16)
    rhs, exact = _weights(rng, 4, 128, 128)
    stacked = jnp.full((3, 4, 128, 128), jnp.nan, rhs.dtype).at[1].set(rhs)

    @jax.jit
    def run(sizes, offset):
        return mosaic.grouped_matmul(lhs, stacked, sizes, group_offset=offset, config=SMALL)

    _check(run(jnp.asarray(sizes, jnp.int32), jnp.int32(4)), lhs, exact, sizes)


@mosaic_gpu_runs
def test_host_schedule(rng):
    """A schedule planned on the host with the kernel's alignment runs as the traced one;
    one without it is refused."""
    sizes = [11, 0, 50]
    lhs = jnp.asarray(rng.standard_normal((64, 64)), BF16)
    rhs, exact = _weights(rng, 3, 64, 128)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    schedule = gm.schedule_row_tiles(np.asarray(sizes), 64, 64, align=mosaic.ROW_ALIGN)
    got = mosaic.grouped_matmul(lhs, rhs, group_sizes, schedule=schedule, config=SMALL)
    _check(got, lhs, exact, sizes)
    with pytest.raises(ValueError, match="aligned to 1 rows"):
        mosaic.grouped_matmul(
            lhs, rhs, group_sizes, schedule=gm.schedule_row_tiles(sizes, 64, 64), config=SMALL
        )


@mosaic_gpu_runs
def test_prefill_on_mosaic_gpu_takes_a_prefills_rows(rng, monkeypatch, caplog):
    """``prefill_on_mosaic_gpu`` runs the Mosaic GPU kernel on a prefill's rows a group (more
    than 64) and the Triton kernel on fewer, said in the log; both match float64."""
    calls = []
    kernel = mosaic.grouped_matmul
    monkeypatch.setattr(
        mosaic, "grouped_matmul", lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    )
    rhs, exact = _weights(rng, 2, 64, 128)
    for sizes, runs in (([70, 81], [1]), ([3, 6], [1])):
        lhs = jnp.asarray(rng.standard_normal((sum(sizes), 64)), BF16)
        with caplog.at_level("WARNING", logger="mla_jax.kernels.grouped_matmul"):
            got = gm.prefill_on_mosaic_gpu(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        _check(got, lhs, exact, sizes)
        assert calls == runs
    assert "the Triton kernel for lhs [9, 64] x rhs [64, 128]" in caplog.text


def test_refuses_what_it_does_not_take(rng):
    lhs = jnp.zeros((16, 128), BF16)
    sizes = jnp.asarray([16], jnp.int32)
    with pytest.raises(ValueError, match=r"weight \[128, 192\] is not whole steps"):
        mosaic.grouped_matmul(lhs, jnp.zeros((1, 128, 192), BF16), sizes, config=SMALL)
    with pytest.raises(ValueError, match="block_m 32 is not 64 or 128"):
        mosaic.grouped_matmul(lhs, jnp.zeros((1, 128, 128), BF16), sizes, config=Config(32))
    with pytest.raises(ValueError, match="lhs is float32"):
        mosaic.grouped_matmul(
            lhs.astype(jnp.float32), jnp.zeros((1, 128, 128), jnp.float32), sizes, config=SMALL
        )
    with pytest.raises(ValueError, match="bytes of shared memory"):
        mosaic.grouped_matmul(
            lhs, jnp.zeros((1, 128, 512), BF16), sizes, config=Config(block_n=256, stages=4)
        )


def test_lowers_for_sm90():
    """The sm90 lowering (layout inference, TMA shapes and alignment) of DeepSeek-V3's expert
    matmuls at 8192 prefill tokens (top-8: 65536 rows), on any machine; only ptxas and the
    run need the GPU."""
    rows, k, n, groups = 65536, 7168, 4096, 256
    config = Config.for_weight(n)  # the launch prefill_on_mosaic_gpu runs
    f = jax.jit(functools.partial(mosaic.grouped_matmul, config=config, interpret=False))
    lowered = f.trace(
        jax.ShapeDtypeStruct((rows, k), BF16),
        jax.ShapeDtypeStruct((groups, k, n), BF16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(7168, 4096), (2048, 7168)])
def test_deepseek_v3_experts_compiled(rng, k, n):
    """V3's gate_up and down expert matmuls over 8 of its experts with ragged rows, with the
    launch ``prefill_on_mosaic_gpu`` runs (GPU only: too large to interpret)."""
    sizes = [300, 0, 1, 129, 400, 64, 7, 250]
    lhs = jnp.asarray(rng.standard_normal((sum(sizes) + 5, k)), BF16)
    rhs, exact = _weights(rng, len(sizes), k, n)
    got = jax.jit(functools.partial(mosaic.grouped_matmul, config=Config.for_weight(n)))(
        lhs, rhs, jnp.asarray(sizes, jnp.int32)
    )
    _check(got, lhs, exact, sizes)
