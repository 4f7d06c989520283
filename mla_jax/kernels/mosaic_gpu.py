"""What the Mosaic GPU kernels (Hopper, ``jax.experimental.pallas.mosaic_gpu``) share:
whether this device and jax run them, the fallbacks to Triton logged once, and the
accumulator's rescale under lazy rescaling."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, scf, vector

log = logging.getLogger(__name__)

_logged: set[str] = set()


def log_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time ``message`` is seen in this process: a
    kernel chosen or passed over automatically is said once, not at every trace."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def device_unsupported() -> str | None:
    """Why the Mosaic GPU kernels cannot run on this device and jax (None: they can,
    compiled on an sm90 GPU or in Mosaic GPU's interpret mode elsewhere)."""
    if jax.default_backend() != "gpu":
        if not hasattr(plgpu, "InterpretGPUParams"):
            return f"on jax {jax.__version__} interpreted (Mosaic GPU's interpret mode needs 0.11)"
        return None
    cc = getattr(jax.devices()[0], "compute_capability", "")
    if cc and not str(cc).startswith("9"):
        return f"on compute capability {cc} (they run on sm90)"
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11):
        # Compiled and run on 0.11.2. The Mosaic GPU lowering of 0.12 refuses the decode
        # output's register-to-global stores (a warp's bf16 row is half a 32-byte sector);
        # interpret mode runs on 0.11 and 0.12.
        return f"on jax {jax.__version__} compiled (they run on 0.11)"
    return None


def unsupported(check, prefix: str) -> str | None:
    """Why a Mosaic GPU kernel cannot run a call here (None: it can): the message of the
    ValueError that ``check()`` raises for an argument the kernel does not take (without
    the kernel's ``prefix``), else ``device_unsupported()``."""
    try:
        check()
    except ValueError as error:
        return str(error).removeprefix(prefix)
    return device_unsupported()


