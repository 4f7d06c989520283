"""``x [M, K] @ weight [K, N]`` for few rows (M <= 64) on Mosaic GPU (Hopper, sm90).

At decode's row counts a projection reads its whole weight to make a few output rows, so its
time is the weight's bytes over the copy bandwidth, and what a kernel must do is keep enough
copies in flight on every multiprocessor. Each program owns ``block_n`` output columns and one
of ``splits`` slices of K; a memory warpgroup streams the slice's ``[block_k, block_n]``
weight tiles and the matching ``[rows, block_k]`` tiles of x by TMA, ``stages`` steps ahead,
into a ring that one compute warpgroup multiplies out of
(``plgpu.emit_pipeline_warp_specialized``). The product runs transposed, ``out^T = weight^T
x^T``: the weight's columns fill the wgmma's 64-row M side and x's rows its N side, so x is
padded to a multiple of 8 rows, not to 64, and a step copies ``rows x block_k`` of it. The
warp-specialized pipeline gives a program a multiprocessor's registers, so one program runs
on an SM at a time and a plan is costed by its waves (``launch``): 171 programs on 132 SMs
take two waves, the second mostly idle (ncu: 1.30 waves, 255 registers a thread). The
program writes its ``[block_n, rows]`` block of ``out^T``; XLA transposes it back (with the
float32 sum of K's slices where there are several), which it fuses into the next elementwise
op where there is one. A stacked weight ``[L, K, N]`` is read in place at ``layer``: no copy
of a layer's weight is made for the call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import mosaic_gpu, online_softmax
from ..decode import device_num_sms

MAX_ROWS = 64  # x's rows on the wgmma's N side: 8 to 64 in steps of 8 keep one warpgroup's
# accumulator within its registers
MAX_BLOCK_N = 192  # output columns a program: the widest run on a GPU (H200, 2026-12-04)
NUM_WARPGROUPS = 2  # one computes, one copies
SMEM_BYTES = 232448  # an sm90 program's shared memory (227 KB)
# Weight bytes a program keeps in flight when ``stages`` is chosen for it: a program has a
# multiprocessor to itself (the warp-specialized pipeline sizes its registers for one
# program an SM), so its copies alone must cover the memory latency at its share of the
# bandwidth (about 32 GB/s an SM on an H200, over a few microseconds under load).
IN_FLIGHT_BYTES = 128 * 1024
# What a program costs beyond its weight tiles, as bytes of weight in the same time (its
# pipeline's first copies, its epilogue): a plan of many small programs pays it per wave.
PROGRAM_COST_BYTES = 48 * 1024


@dataclasses.dataclass(frozen=True)
class SkinnyMatmulConfig:
    """Launch of the skinny matmul (None: chosen by ``launch`` for the shape).

    block_n: output columns a program, a multiple of 64 that divides N.
    block_k: K a pipeline step, a multiple of 64 (one 128-byte swizzled row of bf16).
    stages: pipeline steps in flight (weight tiles copied ahead of the wgmmas).
    splits: slices of K, each run by programs of its own (their float32 parts summed).
    approx_math, auto_barriers: as ``MosaicDecodeConfig``'s (``mosaic_gpu.kernel_options``).

    ``launch`` fills the fields left None: the plan that gives the most loaded
    multiprocessor the fewest bytes to read (``cost``).
    """

    block_n: int | None = None
    block_k: int = 64
    stages: int | None = None
    splits: int | None = None
    approx_math: bool = True
    auto_barriers: bool = False


def check(x: jax.Array, weight: jax.Array, layer: int | None) -> None:
    """Refuses, in one line naming it, an argument ``skinny_matmul`` does not take."""
    if x.ndim != 2 or weight.ndim not in (2, 3):
        raise ValueError(
            f"skinny_matmul: x [M, K] and weight [K, N] or [L, K, N], got x {x.shape} and "
            f"weight {weight.shape}"
        )
    if x.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        raise ValueError(f"skinny_matmul: bfloat16 x and weight, got {x.dtype} and {weight.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_matmul: 1 to {MAX_ROWS} rows of x, got {x.shape[0]}")
    if x.shape[1] != weight.shape[-2]:
        raise ValueError(
            f"skinny_matmul: x's K ({x.shape[1]}) is not the weight's ({weight.shape[-2]})"
        )
    if (weight.ndim == 3) != (layer is not None):
        raise ValueError(
            "skinny_matmul: a layer index goes with a stacked [L, K, N] weight and only "
            f"with one (weight {weight.shape}, layer {layer})"
        )
    if layer is not None and not (isinstance(layer, int) and 0 <= layer < weight.shape[0]):
        raise ValueError(
            f"skinny_matmul: layer must be a static int in [0, {weight.shape[0]}), got {layer!r}"
        )


@dataclasses.dataclass(frozen=True)
class Launch:
    """A config with every field resolved for one shape."""

    block_n: int
    block_k: int
    stages: int
    splits: int


def cost(m: int, k: int, n: int, plan: Launch, num_sms: int) -> int:
    """Bytes the most loaded multiprocessor moves under ``plan``, as the plans are compared:
    its waves of programs (one program an SM at a time), each reading ``block_n`` columns of
    its slice of the weight and paying ``PROGRAM_COST_BYTES``, plus a split product's
    float32 part written and read back by the sum."""
    programs = n // plan.block_n * plan.splits
    waves = -(-programs // num_sms)
    weight = plan.block_n * k // plan.splits * 2
    part = 0 if plan.splits == 1 else 2 * plan.block_n * padded_rows(m) * 4
    return waves * (weight + part + PROGRAM_COST_BYTES)


def launch(m: int, k: int, n: int, config: SkinnyMatmulConfig, num_sms: int) -> Launch:
    """``config``'s fields resolved for a ``[M, K] @ [K, N]`` on ``num_sms`` multiprocessors
    (ValueError where the shape does not tile: see ``unsupported``). Among the column
    blocks (multiples of 64 up to ``MAX_BLOCK_N`` that divide N) and slices of K (divisors
    of its steps) left open, the plan of least ``cost``, the fewest slices among those
    within 3% of it; ``stages`` (unless given) keeps ``IN_FLIGHT_BYTES`` of weight in
    flight, as shared memory and the slice's steps allow."""
    if config.block_n is not None and (config.block_n < 64 or config.block_n % 64):
        raise ValueError(f"skinny_matmul: block_n {config.block_n} is not a multiple of 64")
    if any(v is not None and v < 1 for v in (config.stages, config.splits)):
        raise ValueError(
            f"skinny_matmul: stages ({config.stages}) and splits ({config.splits}) must be "
            "at least 1"
        )
    blocks = [config.block_n] if config.block_n else range(64, MAX_BLOCK_N + 1, 64)
    blocks = [b for b in blocks if n % b == 0]
    if not blocks:
        raise ValueError(
            f"skinny_matmul: N {n} does not split into blocks of {config.block_n or 64}"
        )
    block_k = config.block_k
    if block_k < 64 or block_k % 64 or k % block_k:
        raise ValueError(
            f"skinny_matmul: K {k} does not split into steps of {block_k} (a multiple of 64)"
        )
    steps = k // block_k
    if config.splits is not None and steps % config.splits:
        raise ValueError(
            f"skinny_matmul: {config.splits} slices of K do not divide its {steps} steps of "
            f"{block_k}"
        )
    slices = (
        [config.splits] if config.splits else [d for d in range(1, steps + 1) if steps % d == 0]
    )
    plans = []
    for block_n in blocks:
        for splits in slices:
            stages = config.stages or _stages(m, block_n, block_k, splits, steps // splits)
            if stages and shared_memory(block_n, block_k, stages, splits, m) <= SMEM_BYTES:
                plans.append(Launch(block_n, block_k, stages, splits))
    if not plans:
        stages = config.stages or 1
        raise ValueError(
            f"skinny_matmul: {stages} stages of [{padded_rows(m)}, {block_k}] and "
            f"[{block_k}, {blocks[0]}] tiles need "
            f"{shared_memory(blocks[0], block_k, stages, slices[0], m)} bytes of shared memory "
            f"(has {SMEM_BYTES})"
        )
    costs = {plan: cost(m, k, n, plan, num_sms) for plan in plans}
    least = min(costs.values())
    near = [plan for plan in plans if costs[plan] <= 1.03 * least]
    return min(near, key=lambda plan: (plan.splits, costs[plan], -plan.block_n))


def _stages(m: int, block_n: int, block_k: int, splits: int, slice_steps: int) -> int:
    """Steps in flight that hold ``IN_FLIGHT_BYTES`` of weight tiles, at most the slice's
    steps and what shared memory holds (0: not even one fits)."""
    tile = block_n * block_k * 2
    stages = max(1, min(IN_FLIGHT_BYTES // tile, slice_steps))
    while stages and shared_memory(block_n, block_k, stages, splits, m) > SMEM_BYTES:
        stages -= 1
    return stages


def padded_rows(rows: int) -> int:
    """x's rows as the kernel runs them: a multiple of 8 (the wgmma's N step)."""
    return -(-rows // 8) * 8


def shared_memory(block_n: int, block_k: int, stages: int, splits: int, rows: int) -> int:
    """Bytes of shared memory a program takes: the ring of bf16 tiles of x and the weight,
    and the output tile (float32 where K is split)."""
    out_bytes = 2 if splits == 1 else 4
    rows = padded_rows(rows)
    return stages * (rows + block_n) * block_k * 2 + block_n * rows * out_bytes


def unsupported(x: jax.Array, weight: jax.Array, config: SkinnyMatmulConfig | None = None):
    """Why the kernel cannot run this product here (None: it can): a shape that does not
    tile, or a device or jax that does not run Mosaic GPU kernels."""
    try:
        launch(*x.shape, weight.shape[-1], config or SkinnyMatmulConfig(), device_num_sms())
    except ValueError as error:
        return str(error).removeprefix("skinny_matmul: ")
    return mosaic_gpu.device_unsupported()


def skinny_matmul(
    x: jax.Array,
    weight: jax.Array,
    *,
    layer: int | None = None,
    config: SkinnyMatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ weight`` (``x @ weight[layer]`` for a stacked weight, read in place).

    Args:
      x: ``[M, K]`` bfloat16, M up to ``MAX_ROWS``.
      weight: ``[K, N]`` bfloat16, or ``[L, K, N]`` with ``layer`` (static) in ``[0, L)``;
        K a multiple of ``config.block_k``, N of 64.
      config: the launch (None: the defaults, resolved for the shape by ``launch``).
      interpret: Mosaic GPU's interpret mode (None: off a GPU).

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32 (summed in float32 across K's slices).
    """
    check(x, weight, layer)
    config = config or SkinnyMatmulConfig()
    if interpret is None:
        interpret = online_softmax.interpret_default()
    m, k = x.shape
    n = weight.shape[-1]
    plan = launch(m, k, n, config, device_num_sms())
    rows = padded_rows(m)
    padded = jnp.pad(x, ((0, rows - m), (0, 0)))
    out_dtype = x.dtype if plan.splits == 1 else jnp.float32
    kernel = plgpu.kernel(
        functools.partial(_kernel, plan=plan, layer=layer),
        out_type=jax.ShapeDtypeStruct((plan.splits, n, rows), out_dtype),
        scratch_types=dict(out_smem=plgpu.SMEM((plan.block_n, rows), out_dtype)),
        grid=(n // plan.block_n, plan.splits),
        grid_names=("n", "split"),
        num_threads=NUM_WARPGROUPS,
        thread_name="wg",
        **mosaic_gpu.kernel_options(config, interpret, NUM_WARPGROUPS),
    )
    transposed = jax.named_call(kernel, name="skinny_matmul")(padded, weight)
    transposed = transposed.sum(axis=0) if plan.splits > 1 else transposed[0]
    return transposed.T[:m].astype(x.dtype)


def _swizzled(row_elements: int) -> tuple:
    """A bf16 tile's transforms for wgmma: 8-row tiles, the widest swizzle its rows allow
    (128 bytes from 64 elements)."""
    swizzle = plgpu.find_swizzle(row_elements * 16)
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def _kernel(x_gmem, w_gmem, out_gmem, out_smem, *, plan: Launch, layer):
    """One program: ``out^T``'s rows ``n`` (the output's columns) from slice ``split`` of K,
    ``[block_n, rows]``."""
    rows, k = x_gmem.shape
    steps = k // plan.block_k // plan.splits
    split = lax.axis_index("split")
    k_slice = pl.ds(split * steps * plan.block_k, steps * plan.block_k)
    columns = pl.ds(lax.axis_index("n") * plan.block_n, plan.block_n)
    weight = w_gmem if layer is None else w_gmem.at[layer]

    def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((plan.block_n, rows), jnp.float32))
        def _(acc):
            run_pipeline(acc)
            out_smem[...] = acc[...].astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, columns])
            plgpu.wait_smem_to_gmem(0)

    def step(_, x_tile, w_tile, acc):
        # out^T [block_n, rows] += w_tile^T [block_n, block_k] @ x_tile^T [block_k, rows]
        plgpu.wgmma(acc, w_tile.transpose((1, 0)), x_tile.transpose((1, 0)))
        plgpu.wgmma_wait(0)  # the slot goes back to the copies once its product is done
        return acc

    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (rows, plan.block_k), lambda i: (0, i), transforms=_swizzled(plan.block_k)
            ),
            plgpu.BlockSpec(
                (plan.block_k, plan.block_n), lambda i: (i, 0), transforms=_swizzled(plan.block_n)
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=plan.stages,
        compute_context=compute_context,
    )(x_gmem.at[:, k_slice], weight.at[k_slice, columns])
