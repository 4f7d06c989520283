"""Grouped matmul (Pallas, Triton lowering): the expert matmul of a mixture-of-experts layer.

``out[r] = lhs[r] @ rhs[g]`` for every row r of group g, where the rows of ``lhs`` are sorted
by group: group g owns rows ``[offset[g], offset[g] + group_sizes[g])``, ``offset`` the
exclusive cumulative sum of ``group_sizes``. Rows past the last group are padding and get 0.
``rhs`` is ``[G, K, N]`` in lhs's dtype, or FP8 in HF's layout ``[G, N, K]`` (DeepSeek's
experts as they ship, the layout Hopper's FP8 tensor cores read: ``w8a8_matmul``'s grouped
form takes the same stack), ``out[r] = lhs[r] @ dequantize(rhs[g])^T``.

Rows are cut into tiles of ``block_m`` rows that never straddle two groups; the tile -> group
schedule (``schedule_row_tiles``, the shared ``tiling`` planner) is built on the device with
jnp under a static bound on the tile count (``tiling.max_tiles``), or on the host with NumPy.
Each program computes one tile x ``block_n`` output columns, looping over K in steps of
``block_k``. An empty group has no tile, so its weights are never read: at decode, where a
few tokens pick a few experts, only the chosen experts' weights move. Unlike
``jax.lax.ragged_dot``, which on GPUs lowers to a dense matmul over every group (every row
times every group's matrix), the work here is proportional to the rows.

Programs run in ``config.band`` order (``tiling.banded``): the row tiles a band at a time and,
within it, each column block's programs side by side, so that the programs in flight share a
few row tiles (kept in L2 across their column blocks) and read a group's weight columns
together (kept in L2 across its row tiles). With column blocks fastest (a band of 1) a group's
row tiles reached the same weights a column-block count apart, and HBM carried the weights
about 1.5 times at V3's prefill shapes (ncu: 23 GB read for 15 GB of gate_up weights and
0.9 GB of rows; H100, 2026-12-05).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import fp8, fp8_blocks, matmul_steps, online_softmax, tiling
from .. import tuned as _tuned

# A prefill's row tiles run in bands of this many (``tiling.banded``): at V3's routed experts
# over 8192 tokens (65536 rows, about 256 a group), bands of 8 took gate_up from 8057 to
# 7784 us and down from 4317 to 4200 against column blocks fastest; 4 and 16 were no faster
# (H100, 2026-12-05, a trial script).
PREFILL_BAND = 8


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Launch parameters of the grouped matmul kernel (powers of two, each >= 16);
    ``for_shape`` picks them for a shape, ``dataclasses.replace`` makes variants. The
    defaults suit many rows per group (prefill: compute-bound)."""

    block_m: int = 128  # rows per tile (a tile holds rows of one group)
    block_n: int = 256  # output columns per program
    block_k: int = 64  # reduction depth per step
    num_warps: int = 8
    num_stages: int = 3
    # FP8 weights: the scales multiply each K step's product (the tile only converted), and
    # the weight tile as the MMA's left operand (matmul_steps.accumulate)
    scale_product: bool = False
    swap_ab: bool = False
    # bfloat16 lhs: the MMA in float16, lhs scaled per row into its range, the scales on the
    # product (matmul_steps.float16_operands)
    float16_mma: bool = False
    # row tiles whose programs run side by side for each column block (tiling.banded)
    band: int = 1

    def __post_init__(self):
        if self.band < 1:
            raise ValueError(f"GroupedMatmulConfig.band must be at least 1, got {self.band}")

    @staticmethod
    def regime(num_rows: int, num_groups: int) -> str:
        """``"decode"`` (up to 16 rows per group on average), ``"mid"`` (up to 64) or
        ``"prefill"``: the row regimes ``for_shape`` (and ``tuned.GROUPED_FP8``) tell apart."""
        rows_per_group = num_rows / max(num_groups, 1)
        if rows_per_group <= 16:
            return "decode"
        return "mid" if rows_per_group <= 64 else "prefill"

    @classmethod
    def for_shape(
        cls,
        num_rows: int,
        num_groups: int,
        depth: int | None = None,
        width: int | None = None,
        fp8: bool = False,
    ) -> GroupedMatmulConfig:
        """Launch parameters by the mean rows per group (static shapes only, so it works
        under jit). Few rows per group (decode: batch x top-k spread over the experts) is a
        stream of weights: 16-row tiles, so that one tile covers an expert's tokens and its
        weights are read once, with deep K steps and a deep pipeline. Many rows (prefill) is
        compute: 128-row tiles 256 columns wide (the fastest of ``scripts/bench_moe.py
        --sweep``'s prefill variants; its decode variants ran about even). FP8 weights
        (``fp8``, with ``[K, N] = [depth, width]``) run ``tuned.GROUPED_FP8``'s measured best
        for the shape where it has one."""
        regime = cls.regime(num_rows, num_groups)
        if fp8:
            tuned = _tuned.GROUPED_FP8.get(f"{regime}x{depth}x{width}")
            if tuned is not None:
                return cls(**tuned)
        if regime == "decode":
            return cls(16, 128, 128, num_warps=4, num_stages=4)
        if regime == "mid":
            return cls(64, 128, 64, num_warps=4, num_stages=4)
        return cls(band=PREFILL_BAND)


