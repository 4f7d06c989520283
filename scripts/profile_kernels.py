"""Runs each Pallas kernel a few times at a benchmark shape, for a profiler to attach to:

    ncu --kernel-name regex:mla_decode --launch-skip 2 --launch-count 1 \\
        python scripts/profile_kernels.py decode --heads 128
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.kernels import KernelPlan, decode, prefill


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=["decode", "prefill"])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    n, b, ctx = args.heads, args.batch, args.context
    ks = jax.random.split(jax.random.key(0), 4)
    if args.kernel == "decode":
        pages = b * ctx // 64
        lens = np.full(b, ctx, np.int32)
        table = np.random.default_rng(0).permutation(pages).reshape(b, -1).astype(np.int32)
        schedule = KernelPlan.for_device(n).decode_schedule(lens)
        f = jax.jit(functools.partial(decode.mla_decode, scale=0.07, schedule=schedule))
        args_ = (
            jax.random.normal(ks[0], (b, n, 512), jnp.bfloat16),
            jax.random.normal(ks[1], (b, n, 64), jnp.bfloat16),
            jax.random.normal(ks[2], (pages, 64, 576), jnp.bfloat16),
            jnp.asarray(table),
            jnp.asarray(lens),
        )
    else:
        t = ctx
        cu = jnp.array([0, t], jnp.int32)
        f = jax.jit(functools.partial(prefill.flash_prefill, scale=0.07, causal=True))
        args_ = (
            jax.random.normal(ks[0], (t, n, 192), jnp.bfloat16),
            jax.random.normal(ks[1], (t, n, 192), jnp.bfloat16),
            jax.random.normal(ks[2], (t, n, 128), jnp.bfloat16),
            cu,
            cu,
        )
    for _ in range(args.reps):
        jax.block_until_ready(f(*args_))


if __name__ == "__main__":
    main()
