"""The grouped matmul (Pallas kernel in interpret mode, and the ragged_dot reference) against
a float64 NumPy loop over the groups, and its tile schedule.

Tolerances (max abs error over max |reference|): float32 1e-6 (measured <= 4.5e-7 over seeds
0-2), bfloat16 inputs 7e-3 (bf16 output rounding; measured <= 3.2e-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.kernels import grouped_matmul as gm
from mla_jax.kernels import tiling

KERNELS = {"pallas": gm.grouped_matmul, "reference": gm.reference.grouped_matmul}
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 7e-3}


def _numpy_grouped_matmul(lhs, rhs, sizes) -> np.ndarray:
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for g in range(len(sizes)):
        out[offsets[g] : offsets[g + 1]] = lhs[offsets[g] : offsets[g + 1]] @ rhs[g]
    return out


def _inputs(rng, rows, depth, width, sizes, dtype=jnp.float32):
    lhs = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), depth, width)) / np.sqrt(depth), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


# (rows, K, N, group sizes, launch config): empty groups, one-row groups, padding rows after
# the groups, tiles cut inside a group, K and N that are not multiples of a block, axes
# shorter than a block (padded to 16), all rows padding; row tiles taken in bands of 4 (15
# tiles: the last band runs one program a column block past them).
CASES = {
    "decode-like": (64, 48, 40, [0, 1, 37, 0, 1, 20], None),
    "one-row-groups": (9, 32, 64, [1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0], None),
    "many-tiles": (300, 80, 96, [100, 0, 1, 150, 17], gm.GroupedMatmulConfig(32, 32, 32, 4, 2)),
    "banded": (
        300,
        80,
        96,
        [100, 0, 1, 150, 17],
        gm.GroupedMatmulConfig(32, 32, 32, 4, 2, band=4),
    ),
    "one-group": (70, 64, 32, [70], gm.GroupedMatmulConfig(16, 16, 16, 4, 2)),
    "narrow": (20, 8, 12, [0, 3, 10], None),
    "all-padding": (16, 32, 32, [0, 0, 0], None),
}


@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_matmul(case, impl, rng):
    rows, depth, width, sizes, config = CASES[case]
    lhs, rhs, group_sizes = _inputs(rng, rows, depth, width, sizes)
    kwargs = {"config": config} if config else {}
    got = KERNELS[impl](lhs, rhs, group_sizes, **kwargs)
    want = _numpy_grouped_matmul(lhs, rhs, sizes)
    assert got.shape == (rows, width) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got)[sum(sizes) :], 0)  # padding rows
    scale = max(np.abs(want).max(), 1.0)
    assert np.abs(np.asarray(got, np.float64) - want).max() / scale < TOL[jnp.float32]


@pytest.mark.parametrize("impl", list(KERNELS))
def test_bfloat16(impl, rng):
    sizes = [5, 0, 40, 1]
    lhs, rhs, group_sizes = _inputs(rng, 50, 64, 48, sizes, jnp.bfloat16)
    got = KERNELS[impl](lhs, rhs, group_sizes)
    assert got.dtype == jnp.bfloat16
    want = _numpy_grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < TOL[jnp.bfloat16]


def test_traced_group_sizes_and_poisoned_unused_groups(rng):
    """Under jit (the schedule planned on the device), with NaN weights in every group that
    has no rows: they must not reach the output."""
    sizes = [0, 6, 0, 0, 10, 1, 0]
    lhs, rhs, group_sizes = _inputs(rng, 17, 32, 32, sizes)
    empty = np.array(sizes) == 0
    poisoned = rhs.at[np.flatnonzero(empty)].set(jnp.nan)
    got = jax.jit(gm.grouped_matmul)(lhs, poisoned, group_sizes)
    want = _numpy_grouped_matmul(lhs, rhs, sizes)
    assert np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max() < 1e-6


@pytest.mark.parametrize("layers_axis", [False, True], ids=["flat", "layers-axis"])
@pytest.mark.parametrize("impl", list(KERNELS))
def test_group_offset_reads_only_its_layer(impl, layers_axis, rng):
    """Groups offset into a stacked ``rhs`` (three layers of 4 experts, ``[12, K, N]`` or
    ``[3, 4, K, N]`` as the model passes them, the middle layer's used, the offset traced as
    under a scan): the other layers' matrices are NaN and must not reach the output."""
    sizes = [3, 0, 9, 1]
    lhs, rhs, group_sizes = _inputs(rng, 16, 32, 24, sizes)
    stacked = jnp.full((12, 32, 24), jnp.nan).at[4:8].set(rhs)
    if layers_axis:
        stacked = stacked.reshape(3, 4, 32, 24)
    got = jax.jit(lambda offset: KERNELS[impl](lhs, stacked, group_sizes, group_offset=offset))(
        jnp.int32(4)
    )
    want = _numpy_grouped_matmul(lhs, rhs, sizes)
    assert np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max() < TOL[jnp.float32]


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("block_m", [16, 64])
def test_plan_tiles_each_row_once_within_its_group(block_m, align, rng):
    """Every row is in exactly one tile, a tile holds rows of one group (or only padding
    rows), groups without rows get no tile (their weights are never read), the count stays
    under ``max_tiles``, and the traced plan is the host plan followed by empty tiles. With
    ``align``, a tile's rows lie within ``block_m`` of its start rounded down to it."""
    sizes = rng.integers(0, 3 * block_m, 12) * (rng.random(12) < 0.7)
    rows = int(sizes.sum()) + 5
    host = gm.schedule_row_tiles(sizes, rows, block_m, align=align)
    bound = tiling.max_tiles(rows, len(sizes), block_m, align)
    assert host.tile_segment.shape[0] <= bound and host.align == align
    offsets = np.concatenate([[0], np.cumsum(sizes), [rows]])
    covered = np.zeros(rows, int)
    for g, lo, hi in zip(host.tile_segment, host.tile_start, host.tile_end, strict=True):
        assert lo < hi and hi - (lo - lo % align) <= block_m
        assert offsets[g] <= lo and hi <= offsets[g + 1]
        covered[lo:hi] += 1
    np.testing.assert_array_equal(covered, 1)
    groups_with_tiles = set(host.tile_segment[host.tile_segment < len(sizes)].tolist())
    assert groups_with_tiles == set(np.flatnonzero(sizes).tolist())
    traced = jax.jit(
        lambda s: gm.schedule_row_tiles(s, rows, block_m, num_tiles=bound, align=align, xp=jnp)
    )(jnp.asarray(sizes, jnp.int32))
    n = host.tile_segment.shape[0]
    for field in ("tile_segment", "tile_start", "tile_end"):
        mine = np.asarray(getattr(traced, field))
        np.testing.assert_array_equal(mine[:n], getattr(host, field))
        np.testing.assert_array_equal(mine[n:], np.where(field == "tile_segment", len(sizes), 0))