def schedule_row_tiles(
    group_sizes,
    num_rows: int,
    rows_per_tile: int,
    *,
    num_tiles: int | None = None,
    align: int = 1,
    xp=np,
) -> tiling.TileSchedule:
    """The row tiles of groups of ``group_sizes [G]`` rows (and of the padding rows after
    them up to ``num_rows``): ``rows_per_tile`` rows of one group each, in group order. Group
    sizes past ``num_rows`` rows are cut at ``num_rows``. ``xp=np`` on the host, or ``xp=jnp``
    traced with ``num_tiles`` a static bound (``tiling.max_tiles(num_rows, G,
    rows_per_tile, align)``). ``align``: each group's tiles cut from its first row rounded
    down to a multiple of it (``tiling``; the Mosaic GPU kernel's copies need 8)."""
    sizes = xp.asarray(group_sizes).astype(xp.int32)
    ends = xp.minimum(xp.cumsum(sizes).astype(xp.int32), num_rows)
    offsets = xp.concatenate([xp.zeros(1, xp.int32), ends])
    return tiling.schedule_tiles(
        offsets, num_rows, rows_per_tile, num_tiles=num_tiles, align=align, xp=xp
    )


def device_schedule(
    group_sizes: jax.Array, num_rows: int, rows_per_tile: int, align: int = 1
) -> tiling.TileSchedule:
    """``schedule_row_tiles`` of ``group_sizes [G]`` (may be traced) planned on the device,
    up to the static bound ``tiling.max_tiles``: what a kernel given no schedule runs."""
    return schedule_row_tiles(
        group_sizes,
        num_rows,
        rows_per_tile,
        num_tiles=tiling.max_tiles(num_rows, group_sizes.shape[0], rows_per_tile, align),
        align=align,
        xp=jnp,
    )


def _grouped_matmul_kernel(
    tile_segment_ref,
    tile_start_ref,
    tile_end_ref,
    group_offset_ref,
    lhs_ref,
    rhs_ref,
    *rest,
    num_groups: int,
    depth: int,
    width: int,
    block_m: int,
    block_n: int,
    block_k: int,
    blocks: fp8_blocks.Fp8Blocks | None,
    scale_product: bool,
    swap_ab: bool,
    band: int,
):
    """One row tile x ``block_n`` output columns (``rest``: rhs's scales with ``blocks``,
    lhs's ``float16_rows`` factors where lhs is float16, then the output)."""
    scale_ref, *rest = rest if blocks is not None else (None, *rest)
    row_scale_ref, out_ref = rest if len(rest) == 2 else (None, *rest)
    t, j, real = tiling.banded_tile(
        pl.program_id(0), tile_segment_ref.shape[0], pl.cdiv(width, block_n), band
    )
    g, r0, r1 = tile_segment_ref[t], tile_start_ref[t], tile_end_ref[t]
    r1 = jnp.where(real, r1, r0)  # an extra tile owns no row
    # Padding tiles (the rows after the groups, the tiles past the real ones) run no step and
    # store zeros where they own rows; no weight (or scale) of any group is read for them.
    has_group = (g < num_groups) & (r0 < r1)
    g = group_offset_ref[0] + jnp.minimum(g, num_groups - 1)
    row_ok = r0 + jnp.arange(block_m, dtype=jnp.int32) < r1
    n0 = j * block_n
    steps = jnp.int32(pl.cdiv(depth, block_k))
    acc = matmul_steps.accumulate(
        lhs_ref,
        rhs_ref,
        scale_ref,
        r0=r0,
        row_ok=row_ok,
        n0=n0,
        lead=(g,),
        begin=jnp.int32(0),
        end=jnp.where(has_group, steps, jnp.int32(0)),
        depth=depth,
        width=width,
        block_k=block_k,
        block_n=block_n,
        blocks=blocks,
        scale_product=scale_product,
        swap_ab=swap_ab,
    )
    if row_scale_ref is not None:
        acc = matmul_steps.unscale_rows(acc, row_scale_ref, r0, row_ok)
    cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
    plgpu.store(
        out_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)],
        acc.astype(out_ref.dtype),
        mask=row_ok[:, None] & (cols < width)[None, :],
    )


