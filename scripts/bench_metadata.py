"""Host metadata build time for a step of 256 requests (median of many builds).

python scripts/bench_metadata.py [--out DIR]
"""

from __future__ import annotations

import time

import numpy as np
from benchlib import parse_args, save

from mla_jax.metadata import build_metadata


def _batch(rng, num_decodes, num_prefills, block_size):
    n = num_decodes + num_prefills
    ctx = rng.integers(0, 4096, n)
    ctx[num_decodes:] *= rng.random(num_prefills) < 0.5
    qlen = np.concatenate([np.ones(num_decodes, int), rng.integers(2, 64, num_prefills)])
    width = int((-(-(ctx + qlen) // block_size)).max())
    return ctx, qlen, rng.permutation(n * width).reshape(n, width), n * width


def main():
    args = parse_args(__doc__)
    reps = 500
    rng = np.random.default_rng(0)
    rows = []
    for label, nd, npf in [
        ("256 decodes", 256, 0),
        ("200 decodes + 56 prefills", 200, 56),
        ("256 prefills", 0, 256),
    ]:
        ctx, qlen, table, num_blocks = _batch(rng, nd, npf, 16)
        kw = dict(block_size=16, num_blocks=num_blocks, workspace_size=65536)
        times = []
        for _ in range(reps + 20):
            t0 = time.perf_counter()
            md = build_metadata(ctx, qlen, table, **kw)
            times.append(time.perf_counter() - t0)
        us = np.median(times[20:]) * 1e6
        rows.append([label, int(qlen.sum()), str(tuple(md.step_shape())), round(us, 1)])
        print(f"{label}: {us:.1f} us")
    save(
        "metadata",
        "Host metadata build (256 requests)",
        ["batch", "new tokens", "bucket (StepShape)", "median us"],
        rows,
        [
            f"Median of {reps} builds after 20 warm-up builds; block size 16, contexts up to "
            "4096 tokens, workspace 65536; includes input validation."
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
