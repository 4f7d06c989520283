"""Runs each Pallas kernel a few times at a benchmark shape, for a profiler to attach to:

    ncu --kernel-name regex:mla_decode --launch-skip 2 --launch-count 1 \\
        python scripts/profile_kernels.py decode --heads 128 [--impl pallas|mosaic_gpu|triton]

``--impl`` picks the kernels as ``kernels.select`` does (default ``pallas``: the Mosaic GPU
ones on an sm90 GPU, whose kernels ncu names ``anonymous_mosaic_gpu_kernel``). The Mosaic GPU
prefill chooses its block size in a ``lax.cond``, which XLA runs as a conditional node of a
CUDA graph, and ncu profiles no kernel of such a graph ("No kernels were profiled"): run it
with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` (no graphs).

``--cache fp8``: the decode over the FP8 cache (``kernels.fp8``, the bf16 one quantized).

``--out DIR`` also writes what ran (kernel, shapes, wall seconds of each call) as
``profile_<kernel>.json``. ``--smoke``: both kernels once at 16 heads, 2 x 64 tokens on
the CPU (interpreted), results under --out only.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import parse_args, parser

from mla_jax import kernels
from mla_jax.kernels import KernelPlan, fp8

KERNELS = ("decode", "prefill")
# The defaults of a smoke run (flags given still win).
SMOKE_FLAGS = dict(heads=16, batch=2, context=64, reps=1)


def _decode(kernel_set: kernels.KernelSet, n: int, b: int, ctx: int, cache: str = "bf16"):
    """``mla_decode`` of ``kernel_set`` over ``b`` requests of ``ctx`` tokens (DeepSeek's
    512 + 64, page 64, a bf16 or an FP8 cache) and its arguments."""
    ks = jax.random.split(jax.random.key(0), 3)
    pages = b * -(-ctx // 64)
    lens = np.full(b, ctx, np.int32)
    table = np.random.default_rng(0).permutation(pages).reshape(b, -1).astype(np.int32)
    schedule = KernelPlan.for_impl(kernel_set, n).decode_schedule(lens)
    f = jax.jit(functools.partial(kernel_set.mla_decode, scale=0.07, schedule=schedule))
    kv = jax.random.normal(ks[2], (pages, 64, 576), jnp.bfloat16)
    if cache == "fp8":
        values, scales = fp8.quantize(kv[..., :512])
        kv = fp8.Fp8Cache(values, kv[..., 512:], scales)
    args = (
        jax.random.normal(ks[0], (b, n, 512), jnp.bfloat16),
        jax.random.normal(ks[1], (b, n, 64), jnp.bfloat16),
        kv,
        jnp.asarray(table),
        jnp.asarray(lens),
    )
    return f, args


def _prefill(kernel_set: kernels.KernelSet, n: int, t: int):
    """Causal ``flash_prefill`` of ``kernel_set`` over one sequence of ``t`` tokens (q/k
    192, v 128) and its arguments."""
    ks = jax.random.split(jax.random.key(0), 3)
    cu = jnp.array([0, t], jnp.int32)
    schedule = KernelPlan.for_impl(kernel_set, n).prefill_schedule(np.array([0, t]), t)
    f = jax.jit(
        functools.partial(kernel_set.flash_prefill, scale=0.07, causal=True, schedule=schedule)
    )
    args = (
        jax.random.normal(ks[0], (t, n, 192), jnp.bfloat16),
        jax.random.normal(ks[1], (t, n, 192), jnp.bfloat16),
        jax.random.normal(ks[2], (t, n, 128), jnp.bfloat16),
        cu,
        cu,
    )
    return f, args


def main():
    ap = parser(__doc__)
    ap.add_argument("kernel", nargs="?", choices=KERNELS, help="default: both, in turn")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--impl", choices=["pallas", "mosaic_gpu", "triton"], default="pallas")
    ap.add_argument("--cache", choices=["bf16", "fp8"], default="bf16", help="decode's cache")
    args = parse_args(ap)
    if args.smoke:
        ap.set_defaults(**SMOKE_FLAGS)
        args = ap.parse_args()
    n, b, ctx = args.heads, args.batch, args.context
    kernel_set = kernels.select(args.impl)
    for kernel in [args.kernel] if args.kernel else KERNELS:
        if kernel == "decode":
            f, f_args = _decode(kernel_set, n, b, ctx, args.cache)
        else:
            f, f_args = _prefill(kernel_set, n, ctx)
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(f(*f_args))
            seconds.append(time.perf_counter() - start)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            ran = {
                "kernel": kernel,
                "backend": kernel_set.backend,
                "shapes": {str(i): list(a.shape) for i, a in enumerate(f_args)},
                "dtypes": {str(i): str(a.dtype) for i, a in enumerate(f_args)},
                "seconds": seconds,
                "device": str(jax.devices()[0]),
            }
            with open(os.path.join(args.out, f"profile_{kernel}.json"), "w") as out:
                json.dump(ran, out, indent=1)
        print(f"{kernel}: {args.reps} calls, " + ", ".join(f"{s:.4f} s" for s in seconds))


if __name__ == "__main__":
    main()
