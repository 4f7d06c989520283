"""``x [M, K] @ weight[N, K]^T`` on FP8 tensor cores (Hopper, sm90): activations quantized to
e4m3 per token and 128 columns, DeepSeek's FP8 weight as it ships.

Hopper's e4m3 wgmma reads both operands K-major from shared memory, so the weight stays in
HF's ``[N, K]`` layout and x is quantized as DeepSeek's inference does (``act_quant``: a
float32 scale per row and 128 columns; here a power of two, by ``quantize_rows``' kernel,
which reads x once). The other
FP8 kernels (``fp8_matmul``, ``skinny_matmul``, ``grouped_matmul``) convert each weight tile
into 16 bits before a 16-bit MMA, which at 64 rows left them at 1.08-1.60x the bf16 weight's
time (``skinny_matmul_fp8.json`` of 2026-12-04). A program owns a tile of x's rows
(``row_tile``: 64 for up to 64 rows, decode's, else 128), 128 output columns (one weight
scale block) and one of ``splits`` slices of K; the tiles are numbered in bands of ``band``
column blocks, down every row tile and back up the next band, so that the programs resident
at once share x's row tiles and the weight's column blocks in L2; a memory warpgroup streams
the slice's e4m3 weight tiles (128 columns by ``depth`` x 128 of K), the matching tiles of
quantized x and x's scales by TMA, ``stages`` pipeline steps ahead, and each of ``row_tile
/ 64`` compute warpgroups multiplies its 64 rows (on the wgmma's M side; x's rows padded to
the tile) by each 128-deep part of a step into a fresh float32 accumulator, a wgmma each,
issued together, and adds each, times its weight scale and each row's x scale, to the sum
it carries, the first while the second runs: a new accumulator each 128 deep because the
e4m3 wgmma keeps only about 14 bits of its running sum (DeepSeek-V3's report, 3.3.2). One
slice writes the output in x's dtype; XLA sums several slices' float32 parts.

The grouped form (``grouped_w8a8_matmul``, the MoE layer's routed experts) runs the same
program body (``_tile_product``) on the row tiles of ``grouped_matmul``'s schedule: a tile
holds one group's rows, its copy of x starts at a multiple of 8 rows (TMA into 8-row tiles),
its weight is its group's, and only its group's rows are stored
(``mosaic_gpu.copy_rows_smem_to_gmem``); one slice of K.

Numerics: x's rounding to e4m3 (3 mantissa bits) puts the product about 2.5% (relative L2)
from ``x @ dequantize(weight)`` on normal inputs; against x's e4m3 values the products are
exact, each step's sum keeps about 14 bits in the wgmma (compiled on an H100, past the bf16
output's rounding, the error was at most 1.77e-4 of the steps' sums |x||w| combined in L2,
at K = 256; ``tests/kernels/test_w8a8_matmul.py``) and the float32 sum of the steps adds its
own rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import fp8, matmul_steps, mosaic_gpu, online_softmax, tiling
from ..decode import device_num_sms
from ..grouped_matmul.pallas_triton import check_groups, device_schedule, stacked_groups
from ..quantize_rows import quantize_rows

WARPGROUP_ROWS = 64  # a compute warpgroup's rows: the wgmma's M side; a program's up to 64
BLOCK = 128  # the weight's scale blocks (DeepSeek's 128 x 128), x's scale groups, a step's K
# and a program's columns; 128 e4m3 values are one 128-byte swizzled row
ROW_ALIGN = 8  # the grouped form's tiles copy x from a multiple of this row (8-row tiles)
SPLITS = (1, 2, 4, 8, 16)
# Programs a launch aims for, per multiprocessor: the fewest slices of K that give about a
# wave. At 64 rows V3's o_proj [7168, 16384] and MLP down_proj took 0.95x and 0.94x the
# time in 2 slices (112 programs) of 4 (224), q_b_proj [24576, 1536] 0.72x in 1 (192) of 2,
# gate_proj [18432, 7168] the same in 1 and 2; at one row likewise (H100, 132
# multiprocessors, 2026-12-06, a trial).
PROGRAMS_PER_SM = 0.8
# Shared memory a launch may plan for: an sm90 program's, less some for the pipeline's
# barriers.
SMEM_BYTES = mosaic_gpu.SMEM_BYTES - 7 * 1024


@dataclasses.dataclass(frozen=True)
class W8A8MatmulConfig:
    """Launch of the w8a8 matmul.

    stages: pipeline steps in flight at most (a step: ``depth`` 16 KB weight tiles and 8 or
      16 KB tiles of x); fewer where shared memory holds fewer (``stages``).
    splits: slices of K (None: the fewest of ``SPLITS`` that give ``PROGRAMS_PER_SM``
      programs a multiprocessor, else the most that divide K's steps).
    band: column blocks in a band of the programs' order (``plgpu.planar_snake``);
      with one row tile (decode) the order is the columns'. At 8192 rows of V3's o_proj and
      gate_proj, 8 took 0.98x and 0.99x the time of 1 (row tiles fastest), 16 and 4 within
      1% of 8, and one band of every column block 1.02x and 1.39x the time of 8 (H100,
      2026-12-06, a trial; at 512 rows of o_proj 8 was within 2% of the others).
    depth: K's 128-deep steps a pipeline step (1 or 2; 1 where a slice's steps are odd): two
      products issued together, the first added to the total while the second runs. At
      8192 rows of V3's o_proj and gate_proj 2 took 0.89x and 0.96x the time of 1 (H100,
      2026-12-06, a trial); at 64 rows of the projections 0.95-0.99x in an earlier trial
      (x then quantized by XLA, a step's second weight scale read in the step).
    approx_math, auto_barriers: as ``MosaicDecodeConfig``'s (``mosaic_gpu.kernel_options``).
    """

    stages: int = 6
    splits: int | None = None
    band: int = 8
    depth: int = 2
    approx_math: bool = True
    auto_barriers: bool = False

    def __post_init__(self):
        if self.stages < 1 or self.band < 1 or self.depth not in (1, 2):
            raise ValueError(
                f"W8A8MatmulConfig: stages and band of at least 1 and depth 1 or 2, got "
                f"{self.stages}, {self.band} and {self.depth}"
            )


def check(
    x: jax.Array, weight: jax.Array, scale_inv: jax.Array, layer: int | jax.Array | None = None
) -> None:
    """Refuses, in one line naming it, an argument ``w8a8_matmul`` does not take."""
    want = 2 if layer is None else 3
    if x.ndim != 2 or weight.ndim != want or scale_inv.ndim != want:
        form = "[N, K]" if layer is None else "[L, N, K] (a stack, with layer)"
        raise ValueError(
            f"w8a8_matmul: x [M, K] and weight {form}, got x {x.shape}, weight {weight.shape} "
            f"and scale_inv {scale_inv.shape}"
        )
    if layer is not None:
        matmul_steps.check_layer(layer, weight.shape[0], "w8a8_matmul: ")
    if x.dtype != jnp.bfloat16 or weight.dtype != fp8.FP8 or scale_inv.dtype != jnp.float32:
        raise ValueError(
            "w8a8_matmul: bfloat16 x, a float8_e4m3fn weight and float32 scales, got "
            f"{x.dtype}, {weight.dtype} and {scale_inv.dtype}"
        )
    if x.shape[0] < 1:
        raise ValueError("w8a8_matmul: x has no rows")
    n, k = weight.shape[-2:]
    if x.shape[1] != k:
        raise ValueError(f"w8a8_matmul: x's K ({x.shape[1]}) is not the weight's ({k})")
    if n % BLOCK or k % BLOCK:
        raise ValueError(
            f"w8a8_matmul: weight [{n}, {k}] is not whole {BLOCK} x {BLOCK} scale blocks"
        )
    grid = (*weight.shape[:-2], n // BLOCK, k // BLOCK)
    if scale_inv.shape != grid:
        raise ValueError(
            f"w8a8_matmul: scale_inv {list(scale_inv.shape)} is not the weight's block grid "
            f"{list(grid)}"
        )


def row_tile(m: int) -> int:
    """x's rows a program multiplies: one compute warpgroup's 64 for up to 64 rows
    (decode), else two warpgroups' 128 (a step's weight tile read once for both)."""
    return WARPGROUP_ROWS if m <= WARPGROUP_ROWS else 2 * WARPGROUP_ROWS


def splits(m: int, k: int, n: int, config: W8A8MatmulConfig, num_sms: int) -> int:
    """Slices of K for ``x [m, K]`` times a ``[N, K]`` weight on ``num_sms``
    multiprocessors (ValueError where ``config.splits`` does not divide K's steps)."""
    steps = k // BLOCK
    if config.splits is not None:
        if config.splits < 1 or steps % config.splits:
            raise ValueError(
                f"w8a8_matmul: {config.splits} slices of K do not divide its {steps} steps"
            )
        return config.splits
    tiles = n // BLOCK * -(-m // row_tile(m))
    fits = [s for s in SPLITS if steps % s == 0]
    enough = [s for s in fits if tiles * s >= PROGRAMS_PER_SM * num_sms]
    return enough[0] if enough else fits[-1]


def step_depth(steps: int, config: W8A8MatmulConfig) -> int:
    """128-deep products a pipeline step of a slice of ``steps`` of them: ``config.depth``
    where it divides them, else 1."""
    return config.depth if steps % config.depth == 0 else 1


def stages(m: int, steps: int, slices: int, config: W8A8MatmulConfig, depth: int) -> int:
    """Pipeline steps in flight (each ``depth`` of K's 128-deep steps): ``config.stages``
    at most, no more than a slice has, and as many as shared memory holds beside the output
    tile."""
    rows = row_tile(m)
    out_bytes = rows * BLOCK * (2 if slices == 1 else 4)
    step_bytes = depth * (rows * BLOCK + BLOCK * BLOCK + 4 * rows)
    return max(
        1, min(config.stages, steps // slices // depth, (SMEM_BYTES - out_bytes) // step_bytes)
    )


def unsupported(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    layer: int | jax.Array | None = None,
    config: W8A8MatmulConfig | None = None,
) -> str | None:
    """Why the kernel cannot run this product here (None: it can): an argument it does not
    take, or a device or jax that does not run Mosaic GPU kernels."""

    def arguments():
        check(x, weight, scale_inv, layer)
        n, k = weight.shape[-2:]
        splits(x.shape[0], k, n, config or W8A8MatmulConfig(), device_num_sms())

    return mosaic_gpu.unsupported(arguments, "w8a8_matmul: ")


def w8a8_matmul(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    config: W8A8MatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``quantized(x) @ dequantize(weight, scale_inv)^T`` on e4m3 wgmmas (``x @
    weight[layer]^T`` for a stacked weight, read in place).

    Args:
      x: ``[M, K]`` bfloat16; quantized per row and 128 columns (``quantize_rows``).
      weight: ``[N, K]`` float8_e4m3fn (HF's layout), N and K multiples of 128; or a stack
        ``[L, N, K]`` with ``layer``.
      scale_inv: ``[N / 128, K / 128]`` float32, the weight's block scales (HF's
        ``weight_scale_inv``): its value is ``weight x scale_inv`` blockwise; ``[L, ...]``
        for a stack.
      layer: int32 scalar in ``[0, L)`` (may be traced, as a scan's layer index is; then it
        is not range-checked): which layer of a stacked weight to use.
      config: the launch (None: the defaults).
      interpret: Mosaic GPU's interpret mode (None: off a GPU).

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32 each 128 deep (summed in float32 across
      K's slices).
    """
    check(x, weight, scale_inv, layer)
    config = config or W8A8MatmulConfig()
    if interpret is None:
        interpret = online_softmax.interpret_default()
    m, k = x.shape
    n = weight.shape[-2]
    weight, scale_inv, layer = matmul_steps.as_stack(weight, scale_inv, layer)
    slices = splits(m, k, n, config, device_num_sms())
    rows = row_tile(m)
    values, scales = quantize_rows(x, -(-m // rows) * rows, interpret=interpret)  # whole tiles
    out_dtype = x.dtype if slices == 1 else jnp.float32
    depth = step_depth(k // BLOCK // slices, config)
    tiles = (values.shape[0] // rows, n // BLOCK)
    kernel = _launch(
        functools.partial(_kernel, tiles=tiles, band=config.band, depth=depth),
        config,
        interpret,
        rows=rows,
        stages=stages(m, k // BLOCK, slices, config, depth),
        slices=slices,
        grid=(tiles[0] * tiles[1], slices),
        out_shape=(slices, *values.shape[:1], n),
        out_dtype=out_dtype,
    )
    parts = jax.named_call(kernel, name="w8a8_matmul")(layer, values, scales, weight, scale_inv)
    out = parts[0] if slices == 1 else parts.sum(axis=0)
    return out[:m].astype(x.dtype)


def grouped_row_tile(m: int, num_groups: int) -> int:
    """Rows a tile of ``grouped_w8a8_matmul`` over ``m`` rows in ``num_groups`` groups: one
    compute warpgroup's 64 where the groups average up to 64 rows (decode's few tokens an
    expert: a tile's rows are one group's, and a taller tile would be mostly padding), else
    two warpgroups' 128."""
    return WARPGROUP_ROWS if m <= WARPGROUP_ROWS * num_groups else 2 * WARPGROUP_ROWS


def check_grouped(
    lhs: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    group_sizes: jax.Array,
    group_offset: int | jax.Array,
) -> None:
    """Refuses, in one line naming it, an argument ``grouped_w8a8_matmul`` does not take."""
    if weight.ndim != 3:
        raise ValueError(
            f"grouped_w8a8_matmul: weight [G, N, K] (a stack of groups' weights), got "
            f"{weight.shape}"
        )
    check(lhs, weight, scale_inv, 0)
    check_groups(lhs.shape[0], weight.shape[0], group_sizes, group_offset)


def grouped_unsupported(
    lhs: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    group_sizes: jax.Array,
    group_offset: int | jax.Array = 0,
) -> str | None:
    """Why ``grouped_w8a8_matmul`` cannot run this product here (None: it can): an argument
    it does not take, or a device or jax that does not run Mosaic GPU kernels."""
    return mosaic_gpu.unsupported(
        lambda: check_grouped(lhs, *stacked_groups(weight, scale_inv), group_sizes, group_offset),
        "grouped_w8a8_matmul: ",
    )


def grouped_w8a8_matmul(
    lhs: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    schedule: tiling.TileSchedule | None = None,
    config: W8A8MatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The grouped matmul (``grouped_matmul``'s contract) on e4m3 wgmmas: ``quantized(lhs[r])
    @ dequantize(weight[group_offset + g])^T`` for the rows r of group g; the MoE layer's
    routed experts over FP8 weights in HF's layout.

    A program owns a row tile of the schedule (one group's rows, copied from a multiple of 8
    rows as ``grouped_matmul``'s Mosaic GPU kernel copies them; the copy's rows of other
    groups are multiplied and not stored) and 128 output columns; the rest is
    ``w8a8_matmul``'s, in one slice of K.

    Args:
      lhs: ``[M, K]`` bfloat16, rows sorted by group; quantized per row and 128 columns
        (``quantize_rows``).
      weight: ``[G', N, K]`` float8_e4m3fn, each group's weight in HF's layout, N and K
        multiples of 128; scale_inv: ``[G', N / 128, K / 128]`` float32, their block scales.
        Leading axes stack (``stacked_groups``): ``[L, E, N, K]`` is ``[L * E, N, K]``.
      group_sizes: ``[G]`` int32 rows per group (0 allowed), summing to at most M; G <= G'.
      group_offset: int32 scalar (may be traced): group g's rows multiply
        ``weight[group_offset + g]``.
      schedule: the row tiles (``schedule_row_tiles`` with ``grouped_row_tile(M, G)`` rows
        a tile and ``align=8``); None plans them on the device, up to ``tiling.max_tiles``.
      config: the launch (None: the defaults; ``splits`` must be None or 1).
      interpret: Mosaic GPU's interpret mode (None: off a GPU).

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32 each 128 deep; 0 for the rows after the
      last group.
    """
    weight, scale_inv = stacked_groups(weight, scale_inv)
    check_grouped(lhs, weight, scale_inv, group_sizes, group_offset)
    config = config or W8A8MatmulConfig()
    rows = grouped_row_tile(lhs.shape[0], group_sizes.shape[0])
    if config.splits not in (None, 1):
        raise ValueError(f"grouped_w8a8_matmul: {config.splits} slices of K (it runs one)")
    if schedule is not None and (schedule.rows_per_tile != rows or schedule.align % ROW_ALIGN):
        raise ValueError(
            f"grouped_w8a8_matmul: a schedule of {schedule.rows_per_tile}-row tiles aligned "
            f"to {schedule.align} rows, for {rows}-row tiles (schedule_row_tiles(..., "
            f"align={ROW_ALIGN}))"
        )
    if interpret is None:
        interpret = online_softmax.interpret_default()
    group_offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    return _grouped_w8a8_matmul(
        lhs, weight, scale_inv, group_sizes, group_offset, schedule, config, interpret
    )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _grouped_w8a8_matmul(
    lhs, weight, scale_inv, group_sizes, group_offset, schedule, config, interpret
):
    m, k = lhs.shape
    n = weight.shape[1]
    num_groups = group_sizes.shape[0]
    rows = grouped_row_tile(m, num_groups)
    if schedule is None:
        schedule = device_schedule(group_sizes, m, rows, ROW_ALIGN)
    # A tile's copy starts at a multiple of ROW_ALIGN rows, at most a tile before the end.
    values, scales = quantize_rows(
        lhs, max(-(-m // ROW_ALIGN) * ROW_ALIGN, rows), interpret=interpret
    )
    tiles = (schedule.tile_segment.shape[0], n // BLOCK)
    depth = step_depth(k // BLOCK, config)
    kernel = _launch(
        functools.partial(
            _grouped_kernel, tiles=tiles, band=config.band, num_groups=num_groups, depth=depth
        ),
        config,
        interpret,
        rows=rows,
        stages=stages(rows, k // BLOCK, 1, config, depth),
        slices=1,
        grid=(tiles[0] * tiles[1],),
        out_shape=(values.shape[0], n),
        out_dtype=lhs.dtype,
    )
    out = jax.named_call(kernel, name="grouped_w8a8_matmul")(
        schedule.tile_segment,
        schedule.tile_start,
        schedule.tile_end,
        group_offset,
        values,
        scales,
        weight,
        scale_inv,
    )
    return out[:m]


def _launch(body, config, interpret, *, rows, stages, slices, grid, out_shape, out_dtype):
    """``plgpu.kernel`` of a program body: a memory warpgroup and ``rows / 64`` compute
    warpgroups, a ``[rows, BLOCK]`` output tile in shared memory."""
    compute_warpgroups = rows // WARPGROUP_ROWS
    return plgpu.kernel(
        functools.partial(body, slices=slices, rows=rows, stages=stages),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=dict(out_smem=plgpu.SMEM((rows, BLOCK), out_dtype)),
        grid=grid,
        grid_names=("tile", "split")[: len(grid)],
        num_threads=compute_warpgroups + 1,  # one warpgroup copies, the others multiply
        thread_name="wg",
        **mosaic_gpu.kernel_options(config, interpret, compute_warpgroups + 1),
    )


def _tile_order(tile, tiles: tuple[int, int], band: int):
    """``(row tile, column block)`` of program ``tile``: in bands of ``band`` column blocks,
    down every row tile and back up the next band; the columns' order for one row tile."""
    if tiles[0] == 1:
        return 0, tile
    return plgpu.planar_snake(tile, tiles, 1, band)


def _kernel(
    layer_gmem,
    x_gmem,
    x_scale_gmem,
    w_gmem,
    w_scale_gmem,
    out_gmem,
    out_smem,
    *,
    slices: int,
    rows: int,
    stages: int,
    tiles: tuple[int, int],
    band: int,
    depth: int,
):
    """One program of ``w8a8_matmul``: tile ``tile`` of the output's ``tiles`` (row tiles,
    column blocks) from slice ``split`` of K, ``[rows, BLOCK]``, of the stacked weight
    ``w_gmem [L, N, K]``'s layer ``layer_gmem [1]``; each compute warpgroup ``wg`` its 64
    rows."""
    split = lax.axis_index("split")
    row_block, column_block = _tile_order(lax.axis_index("tile"), tiles, band)
    first = row_block * rows
    columns = pl.ds(column_block * BLOCK, BLOCK)

    def store(own_rows):
        plgpu.copy_smem_to_gmem(
            out_smem.at[own_rows],
            out_gmem.at[split, pl.ds(first + own_rows.start, own_rows.size), columns],
        )

    _tile_product(
        x_gmem.at[pl.ds(first, rows)],
        x_scale_gmem.at[:, pl.ds(first, rows)],
        w_gmem.at[layer_gmem[0], columns],
        w_scale_gmem.at[layer_gmem[0], column_block],
        out_smem,
        store,
        split=split,
        slices=slices,
        rows=rows,
        stages=stages,
        depth=depth,
    )


def _grouped_kernel(
    segment_gmem,
    start_gmem,
    end_gmem,
    offset_gmem,
    x_gmem,
    x_scale_gmem,
    w_gmem,
    w_scale_gmem,
    out_gmem,
    out_smem,
    *,
    slices: int,
    rows: int,
    stages: int,
    tiles: tuple[int, int],
    band: int,
    num_groups: int,
    depth: int,
):
    """One program of ``grouped_w8a8_matmul``: the schedule's row tile and column block
    ``tile`` (in ``_tile_order``), its rows ``[start, end)`` of segment ``segment`` (a group,
    or the padding rows after them), each compute warpgroup ``wg`` the 64 rows of the tile's
    copy from ``first``."""
    tile, column_block = _tile_order(lax.axis_index("tile"), tiles, band)
    segment, r0, r1 = segment_gmem[tile], start_gmem[tile], end_gmem[tile]
    has_group = (segment < num_groups) & (r0 < r1)
    group = offset_gmem[0] + jnp.minimum(segment, num_groups - 1)
    # A multiple of ROW_ALIGN (a TMA copy into 8-row tiles), the tile's rows within a tile's
    # rows of it (the schedule's align).
    first = pl.multiple_of(jnp.minimum(r0 - r0 % ROW_ALIGN, x_gmem.shape[0] - rows), ROW_ALIGN)
    out_rows = out_gmem.at[pl.ds(first, rows), pl.ds(column_block * BLOCK, BLOCK)]

    def store(own_rows):
        """The tile's rows in the warpgroup's ``own_rows`` of the copy."""
        lo = jnp.clip(r0 - first, own_rows.start, own_rows.start + own_rows.size)
        hi = jnp.clip(r1 - first, own_rows.start, own_rows.start + own_rows.size)
        mosaic_gpu.copy_rows_smem_to_gmem(
            out_smem.at[own_rows], out_rows.at[own_rows], lo - own_rows.start, hi - lo
        )

    @pl.when(has_group)
    def _():
        _tile_product(
            x_gmem.at[pl.ds(first, rows)],
            x_scale_gmem.at[:, pl.ds(first, rows)],
            w_gmem.at[group, pl.ds(column_block * BLOCK, BLOCK)],
            w_scale_gmem.at[group, column_block],
            out_smem,
            store,
            split=0,
            slices=1,
            rows=rows,
            stages=stages,
            depth=depth,
        )

    @pl.when(~has_group & (r0 < r1))  # padding rows after the groups: zeros
    def _():
        wg = lax.axis_index("wg")

        @pl.when(wg < rows // WARPGROUP_ROWS)
        def _():
            own_rows = pl.ds(wg * WARPGROUP_ROWS, WARPGROUP_ROWS)
            zeros = jnp.zeros((WARPGROUP_ROWS, BLOCK), out_smem.dtype)
            out_smem.at[own_rows][...] = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            store(own_rows)
            plgpu.wait_smem_to_gmem(0)


def _tile_product(
    x_rows,
    x_scales,
    weight,
    weight_scales,
    out_smem,
    store,
    *,
    split,
    slices,
    rows,
    stages,
    depth,
):
    """A program's product: ``x_rows [rows, K]`` (e4m3) times ``weight [BLOCK, K]^T``'s slice
    ``split`` of ``slices`` of K, with ``x_scales [K / BLOCK, rows]`` and ``weight_scales [K
    / BLOCK]``; each compute warpgroup writes its 64 rows into ``out_smem`` and hands them
    to ``store(own_rows)`` (TMA copies out, waited for here)."""
    steps = x_rows.shape[1] // BLOCK // slices
    first_step = split * steps
    acc_shape = (WARPGROUP_ROWS, BLOCK)
    # The compute warpgroup's rows of the tile (static where it is the only one).
    first_row = 0 if rows == WARPGROUP_ROWS else lax.axis_index("wg") * WARPGROUP_ROWS
    own_rows = pl.ds(first_row, WARPGROUP_ROWS)

    def weight_scale(i):
        """Step ``i``'s weight scale (of the slice; clamped to its last step)."""
        return weight_scales[first_step + jnp.minimum(i, steps - 1)]

    def row_factors(x_scale_tile, h, scale):
        """The ``[64]`` factors of part ``h``'s product: each row's x scale times the
        weight's."""
        row_scales = plgpu.load(x_scale_tile.at[h, own_rows], layout=plgpu.Layout.WGMMA.reduce(1))
        return row_scales * scale

    def promote(total, acc, factors):
        return total + acc * lax.broadcast_in_dim(factors, acc_shape, [0])

    def multiply(acc, x_tile, w_tile, h):
        # [64, BLOCK] += x_tile's rows [64, BLOCK (K)] @ w_tile^T [BLOCK (K), BLOCK]
        depth_columns = pl.ds(h * BLOCK, BLOCK)
        plgpu.wgmma(
            acc, x_tile.at[own_rows, depth_columns], w_tile.at[:, depth_columns].transpose((1, 0))
        )

    def step_scales(i):
        """Pipeline step ``i``'s weight scales, one a product."""
        return tuple(weight_scale(depth * i + h) for h in range(depth))

    def compute_context(run_pipeline):
        total = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
        total, _ = run_pipeline((total, step_scales(0)))
        out_smem.at[own_rows][...] = total.astype(out_smem.dtype)
        plgpu.commit_smem()
        store(own_rows)
        plgpu.wait_smem_to_gmem(0)

    def step(indices, x_tile, w_tile, x_scale_tile, carry):
        """``depth`` of K's 128-deep steps, each its own product (the e4m3 wgmma keeps about
        14 bits of its running sum), added to the total as the next one runs."""
        total, scales = carry
        next_scales = step_scales(indices[0] + 1)  # in flight while this step computes

        def products(*accumulators):
            for h, acc in enumerate(accumulators):
                multiply(acc, x_tile, w_tile, h)
            result = total
            for h, acc in enumerate(accumulators):
                # The later products may still run; the last wait is for all of them, and
                # the slot goes back to the copies.
                done = plgpu.wgmma_accumulator_load(acc, wait_n=depth - 1 - h)
                result = promote(result, done, row_factors(x_scale_tile, h, scales[h]))
            return result

        total = pl.run_scoped(products, *[plgpu.ACC(acc_shape)] * depth)
        return total, next_scales

    k_slice = pl.ds(first_step * BLOCK, steps * BLOCK)
    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps // depth,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (rows, depth * BLOCK),
                lambda i: (0, i),
                transforms=mosaic_gpu.swizzled(BLOCK, 1),
            ),
            plgpu.BlockSpec(
                (BLOCK, depth * BLOCK),
                lambda i: (0, i),
                transforms=mosaic_gpu.swizzled(BLOCK, 1),
            ),
            # depth x 64 or 128 float32 scales a step: slots of 256 or 512 bytes a part keep
            # every TMA destination 128-byte aligned
            plgpu.BlockSpec((depth, rows), lambda i: (i, 0)),
        ],
        wg_axis="wg",
        num_compute_wgs=rows // WARPGROUP_ROWS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )(x_rows.at[:, k_slice], weight.at[:, k_slice], x_scales.at[pl.ds(first_step, steps)])
