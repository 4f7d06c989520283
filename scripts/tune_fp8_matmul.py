"""Measures launch parameters of the FP8 weight paths on the GPU and writes the fastest into
``mla_jax/kernels/tuned.py`` (what ``Fp8MatmulConfig.for_shape`` and
``GroupedMatmulConfig.for_shape`` consult), with every candidate's time in
``benchmarks/tuning/fp8_tune.json``:

* the dense projections' Pallas kernel at decode (1 and 64 rows) for the shapes
  ``bench_fp8_matmul.py`` measures: column tile, K step, K splits (programs per
  multiprocessor), warps, stages, scales on the product, the MMA in float16;
* the grouped matmul with DeepSeek-V3's FP8 experts (``gate_up_proj``, ``down_proj``) at
  decode (64 tokens x top-8) and prefill (8192 tokens x top-8), random routing.

    python scripts/tune_fp8_matmul.py [--smoke] [--out DIR]

The tables are rewritten after each shape, so a run cut short keeps what it measured.
``--smoke``: tiny shapes on the CPU (interpreted), results under --out only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pprint
import time

import jax
import jax.numpy as jnp
from benchlib import RESULTS, ROOT, machine, parse_args, parser, time_many

from mla_jax.kernels import fp8_blocks, tuned
from mla_jax.kernels import fp8_matmul as fm
from mla_jax.kernels import grouped_matmul as gm

NUM_SMS = 132
DENSE = {  # bench_fp8_matmul.FULL's projections
    "q_a_proj": (7168, 1536),
    "q_b_proj": (1536, 128 * 192),
    "kv_a_proj_with_mqa": (7168, 576),
    "o_proj": (128 * 128, 7168),
    "mlp.gate_proj": (7168, 18432),
    "mlp.down_proj": (18432, 7168),
}
EXPERTS = dict(num=256, hidden=7168, inter=2048, topk=8, tokens=(64, 8192))
SMOKE_DENSE = {"q_a_proj": (64, 48)}
SMOKE_EXPERTS = dict(num=8, hidden=32, inter=16, topk=2, tokens=(4, 600))


def dense_candidates(rows: int, depth: int, width: int) -> dict:
    """Decode configs of ``fp8_matmul``: the ``for_shape`` rule's and its variants."""
    block_m = max(16, 1 << (rows - 1).bit_length())

    def make(block_n=64, block_k=128, per_sm=2, warps=4, stages=4, **kw):
        steps = math.ceil(depth / block_k)
        splits = max(1, min(math.ceil(per_sm * NUM_SMS / math.ceil(width / block_n)), steps // 4))
        return fm.Fp8MatmulConfig(block_m, block_n, block_k, splits, warps, stages, **kw)

    return {
        "rule": make(),
        "splits4": make(per_sm=4),
        "splits8": make(per_sm=8),
        "n128_splits4": make(block_n=128, per_sm=4),
        "n128_splits8": make(block_n=128, per_sm=8),
        "n32_splits4": make(block_n=32, per_sm=4),
        "k64_st6_splits4": make(block_k=64, stages=6, per_sm=4),
        "splits4_scaleprod": make(per_sm=4, scale_product=True),
        "n128_w8_splits8": make(block_n=128, per_sm=8, warps=8),
        "f16": make(float16_mma=True),
        "splits8_f16": make(per_sm=8, float16_mma=True),
        "n128_splits8_f16": make(block_n=128, per_sm=8, float16_mma=True),
    }


def grouped_candidates(regime: str) -> dict:
    cfg = gm.GroupedMatmulConfig
    if regime == "decode":
        base = cfg(16, 128, 128, num_warps=4, num_stages=4)
        return {
            "rule": base,
            "scaleprod": dataclasses.replace(base, scale_product=True),
            "scaleprod_swap": dataclasses.replace(base, scale_product=True, swap_ab=True),
            "n256_scaleprod": dataclasses.replace(base, block_n=256, scale_product=True),
            "n64_scaleprod": dataclasses.replace(base, block_n=64, scale_product=True),
            "st6_scaleprod": dataclasses.replace(base, num_stages=6, scale_product=True),
            "w8_scaleprod": dataclasses.replace(base, num_warps=8, scale_product=True),
            "f16": dataclasses.replace(base, float16_mma=True),
            "n256_f16": dataclasses.replace(base, block_n=256, float16_mma=True),
            "st6_f16": dataclasses.replace(base, num_stages=6, float16_mma=True),
        }
    base = cfg()
    return {
        "rule": base,
        "scaleprod": dataclasses.replace(base, scale_product=True),
        "swap": dataclasses.replace(base, swap_ab=True),
        "scaleprod_swap": dataclasses.replace(base, scale_product=True, swap_ab=True),
        "n128_k128_scaleprod": cfg(128, 128, 128, 8, 3, scale_product=True),
        "m64_n256_w4_scaleprod": cfg(64, 256, 64, 4, 4, scale_product=True),
        "k128_st4_scaleprod": cfg(128, 256, 128, 8, 4, scale_product=True),
        "k128_f16": cfg(128, 256, 128, 8, 3, float16_mma=True),
    }


def _fp8_weight(key, shape, blocks):
    """Random fp8 values (made on the device without a float32 copy) and block scales."""
    k1, k2 = jax.random.split(key)
    weight = jax.jit(
        lambda k: (jax.random.normal(k, shape, jnp.bfloat16) * 100).astype(jnp.float8_e4m3fn)
    )(k1)
    *lead, depth, width = shape
    grid = (*lead, *blocks.scale_shape(depth, width))
    scale = jax.random.uniform(k2, grid, jnp.float32, 0.5, 2.0) / (100 * math.sqrt(depth))
    return weight, scale


def tune_dense(shapes, block, reps, record, table):
    blocks = fp8_blocks.Fp8Blocks(block, block)
    for name, (depth, width) in shapes.items():
        # fp8_matmul takes HF's layout: weight [N, K], its scales [N-grid, K-grid]
        weight, scale = (a.T for a in _fp8_weight(jax.random.key(0), (depth, width), blocks))
        for rows in (1, 64):
            xs = [
                jax.random.normal(jax.random.key(i), (rows, depth), jnp.bfloat16) for i in range(2)
            ]
            cands = dense_candidates(rows, depth, width)
            fns = {
                c: (
                    jax.jit(functools.partial(fm.fp8_matmul, blocks=blocks, config=cfg)),
                    [(x, weight, scale) for x in xs],
                )
                for c, cfg in cands.items()
            }
            us = {name: t for name, (t, _) in time_many(fns, reps).items()}
            best = min(us, key=us.get)
            key = f"{cands[best].block_m}x{depth}x{width}"
            table[key] = dataclasses.asdict(cands[best])
            record.append({"kind": "dense", "what": name, "rows": rows, "us": us, "best": best})
            cells = " ".join(f"{c}={t:.1f}" for c, t in us.items())
            print(f"{name} rows={rows}: best {best}; {cells}", flush=True)
            yield


def tune_grouped(sizes, block, reps, record, table):
    e, h, i, topk = sizes["num"], sizes["hidden"], sizes["inter"], sizes["topk"]
    mats = {
        "experts.gate_up_proj": ((e, h, 2 * i), fp8_blocks.Fp8Blocks(block, block, parts=2)),
        "experts.down_proj": ((e, i, h), fp8_blocks.Fp8Blocks(block, block)),
    }
    for name, (shape, blocks) in mats.items():
        # FP8 experts in HF's layout: weight [E, N, K], its scales [E, N-grid, K-grid]
        weight, scale = (
            jnp.swapaxes(a, -1, -2) for a in _fp8_weight(jax.random.key(1), shape, blocks)
        )
        for tokens in sizes["tokens"]:
            rows = tokens * topk
            keys = jax.random.split(jax.random.key(tokens), tokens)
            ids = jax.vmap(lambda k: jax.random.permutation(k, e)[:topk])(keys).reshape(-1)
            group_sizes = jnp.bincount(ids, length=e).astype(jnp.int32)
            lhs = [
                jax.random.normal(jax.random.key(j), (rows, shape[1]), jnp.bfloat16)
                for j in range(2)
            ]
            regime = gm.GroupedMatmulConfig.regime(rows, e)
            cands = grouped_candidates(regime)
            fns = {}
            for c, cfg in cands.items():
                run = functools.partial(gm.grouped_matmul, blocks=blocks, config=cfg)
                fns[c] = (
                    jax.jit(lambda x, w, g, s, run=run: run(x, w, g, rhs_scale_inv=s)),
                    [(x, weight, group_sizes, scale) for x in lhs],
                )
            timed = time_many(fns, reps if rows < 10_000 else max(2, reps // 2))
            us = {name: t for name, (t, _) in timed.items()}
            best = min(us, key=us.get)
            table[f"{regime}x{shape[1]}x{shape[2]}"] = dataclasses.asdict(cands[best])
            record.append(
                {"kind": "grouped", "what": name, "tokens": tokens, "us": us, "best": best}
            )
            cells = " ".join(f"{c}={t:.0f}" for c, t in us.items())
            print(f"{name} tokens={tokens}: best {best}; {cells}", flush=True)
            yield
        del weight, scale


def write_tables(path: str, dense: dict, grouped: dict, device: str) -> None:
    with open(tuned.__file__) as f:
        head = f.read().split("\nDEVICE = ")[0]
    body = (
        f"\nDEVICE = {device!r}\n"
        f"FP8_MATMUL: dict[str, dict] = {pprint.pformat(dense, sort_dicts=True)}\n"
        f"GROUPED_FP8: dict[str, dict] = {pprint.pformat(grouped, sort_dicts=True)}\n"
    )
    with open(path, "w") as f:
        f.write(head + body)


def main():
    args = parse_args(parser(__doc__))
    out = args.out or os.path.join(RESULTS, "tuning")
    os.makedirs(out, exist_ok=True)
    # Only a full run without --out rewrites the kernels' tables; else the JSON keeps them.
    tuned = os.path.join(ROOT, "mla_jax", "kernels", "tuned.py")
    table_path = None if args.smoke or args.out else tuned
    block, reps = (16, 2) if args.smoke else (128, 10)
    dense, grouped, record = {}, {}, []
    device = machine()
    steps = [
        tune_grouped(SMOKE_EXPERTS if args.smoke else EXPERTS, block, reps, record, grouped),
        tune_dense(SMOKE_DENSE if args.smoke else DENSE, block, reps, record, dense),
    ]
    t0 = time.time()
    for step in steps:
        for _ in step:
            if table_path is not None:
                write_tables(table_path, dense, grouped, device)
            result = {"device": device, "date": time.strftime("%Y-%m-%d"), "rows": record}
            result["tables"] = {"FP8_MATMUL": dense, "GROUPED_FP8": grouped}
            with open(os.path.join(out, "fp8_tune.json"), "w") as f:
                json.dump(result, f, indent=1)
    print(f"tuned in {time.time() - t0:.0f}s: {table_path or out}")


if __name__ == "__main__":
    main()
