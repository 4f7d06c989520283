"""One MLA layer step end to end (projections, rope, cache write, attention, o_proj), with
DeepSeek-V3 dimensions in bf16, on the Pallas kernels and on the pure-jnp references.

    python scripts/bench_e2e.py [--out DIR] [--smoke]

``--smoke``: the same table with the tiny model's attention and tiny steps on the CPU,
results under --out only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import DonatedCache, parse_args, parser, row, save, time_us
from flax import nnx

from mla_jax.cache.metadata import build_metadata
from mla_jax.checkpoint.tiny import TINY
from mla_jax.kernels import KernelPlan
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import MLAConfig, preset


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the benchmark's steps, or a smoke run's."""

    model_name: str
    model: MLAConfig
    page: int
    workspace: int
    # (label, context of each request or None for random ones in ``random_context``, new
    # tokens of each request): decodes first, as the engine lays a step out
    steps: tuple[tuple[str, tuple[int, ...] | None, tuple[int, ...]], ...]
    random_context: tuple[int, int]  # lowest, highest


FULL = Sizes(
    model_name="DeepSeek-V3",
    model=preset("deepseek-v3"),
    page=64,
    workspace=8192,
    steps=(
        ("decode 64 x ctx 4096", (4096,) * 64, (1,) * 64),
        ("decode 128 x ctx 1024..8192", None, (1,) * 128),
        ("prefill 4 x 1024 new", (0,) * 4, (1024,) * 4),
        (
            "mixed: 32 decodes (ctx 2048) + 512 new on ctx 8192",
            (2048,) * 32 + (8192,),
            (1,) * 32 + (512,),
        ),
    ),
    random_context=(1024, 8192),
)
SMOKE = Sizes(
    model_name="the tiny model's",
    model=TINY.mla,
    page=16,
    workspace=32,
    steps=(
        ("decode 4 x ctx 16..64", None, (1,) * 4),
        ("mixed: 2 decodes (ctx 20) + 8 new on ctx 40", (20, 20, 40), (1, 1, 8)),
    ),
    random_context=(16, 64),
)


def main():
    args = parse_args(parser(__doc__))
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    cfg = sizes.model
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    plan = KernelPlan.for_device(cfg.num_heads)

    def step(impl):
        def f(state, x, cache, md):
            return nnx.merge(graphdef, state)(x, cache, md, impl=impl)

        # The cache is donated, as Engine donates it: the step updates it in place.
        return jax.jit(f, donate_argnums=2)

    steps = {impl: step(impl) for impl in ("pallas", "reference")}
    rows = []
    for label, ctx, new in sizes.steps:
        new = np.asarray(new)
        low, high = sizes.random_context
        ctx = np.asarray(ctx) if ctx is not None else rng.integers(low, high + 1, len(new))
        need = -(-(ctx + new) // sizes.page)
        num_blocks = int(need.sum())
        table = np.zeros((len(new), int(need.max())), np.int32)
        table[np.arange(table.shape[1])[None, :] < need[:, None]] = rng.permutation(num_blocks)
        md = build_metadata(
            ctx,
            new,
            table,
            block_size=sizes.page,
            num_blocks=num_blocks,
            workspace_size=sizes.workspace,
            kernel_plan=plan,
        )
        rows_real = md.token_rows()
        key = jax.random.key(int(rng.integers(2**31)))
        k1, k2 = jax.random.split(key)
        x = jax.random.normal(k1, (md.positions.shape[0], cfg.hidden_size), jnp.bfloat16)
        cache = jax.random.normal(k2, (num_blocks, sizes.page, cfg.cache_width), jnp.bfloat16)
        md = jax.device_put(md)
        # Each impl steps on its own copy of the cache (the donated one is consumed).
        runs = {impl: DonatedCache(f, cache.copy()) for impl, f in steps.items()}
        timings = {impl: time_us(run, [(state, x, md)], reps=10) for impl, run in runs.items()}
        y_p, _ = runs["pallas"](state, x, md)
        y_r, _ = runs["reference"](state, x, md)
        diff = (y_p - y_r).astype(jnp.float32)[rows_real]
        err = float(jnp.linalg.norm(diff) / jnp.linalg.norm(y_r.astype(jnp.float32)[rows_real]))
        pallas_us, reference_us = timings["pallas"].us, timings["reference"].us
        cells = [
            label,
            int(new.sum()),
            int(ctx.sum()),
            round(pallas_us, 1),
            round(reference_us, 1),
            f"{reference_us / pallas_us:.1f}x",
            f"{err:.1e}",
        ]
        print(cells, flush=True)
        rows.append(row(cells, **timings))
    save(
        "e2e_layer",
        f"One MLA layer step ({sizes.model_name} dims, bf16, page {sizes.page}): Pallas vs "
        "reference kernels",
        ["step", "new tokens", "cached tokens", "Pallas us", "reference us", "speedup", "rel diff"],
        rows,
        [
            "The whole MLAAttention call under jit: q/kv projections, RMSNorms, rope, cache "
            f"write, absorbed decode and chunked prefill (workspace {sizes.workspace}), o_proj; "
            "the cache "
            "donated to the step and replaced by the one it returns, as the engine does.",
            "rel diff: relative L2 difference of the two outputs over the real tokens (bf16).",
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
