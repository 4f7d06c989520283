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
A second table puts the kernel over FP8 weights (float8_e4m3fn, 128 x 128 block scales, as
DeepSeek-V3 ships them) beside the Triton FP8 kernel (``fp8_matmul.fastest``: what the
Triton kernel set runs, over the weight in HF's ``[N, K]`` layout) and the bf16 weight's XLA
dot, on V3's projections (issue 23 asks an FP8 projection at decode for <= 0.6x the bf16
time), and beside them the w8a8 matmul (``mla_jax/kernels/w8a8_matmul``: the same ``[N, K]``
weight, x quantized into e4m3, e4m3 wgmmas); its bandwidth counts the e4m3 bytes.
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
from benchlib import (
    copy_bandwidth,
    jsonable,
    parse_args,
    parser,
    random_fp8_weight,
    row,
    run,
    save,
    sweep,
    time_us,
)

from mla_jax.engine.runner import GPU_COMPILER_OPTIONS
from mla_jax.kernels import fp8_blocks
from mla_jax.kernels import fp8_matmul as fm
from mla_jax.kernels import skinny_matmul as skinny
from mla_jax.kernels import w8a8_matmul as w8a8
from mla_jax.kernels.decode import device_num_sms
from mla_jax.kernels.skinny_matmul import pallas_mosaic_gpu
from mla_jax.model.layers import k_splits, split_k_dot