@pytest.mark.parametrize("band", [1, 3, 8])
def test_banded_order_runs_every_tile_and_column_block_once(band):
    """Over ``banded_programs`` programs, ``banded`` gives every (row tile, column block)
    exactly once, the extra tiles of the last band past the real ones; a band's tiles are
    consecutive programs for each column block."""
    num_tiles, blocks = 11, 4
    programs = tiling.banded_programs(num_tiles, blocks, band)
    tile, block = tiling.banded(np.arange(programs), blocks, band)
    pairs = set(zip(tile.tolist(), block.tolist(), strict=True))
    assert len(pairs) == programs and {b for _, b in pairs} == set(range(blocks))
    assert {t for t, _ in pairs} == set(range(programs // blocks))
    np.testing.assert_array_equal(tile[:band], np.arange(band))
    np.testing.assert_array_equal(block[:band], 0)


def test_traced_plan_has_no_loop():
    """The traced plan lowers to no while loop: XLA's GPU runtime steps a loop's iterations
    from the host, outside the step's CUDA graphs, so a loop in every MoE layer's plan held
    the host for about the device's time of a decode step."""
    plan = jax.jit(lambda s: gm.schedule_row_tiles(s, 70, 16, num_tiles=80, xp=jnp))
    text = plan.lower(jnp.ones(64, jnp.int32)).as_text()
    assert "stablehlo.while" not in text


def test_bad_input_is_refused(rng):
    lhs, rhs, sizes = _inputs(rng, 8, 16, 16, [3, 4])
    with pytest.raises(ValueError, match="sum to at most 8 rows"):
        gm.grouped_matmul(lhs, rhs, jnp.asarray([5, 4], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        gm.grouped_matmul(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gm.grouped_matmul(lhs.astype(jnp.bfloat16), rhs, sizes)
    with pytest.raises(ValueError, match="group_offset 1 puts 2 groups past rhs's 2"):
        gm.grouped_matmul(lhs, rhs, sizes, group_offset=1)
