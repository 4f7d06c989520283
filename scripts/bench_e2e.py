"""One MLA layer step end to end (projections, rope, cache write, attention, o_proj), with
DeepSeek-V3 dimensions in bf16, on the Pallas kernels and on the pure-jnp references.

    PYTHONPATH=. python scripts/bench_e2e.py [--out DIR]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import parse_args, row, save, time_us
from flax import nnx

from mla_jax.cache.metadata import build_metadata
from mla_jax.kernels import KernelPlan
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import preset

PAGE = 64
STEPS = [
    ("decode 64 x ctx 4096", [4096] * 64, [1] * 64),
    ("decode 128 x ctx 1024..8192", None, [1] * 128),
    ("prefill 4 x 1024 new", [0] * 4, [1024] * 4),
    ("mixed: 32 decodes (ctx 2048) + 512 new on ctx 8192", [2048] * 32 + [8192], [1] * 32 + [512]),
]


class _DonatedCache:
    """A layer step that owns its cache: each call donates the cache and keeps the one the
    step returns, as ``Engine.step`` does (a donated buffer cannot be passed again)."""

    def __init__(self, step, cache):
        self.step = step
        self.cache = cache

    def __call__(self, state, x, md):
        y, self.cache = self.step(state, x, self.cache, md)
        return y, self.cache


def main():
    args = parse_args(__doc__)
    rng = np.random.default_rng(0)
    cfg = preset("deepseek-v3")
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
    for label, ctx, new in STEPS:
        new = np.asarray(new)
        ctx = np.asarray(ctx) if ctx is not None else rng.integers(1024, 8193, len(new))
        need = -(-(ctx + new) // PAGE)
        num_blocks = int(need.sum())
        table = np.zeros((len(new), int(need.max())), np.int32)
        table[np.arange(table.shape[1])[None, :] < need[:, None]] = rng.permutation(num_blocks)
        md = build_metadata(
            ctx,
            new,
            table,
            block_size=PAGE,
            num_blocks=num_blocks,
            workspace_size=8192,
            kernel_plan=plan,
        )
        rows_real = md.token_rows()
        key = jax.random.key(int(rng.integers(2**31)))
        k1, k2 = jax.random.split(key)
        x = jax.random.normal(k1, (md.positions.shape[0], cfg.hidden_size), jnp.bfloat16)
        cache = jax.random.normal(k2, (num_blocks, PAGE, cfg.cache_width), jnp.bfloat16)
        md = jax.device_put(md)
        # Each impl steps on its own copy of the cache (the donated one is consumed).
        runs = {impl: _DonatedCache(f, cache.copy()) for impl, f in steps.items()}
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
        "One MLA layer step (DeepSeek-V3 dims, bf16, page 64): Pallas vs reference kernels",
        ["step", "new tokens", "cached tokens", "Pallas us", "reference us", "speedup", "rel diff"],
        rows,
        [
            "The whole MLAAttention call under jit: q/kv projections, RMSNorms, rope, cache "
            "write, absorbed decode and chunked prefill (workspace 8192), o_proj; the cache "
            "donated to the step and replaced by the one it returns, as the engine does.",
            "rel diff: relative L2 difference of the two outputs over the real tokens (bf16).",
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
