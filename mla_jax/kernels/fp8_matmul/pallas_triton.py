"""FP8 weight-only matmul (Pallas, Triton lowering): ``y = x @ dequantize(W)^T`` for a weight
``W [N, K]`` kept in float8_e4m3fn with its float32 block scales ``[N-grid, K-grid]``
(``fp8_blocks``), DeepSeek's projections as its checkpoints store them (HF's ``weight`` and
``weight_scale_inv``) and the model holds them: K-major, as Hopper's FP8 tensor cores read
both operands.

Each program computes ``block_m`` rows x ``block_n`` columns of the output over one range of
K steps: it loads each weight tile ``[block_n, block_k]`` as fp8 (half a bf16 tile's bytes),
gathers the tile's scales, dequantizes it in registers into x's dtype and runs the MMA in that
dtype, contracting both operands' K axes (``matmul_steps``); with ``float16_mma`` it converts
the tile into float16 instead, x scaled per row into float16's range, and the scales multiply
each step's product. The weight crosses HBM once, in fp8, and no dequantized copy exists.

At decode a step's few rows make the matmul a stream of the weight; a projection of ``N``
columns has only ``N / block_n`` column tiles, too few to keep every multiprocessor reading,
so K is split into ``k_splits`` ranges whose float32 partial products are summed after the
kernel (``M x N x k_splits`` floats, small beside the weight at decode). Prefill runs
128 x 128 tiles over the whole K, column tiles fastest, so the programs in flight share a row
tile of x (kept in L2).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import fp8, fp8_blocks, matmul_steps, online_softmax
from .. import tuned as _tuned

# H100 SXM and H200 have 132 multiprocessors; the split of K aims at two programs on each.
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Launch parameters of the FP8 matmul kernel (blocks: powers of two, each >= 16);
    ``for_shape`` picks them for a shape, ``dataclasses.replace`` makes variants. The defaults
    suit many rows (prefill: compute-bound)."""

    block_m: int = 128  # rows of x per program
    block_n: int = 128  # output columns per program
    block_k: int = 64  # reduction depth per step (a divisor of the scale blocks' K side)
    k_splits: int = 1  # ranges of K run by separate programs, summed after the kernel
    num_warps: int = 8
    num_stages: int = 3
    # FP8 weights: the scales multiply each K step's product (the tile only converted), and
    # the weight tile as the MMA's left operand (matmul_steps.accumulate)
    scale_product: bool = False
    swap_ab: bool = False
    # bfloat16 x: the MMA in float16, x scaled per row into its range, the scales on the
    # product (matmul_steps.float16_operands)
    float16_mma: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < matmul_steps.MIN_TILE or value & (value - 1):
                raise ValueError(f"Fp8MatmulConfig.{name} must be a power of two >= 16: {value}")
        if self.k_splits < 1:
            raise ValueError(f"Fp8MatmulConfig.k_splits must be >= 1, got {self.k_splits}")

    @classmethod
    def for_shape(
        cls, rows: int, depth: int, width: int, num_sms: int = DEFAULT_NUM_SMS
    ) -> Fp8MatmulConfig:
        """Launch parameters for ``x [rows, K = depth]`` times a weight of ``N = width``
        columns (static shapes, so it works under jit). Up to 64 rows (decode) stream the
        weight: one row tile, 64 columns and 128 deep per step, K split until there are about
        two programs per multiprocessor (each range at least 4 steps), unless
        ``tuned.FP8_MATMUL`` holds the measured best for the shape (keyed
        ``"{block_m}x{K}x{N}"``). More rows (prefill) run the defaults."""
        if rows > 64:
            return cls()
        block_m = online_softmax.tile_width(rows)
        tuned = _tuned.FP8_MATMUL.get(f"{block_m}x{depth}x{width}")
        if tuned is not None:
            return cls(**tuned)
        block_n, block_k = 64, 128
        column_tiles = math.ceil(width / block_n)
        steps = math.ceil(depth / block_k)
        splits = max(1, min(math.ceil(2 * num_sms / column_tiles), steps // 4))
        return cls(block_m, block_n, block_k, splits, num_warps=4, num_stages=4)


def check(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
) -> None:
    """The kernel's (and its reference's) input checks: ValueError in one line naming the
    argument."""
    want_ndim = 2 if layer is None else 3
    if x.ndim != 2 or weight.ndim != want_ndim or x.shape[1] != weight.shape[-1]:
        form = "[N, K]" if layer is None else "[L, N, K] (a stack, with layer)"
        raise ValueError(f"x {x.shape} must be [M, K] and weight {weight.shape} {form}")
    if layer is not None:
        matmul_steps.check_layer(layer, weight.shape[0])
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    if not isinstance(blocks, fp8_blocks.Fp8Blocks):
        raise ValueError(f"blocks must be an Fp8Blocks, got {blocks!r}")
    blocks.check_nk(weight, scale_inv, "weight")


def _fp8_matmul_kernel(
    layer_ref,
    x_ref,
    weight_ref,
    scale_ref,
    *rest,
    rows: int,
    depth: int,
    width: int,
    block_m: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
    blocks: fp8_blocks.Fp8Blocks,
    scale_product: bool,
    swap_ab: bool,
):
    """``block_m`` rows x ``block_n`` columns over K steps ``[split x steps_per_split, ...)``
    of the weight ``weight_ref [L, N, K]`` at ``layer_ref [1]`` (``rest``: x's
    ``float16_rows`` factors where x is float16, then the output); ``out_ref [k_splits,
    rows, N]`` float32 partials, or ``[rows, N]`` in the model's dtype."""
    row_scale_ref, out_ref = rest if len(rest) == 2 else (None, *rest)
    j, i, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r0, n0 = i * block_m, j * block_n
    row_ok = r0 + jnp.arange(block_m, dtype=jnp.int32) < rows
    begin = split * steps_per_split
    end = jnp.minimum(begin + steps_per_split, jnp.int32(pl.cdiv(depth, block_k)))
    acc = matmul_steps.accumulate(
        x_ref,
        weight_ref,
        scale_ref,
        r0=r0,
        row_ok=row_ok,
        n0=n0,
        lead=(layer_ref[0],),
        begin=begin,
        end=end,
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
    partial = () if out_ref.ndim == 2 else (split,)
    plgpu.store(
        out_ref.at[(*partial, pl.ds(r0, block_m), pl.ds(n0, block_n))],
        acc.astype(out_ref.dtype),
        mask=row_ok[:, None] & (cols < width)[None, :],
    )


def fp8_matmul(
    x: jax.Array,
    weight: jax.Array,
    scale_inv: jax.Array,
    *,
    blocks: fp8_blocks.Fp8Blocks,
    layer: int | jax.Array | None = None,
    config: Fp8MatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ dequantize(weight, scale_inv)^T``, each weight tile dequantized in the kernel.

    Args:
      x: ``[M, K]`` bfloat16 or float32 (the MMA runs in x's dtype, or in float16 with
        ``config.float16_mma``).
      weight: ``[N, K]`` float8_e4m3fn (HF's layout); with ``layer``, a stack of layers'
        weights ``[L, N, K]``.
      scale_inv: ``blocks.scale_shape_nk(N, K)`` float32 block scales (HF's
        ``weight_scale_inv``), ``[L, ...]`` for a stack. blocks: their block sizes (static).
      layer: int32 scalar (may be traced, and then is not range-checked): which of a
        stacked weight's layers to use. The kernel reads it in place: a layer sliced out
        of a stack (as a scan over layers would) is copied before a kernel can take it,
        every call.
      config: launch parameters (default: ``Fp8MatmulConfig.for_shape(M, K, N)``); blocks
        larger than an axis shrink to the power of two that fits it (at least 16).
      interpret: Pallas interpret mode (default: off on GPUs only).

    Returns:
      ``[M, N]`` in x's dtype, accumulated in float32.
    """
    check(x, weight, scale_inv, blocks, layer)
    if interpret is None:
        interpret = online_softmax.interpret_default()
    if not interpret:
        fp8.check_triton_indexable(weight, "weight")
    config = config or Fp8MatmulConfig.for_shape(x.shape[0], weight.shape[-1], weight.shape[-2])
    weight, scale_inv, layer = matmul_steps.as_stack(weight, scale_inv, layer)
    return _fp8_matmul(
        x, weight, scale_inv, layer, blocks=blocks, config=config, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("blocks", "config", "interpret"))
def _fp8_matmul(x, weight, scale_inv, layer, *, blocks, config, interpret):
    m, k = x.shape
    n = weight.shape[-2]
    block_m = matmul_steps.fit_block(config.block_m, m)
    block_n = matmul_steps.fit_block(config.block_n, n)
    block_k = matmul_steps.fit_block(config.block_k, k)
    steps = pl.cdiv(k, block_k)
    splits = min(config.k_splits, steps)
    steps_per_split = pl.cdiv(steps, splits)
    splits = pl.cdiv(steps, steps_per_split)  # no empty split
    # Only axes shorter than one block are padded (tiny test shapes): a DeepSeek weight is
    # never copied. Tiles past an axis are masked.
    tile = matmul_steps.MIN_TILE
    rows = max(m, block_m)
    out_dtype = x.dtype
    x, row_scale = matmul_steps.float16_operands(config.float16_mma, x, blocks, block_k, rows)
    x = online_softmax.pad_to(x, (rows, max(k, tile)))
    weight = online_softmax.pad_to(weight, (weight.shape[0], max(n, tile), max(k, tile)))
    kernel = functools.partial(
        _fp8_matmul_kernel,
        rows=m,
        depth=k,
        width=n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        steps_per_split=steps_per_split,
        blocks=blocks,
        scale_product=config.scale_product or bool(row_scale),
        swap_ab=config.swap_ab,
    )
    out_shape = (rows, weight.shape[-2])
    if splits > 1:
        out_shape = jax.ShapeDtypeStruct((splits, *out_shape), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct(out_shape, out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_n), pl.cdiv(m, block_m), splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="fp8_matmul",
    )(layer, x, weight, scale_inv, *row_scale)
    if splits > 1:
        out = out.sum(axis=0).astype(out_dtype)
    return out[:m, :n]
