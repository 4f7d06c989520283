"""FP8 weights with block scales (DeepSeek's ``weight_scale_inv``), shared by ``fp8_matmul``,
``grouped_matmul``, ``w8a8_matmul`` and their references.

A weight is stored as float8_e4m3fn with one float32 scale per ``block_out`` output columns x
``block_in`` rows of K; its value is the fp8 value times its block's scale. The edge blocks may
be partial (the grid is ``cdiv``-sized). Two layouts: the routed experts' ``[..., K, N]`` (HF's
``[N, K]`` transposed; ``scale_shape``, ``check``, ``dequantize``) and the projections' ``[...,
N, K]``, HF's own (``scale_shape_nk``, ``check_nk``, ``dequantize_nk``), which Hopper's FP8
tensor cores read K-major. A fused weight of ``parts`` matrices side by side on N (the routed
experts' ``gate_up_proj``: gate then up; ``fused_qkv_a_proj``) holds each part's own grid, so
the scale grid is ``[..., cdiv(K, block_in), parts x cdiv(N / parts, block_out)]`` (``[K, N]``)
or its transpose (``[N, K]``). The Pallas kernels load a weight tile as fp8, gather its scales
(one scale row per K step when ``block_in`` is a multiple of the step, else one per tile row)
and dequantize the tile in registers into the activations' dtype before the MMA: the weight
crosses HBM once, in fp8.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from .fp8 import FP8


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """The scale blocks of an FP8 weight ``[..., K, N]``: ``block_in`` rows (of K) by
    ``block_out`` columns (of N) per float32 scale, in each of ``parts`` column parts."""

    block_out: int
    block_in: int
    parts: int = 1

    def __post_init__(self):
        for name in ("block_out", "block_in", "parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Fp8Blocks.{name} must be an integer >= 1, got {value!r}")

    def scale_shape(self, depth: int, width: int) -> tuple[int, int]:
        """``[cdiv(K, block_in), parts x cdiv(N / parts, block_out)]`` for a ``[K, N]``
        weight."""
        return math.ceil(depth / self.block_in), self.parts * math.ceil(
            width // self.parts / self.block_out
        )

    def check(self, weight: jax.Array, scale_inv: jax.Array, what: str = "weight") -> None:
        """ValueError (one line, naming ``what``) unless ``weight [..., K, N]`` is
        float8_e4m3fn and ``scale_inv`` float32 of its grid, N splitting into the parts."""
        *lead, depth, width = weight.shape
        self._check(weight, scale_inv, what, width, (*lead, *self.scale_shape(depth, width)))

    def scale_shape_nk(self, width: int, depth: int) -> tuple[int, int]:
        """``[parts x cdiv(N / parts, block_out), cdiv(K, block_in)]`` for an ``[N, K]`` weight
        (HF's layout: its ``weight_scale_inv``'s grid)."""
        return self.scale_shape(depth, width)[::-1]

    def check_nk(self, weight: jax.Array, scale_inv: jax.Array, what: str = "weight") -> None:
        """``check`` for a weight ``[..., N, K]`` (HF's layout) and its ``scale_shape_nk``
        grid."""
        *lead, width, depth = weight.shape
        self._check(weight, scale_inv, what, width, (*lead, *self.scale_shape_nk(width, depth)))

    def _check(self, weight, scale_inv, what: str, width: int, want: tuple) -> None:
        """``check``'s tests of a weight of ``width`` columns (N) whose scales must be
        ``want``, in either layout (the shapes said as given)."""
        if weight.dtype != FP8 or scale_inv.dtype != jnp.float32:
            raise ValueError(
                f"{what} must be float8_e4m3fn with float32 scales, got {weight.dtype} and "
                f"{scale_inv.dtype}"
            )
        if width % self.parts:
            raise ValueError(f"{what} {list(weight.shape)}: N is not {self.parts} equal parts")
        if tuple(scale_inv.shape) != want:
            raise ValueError(
                f"{what} scale_inv {list(scale_inv.shape)} does not fit {list(weight.shape)} "
                f"with {self} (expected {list(want)})"
            )


def scale_columns(columns: jax.Array, width: int, blocks: Fp8Blocks) -> jax.Array:
    """The scale-grid column of each weight column in ``columns`` (int32) of an ``N =
    width`` weight: ``part x cdiv(N / parts, block_out) + (column within its part) //
    block_out``."""
    part_width = width // blocks.parts
    part = columns // part_width
    per_part = -(-part_width // blocks.block_out)
    return part * per_part + (columns - part * part_width) // blocks.block_out


def dequantize(
    weight: jax.Array, scale_inv: jax.Array, blocks: Fp8Blocks, dtype=jnp.float32
) -> jax.Array:
    """``weight [..., K, N]`` float8_e4m3fn times its blocks' ``scale_inv`` -> ``dtype``
    (computed in float32), in jnp: what the references use, and what a tile of the kernels
    is."""
    depth, width = weight.shape[-2:]
    rows = jnp.arange(depth) // blocks.block_in
    cols = scale_columns(jnp.arange(width), width, blocks)
    scales = scale_inv[..., rows, :][..., cols]
    return (weight.astype(jnp.float32) * scales).astype(dtype)


def dequantize_nk(
    weight: jax.Array, scale_inv: jax.Array, blocks: Fp8Blocks, dtype=jnp.float32
) -> jax.Array:
    """``weight [..., N, K]`` (HF's layout) float8_e4m3fn times its blocks' ``scale_inv [...,
    parts x cdiv(N / parts, block_out), cdiv(K, block_in)]`` -> ``[..., N, K]`` in ``dtype``
    (computed in float32)."""
    width, depth = weight.shape[-2:]
    rows = scale_columns(jnp.arange(width), width, blocks)
    cols = jnp.arange(depth) // blocks.block_in
    scales = scale_inv[..., rows, :][..., cols]
    return (weight.astype(jnp.float32) * scales).astype(dtype)


def dequantize_tile(
    tile: jax.Array,
    scale_ref,
    lead: tuple,
    k0,
    columns: jax.Array,
    k_ok: jax.Array | None,
    col_ok: jax.Array | None,
    blocks: Fp8Blocks,
    width: int,
    dtype,
) -> jax.Array:
    """Inside a Pallas kernel: the fp8 weight tile ``[block_n, block_k]`` at ``columns
    [block_n]`` (int32, of a ``width``-column weight) and K ``k0 + [0, block_k)`` of an
    ``[..., N, K]`` weight (HF's layout), times its scales read from ``scale_ref [...,
    N-grid, K-grid]`` (indexed by the scalars ``lead``, then the grid's row and column) ->
    ``dtype``. ``k_ok [block_k]`` and ``col_ok [block_n]`` (or None: all inside): the tile's
    K and columns inside the weight; no scale outside it is read."""
    block_k = tile.shape[1]
    inside = tile_mask(k_ok, col_ok, tile.shape, nk=True)
    if blocks.block_in % block_k == 0:
        # The K step lies in one scale row (k0 is a multiple of block_k, and k0 < K): a row
        # of scales; rows past K are zeros in the tile.
        step = step_scales(scale_ref, lead, k0, columns, col_ok, blocks, width)
        _, scales = _on_tile(None, step, nk=True)
    else:  # blocks smaller than the step (tests' tiny blocks): a scale per element
        rows = (k0 + jnp.arange(block_k, dtype=jnp.int32)) // blocks.block_in
        scale_cols = scale_columns(columns, width, blocks)
        k_index, n_index = _on_tile(rows, scale_cols, nk=True)
        index = scale_ref.at[(*lead, n_index, k_index)]
        scales = index[...] if inside is None else plgpu.load(index, mask=inside, other=0.0)
    values = tile.astype(jnp.float32)
    if inside is not None:  # masked elements were loaded undefined
        values = jnp.where(inside, values, 0.0)
    return (values * scales).astype(dtype)


def step_scales(
    scale_ref,
    lead: tuple,
    k0,
    columns: jax.Array,
    col_ok: jax.Array | None,
    blocks,
    width: int,
) -> jax.Array:
    """Inside a Pallas kernel: the ``[block_n]`` float32 scales of a K step at ``k0`` that
    lies in one scale block (``blocks.block_in`` a multiple of the step), for ``columns``
    (int32) of a ``width``-column ``[N, K]`` weight, from its ``[..., N-grid, K-grid]``
    ``scale_ref``; 0 where ``col_ok`` is False."""
    k_index, n_index = k0 // blocks.block_in, scale_columns(columns, width, blocks)
    index = scale_ref.at[(*lead, n_index, k_index)]
    return index[...] if col_ok is None else plgpu.load(index, mask=col_ok, other=0.0)


def upcast_tile(tile: jax.Array, k_ok, col_ok, dtype) -> jax.Array:
    """An fp8 weight tile ``[block_n, block_k]`` converted (exactly) into ``dtype``, its
    masked elements (loaded undefined) zeroed: the tile of a step whose scales go on the
    product instead."""
    values = tile.astype(dtype)
    inside = tile_mask(k_ok, col_ok, tile.shape, nk=True)
    if inside is not None:
        values = jnp.where(inside, values, jnp.zeros((), dtype))
    return values


def tile_mask(
    k_ok: jax.Array | None, col_ok: jax.Array | None, shape, nk: bool = False
) -> jax.Array | None:
    """The mask of a weight tile of ``shape`` (``[block_k, block_n]``, or ``[block_n,
    block_k]`` where ``nk``) from its K and column masks (None: all inside); None where
    both are None."""
    if k_ok is None and col_ok is None:
        return None
    k_ok, col_ok = _on_tile(k_ok, col_ok, nk)
    if k_ok is None:
        return jnp.broadcast_to(col_ok, shape)
    if col_ok is None:
        return jnp.broadcast_to(k_ok, shape)
    return k_ok & col_ok


def _on_tile(k_values: jax.Array | None, n_values: jax.Array | None, nk: bool):
    """``k_values [block_k]`` and ``n_values [block_n]`` (either None) shaped to broadcast
    against a tile ``[block_k, block_n]``, or ``[block_n, block_k]`` where ``nk``."""
    k_axis = 1 if nk else 0

    def expand(values, along: int):  # values along the tile's axis ``along``
        return None if values is None else jnp.expand_dims(values, 1 - along)

    return expand(k_values, k_axis), expand(n_values, 1 - k_axis)
