"""Row tiles over ragged segments: the schedule of the prefill and grouped-matmul kernels.

Rows ``[0, num_rows)`` are cut into segments by rising ``offsets [S + 1]`` (the prefill's
sequences, the grouped matmul's groups): segment ``s`` holds rows ``[offsets[s],
offsets[s + 1])``, and the rows ``[offsets[S], num_rows)`` after them form a padding segment
``S``. Each segment is cut into tiles of at most ``rows_per_tile`` rows, so that a tile never
straddles two segments and a kernel program handles one tile. The plan runs on the host
(NumPy, exact tile count) or traced on the device (jnp, a static bound on the count).

With ``align`` > 1 a segment's tiles are cut from its first row rounded down to a multiple
of ``align`` (its first tile then holds fewer rows): a kernel whose copies must start at
such a row (a TMA copy into 8-row tiles of shared memory) copies from there, and a tile's
rows still fit one copy of ``rows_per_tile`` rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Tile ``t`` covers rows ``[tile_start[t], tile_end[t])`` of segment
    ``tile_segment[t]`` (``S``, one past the last segment, for padding rows); tiles past the
    real ones are empty (``tile_start == tile_end == 0``) and do nothing. ``rows_per_tile``
    is the tile height the kernel runs with; ``align``: a tile's rows lie within
    ``rows_per_tile`` rows from its start rounded down to a multiple of it."""

    tile_segment: jax.Array  # [num_tiles] int32
    tile_start: jax.Array  # [num_tiles] int32
    tile_end: jax.Array  # [num_tiles] int32
    rows_per_tile: int = dataclasses.field(metadata={"static": True})
    align: int = dataclasses.field(default=1, metadata={"static": True})


def max_tiles(num_rows: int, num_segments: int, rows_per_tile: int, align: int = 1) -> int:
    """A static bound on the tile count of ``num_segments`` segments and the padding after
    them, ``num_rows`` rows in all: each segment (the padding included) adds at most one
    partial tile, and with ``align`` its first tile reaches back up to ``align - 1`` rows."""
    return -(-(num_rows + (num_segments + 1) * (align - 1)) // rows_per_tile) + num_segments


def schedule_tiles(
    offsets,
    num_rows: int,
    rows_per_tile: int,
    *,
    heaviest_first: bool = False,
    num_tiles: int | None = None,
    align: int = 1,
    xp=np,
) -> TileSchedule:
    """Tiles of ``rows_per_tile`` rows per segment of ``offsets [S + 1]`` (int, rising,
    ``offsets[-1] <= num_rows``), then the padding rows, in segment order; with
    ``heaviest_first``, ordered by descending row offset within the segment instead (a causal
    tile's work grows with it), so that the longest tiles start first, padding last.
    ``xp=np`` on the host (``num_tiles`` defaults to the exact count) or ``xp=jnp`` traced,
    with ``num_tiles`` a static bound (``max_tiles``). ``align``: see the module's docstring."""
    offsets = xp.asarray(offsets).astype(xp.int32)
    starts = xp.concatenate([offsets[:-1], offsets[-1:]])
    ends = xp.concatenate([offsets[1:], xp.full(1, num_rows, xp.int32)])
    aligned = starts - starts % align  # where a segment's tiles are cut from
    counts = xp.where(ends > starts, -(-(ends - aligned) // rows_per_tile), 0)
    first = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(counts).astype(xp.int32)])
    if num_tiles is None:
        num_tiles = int(first[-1])
    tile = xp.arange(num_tiles, dtype=xp.int32)
    # Traced, every tile against every segment at once: jnp's default binary search is a
    # while loop, which XLA's GPU runtime steps from the host, launching each iteration's
    # kernels apart from the program's CUDA graphs (in an MoE decode step, once per layer).
    method = {} if xp is np else {"method": "compare_all"}
    segment = xp.searchsorted(first, tile, side="right", **method) - 1
    segment = xp.clip(segment, 0, counts.shape[0] - 1)
    real = tile < first[-1]
    offset = (tile - first[segment]) * rows_per_tile
    cut = aligned[segment] + offset
    start = xp.where(real, xp.maximum(cut, starts[segment]), 0)
    end = xp.where(real, xp.minimum(cut + rows_per_tile, ends[segment]), 0)
    if heaviest_first:
        order = xp.argsort(-xp.where(real, offset, -1), stable=True)
        segment, start, end = segment[order], start[order], end[order]
    return TileSchedule(
        segment.astype(xp.int32),
        start.astype(xp.int32),
        end.astype(xp.int32),
        rows_per_tile,
        align,
    )


def banded_programs(num_tiles: int, num_column_blocks: int, band: int) -> int:
    """Programs of a launch in ``band`` order (``banded``): every row tile x column block,
    the tiles rounded up to whole bands (the extra ones past ``num_tiles`` do nothing)."""
    return -(-num_tiles // band) * band * num_column_blocks


def banded(program, num_column_blocks: int, band: int):
    """``(row tile, column block)`` of ``program`` (an int32 scalar) in a launch that takes the
    row tiles ``band`` at a time and, within a band, runs its tiles' programs side by side for
    each column block in turn: ``(t, 0), (t + 1, 0), ..., (t + band - 1, 0), (t, 1), ...``.

    A grouped matmul's programs that read the same weight columns (the row tiles of one
    group) then start together and share each weight tile through L2, and a band's rows stay
    in L2 across its column blocks. Column blocks fastest (``band`` 1) space a group's tiles
    ``num_column_blocks`` launches apart (``grouped_matmul.pallas_triton`` has what that
    cost)."""
    per_band = band * num_column_blocks
    within = program % per_band
    return program // per_band * band + within % band, within // band


def banded_tile(program, num_tiles: int, num_column_blocks: int, band: int):
    """What a kernel program in ``band`` order runs: ``(tile, column block, real)``, the tile
    (``banded``'s) kept within the schedule's ``num_tiles`` and ``real`` false for the last
    band's extra tiles past them, which must own no row."""
    tile, column_block = banded(program, num_column_blocks, band)
    return jnp.minimum(tile, num_tiles - 1), column_block, tile < num_tiles
