"""Decode's projections, ``[rows <= 64, K] @ [K, N]``: the Mosaic GPU skinny matmul
(``mla_jax/kernels/skinny_matmul``) against what the model runs today (XLA's dot, cuBLAS, with K
split where ``layers.k_splits`` says), on the GPU, in one run.

    python scripts/bench_skinny_matmul.py [--out DIR] [--sweep] [--smoke]

Each weight is layer 1 of a stacked ``[2, K, N]`` array, as the decode step reads a layer's
weight (both products read it in place), and enough stacks rotate that a call finds none of
its weight in L2 (as in a step, where the other layers' weights pass through it). Per row:
the median device time of each (CUPTI), the weight's bytes over it as a fraction of the copy
bandwidth measured in the same run (issue 20 asks >= 85%), their ratio, the kernel's launch
(``launch``: column block, slices of K) and its relative error against a float32 product.
``--sweep``: the kernel's launch parameters (column block, step depth, stages, slices) on
V2-Lite's shapes at 16 rows (``skinny_matmul_sweep.json``, under --out only).

``--smoke``: small shapes on the CPU, the kernel interpreted where this jax has Mosaic GPU's
interpret mode (0.11 and later; otherwise its columns say why not), results under --out only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from benchlib import copy_bandwidth, jsonable, parse_args, parser, row, run, save, sweep, time_us

from mla_jax.engine.runner import GPU_COMPILER_OPTIONS
from mla_jax.kernels import skinny_matmul as skinny
from mla_jax.kernels.decode import device_num_sms
from mla_jax.kernels.skinny_matmul import pallas_mosaic_gpu
from mla_jax.model.layers import k_splits, split_k_dot

Config = skinny.SkinnyMatmulConfig


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: projections ``name -> (K, N)``, row counts, the bytes of
    weights a rotation spans at least (past L2) and the sweep's shapes and configs."""

    projections: dict
    rows: tuple[int, ...]
    rotation_bytes: int
    sweep_projections: tuple[str, ...]
    sweep_rows: int
    sweep_configs: tuple[Config, ...]


FULL = Sizes(
    projections={
        "V2-Lite q_proj": (2048, 16 * 192),
        "V2-Lite kv_a_proj_with_mqa": (2048, 576),
        "V2-Lite o_proj": (16 * 128, 2048),
        "V2-Lite gate_proj": (2048, 10944),  # (and up_proj)
        "V2-Lite down_proj": (10944, 2048),
        "V3 q_a_proj": (7168, 1536),
        "V3 q_b_proj": (1536, 128 * 192),
        "V3 kv_a_proj_with_mqa": (7168, 576),
        "V3 o_proj": (128 * 128, 7168),
        "V3 shared experts' gate_proj": (7168, 2048),
    },
    rows=(1, 16, 64),
    rotation_bytes=256 * 2**20,
    sweep_projections=("V2-Lite q_proj", "V2-Lite gate_proj", "V2-Lite down_proj"),
    sweep_rows=16,
    sweep_configs=tuple(
        Config(block_n=block_n, block_k=block_k, stages=stages, splits=splits)
        for block_n in (64, 128)
        for block_k, stages in ((64, 4), (64, 8), (128, 2), (128, 4))
        for splits in (None, 1)
    ),
)
SMOKE = Sizes(
    projections={"small": (256, 128)},
    rows=(1, 5),
    rotation_bytes=0,
    sweep_projections=("small",),
    sweep_rows=5,
    sweep_configs=(Config(), Config(stages=1, splits=2)),
)


