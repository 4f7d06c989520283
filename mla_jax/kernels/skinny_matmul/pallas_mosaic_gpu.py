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

An FP8 weight (float8_e4m3fn with DeepSeek's block scales, ``fp8_blocks``) streams half the
bytes. A step lies inside one scale block, so its scale is one number and goes on the step's
product, not on its weights: the compute warpgroup converts the step's e4m3 tile into float16
(exact, one instruction a pair of values; bf16 would take three and a multiply each) in shared
memory, multiplies it with x in float16 (each row scaled into float16's range by a power of
two, ``matmul_steps.float16_rows``, undone on the output) into a fresh accumulator, and adds
that times the scale to the float32 sum it carries. A step's chain (wait for its copy,
convert, fence, product, add) is latency-bound in one warpgroup, so ``fp8_warpgroups``
compute warpgroups take alternate steps, each with its own sum (added in shared memory at
the end), and each reads its next step's scale from global memory while it computes one:
two ran V3's o_proj at 16 rows in 58.3 us against one's 74.1, its gate_proj in 79.6 against
90.3 (64-column blocks; H200, 2026-12-04, a trial script).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import fp8, fp8_blocks, matmul_steps, mosaic_gpu, online_softmax
from ..decode import device_num_sms

MAX_ROWS = 64  # x's rows on the wgmma's N side: 8 to 64 in steps of 8 keep one warpgroup's
# accumulator within its registers
MAX_BLOCK_N = 192  # output columns a program: the widest run on a GPU (H200, 2026-12-04)
CONVERT_COLUMNS = 32  # an FP8 tile's columns a conversion loads: its 32-byte swizzle
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
    block_k: K a pipeline step, a multiple of 64 (one 128-byte swizzled row of bf16); None:
      64, or over an FP8 weight its scale blocks' depth up to 128 (a step's chain costs
      about the same 64 deep as 128: V3's projections at 16 and 64 rows ran 11-31% faster
      at 128; H200, 2026-12-04, a trial script).
    stages: pipeline steps in flight (weight tiles copied ahead of the wgmmas).
    splits: slices of K, each run by programs of its own (their float32 parts summed).
    fp8_warpgroups: over an FP8 weight, compute warpgroups that take alternate steps (1 or 2).
    approx_math, auto_barriers: as ``MosaicDecodeConfig``'s (``mosaic_gpu.kernel_options``).

    ``launch`` fills the fields left None: the plan that gives the most loaded
    multiprocessor the fewest bytes to read (``cost``).
    """

    block_n: int | None = None
    block_k: int | None = None
    stages: int | None = None
    splits: int | None = None
    fp8_warpgroups: int = 2
    approx_math: bool = True
    auto_barriers: bool = False


def check(
    x: jax.Array,
    weight: jax.Array,
    layer: int | jax.Array | None,
    scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
) -> None:
    """Refuses, in one line naming it, an argument ``skinny_matmul`` does not take."""
    if x.ndim != 2 or weight.ndim not in (2, 3):
        raise ValueError(
            f"skinny_matmul: x [M, K] and weight [K, N] or [L, K, N], got x {x.shape} and "
            f"weight {weight.shape}"
        )
    if x.dtype != jnp.bfloat16 or weight.dtype not in (jnp.bfloat16, fp8.FP8):
        raise ValueError(
            f"skinny_matmul: bfloat16 x and a bfloat16 or float8_e4m3fn weight, got {x.dtype} "
            f"and {weight.dtype}"
        )
    if (weight.dtype == fp8.FP8) != (scale_inv is not None) or (scale_inv is None) != (
        blocks is None
    ):
        raise ValueError(
            "skinny_matmul: scale_inv and blocks go with a float8_e4m3fn weight and only with "
            f"one (weight {weight.dtype}, scale_inv {scale_inv is not None}, blocks {blocks})"
        )
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
    if layer is not None:
        matmul_steps.check_layer(layer, weight.shape[0], "skinny_matmul: ")
    if blocks is not None:
        blocks.check(weight, scale_inv, "skinny_matmul: weight")


@dataclasses.dataclass(frozen=True)
class Launch:
    """A config with every field resolved for one shape."""

    block_n: int
    block_k: int
    stages: int
    splits: int
    consumers: int = 1  # compute warpgroups, taking alternate steps


def cost(m: int, k: int, n: int, plan: Launch, num_sms: int, weight_bytes: int = 2) -> int:
    """Bytes the most loaded multiprocessor moves under ``plan``, as the plans are compared:
    its waves of programs (one program an SM at a time), each reading ``block_n`` columns of
    its slice of the weight (``weight_bytes`` an element) and paying ``PROGRAM_COST_BYTES``,
    plus a split product's float32 part written and read back by the sum."""
    programs = n // plan.block_n * plan.splits
    waves = -(-programs // num_sms)
    weight = plan.block_n * k // plan.splits * weight_bytes
    part = 0 if plan.splits == 1 else 2 * plan.block_n * padded_rows(m) * 4
    return waves * (weight + part + PROGRAM_COST_BYTES)


def launch(
    m: int,
    k: int,
    n: int,
    config: SkinnyMatmulConfig,
    num_sms: int,
    blocks: fp8_blocks.Fp8Blocks | None = None,
) -> Launch:
    """``config``'s fields resolved for a ``[M, K] @ [K, N]`` on ``num_sms`` multiprocessors
    (ValueError where the shape does not tile: see ``unsupported``); ``blocks``: an FP8
    weight's scale blocks (None: bf16), whose block sizes the column blocks and steps must
    divide. Among the column blocks (multiples of 64 up to ``MAX_BLOCK_N`` that divide N;
    over FP8 the widest) and slices of K (divisors of its steps) left open, the plan of
    least ``cost``, the fewest slices among those within 3% of it; ``stages`` (unless
    given) keeps ``IN_FLIGHT_BYTES`` of weight in flight, as shared memory and the slice's
    steps allow."""
    if config.fp8_warpgroups not in (1, 2):
        raise ValueError(
            f"skinny_matmul: fp8_warpgroups must be 1 or 2, got {config.fp8_warpgroups}"
        )
    if blocks is not None and (k % blocks.block_in or n // blocks.parts % blocks.block_out):
        raise ValueError(
            f"skinny_matmul: weight [{k}, {n}] is not whole blocks of {blocks} (partial "
            "edge blocks are the Triton kernel's)"
        )
    if config.block_n is not None and (config.block_n < 64 or config.block_n % 64):
        raise ValueError(f"skinny_matmul: block_n {config.block_n} is not a multiple of 64")
    if any(v is not None and v < 1 for v in (config.stages, config.splits)):
        raise ValueError(
            f"skinny_matmul: stages ({config.stages}) and splits ({config.splits}) must be "
            "at least 1"
        )
    widest = MAX_BLOCK_N if blocks is None else min(MAX_BLOCK_N, blocks.block_out)
    blocks_n = [config.block_n] if config.block_n else range(64, widest + 1, 64)
    blocks_n = [b for b in blocks_n if n % b == 0 and (blocks is None or blocks.block_out % b == 0)]
    if blocks is not None and not config.block_n:
        # An FP8 step's chain (wait, convert, fence, product, add) costs about the same
        # at 64 columns as at 128, so the widest block: V3's projections at 16 and 64 rows
        # ran 6-17% faster at 128 columns than at 64, but for q_a_proj [7168, 1536] (2%
        # and 13% slower; H200, 2026-12-04, a trial script).
        blocks_n = blocks_n[-1:]
    if not blocks_n:
        raise ValueError(
            f"skinny_matmul: N {n} does not split into blocks of {config.block_n or 64}"
            + ("" if blocks is None else f" within scale blocks of {blocks.block_out}")
        )
    block_k = config.block_k or (64 if blocks is None else min(blocks.block_in, 128))
    if block_k < 64 or block_k % 64 or k % block_k:
        raise ValueError(
            f"skinny_matmul: K {k} does not split into steps of {block_k} (a multiple of 64)"
        )
    if blocks is not None and blocks.block_in % block_k:
        raise ValueError(
            f"skinny_matmul: steps of {block_k} do not divide the scale blocks' "
            f"{blocks.block_in} rows"
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
    weight_bytes = 2 if blocks is None else 1
    consumers = 1 if blocks is None else config.fp8_warpgroups
    plans = []
    for block_n in blocks_n:
        for splits in slices:
            plan = Launch(block_n, block_k, config.stages or 1, splits, consumers)
            stages = config.stages or _stages(m, plan, steps // splits, weight_bytes)
            plan = dataclasses.replace(plan, stages=stages)
            if stages and shared_memory(plan, m, weight_bytes) <= mosaic_gpu.SMEM_BYTES:
                plans.append(plan)
    if not plans:
        plan = Launch(blocks_n[0], block_k, config.stages or 1, slices[0], consumers)
        raise ValueError(
            f"skinny_matmul: {plan.stages} stages of [{padded_rows(m)}, {block_k}] and "
            f"[{block_k}, {blocks_n[0]}] tiles need "
            f"{shared_memory(plan, m, weight_bytes)} bytes of shared memory "
            f"(has {mosaic_gpu.SMEM_BYTES})"
        )
    costs = {plan: cost(m, k, n, plan, num_sms, weight_bytes) for plan in plans}
    least = min(costs.values())
    near = [plan for plan in plans if costs[plan] <= 1.03 * least]
    return min(near, key=lambda plan: (plan.splits, costs[plan], -plan.block_n))


def _stages(m: int, plan: Launch, slice_steps: int, weight_bytes: int) -> int:
    """Steps in flight that hold ``IN_FLIGHT_BYTES`` of weight tiles, at most the slice's
    steps and what shared memory holds (0: not even one fits)."""
    tile = plan.block_n * plan.block_k * weight_bytes
    stages = max(1, min(IN_FLIGHT_BYTES // tile, slice_steps))
    while stages and shared_memory(dataclasses.replace(plan, stages=stages), m, weight_bytes) > (
        mosaic_gpu.SMEM_BYTES
    ):
        stages -= 1
    return stages


def padded_rows(rows: int) -> int:
    """x's rows as the kernel runs them: a multiple of 8 (the wgmma's N step)."""
    return -(-rows // 8) * 8


def shared_memory(plan: Launch, rows: int, weight_bytes: int = 2) -> int:
    """Bytes of shared memory a program takes: the ring of 16-bit tiles of x and of the
    weight's tiles (``weight_bytes`` an element), and the output tile (float32 where K is
    split); over an FP8 weight each compute warpgroup's float16 tile of a step, the last one
    shared with the float32 output tile."""
    rows = padded_rows(rows)
    ring = plan.stages * (rows * 2 + plan.block_n * weight_bytes) * plan.block_k
    if weight_bytes == 2:
        return ring + plan.block_n * rows * (2 if plan.splits == 1 else 4)
    converted = plan.block_k * plan.block_n * 2
    return ring + (plan.consumers - 1) * converted + max(converted, plan.block_n * rows * 4)


def unsupported(
    x: jax.Array,
    weight: jax.Array,
    config: SkinnyMatmulConfig | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
):
    """Why the kernel cannot run this product here (None: it can): x not bfloat16, a shape
    that does not tile, or a device or jax that does not run Mosaic GPU kernels."""
    if x.dtype != jnp.bfloat16:
        return f"x is {x.dtype}, not bfloat16"
    return mosaic_gpu.unsupported(
        lambda: launch(
            *x.shape, weight.shape[-1], config or SkinnyMatmulConfig(), device_num_sms(), blocks
        ),
        "skinny_matmul: ",
    )


def skinny_matmul(
    x: jax.Array,
    weight: jax.Array,
    *,
    scale_inv: jax.Array | None = None,
    blocks: fp8_blocks.Fp8Blocks | None = None,
    layer: int | jax.Array | None = None,
    config: SkinnyMatmulConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ weight`` (``x @ weight[layer]`` for a stacked weight, read in place; ``x @
    dequantize(weight, scale_inv)`` for an FP8 one).

    Args:
      x: ``[M, K]`` bfloat16, M up to ``MAX_ROWS``.
      weight: ``[K, N]`` bfloat16 or float8_e4m3fn, or ``[L, K, N]`` with ``layer``, an
        int32 scalar in ``[0, L)`` (may be traced, as a scan's layer index is; the kernel
        reads it from global memory); K a multiple of ``config.block_k``, N of 64.
      scale_inv, blocks: a float8_e4m3fn weight's float32 block scales
        (``blocks.scale_shape(K, N)``, ``[L, ...]`` for a stacked one) and their block sizes
        (static; whole blocks only); None for bfloat16.
      config: the launch (None: the defaults, resolved for the shape by ``launch``).
      interpret: Mosaic GPU's interpret mode (None: off a GPU).

    Returns:
      ``[M, N]`` bfloat16, accumulated in float32 (summed in float32 across K's slices).
    """
    check(x, weight, layer, scale_inv, blocks)
    config = config or SkinnyMatmulConfig()
    if interpret is None:
        interpret = online_softmax.interpret_default()
    m, k = x.shape
    n = weight.shape[-1]
    plan = launch(m, k, n, config, device_num_sms(), blocks)
    rows = padded_rows(m)
    padded = jnp.pad(x, ((0, rows - m), (0, 0)))
    weight, scale_inv, layer = matmul_steps.as_stack(weight, scale_inv, layer)
    if blocks is None:
        out_dtype = x.dtype if plan.splits == 1 else jnp.float32
        scratch = dict(out_smem=plgpu.SMEM((plan.block_n, rows), out_dtype))
    else:
        padded, row_factors = matmul_steps.float16_rows(padded)
        out_dtype = jnp.float32
        tile = plgpu.SMEM(
            (plan.block_k, plan.block_n),
            jnp.float16,
            transforms=mosaic_gpu.swizzled(CONVERT_COLUMNS),
        )
        # The output tile takes the bytes of the last compute warpgroup's float16 tile,
        # which it writes only after its last step (shared memory for x's tiles at 64 rows).
        scratch = dict(
            converted=[tile] * (plan.consumers - 1),
            last_or_out=plgpu.RefUnion(tile, plgpu.SMEM((plan.block_n, rows), out_dtype)),
            total_ready=plgpu.Barrier(num_arrivals=1),
        )
    num_warpgroups = plan.consumers + 1  # beside one that copies
    kernel = plgpu.kernel(
        functools.partial(_kernel, plan=plan, blocks=blocks),
        out_type=jax.ShapeDtypeStruct((plan.splits, n, rows), out_dtype),
        scratch_types=scratch,
        grid=(n // plan.block_n, plan.splits),
        grid_names=("n", "split"),
        num_threads=num_warpgroups,
        thread_name="wg",
        **mosaic_gpu.kernel_options(config, interpret, num_warpgroups),
    )
    operands = (layer, padded, weight) + (() if scale_inv is None else (scale_inv,))
    transposed = jax.named_call(kernel, name="skinny_matmul")(*operands)
    transposed = transposed.sum(axis=0) if plan.splits > 1 else transposed[0]
    if blocks is not None:
        transposed = transposed * row_factors
    return transposed.T[:m].astype(x.dtype)


def _kernel(
    layer_gmem,
    x_gmem,
    w_gmem,
    *refs,
    plan: Launch,
    blocks,
    out_smem=None,
    converted=(),
    last_or_out=None,
    total_ready=None,
):
    """One program: ``out^T``'s rows ``n`` (the output's columns) from slice ``split`` of K,
    ``[block_n, rows]``, of the stacked weight ``w_gmem [L, K, N]``'s layer ``layer_gmem
    [1]``; over an FP8 weight float32, before the rows' float16 factors, the compute
    warpgroups' sums added in the last one's tile."""
    *scale_gmem, out_gmem = refs
    rows, k = x_gmem.shape
    steps = k // plan.block_k // plan.splits
    split = lax.axis_index("split")
    n0 = lax.axis_index("n") * plan.block_n
    k_slice = pl.ds(split * steps * plan.block_k, steps * plan.block_k)
    layer = layer_gmem[0]
    weight = w_gmem.at[layer]
    acc_shape = (plan.block_n, rows)
    if blocks is not None:
        *converted, (last, out_smem) = (*converted, last_or_out)
        converted = (*converted, last)  # each compute warpgroup's float16 tile

    def store(total):
        out_smem[...] = total.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, pl.ds(n0, plan.block_n)])
        plgpu.wait_smem_to_gmem(0)

    if blocks is None:

        def compute_context(run_pipeline):
            @functools.partial(pl.run_scoped, acc=plgpu.ACC(acc_shape, jnp.float32))
            def _(acc):
                run_pipeline(acc)
                store(acc[...])

        def step(_, x_tile, w_tile, acc):
            # out^T [block_n, rows] += w_tile^T [block_n, block_k] @ x_tile^T [block_k, rows]
            plgpu.wgmma(acc, w_tile.transpose((1, 0)), x_tile.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the slot goes back to the copies once its product is done
            return acc

    else:
        scales = scale_gmem[0].at[layer]
        column = fp8_blocks.scale_columns(n0, w_gmem.shape[-1], blocks)
        wg = lax.axis_index("wg")  # of the compute warpgroups, 0 to consumers - 1

        def step_scale(i):
            """Step ``i``'s scale (of the slice; clamped to its last step)."""
            i = split * steps + jnp.minimum(i, steps - 1)
            return scales[i * plan.block_k // blocks.block_in, column]

        def compute_context(run_pipeline):
            total = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
            total, _ = run_pipeline((total, step_scale(wg)))
            if plan.consumers == 1:
                store(total)
                return

            @pl.when(wg == 1)
            def _():
                out_smem[...] = total
                plgpu.commit_smem()  # every thread's stores before the arrival
                plgpu.barrier_arrive(total_ready)

            @pl.when(wg == 0)
            def _():
                plgpu.barrier_wait(total_ready)
                store(total + plgpu.load(out_smem, layout=plgpu.Layout.WGMMA))

        def take(c, total, scale, *, x_tile, w_tile, index):
            """Step ``index`` by compute warpgroup ``c``, in its float16 tile."""
            # Our next step's scale, in flight while this step computes.
            next_scale = step_scale(index + plan.consumers)
            mosaic_gpu.convert_fp8_tile(w_tile, converted[c], CONVERT_COLUMNS)

            def product(acc):
                plgpu.wgmma(acc, converted[c].transpose((1, 0)), x_tile.transpose((1, 0)))
                return acc[...]  # waits for the product: the slot goes back to the copies

            return total + pl.run_scoped(product, plgpu.ACC(acc_shape)) * scale, next_scale

        def step(indices, x_tile, w_tile, carry):
            take_step = functools.partial(take, x_tile=x_tile, w_tile=w_tile, index=indices[0])
            if plan.consumers == 1:
                return take_step(0, *carry)

            def ours(c):  # step of compute warpgroup c: taken there, passed by the other
                return lambda *carry: lax.cond(
                    wg == c, functools.partial(take_step, c), lambda *carry: carry, *carry
                )

            return lax.cond(indices[0] % 2 == 0, ours(0), ours(1), *carry)

    itemsize = 2 if blocks is None else 1
    columns = plan.block_n if blocks is None else CONVERT_COLUMNS
    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(
                (rows, plan.block_k),
                lambda i: (0, i),
                transforms=mosaic_gpu.swizzled(plan.block_k if blocks is None else CONVERT_COLUMNS),
            ),
            plgpu.BlockSpec(
                (plan.block_k, plan.block_n),
                lambda i: (i, 0),
                transforms=mosaic_gpu.swizzled(columns, itemsize),
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=plan.consumers,
        max_concurrent_steps=plan.stages,
        compute_context=compute_context,
    )(x_gmem.at[:, k_slice], weight.at[k_slice, pl.ds(n0, plan.block_n)])