def cpu_pool_threads() -> int:
    """The threads of XLA's CPU pool, sized as XLA sizes it when jax starts: ``PJRT_NPROC``,
    else ``NPROC``, else the cores this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# XLA's CPU pool for interpret mode: more threads than a kernel here has warpgroups (three;
# four in a decode cluster of two programs) and their caller, which block one each
# (``kernel_options``).
INTERPRET_POOL_THREADS = 8
# The register layout an FP8 tile in shared memory is converted in: four e4m3 values a
# thread in one 4-byte load without bank conflicts, their 16-bit values in one 8-byte store
# (the WGMMA layout's two-value accesses conflicted; the decode's 128 heads, 128 x 4096 on
# an H200: 426 -> 408 us).
FP8_CONVERT_LAYOUT = plgpu.Layout.WGMMA_8BIT
SMEM_BYTES = 227 * 1024  # an sm90 program's shared memory


def swizzled(row_elements: int, itemsize: int = 2) -> tuple:
    """A shared-memory tile's transforms for TMA and wgmma: 8-row tiles, the widest swizzle
    that rows of ``row_elements`` elements of ``itemsize`` bytes allow (128 bytes from 64
    bf16 elements)."""
    swizzle = plgpu.find_swizzle(row_elements * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def convert_fp8_tile(tile, converted, chunk_columns: int) -> None:
    """Inside a Mosaic GPU kernel: the e4m3 ``tile [rows, columns]`` (shared memory, swizzled
    in rows of ``chunk_columns``) into the 16-bit ``converted`` of its shape, ``chunk_columns``
    at a time, exactly (e4m3 fits float16 and bf16); made visible to the wgmma that reads
    it."""
    for first in range(0, tile.shape[1], chunk_columns):
        columns = pl.ds(first, chunk_columns)
        values = plgpu.load(tile.at[:, columns], layout=FP8_CONVERT_LAYOUT, optimized=True)
        converted[:, columns] = values.astype(converted.dtype)
    plgpu.commit_smem()


def copy_rows_smem_to_gmem(smem, gmem, offset, count) -> None:
    """Rows ``[offset, offset + count)`` of ``smem [S, C]`` to the same rows of ``gmem [S,
    C]`` (a view of the output's rows the tile covers) by TMA: one copy of ``2^i`` rows for
    each set bit of ``count`` (a copy's box is static, ``count`` is not), the largest first.
    ``offset`` and ``count`` are int32 scalars (may be traced), ``count < 2 S``; the caller
    waits for the copies (``plgpu.wait_smem_to_gmem``)."""
    size = 1 << (smem.shape[0].bit_length() - 1)
    while size:

        @pl.when(count & size != 0)
        def _(offset=offset, size=size):
            rows = pl.ds(offset, size)
            plgpu.copy_smem_to_gmem(smem.at[rows], gmem.at[rows])

        offset = offset + (count & size)
        size //= 2


def widen_cpu_pool() -> None:
    """Gives XLA's CPU pool at least ``INTERPRET_POOL_THREADS`` threads (``PJRT_NPROC``)
    unless it is set. XLA reads it when jax starts its CPU backend: call before any
    computation."""
    os.environ.setdefault("PJRT_NPROC", str(max(INTERPRET_POOL_THREADS, cpu_pool_threads())))


def kernel_options(
    config, interpret: bool, num_warpgroups: int, programs_per_cluster: int = 1
) -> dict:
    """``plgpu.kernel``'s compile and interpret options from a Mosaic GPU kernel's frozen
    config (its ``approx_math`` and ``auto_barriers``).

    Interpreted, each of the ``num_warpgroups`` warpgroups of each of a cluster's
    ``programs_per_cluster`` programs runs as a computation whose callbacks block in
    mbarrier waits on a thread of XLA's CPU pool, and the kernel's caller holds one more; a
    pool with fewer threads can deadlock (it did on 2 cores), which is said once with the
    setting that avoids it."""
    threads = cpu_pool_threads()
    blocking = num_warpgroups * programs_per_cluster + 1
    if interpret and threads < blocking:
        log_once(
            log,
            f"Mosaic GPU interpret mode: XLA's CPU pool has {threads} threads and "
            f"the kernel's {num_warpgroups * programs_per_cluster} warpgroups and their "
            f"caller block {blocking}, so it can deadlock: set PJRT_NPROC={blocking} "
            "or more before jax starts",
        )
    return dict(
        compiler_params=plgpu.CompilerParams(
            approx_math=config.approx_math,
            unsafe_no_auto_barriers=not config.auto_barriers,
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def rescale_rows(acc: jax.Array, alpha: jax.Array, *, lazy: bool, interpret: bool) -> jax.Array:
    """``acc * alpha[:, None]`` inside a Mosaic GPU kernel: ``acc [rows, width]`` float32 in
    the WGMMA layout, ``alpha [rows]`` float32 in its row layout.

    With ``lazy`` (lazy rescaling, where most steps leave every ``alpha`` at exactly 1),
    compiled, each thread branches past its multiplies unless one of its own rows has
    ``alpha != 1``: a divergent branch, which a warp skips when none of its 16 rows moved.
    A skipped multiply by exactly 1 changes nothing, so no thread needs another's decision
    (a warpgroup-wide one would put a reduction through shared memory and a barrier on the
    softmax's critical path). Interpreted
    (Mosaic GPU's interpret mode runs no inline Mosaic GPU code) or without ``lazy``, every
    row is multiplied: the same values."""

    def multiply(acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    if not lazy or interpret:
        return multiply(acc, alpha)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
        return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA),
    )
    def where_moved(_, acc, alpha):
        one = arith.constant(ir.F32Type.get(), 1.0)
        moved = None
        for register in alpha.registers.flat:
            for i in range(ir.VectorType(register.type).shape[0]):
                element = vector.extract(register, dynamic_position=[], static_position=[i])
                differs = arith.cmpf(arith.CmpFPredicate.UNE, element, one)
                moved = differs if moved is None else arith.ori(moved, differs)
        branch = scf.IfOp(moved, [r.type for r in acc.registers.flat], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scaled = acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
            scf.yield_(list(scaled.registers.flat))
        with ir.InsertionPoint(branch.else_block):
            scf.yield_(list(acc.registers.flat))
        registers = np.empty(acc.registers.shape, dtype=object)
        registers.flat[:] = list(branch.results)
        return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)

    return where_moved(acc, alpha)
