"""The grouped matmul on Mosaic GPU (Hopper, sm90) for many rows a group: the routed experts'
matmuls at prefill over bf16 weights (FP8 experts run on ``w8a8_matmul``'s grouped form).

The contract is the Triton kernel's (``pallas_triton.grouped_matmul``): rows sorted by group,
``out[r] = lhs[r] @ rhs[group_offset + g]`` for the rows r of group g, zeros for the rows
after the last group, the same row tiles (``schedule_row_tiles``: a tile holds rows of one
group) and the same stacked ``rhs``. What differs is how a tile is computed:

- A program owns one row tile and ``2 x block_n`` output columns: a memory warpgroup copies
  the tile's ``[block_m, block_k]`` rows of lhs and the ``[block_k, 2 x block_n]`` weight
  tile by TMA, ``stages`` steps ahead, and two compute warpgroups multiply (wgmma), each
  into its own ``[block_m, block_n]`` float32 accumulator: the columns are split between
  them, so neither waits for the other.
- A tile's copy of lhs starts at a multiple of 8 rows (TMA into 8-row tiles of shared
  memory): a group's tiles are cut from its first row rounded down (``schedule_row_tiles(...,
  align=8)``), and a tile that would run past the last row is copied from ``M - block_m``.
  The copy's rows of other groups are computed and not stored
  (``mosaic_gpu.copy_rows_smem_to_gmem``).
- A tile with no group's rows (padding rows after the groups) stores zeros and reads no
  weight; a tile past the real ones does nothing.
- With ``skip_empty_half`` the rows are multiplied in halves of 64 (the wgmma's M), the
  second half of a tile only where the tile has rows there: a group's last tile is mostly
  short.
- Programs run in ``config.band`` order on a one-axis grid (``tiling.banded``; by default
  each row tile's column blocks side by side, its rows kept in L2 across them). Mosaic GPU
  launches a grid's last axis fastest (Triton its first), so the grid ``(column blocks,
  tiles)`` this kernel had ran the row tiles fastest, and the programs in flight shared
  neither rows nor weight columns: V3's gate_up over 65536 rows (15 GB of weights, 0.9 GB of
  rows) read 30.3 GB from HBM, against 21 GB in this order (ncu; H100, 2026-12-05).

What limits it and the launches tried that did not pay: ``MOSAIC_GPU.md`` here.

Where the Triton kernel is the one to run (decode's few rows a group, shapes that do not
tile) is the kernel set's choice; this kernel refuses what it does not take
(``unsupported``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import mosaic_gpu, online_softmax, tiling
from .pallas_triton import check, device_schedule, stacked_groups

COMPUTE_WARPGROUPS = 2  # each owns block_n of a program's output columns
ROW_ALIGN = 8  # a tile's copy of lhs starts at a multiple of this row (its 8-row tiles)
WGMMA_ROWS = 64  # a wgmma's M: the halves of a tile that skip_empty_half multiplies apart


@dataclasses.dataclass(frozen=True)
class MosaicGroupedMatmulConfig:
    """Launch of the Mosaic GPU grouped matmul.

    block_m: rows a tile (64 or 128: the wgmma's M, once or twice).
    block_n: output columns a compute warpgroup (a multiple of 64; a program has two).
    block_k: K a pipeline step (a multiple of 64).
    stages: pipeline steps in flight (None: as many as shared memory holds, up to 4).
    band: row tiles whose programs run side by side for each column block
      (``tiling.banded``; 1: column blocks fastest, each row tile's programs together).
    skip_empty_half: a 128-row tile multiplies its rows in halves of 64, the second only
      where the tile has rows there. Over bf16 weights it took V3's gate_up at 8192 tokens
      from 8360 to 8921 us and left down at 4453 (H100, 2026-12-05: a trial script; over
      the FP8 weights this kernel then converted, 0.95-0.99x the time).
    approx_math, auto_barriers: as ``MosaicDecodeConfig``'s (``mosaic_gpu.kernel_options``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int | None = None
    band: int = 1
    skip_empty_half: bool = False
    approx_math: bool = True
    auto_barriers: bool = False

    @classmethod
    def for_weight(cls, width: int) -> MosaicGroupedMatmulConfig:
        """The defaults, with 64-column warpgroup blocks where N is not whole 256-column
        programs (a small test layer's; DeepSeek's weights take the defaults)."""
        return cls(block_n=128 if width % (COMPUTE_WARPGROUPS * 128) == 0 else 64)


def shared_memory(config: MosaicGroupedMatmulConfig, stages: int) -> int:
    """Bytes of shared memory a program takes: the ring of lhs and weight tiles and each
    compute warpgroup's output tile (bf16)."""
    width = COMPUTE_WARPGROUPS * config.block_n
    ring = stages * (config.block_m + width) * 2 * config.block_k
    return ring + COMPUTE_WARPGROUPS * config.block_m * config.block_n * 2


def stages_for(config: MosaicGroupedMatmulConfig) -> int:
    """``config.stages``, or the most (up to 4) that fit shared memory; 0: none fits."""
    if config.stages is not None:
        return config.stages
    stages = 4
    while stages and shared_memory(config, stages) > mosaic_gpu.SMEM_BYTES:
        stages -= 1
    return stages


def _check_launch(depth: int, width: int, config: MosaicGroupedMatmulConfig) -> None:
    """ValueError, in one line, where a ``[K, N] = [depth, width]`` weight does not tile under
    ``config``."""
    if config.band < 1:
        raise ValueError(f"grouped_matmul (Mosaic GPU): band {config.band} is not at least 1")
    if config.block_m not in (64, 128):
        raise ValueError(f"grouped_matmul (Mosaic GPU): block_m {config.block_m} is not 64 or 128")
    if config.block_n < 64 or config.block_n % 64 or config.block_k < 64 or config.block_k % 64:
        raise ValueError(
            f"grouped_matmul (Mosaic GPU): block_n {config.block_n} and block_k "
            f"{config.block_k} must be multiples of 64"
        )
    if width % (COMPUTE_WARPGROUPS * config.block_n) or depth % config.block_k:
        raise ValueError(
            f"grouped_matmul (Mosaic GPU): weight [{depth}, {width}] is not whole steps of "
            f"{config.block_k} and programs of {COMPUTE_WARPGROUPS * config.block_n} columns"
        )
    stages = stages_for(config)
    if stages < 1 or shared_memory(config, stages) > mosaic_gpu.SMEM_BYTES:
        raise ValueError(
            f"grouped_matmul (Mosaic GPU): {config} needs "
            f"{shared_memory(config, max(stages, 1))} bytes of shared memory (has "
            f"{mosaic_gpu.SMEM_BYTES})"
        )


def unsupported(
    lhs: jax.Array, rhs: jax.Array, config: MosaicGroupedMatmulConfig | None = None
) -> str | None:
    """Why the kernel cannot run this product here (None: it can): an lhs or rhs not
    bfloat16, a weight that does not tile, or a device or jax that does not run Mosaic GPU
    kernels."""
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16:
        return f"lhs and rhs are {lhs.dtype} and {rhs.dtype}, not bfloat16"
    return mosaic_gpu.unsupported(
        lambda: _check_launch(*rhs.shape[-2:], config or MosaicGroupedMatmulConfig()),
        "grouped_matmul (Mosaic GPU): ",
    )


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    schedule: tiling.TileSchedule | None = None,
    config: MosaicGroupedMatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped matmul over rows sorted by group, on Mosaic GPU.

    Args:
      lhs: ``[M, K]`` bfloat16, rows sorted by group.
      rhs: ``[G', K, N]`` bfloat16; leading axes stack (``[L, E, K, N]`` is ``[L * E, K,
        N]``). K a multiple of ``config.block_k``, N of ``2 x config.block_n``.
      group_sizes: ``[G]`` int32 rows per group (0 allowed), summing to at most M; G <= G'.
      group_offset: int32 scalar (may be traced): group g's rows multiply
        ``rhs[group_offset + g]``.
      schedule: the row tiles (``schedule_row_tiles`` with ``config.block_m`` rows a tile);
        None plans them on the device, up to ``tiling.max_tiles``.
      config: the launch (None: the defaults).
      interpret: Mosaic GPU's interpret mode (None: off a GPU).

    Returns:
      ``out [M, N]`` bfloat16, accumulated in float32: ``lhs[r] @ rhs[g]`` for the rows r of
      group g, 0 for the rows after the last group.
    """
    rhs, _ = stacked_groups(rhs)
    check(lhs, rhs, group_sizes, group_offset)
    config = config or MosaicGroupedMatmulConfig()
    if lhs.dtype != jnp.bfloat16:
        raise ValueError(f"grouped_matmul (Mosaic GPU): lhs is {lhs.dtype}, not bfloat16")
    _check_launch(*rhs.shape[-2:], config)
    if schedule is not None and (
        schedule.rows_per_tile != config.block_m or schedule.align % ROW_ALIGN
    ):
        raise ValueError(
            f"grouped_matmul (Mosaic GPU): a schedule of {schedule.rows_per_tile}-row tiles "
            f"aligned to {schedule.align} rows for block_m {config.block_m} (schedule_row_tiles"
            f"(..., align={ROW_ALIGN}))"
        )
    if interpret is None:
        interpret = online_softmax.interpret_default()
    group_offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    return _grouped_matmul(
        lhs, rhs, group_sizes, group_offset, schedule, config=config, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _grouped_matmul(lhs, rhs, group_sizes, group_offset, schedule, *, config, interpret):
    m = lhs.shape[0]
    num_groups = group_sizes.shape[0]
    if schedule is None:
        schedule = device_schedule(group_sizes, m, config.block_m, ROW_ALIGN)
    # A tile's copy starts at a multiple of ROW_ALIGN rows, at most block_m rows before the
    # end: lhs is padded to whole ROW_ALIGN rows (the MoE layer's rows, tokens x top-k,
    # mostly are) and to at least one tile (a short prompt's).
    rows = max(-(-m // ROW_ALIGN) * ROW_ALIGN, config.block_m)
    lhs = online_softmax.pad_to(lhs, (rows, lhs.shape[1]))
    width = rhs.shape[2]
    out_tile = plgpu.SMEM((config.block_m, config.block_n), lhs.dtype)
    num_warpgroups = COMPUTE_WARPGROUPS + 1  # beside one that copies
    kernel = plgpu.kernel(
        functools.partial(_kernel, num_groups=num_groups, config=config, stages=stages_for(config)),
        out_type=jax.ShapeDtypeStruct((rows, width), lhs.dtype),
        scratch_types=dict(out_tiles=[out_tile] * COMPUTE_WARPGROUPS),
        grid=(
            tiling.banded_programs(
                schedule.tile_segment.shape[0],
                width // (COMPUTE_WARPGROUPS * config.block_n),
                config.band,
            ),
        ),
        grid_names=("program",),
        num_threads=num_warpgroups,
        thread_name="wg",
        **mosaic_gpu.kernel_options(config, interpret, num_warpgroups),
    )
    out = jax.named_call(kernel, name="grouped_matmul_mosaic_gpu")(
        schedule.tile_segment,
        schedule.tile_start,
        schedule.tile_end,
        group_offset,
        lhs,
        rhs,
    )
    return out[:m]


def _kernel(
    segment_gmem,
    start_gmem,
    end_gmem,
    offset_gmem,
    lhs_gmem,
    rhs_gmem,
    out_gmem,
    out_tiles,
    *,
    num_groups: int,
    config: MosaicGroupedMatmulConfig,
    stages: int,
):
    """One program: a row tile of the schedule x columns ``[n0, n0 + 2 block_n)``, in
    ``config.band`` order (``tiling.banded``)."""
    block_m, block_n = config.block_m, config.block_n
    rows, depth = lhs_gmem.shape
    width = rhs_gmem.shape[2]
    tile, column_block, real = tiling.banded_tile(
        lax.axis_index("program"),
        segment_gmem.shape[0],
        width // (COMPUTE_WARPGROUPS * block_n),
        config.band,
    )
    n0 = column_block * COMPUTE_WARPGROUPS * block_n
    segment, r0, r1 = segment_gmem[tile], start_gmem[tile], end_gmem[tile]
    r1 = jnp.where(real, r1, r0)  # an extra tile owns no row
    has_group = (segment < num_groups) & (r0 < r1)
    group = offset_gmem[0] + jnp.minimum(segment, num_groups - 1)
    # The tile's copy starts here: a multiple of ROW_ALIGN (a TMA copy into 8-row tiles of
    # shared memory), its rows within block_m of it (the schedule's align).
    first = pl.multiple_of(jnp.minimum(r0 - r0 % ROW_ALIGN, rows - block_m), ROW_ALIGN)

    def store(wg, pieces):
        """Compute warpgroup ``wg``'s columns of the tile's rows ``[r0, r1)``, from
        ``pieces``, the tile's ``block_m`` rows (those of the copy from ``first``) in equal
        parts, ``[block_m / len(pieces), block_n]`` each."""

        def write(out_tile):
            piece_rows = block_m // len(pieces)
            for p, values in enumerate(pieces):
                out_tile[pl.ds(p * piece_rows, piece_rows)] = values.astype(out_tile.dtype)
            plgpu.commit_smem()
            tile_rows = out_gmem.at[pl.ds(first, block_m), pl.ds(n0 + wg * block_n, block_n)]
            mosaic_gpu.copy_rows_smem_to_gmem(out_tile, tile_rows, r0 - first, r1 - r0)
            plgpu.wait_smem_to_gmem(0)

        for c in range(COMPUTE_WARPGROUPS):  # a warpgroup writes its own tile
            pl.when(wg == c)(functools.partial(write, out_tiles[c]))

    @pl.when(has_group)
    def _():
        _run_pipeline(
            lhs_gmem.at[pl.ds(first, block_m)],
            rhs_gmem.at[group, :, pl.ds(n0, COMPUTE_WARPGROUPS * block_n)],
            store,
            r1 - first > WGMMA_ROWS,
            depth=depth,
            config=config,
            stages=stages,
        )

    @pl.when(~has_group & (r0 < r1))  # padding rows after the groups: zeros
    def _():
        wg = lax.axis_index("wg")

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _():
            zeros = jnp.zeros((block_m, block_n), jnp.float32)
            store(wg, [plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)])


def _run_pipeline(
    lhs_rows,
    weight,
    store,
    second_half,
    *,
    depth: int,
    config: MosaicGroupedMatmulConfig,
    stages: int,
):
    """The tile's K steps: ``lhs_rows [block_m, K]`` times ``weight [K, 2 block_n]``, each
    compute warpgroup's columns stored by ``store``.

    With ``config.skip_empty_half`` the rows are multiplied in halves of ``WGMMA_ROWS``, each
    into its own accumulator, the second (of a 128-row tile) only where ``second_half``
    (traced: the tile's rows reach it). A group's last tile is mostly short (V3's experts at
    prefill, about 256 rows each, cut into 128-row tiles: 78% of the tiles' rows are a
    group's), and its empty half would cost a full product a step."""
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    steps = depth // block_k
    wg = lax.axis_index("wg")  # of the compute warpgroups
    columns = pl.ds(wg * block_n, block_n)
    pieces = block_m // WGMMA_ROWS if config.skip_empty_half else 1
    piece_rows = block_m // pieces
    accumulators = [plgpu.ACC((piece_rows, block_n), jnp.float32)] * pieces

    def product(accs, lhs_tile, weight_tile):
        """``accs += lhs_tile @ weight_tile`` (by halves where there are two accumulators),
        then a wait for the step before's products (each wgmma is a group of its own): its
        slots go back to the copies."""
        plgpu.wgmma(accs[0], lhs_tile.at[pl.ds(0, piece_rows)], weight_tile)
        if len(accs) == 1:
            plgpu.wgmma_wait(1)
            return

        @pl.when(second_half)
        def _():
            plgpu.wgmma(accs[1], lhs_tile.at[pl.ds(piece_rows, piece_rows)], weight_tile)
            plgpu.wgmma_wait(2)

        @pl.when(~second_half)
        def _():
            plgpu.wgmma_wait(1)

    def compute_context(run_pipeline):
        def run(*accs):
            run_pipeline(accs)
            # Reading an accumulator waits for the last product (an unused half holds 0).
            store(wg, [acc[...] for acc in accs])

        pl.run_scoped(run, *accumulators)

    def step(_, lhs_tile, weight_tile, accs):
        product(accs, lhs_tile, weight_tile.at[:, columns])
        return accs

    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (block_m, block_k),
                lambda k: (0, k),
                transforms=mosaic_gpu.swizzled(block_k, 2),
                delay_release=1,
            ),
            plgpu.BlockSpec(
                (block_k, COMPUTE_WARPGROUPS * block_n),
                lambda k: (k, 0),
                transforms=mosaic_gpu.swizzled(64, 2),
                delay_release=1,
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=COMPUTE_WARPGROUPS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )(lhs_rows, weight)
