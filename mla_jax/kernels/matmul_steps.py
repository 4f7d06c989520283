"""The reduction loop of the matmul kernels (``grouped_matmul``, ``fp8_matmul``): one output
tile ``[block_m, block_n]`` accumulated in float32 over steps of ``block_k``, the full steps
unmasked and the partial last one masked, each step's weight tile (of a ``[K, N]`` weight, or
an ``[N, K]`` one) dequantized in registers when the weight is FP8 (``fp8_blocks``); and the
float16 MMA over FP8 weights (``float16_operands``, ``unscale_rows``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import fp8_blocks, online_softmax

# The smallest tile along any dot dimension (a Triton dot operand is at least 16 wide).
MIN_TILE = 16


def float16_rows(lhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``lhs [M, K]`` bfloat16 in float16 for an MMA against FP8 weight tiles, and ``[M]``
    float32 factors that undo the conversion: each row times the power of two that puts its
    largest magnitude in ``[2^14, 2^15)``, inside float16's range (65504) whatever the row's
    scale. Exact for every value above ``2^-29`` of its row's maximum (float16's 11 bits hold
    bfloat16's 8; below that, float16's subnormals round). Why float16: e4m3 -> float16 is
    one conversion instruction a pair of values on Hopper, e4m3 -> bfloat16 three."""
    values = lhs.astype(jnp.float32)
    _, exponent = jnp.frexp(jnp.max(jnp.abs(values), axis=1))  # max < 2^exponent
    # Both factors stay normal float32 numbers: a row whose largest value is under 2^-111
    # is scaled by 2^126 only (into float16's range still, with fewer of its small values).
    shift = jnp.clip(15 - exponent, -126, 126)
    scaled = (values * power_of_two(shift)[:, None]).astype(jnp.float16)
    return scaled, power_of_two(-shift)