def stacked_groups(
    rhs: jax.Array, rhs_scale_inv: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``rhs [..., G', K, N]`` (a stacked model's every layer's experts, ``[L, E, K, N]``) and
    its scales ``[..., G', ...]`` as one ``[L E, K, N]`` stack of matrices: a free reshape
    of whole arrays. Done here rather than by the caller: an expert-split stack reshaped
    outside the kernel's ``shard_map`` (``sharding._by_experts``) would be gathered whole to
    do it, every step."""
    if rhs.ndim <= 3:
        return rhs, rhs_scale_inv
    if rhs_scale_inv is not None:
        rhs_scale_inv = rhs_scale_inv.reshape(-1, *rhs_scale_inv.shape[-2:])
    return rhs.reshape(-1, *rhs.shape[-2:]), rhs_scale_inv


def _width(rhs: jax.Array, blocks: fp8_blocks.Fp8Blocks | None) -> int:
    """N of ``rhs [G, K, N]``, or of an FP8 rhs ``[G, N, K]``."""
    return rhs.shape[2] if blocks is None else rhs.shape[1]


def check(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset,
    rhs_scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
) -> None:
    """The kernel's (and its reference's) input checks: ValueError in one line naming the
    argument."""
    if (rhs_scale_inv is None) != (blocks is None):
        raise ValueError("rhs_scale_inv and blocks go together (an FP8 rhs needs both)")
    depth_axis = 1 if blocks is None else 2  # [G, K, N], or an FP8 rhs's [G, N, K]
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[depth_axis]:
        form = "[G, K, N]" if blocks is None else "[G, N, K] (FP8, HF's layout)"
        raise ValueError(f"lhs {lhs.shape} must be [M, K] and rhs {rhs.shape} {form}")
    if lhs.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"lhs must be bfloat16 or float32, got {lhs.dtype}")
    if blocks is not None:
        blocks.check_nk(rhs, rhs_scale_inv, "rhs")
    elif rhs.dtype != lhs.dtype:
        raise ValueError(
            f"lhs and rhs must both be bfloat16 or float32 (or rhs float8_e4m3fn with "
            f"rhs_scale_inv), got {lhs.dtype}, {rhs.dtype}"
        )
    if min(rhs.shape) < 1:
        raise ValueError(f"rhs {rhs.shape}: groups, K and N must be >= 1")
    check_groups(lhs.shape[0], rhs.shape[0], group_sizes, group_offset)


def check_groups(num_rows: int, num_matrices: int, group_sizes: jax.Array, group_offset) -> None:
    """ValueError, in one line naming it, where ``group_sizes`` is not int32 ``[G]`` of at
    most ``num_matrices`` groups summing to at most ``num_rows`` rows (where concrete), or
    ``group_offset`` puts the groups past the matrices (where concrete)."""
    if (
        group_sizes.ndim != 1
        or not 1 <= group_sizes.shape[0] <= num_matrices
        or group_sizes.dtype != jnp.int32
    ):
        raise ValueError(
            f"group_sizes must be int32 [G] with G <= {num_matrices} (rhs's groups), got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}"
        )
    if not isinstance(group_offset, jax.core.Tracer) and not (
        0 <= int(group_offset) <= num_matrices - group_sizes.shape[0]
    ):
        raise ValueError(
            f"group_offset {int(group_offset)} puts {group_sizes.shape[0]} groups past rhs's "
            f"{num_matrices}"
        )
    if not isinstance(group_sizes, jax.core.Tracer):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any() or sizes.sum() > num_rows:
            raise ValueError(
                f"group_sizes must be >= 0 and sum to at most {num_rows} rows, got {sizes.tolist()}"
            )


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: int | jax.Array = 0,
    rhs_scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
    schedule: tiling.TileSchedule | None = None,
    config: GroupedMatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped matmul over rows sorted by group.

    Args:
      lhs: ``[M, K]`` rows sorted by group (bf16 or f32).
      rhs: ``[G', K, N]`` one ``[K, N]`` matrix per group in lhs's dtype, or float8_e4m3fn
        ``[G', N, K]`` (HF's layout) with ``rhs_scale_inv``; group g's rows multiply
        ``rhs[group_offset + g]`` (its transpose for FP8). Leading axes stack too
        (``stacked_groups``): ``[L, E, K, N]`` is ``[L * E, K, N]``.
      group_sizes: ``[G]`` int32 rows per group (0 allowed), summing to at most M; G <= G'.
      group_offset: int32 scalar (may be traced), the first of rhs's matrices the groups use.
        A stacked model passes every layer's experts (``[L, E, K, N]``) and ``layer * E``:
        slicing one layer's experts out under a scan would copy them each step.
      rhs_scale_inv: for an FP8 rhs, its float32 block scales ``[G', N-grid, K-grid]``
        (``fp8_blocks.Fp8Blocks.scale_shape_nk``, HF's ``weight_scale_inv``); each weight
        tile is dequantized into lhs's dtype in registers (or into float16 with
        ``config.float16_mma``). blocks: their block sizes (static).
      schedule: the row tiles (``schedule_row_tiles``; its ``rows_per_tile`` wins over
        ``config.block_m``); None plans them on the device, up to the static bound
        ``tiling.max_tiles``.
      config: launch parameters (default: ``GroupedMatmulConfig.for_shape(M, G)``); block
        sizes larger than a dimension shrink to the power of two that fits it (at least 16).

    Returns:
      ``out [M, N]`` in lhs's dtype, accumulated in float32: ``lhs[r] @ rhs[g]`` for the rows r
      of group g, 0 for the rows after the last group.
    """
    rhs, rhs_scale_inv = stacked_groups(rhs, rhs_scale_inv)
    check(lhs, rhs, group_sizes, group_offset, rhs_scale_inv, blocks)
    if interpret is None:
        interpret = online_softmax.interpret_default()
    if not interpret:
        fp8.check_triton_indexable(rhs, "rhs")
    config = config or GroupedMatmulConfig.for_shape(
        lhs.shape[0],
        group_sizes.shape[0],
        lhs.shape[1],
        _width(rhs, blocks),
        fp8=blocks is not None,
    )
    if schedule is not None:
        config = dataclasses.replace(config, block_m=schedule.rows_per_tile)
    group_offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    return _grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        rhs_scale_inv,
        schedule,
        blocks=blocks,
        config=config,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("blocks", "config", "interpret"))
def _grouped_matmul(
    lhs, rhs, group_sizes, group_offset, rhs_scale_inv, schedule, *, blocks, config, interpret
):
    m, k = lhs.shape
    num_groups = group_sizes.shape[0]
    n = _width(rhs, blocks)
    rhs_nk = blocks is not None
    block_n = matmul_steps.fit_block(config.block_n, n)
    block_k = matmul_steps.fit_block(config.block_k, k)
    if schedule is None:
        schedule = device_schedule(group_sizes, m, config.block_m)
    block_m = schedule.rows_per_tile
    # Only axes shorter than one block are padded (tiny test shapes): a DeepSeek weight is
    # never copied. Row tiles may run past M; their loads and stores are masked.
    rows = max(m, block_m)
    tile = matmul_steps.MIN_TILE
    out_dtype = lhs.dtype
    lhs, row_scale = matmul_steps.float16_operands(config.float16_mma, lhs, blocks, block_k, rows)
    lhs = online_softmax.pad_to(lhs, (rows, max(k, tile)))
    padded = (max(n, tile), max(k, tile)) if rhs_nk else (max(k, tile), max(n, tile))
    rhs = online_softmax.pad_to(rhs, (rhs.shape[0], *padded))
    kernel = functools.partial(
        _grouped_matmul_kernel,
        num_groups=num_groups,
        depth=k,
        width=n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        blocks=blocks,
        scale_product=config.scale_product or bool(row_scale),
        swap_ab=config.swap_ab,
        band=config.band,
    )
    scales = () if blocks is None else (rhs_scale_inv,)
    out = pl.pallas_call(
        kernel,
        grid=(
            tiling.banded_programs(
                schedule.tile_segment.shape[0], pl.cdiv(n, block_n), config.band
            ),
        ),
        out_shape=jax.ShapeDtypeStruct((rows, max(n, tile)), out_dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="grouped_matmul",
    )(
        schedule.tile_segment,
        schedule.tile_start,
        schedule.tile_end,
        group_offset,
        lhs,
        rhs,
        *scales,
        *row_scale,
    )
    return out[:m, :n]