Config = skinny.SkinnyMatmulConfig


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: projections ``name -> (K, N)``, row counts, the bytes of
    weights a rotation spans at least (past L2) and the sweep's shapes and configs."""

    projections: dict
    fp8_projections: dict
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
    fp8_projections={
        "V3 q_a_proj": (7168, 1536),
        "V3 q_b_proj": (1536, 128 * 192),
        "V3 kv_a_proj_with_mqa": (7168, 576),
        "V3 o_proj": (128 * 128, 7168),
        "V3 mlp.gate_proj": (7168, 18432),
        "V3 mlp.down_proj": (18432, 7168),
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
    fp8_projections={"small": (256, 128)},
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


def _compiled(fn, x, *operands):
    options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
    return jax.jit(fn).lower(x, *operands).compile(compiler_options=options)


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
    fp8_table(sizes, copy.gbs, out_dir)


FP8_BLOCKS = fp8_blocks.Fp8Blocks(128, 128)


def _fp8_stacks(k: int, n: int, rotation_bytes: int) -> list[tuple[jax.Array, jax.Array]]:
    """``[2, K, N]`` e4m3 stacks spanning e4m3's range and their ``[2, K/128, N/128]``
    random scales, as many (3 to 32) as span ``rotation_bytes`` of layer 1."""
    count = min(32, max(3, -(-rotation_bytes // (k * n))))
    keys = jax.random.split(jax.random.key(k * n + 1), count)
    return [random_fp8_weight(key, (2, k, n), FP8_BLOCKS) for key in keys]


def _fp8_case(fn, x, stacks, want) -> dict:
    """``fn(x, weight, scales)`` timed over the rotation of ``(weight, scales)`` pairs, with
    its relative error against ``want``."""
    f = _compiled(fn, x, *stacks[0])
    got = f(x, *stacks[0]).astype(jnp.float32)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    return {"us": time_us(f, [(x, *s) for s in stacks]), "rel_err": error}


def _fp8_cells(case: dict, bf16_us: float, copy_us: float) -> list:
    """An FP8 product's time (and its ratio to the bf16 weight's), share of the copy
    bandwidth (``copy_us``: its e4m3 bytes' copy time) and error, or why it does not run."""
    if "unsupported" in case:
        return [f"does not run: {case['unsupported']}", "", ""]
    us = case["us"].us
    return [
        f"{us:.1f} ({us / bf16_us:.2f}x)",
        f"{100 * copy_us / us:.0f}%",
        f"{case['rel_err']:.1e}",
    ]


def fp8_table(sizes: Sizes, bandwidth_gbs: float, out_dir: str | None) -> None:
    """The FP8 table: bf16 XLA, the Triton FP8 kernel, this kernel over FP8 and the w8a8
    matmul, per V3 projection and row count."""
    rows = []
    for name, (k, n) in sizes.fp8_projections.items():
        stacks = _fp8_stacks(k, n, sizes.rotation_bytes)
        bf16_stacks = [fp8_blocks.dequantize(w, s, FP8_BLOCKS, jnp.bfloat16) for w, s in stacks]
        dense = fp8_blocks.dequantize(stacks[0][0][1], stacks[0][1][1], FP8_BLOCKS)
        # The Triton kernel's and w8a8's weight: layer 1 in HF's [N, K] layout, with its
        # [N / 128, K / 128] scales
        hf_layout = [(w[1].T, scale[1].T) for w, scale in stacks]
        for m in sizes.rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            want = jnp.dot(x.astype(jnp.float32), dense, precision="highest")
            bf16 = time_us(
                _compiled(_model_product, x, bf16_stacks[0]), [(x, s) for s in bf16_stacks]
            )
            triton = _fp8_case(
                lambda x, w, s: fm.fastest(x, w, s, blocks=FP8_BLOCKS), x, hf_layout, want
            )
            reason = skinny.unsupported(x, stacks[0][0], blocks=FP8_BLOCKS)
            kernel = (
                {"unsupported": reason}
                if reason
                else _fp8_case(
                    lambda x, w, s: skinny.skinny_matmul(
                        x, w, scale_inv=s, blocks=FP8_BLOCKS, layer=1
                    ),
                    x,
                    stacks,
                    want,
                )
            )
            print(name, m, jsonable({"bf16": bf16, "triton": triton, "kernel": kernel}), flush=True)
            cells = [f"{name} [{k}, {n}]", m, round(bf16.us, 1)]
            timings = {"bf16": bf16}
            for label, case in (("triton_fp8", triton), ("kernel_fp8", kernel)):
                cells += _fp8_cells(case, bf16.us, k * n / bandwidth_gbs / 1e3)
                timings.update({} if "unsupported" in case else {label: case["us"]})
            if "unsupported" not in kernel:
                plan = pallas_mosaic_gpu.launch(m, k, n, Config(), device_num_sms(), FP8_BLOCKS)
                cells.append(f"{plan.block_n} x {plan.splits}")
            else:
                cells.append("")
            reason = w8a8.unsupported(x, *hf_layout[0])
            case = (
                {"unsupported": reason}
                if reason
                else _fp8_case(lambda x, w, s: w8a8.w8a8_matmul(x, w, s), x, hf_layout, want)
            )
            print(name, m, "w8a8", jsonable(case), flush=True)
            cells += _fp8_cells(case, bf16.us, k * n / bandwidth_gbs / 1e3)
            timings.update({} if reason else {"w8a8": case["us"]})
            rows.append(row(cells, **timings))
    save(
        "skinny_matmul_fp8",
        "Decode's projections over FP8 weights: the Mosaic GPU skinny matmul vs the Triton FP8 "
        "kernel and the bf16 weight",
        [
            "projection [K, N]",
            "rows",
            "bf16 XLA us",
            "Triton FP8 us (/ bf16)",
            "Triton of copy BW",
            "Triton rel err",
            "kernel FP8 us (/ bf16)",
            "kernel of copy BW",
            "kernel rel err",
            "columns x slices",
            "w8a8 us (/ bf16)",
            "w8a8 of copy BW",
            "w8a8 rel err",
        ],
        rows,
        [
            f"Copy bandwidth measured in the same run: {bandwidth_gbs:.0f} GB/s.",
            "FP8: layer 1 of a stacked [2, K, N] float8_e4m3fn weight with random 128 x 128 "
            "block scales, stacks rotating past L2; bf16: the same weights dequantized into "
            "bf16, through what layers.Linear runs for them (XLA's dot, K split by "
            "layers.k_splits). Triton FP8: fp8_matmul.fastest (what the Triton kernel set runs "
            "for an FP8 Linear) over the same layer in HF's [N, K] layout (a copy, as w8a8 "
            "reads it). Kernel: skinny_matmul over the stack's layer 1, read in place, "
            "with its default launch (columns a program x slices of K; two compute warpgroups "
            "taking alternate steps).",
            "w8a8: w8a8_matmul over the same [N, K] copy of the layer (e4m3 wgmmas), "
            "x quantized per row and 128 columns into e4m3 in the same call; its rel err is "
            "mostly that rounding of x (about 2.5%).",
            "Of copy BW: K N bytes (e4m3) over the time. rel err: relative L2 against a float32 "
            "product with the dequantized weight.",
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
