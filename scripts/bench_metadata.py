"""Host metadata build time for a step of 256 requests (median of many builds), without and
with the Pallas kernels' work schedules (what the engine builds on a GPU).

    python scripts/bench_metadata.py [--out DIR] [--smoke]

``--smoke``: the same table for 8 requests and a few builds, results under --out only.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from benchlib import Timing, parse_args, parser, row, save

from mla_jax.cache.metadata import build_metadata
from mla_jax.kernels import KernelPlan

BLOCK_SIZE, WORKSPACE = 16, 65536
# DeepSeek-V3's 128 heads on an H100 / H200 (132 SMs): the plan Engine makes on such a GPU.
GPU_PLAN = KernelPlan(num_heads=128, num_sms=132)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the benchmark's batches and builds, or a smoke run's."""

    reps: int  # timed builds
    warmup: int
    batches: tuple[tuple[str, int, int], ...]  # (label, decodes, prefills)

    @property
    def requests(self) -> int:
        return self.batches[0][1] + self.batches[0][2]


FULL = Sizes(
    reps=500,
    warmup=20,
    batches=(
        ("256 decodes", 256, 0),
        ("200 decodes + 56 prefills", 200, 56),
        ("256 prefills", 0, 256),
    ),
)
SMOKE = Sizes(
    reps=3,
    warmup=1,
    batches=(("6 decodes + 2 prefills", 6, 2),),
)


def _batch(rng, num_decodes, num_prefills, block_size):
    n = num_decodes + num_prefills
    ctx = rng.integers(0, 4096, n)
    ctx[num_decodes:] *= rng.random(num_prefills) < 0.5
    qlen = np.concatenate([np.ones(num_decodes, int), rng.integers(2, 64, num_prefills)])
    width = int((-(-(ctx + qlen) // block_size)).max())
    return ctx, qlen, rng.permutation(n * width).reshape(n, width), n * width


def _time_build(build, sizes: Sizes, **kwargs) -> Timing:
    """Wall clock of each ``build(**kwargs)`` on the host (no device work to wait for)."""
    times = []
    for _ in range(sizes.warmup + sizes.reps):
        t0 = time.perf_counter()
        build(**kwargs)
        times.append((time.perf_counter() - t0) * 1e6)
    return Timing.of(times[sizes.warmup :], "wall", warmup=sizes.warmup, rotation=1)


def main():
    args = parse_args(parser(__doc__))
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    rows = []
    for label, num_decodes, num_prefills in sizes.batches:
        ctx, qlen, table, num_blocks = _batch(rng, num_decodes, num_prefills, BLOCK_SIZE)
        build = functools.partial(
            build_metadata,
            ctx,
            qlen,
            table,
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            workspace_size=WORKSPACE,
        )
        plain = _time_build(build, sizes, kernel_plan=None)
        scheduled = _time_build(build, sizes, kernel_plan=GPU_PLAN)
        shape = str(tuple(build(kernel_plan=GPU_PLAN).step_shape()))
        cells = [label, int(qlen.sum()), shape, round(plain.us, 1), round(scheduled.us, 1)]
        rows.append(row(cells, without_schedules=plain, with_schedules=scheduled))
        print(f"{label}: {plain.us:.1f} us, with kernel schedules {scheduled.us:.1f} us")
    save(
        "metadata",
        f"Host metadata build ({sizes.requests} requests)",
        [
            "batch",
            "new tokens",
            "bucket (StepShape)",
            "median us, no schedules",
            "median us, with kernel schedules",
        ],
        rows,
        [
            f"Median of {sizes.reps} builds after {sizes.warmup} warm-up builds (wall clock); "
            "block size "
            f"{BLOCK_SIZE}, contexts up to 4096 tokens, workspace {WORKSPACE}; includes input "
            "validation.",
            "no schedules: build_metadata without a kernel plan (what the engine builds for "
            "the reference kernels, e.g. on a CPU).",
            f"with kernel schedules: also the Pallas kernels' split-KV and query-tile schedules, "
            f"kernel_plan=KernelPlan(num_heads={GPU_PLAN.num_heads}, "
            f"num_sms={GPU_PLAN.num_sms}), as the engine builds them on an H100 / H200.",
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