def power_of_two(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` float32 for int32 exponents in [-126, 126], built from its bits
    (``jnp.ldexp`` handles any exponent and subnormals, in many more operations)."""
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def unscale_rows(acc: jax.Array, row_scale_ref, r0, row_ok: jax.Array) -> jax.Array:
    """Inside a kernel: the float32 tile ``acc [block_m, block_n]`` of rows ``r0 + [0,
    block_m)`` times those rows' ``float16_rows`` factors (``row_scale_ref [M]``; rows where
    ``row_ok`` is False read nothing)."""
    block_m = row_ok.shape[0]
    factors = plgpu.load(row_scale_ref.at[pl.ds(r0, block_m)], mask=row_ok, other=0.0)
    return acc * factors[:, None]


def float16_operands(
    float16_mma: bool, lhs: jax.Array, blocks, block_k: int, rows: int
) -> tuple[jax.Array, tuple]:
    """``lhs [M, K]`` as a matmul kernel configured with ``float16_mma`` takes it, and its
    extra operands: ``(float16 lhs, (the [rows] row factors zero-padded,))`` where the MMA
    runs in float16, else ``(lhs, ())``. It does over FP8 weights (``blocks``), bfloat16
    ``lhs`` (a float32 one keeps its exact float32 MMA) and scale blocks a whole number of
    K steps deep (the scales then go on each step's product, so the converted tile is
    exact)."""
    if not (
        float16_mma
        and blocks is not None
        and lhs.dtype == jnp.bfloat16
        and blocks.block_in % block_k == 0
    ):
        return lhs, ()
    lhs, factors = float16_rows(lhs)
    return lhs, (jnp.pad(factors, (0, rows - factors.shape[0])),)


def check_layer(layer, num_layers: int, prefix: str = "") -> None:
    """ValueError (one line, after ``prefix``) unless ``layer``, the index into a stack of
    ``num_layers`` weights, is an integer scalar in ``[0, num_layers)``; a traced one (a
    scan's index) is not bounded here, and the kernels do not bound it either."""
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"{prefix}layer must be an integer scalar, got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < num_layers:
        raise ValueError(f"{prefix}layer {int(layer)} is not in [0, {num_layers})")


def layer_of(weight: jax.Array, scale_inv: jax.Array | None, layer):
    """``layer`` of a stacked weight and of its scales (a slice: XLA copies it before an
    opaque kernel can take it); both as given where ``layer`` is None."""
    if layer is None:
        return weight, scale_inv
    return weight[layer], None if scale_inv is None else scale_inv[layer]


def as_stack(weight: jax.Array, scale_inv: jax.Array | None, layer):
    """``(weight [L, ...], scale_inv [L, ...] or None, layer int32 [1])`` as a kernel that
    reads a stack's layer in place takes them: a weight of one layer as a stack of one (free
    reshapes) at layer 0."""
    if layer is None:
        weight, layer = weight[None], 0
        scale_inv = None if scale_inv is None else scale_inv[None]
    return weight, scale_inv, jnp.asarray(layer, jnp.int32).reshape(1)


def fit_block(block: int, dim: int) -> int:
    """``block`` shrunk to the largest power of two <= ``dim`` (at least 16), so that a block
    never outgrows its axis; an axis under 16 is zero-padded to 16 by the caller."""
    return max(MIN_TILE, min(block, 1 << (dim.bit_length() - 1)))


def accumulate(
    lhs_ref,
    rhs_ref,
    scale_ref,
    *,
    r0,
    row_ok: jax.Array,
    n0,
    lead: tuple,
    begin,
    end,
    depth: int,
    width: int,
    block_k: int,
    block_n: int,
    blocks: fp8_blocks.Fp8Blocks | None,
    scale_product: bool = False,
    swap_ab: bool = False,
) -> jax.Array:
    """``sum over K steps s in [begin, end) of lhs[r0 + [0, block_m), s] @ W[lead][s, n0 +
    [0, block_n)]`` -> ``[block_m, block_n]`` float32 (the rows where ``row_ok [block_m]`` is
    False read nothing), ``rhs_ref`` indexed by the scalars ``lead``: in lhs's dtype it holds
    ``W [..., K = depth, N = width]`` and ``scale_ref`` is None; with ``blocks`` it holds the
    float8_e4m3fn transpose ``[..., N, K]`` (HF's layout, K-major as Hopper's tensor cores
    read an operand) and ``scale_ref`` its ``[..., N-grid, K-grid]`` scales
    (``Fp8Blocks.scale_shape_nk``): each step loads a ``[block_n, block_k]`` tile,
    dequantized into lhs's dtype, and the dot contracts both operands' K axes. ``begin``,
    ``end``: int32 scalars within ``[0, cdiv(depth, block_k)]``.

    ``scale_product`` (FP8 with ``blocks.block_in`` a multiple of ``block_k``): each step's
    tile is only converted (exactly) into lhs's dtype and its scales multiply the step's
    float32 product, ``[block_n]`` multiplies per step instead of ``block_k x block_n``.
    ``swap_ab``: each step computes the transposed product ``b.T @ a.T`` (the weight tile is
    the MMA's left operand, which Hopper's wgmma may take from registers, where the
    converted tile already is), the accumulator ``[block_n, block_m]`` transposed at the
    end."""
    block_m = row_ok.shape[0]
    cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < width if width % block_n else None
    if scale_product and (blocks is None or blocks.block_in % block_k):
        scale_product = False  # no per-step scale row: the tile is dequantized whole
    rhs_nk = blocks is not None  # an FP8 weight in HF's layout
    k_axis = 1 if rhs_nk else 0  # of the weight tile

    def step(s, acc, *, tail: bool):
        k0 = s * block_k
        lhs_mask = row_ok[:, None]
        k_ok = None
        if tail:
            k_ok = k0 + jnp.arange(block_k, dtype=jnp.int32) < depth
            lhs_mask = lhs_mask & k_ok[None, :]
        a = plgpu.load(lhs_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], mask=lhs_mask, other=0)
        k_slice, n_slice = pl.ds(k0, block_k), pl.ds(n0, block_n)
        b_ref = rhs_ref.at[(*lead, n_slice, k_slice) if rhs_nk else (*lead, k_slice, n_slice)]
        rhs_mask = fp8_blocks.tile_mask(k_ok, col_ok, b_ref.shape, rhs_nk)
        # Triton cannot cast a fill value to fp8: an FP8 tile's masked elements are zeroed
        # when it is dequantized.
        fill = None if blocks is not None else 0
        b = b_ref[...] if rhs_mask is None else plgpu.load(b_ref, mask=rhs_mask, other=fill)
        scales = None
        if scale_product:
            b = fp8_blocks.upcast_tile(b, k_ok, col_ok, a.dtype)
            scales = fp8_blocks.step_scales(scale_ref, lead, k0, cols, col_ok, blocks, width)
        elif blocks is not None:
            b = fp8_blocks.dequantize_tile(
                b, scale_ref, lead, k0, cols, k_ok, col_ok, blocks, width, a.dtype
            )
        if swap_ab:  # [block_n, block_m]
            precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
            dims = (((k_axis,), (1,)), ((), ()))
            product = jax.lax.dot_general(
                b, a, dims, precision=precision, preferred_element_type=jnp.float32
            )
            return acc + (product if scales is None else product * scales[:, None])
        product = online_softmax.dot(a, b, trans_b=rhs_nk)
        return acc + (product if scales is None else product * scales[None, :])

    # Loop bounds as strong int32 scalars: Triton's scf.for wants all three of one type, and
    # a Python int beside a weakly typed jnp.where lowered to mixed ones.
    full_steps = jnp.int32(depth // block_k)
    acc = jnp.zeros((block_n, block_m) if swap_ab else (block_m, block_n), jnp.float32)
    acc = jax.lax.fori_loop(
        begin, jnp.minimum(end, full_steps), functools.partial(step, tail=False), acc
    )
    if depth % block_k:
        acc = jax.lax.fori_loop(
            jnp.maximum(begin, full_steps), end, functools.partial(step, tail=True), acc
        )
    return acc.T if swap_ab else acc