def _stacks(k: int, n: int, rotation_bytes: int) -> list[jax.Array]:
    """``[2, K, N]`` bf16 stacks, as many (3 to 32) as span ``rotation_bytes`` of layer 1."""
    count = min(32, max(3, -(-rotation_bytes // (2 * k * n))))
    keys = jax.random.split(jax.random.key(k * n), count)
    return [jax.random.normal(key, (2, k, n), jnp.bfloat16) / k**0.5 for key in keys]


def _model_product(x: jax.Array, stack: jax.Array) -> jax.Array:
    """What ``layers.Linear`` runs on a GPU for a bf16 weight of a stacked layer."""
    k, n = stack.shape[1:]
    splits = k_splits(x.shape[0], k, n)
    return split_k_dot(x, stack[1], splits) if splits > 1 else jnp.dot(x, stack[1])


def _compiled(fn, x, stack):
    options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
    return jax.jit(fn).lower(x, stack).compile(compiler_options=options)


def _rel_err(fn, x, stack) -> float:
    want = jnp.dot(x.astype(jnp.float32), stack[1].astype(jnp.float32), precision="highest")
    got = fn(x, stack).astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _kernel_case(x, stacks, config: Config, bandwidth_gbs: float) -> dict:
    """The kernel on ``stacks``' layer 1: time, fraction of the copy bandwidth, error (or
    why it does not run here)."""
    k, n = stacks[0].shape[1:]
    reason = skinny.unsupported(x, stacks[0], config)
    if reason is not None:
        return {"unsupported": reason}
    plan = pallas_mosaic_gpu.launch(x.shape[0], k, n, config, device_num_sms())
    f = _compiled(functools.partial(skinny.skinny_matmul, layer=1, config=config), x, stacks[0])
    t = time_us(f, [(x, s) for s in stacks])
    return {
        "us": t,
        "of_copy_bandwidth": 2 * k * n / t.us / 1e3 / bandwidth_gbs,
        "rel_err": _rel_err(f, x, stacks[0]),
        "launch": dataclasses.asdict(plan),
    }


def tables(sizes: Sizes, out_dir: str | None) -> None:
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})", flush=True)
    rows = []
    for name, (k, n) in sizes.projections.items():
        stacks = _stacks(k, n, sizes.rotation_bytes)
        for m in sizes.rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            f = _compiled(_model_product, x, stacks[0])
            xla = time_us(f, [(x, s) for s in stacks])
            kernel = _kernel_case(x, stacks, Config(), copy.gbs)
            xla_share = 2 * k * n / xla.us / 1e3 / copy.gbs
            print(name, m, jsonable({"xla": xla, **kernel}), flush=True)
            cells = [f"{name} [{k}, {n}]", m, round(xla.us, 1), f"{100 * xla_share:.0f}%"]
            if "unsupported" in kernel:
                cells += [f"does not run: {kernel['unsupported']}", "", "", "", ""]
                rows.append(row(cells, xla=xla))
                continue
            plan = kernel["launch"]
            cells += [
                round(kernel["us"].us, 1),
                f"{100 * kernel['of_copy_bandwidth']:.0f}%",
                f"{kernel['us'].us / xla.us:.2f}x",
                f"{plan['block_n']} x {plan['splits']}",
                f"{kernel['rel_err']:.1e}",
            ]
            rows.append(row(cells, xla=xla, kernel=kernel["us"]))
    save(
        "skinny_matmul",
        "Decode's projections: the Mosaic GPU skinny matmul vs XLA's dot (cuBLAS)",
        [
            "projection [K, N]",
            "rows",
            "XLA us",
            "XLA of copy BW",
            "kernel us",
            "kernel of copy BW",
            "kernel / XLA",
            "columns x slices",
            "kernel rel err",
        ],
        rows,
        [
            f"Copy bandwidth measured in the same run: {copy.gbs:.0f} GB/s ({copy.method}).",
            "Each weight is layer 1 of a stacked [2, K, N] bf16 array, read in place by both; "
            "stacks rotate past L2. XLA: what layers.Linear runs (jnp.dot, or K split into "
            "slices by layers.k_splits, with the engine's GPU compiler options). Kernel: "
            "skinny_matmul with its default launch (columns a program x slices of K).",
            "Of copy BW: 2 K N bytes over the time, against the copy bandwidth (read + write). "
            "rel err: relative L2 against a float32 product.",
        ],
        out_dir=out_dir,
    )


def sweep_trials(sizes: Sizes) -> list:
    """``(info, variant, measure)`` per shape and launch config."""
    bandwidth = copy_bandwidth().gbs
    trials = []
    for name in sizes.sweep_projections:
        k, n = sizes.projections[name]
        stacks = _stacks(k, n, sizes.rotation_bytes)
        x = jax.random.normal(jax.random.key(0), (sizes.sweep_rows, k), jnp.bfloat16)
        for config in sizes.sweep_configs:
            info = dict(projection=name, k=k, n=n, rows=sizes.sweep_rows)
            measure = functools.partial(_kernel_case, x, stacks, config, bandwidth)
            trials.append((info, dataclasses.asdict(config), measure))
    return trials


def main():
    args = parse_args(parser(__doc__, sweeps=("launch",)))
    sizes = SMOKE if args.smoke else FULL
    run(
        args,
        lambda: tables(sizes, args.out),
        {"launch": lambda: sweep("skinny_matmul", sweep_trials(sizes), args.out)},
    )


if __name__ == "__main__":
    main()
