"""Paged MLA decode: the Pallas kernel against the XLA gather reference, on the GPU.

    PYTHONPATH=. python scripts/bench_decode.py [--out DIR] [--sweep [fp8|mgpu]]
        [--kernel triton|mgpu]

Page 64, bf16, Lkv 512 + R 64. Per row: median device microseconds (warm, CUPTI kernel
time), GB/s over the bytes the math needs (576 x 2 B per context token, plus q and out),
TFLOP/s (2 x N x context x (576 + 512)), the copy bandwidth measured in the same run, and the
reference's time. For N = 16 and 128 the same run times the FP8 cache (``kernels.fp8``: 656 B
a token) on the same inputs quantized, beside the bf16 time (``decode_fp8.json``).
``--sweep`` times kernel variants instead (written only under --out); ``--sweep fp8``
the FP8 cache's variants beside bf16 on the cases of its targets (``decode_fp8_sweep.json``).
``--kernel mgpu`` times the Mosaic GPU kernel (``kernels/decode/pallas_mosaic_gpu.py``)
beside the Triton one on the same inputs in the same run, N = 16 and 128 over the cases
below (``decode_mgpu.json``); ``--sweep mgpu`` its compile options on the cases of its
targets (``decode_mgpu_sweep.json``, under --out only).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import copy_bandwidth, jsonable, parse_args, row, save, sweep, time_us

from mla_jax.kernels import KernelPlan, decode, fp8, reference
from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic

LKV, R, PAGE = 512, 64, 64
SCALE = 192**-0.5
FP8_TOKEN_BYTES = LKV + fp8.num_groups(LKV) * 4 + R * 2  # 656


def _inputs(rng, seq_lens, n, sets):
    """Random q, a paged cache with randomly placed pages, and block tables; ``sets`` copies
    of the cache (rotated between calls when one copy would sit in L2)."""
    b = len(seq_lens)
    pages = -(-seq_lens // PAGE)
    width = int(pages.max())
    num_pages = int(pages.sum()) + 1
    perm = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    table[np.arange(width)[None, :] < pages[:, None]] = perm[: int(pages.sum())]
    key = jax.random.key(int(rng.integers(2**31)))
    ks = jax.random.split(key, 2 + sets)
    q_lat = jax.random.normal(ks[0], (b, n, LKV), jnp.bfloat16)
    q_pe = jax.random.normal(ks[1], (b, n, R), jnp.bfloat16)
    caches = [jax.random.normal(k, (num_pages, PAGE, LKV + R), jnp.bfloat16) for k in ks[2:]]
    lens = jnp.asarray(seq_lens, jnp.int32)
    return [(q_lat, q_pe, c, jnp.asarray(table), lens) for c in caches]


@jax.jit
def _quantized(cache: jax.Array) -> fp8.Fp8Cache:
    """The FP8 layout of a bf16 cache ``[pages, PAGE, LKV + R]`` (what ``write_cache`` would
    have stored for the same rows)."""
    values, scales = fp8.quantize(cache[..., :LKV])
    return fp8.Fp8Cache(values, cache[..., LKV:], scales)


def _case(rng, label, seq_lens, n, variant=None, with_reference=True, quantized=False):
    """Times the kernel on one batch; ``quantized``: over the FP8 layout of the same kind of
    random cache."""
    seq_lens = np.asarray(seq_lens)
    token_bytes = FP8_TOKEN_BYTES if quantized else (LKV + R) * 2
    cache_bytes = int(seq_lens.sum()) * token_bytes
    sets = int(min(8, max(1, -(-256 * 2**20 // cache_bytes))))
    arg_sets = _inputs(rng, seq_lens, n, sets)
    if quantized:
        arg_sets = [(*a[:2], _quantized(a[2]), *a[3:]) for a in arg_sets]
    config = decode.default_config(n, len(seq_lens))._replace(**(variant or {}))
    programs = decode.num_programs(config, n, KernelPlan.for_device(n).num_sms)
    schedule = jax.device_put(decode.plan(seq_lens, num_programs=programs, block_k=config.block_k))
    # The schedule is an argument (as it is in the model), not a constant baked in.
    kernel = jax.jit(
        lambda *a: decode.mla_decode(*a[:5], schedule=a[5], scale=SCALE, config=config)
    )
    arg_sets = [(*a, schedule) for a in arg_sets]
    timing = time_us(kernel, arg_sets)
    us = timing.us
    tokens = int(seq_lens.sum())
    b = len(seq_lens)
    nbytes = tokens * token_bytes + b * n * (LKV + R) * 2 + b * n * LKV * 2
    result = {
        "case": label,
        "N": n,
        "cache": "fp8" if quantized else "bf16",
        "us": us,
        "GB/s": nbytes / us / 1e3,
        "TFLOP/s": 2 * n * tokens * (LKV + R + LKV) / us / 1e6,
        "items": int(schedule.req_items[-1]),
        "programs": programs,
        "timing": timing,
    }
    if with_reference:
        ref = jax.jit(functools.partial(reference.mla_decode, scale=SCALE))
        want = ref(*arg_sets[0][:5])
        result.update(_errors(kernel(*arg_sets[0]), want, seq_lens))
        if not quantized:
            result["xla_timing"] = time_us(ref, [arg_sets[0][:5]], reps=10)
            result["xla_us"] = result["xla_timing"].us
    return result


def _errors(got, want, seq_lens) -> dict:
    """Relative L2 error of ``out`` and the largest absolute ``lse`` error (non-empty rows)
    of a kernel's ``got`` against the reference's ``want``."""
    (out, lse), (want_out, want_lse) = got, want
    err = jnp.linalg.norm((out - want_out).astype(jnp.float32)) / jnp.linalg.norm(
        want_out.astype(jnp.float32)
    )
    lse_err = jnp.max(jnp.abs(jnp.where(seq_lens[:, None] > 0, lse - want_lse, 0)))
    return {"rel_err": float(err), "lse_err": float(lse_err)}


def _mosaic_case(rng, label, seq_lens, n, variant=None, with_triton=True) -> dict:
    """Times the Mosaic GPU kernel (compile options ``variant`` on the defaults) and, on
    the same inputs, the Triton kernel with its default config; errors of both against the
    reference."""
    seq_lens = np.asarray(seq_lens)
    tokens = int(seq_lens.sum())
    sets = int(min(8, max(1, -(-256 * 2**20 // (tokens * (LKV + R) * 2)))))
    arg_sets = _inputs(rng, seq_lens, n, sets)
    num_sms = KernelPlan.for_device(n).num_sms
    programs = mosaic.num_programs(n, num_sms)
    schedule = jax.device_put(decode.plan(seq_lens, num_programs=programs, block_k=PAGE))
    config = mosaic.MosaicDecodeConfig(**(variant or {}))
    kernel = jax.jit(
        lambda *a: mosaic.mla_decode(*a[:5], schedule=a[5], scale=SCALE, config=config)
    )
    want = jax.jit(functools.partial(reference.mla_decode, scale=SCALE))(*arg_sets[0])
    timing = time_us(kernel, [(*a, schedule) for a in arg_sets])
    b = len(seq_lens)
    nbytes = tokens * (LKV + R) * 2 + b * n * (LKV + R) * 2 + b * n * LKV * 2
    result = {
        "case": label,
        "N": n,
        "us": timing.us,
        "GB/s": nbytes / timing.us / 1e3,
        "TFLOP/s": 2 * n * tokens * (LKV + R + LKV) / timing.us / 1e6,
        "programs": programs,
        "items": int(schedule.req_items[-1]),
        "timing": timing,
        **_errors(kernel(*arg_sets[0], schedule), want, seq_lens),
    }
    if with_triton:
        t_config = decode.default_config(n, b)
        t_programs = decode.num_programs(t_config, n, num_sms)
        t_schedule = jax.device_put(
            decode.plan(seq_lens, num_programs=t_programs, block_k=t_config.block_k)
        )
        triton = jax.jit(
            lambda *a: decode.mla_decode(*a[:5], schedule=a[5], scale=SCALE, config=t_config)
        )
        result["triton_timing"] = time_us(triton, [(*a, t_schedule) for a in arg_sets])
        result["triton_us"] = result["triton_timing"].us
        result["triton_rel_err"] = _errors(triton(*arg_sets[0], t_schedule), want, seq_lens)[
            "rel_err"
        ]
    return result


def _mosaic_table(rng, copy, out_dir) -> None:
    """``decode_mgpu.json``: the Mosaic GPU kernel beside Triton, N = 16 and 128."""
    rows = []
    for n in (16, 128):
        for label, lens in CASES:
            r = _mosaic_case(rng, label, lens, n)
            print(json.dumps(jsonable(r)), flush=True)
            cells = [
                r["case"],
                n,
                round(r["triton_us"], 1),
                round(r["us"], 1),
                f"{r['triton_us'] / r['us']:.2f}x",
                round(r["TFLOP/s"], 1),
                round(r["GB/s"]),
                f"{100 * r['GB/s'] / copy.gbs:.0f}%",
                f"{r['rel_err']:.1e}",
                f"{r['triton_rel_err']:.1e}",
            ]
            rows.append(row(cells, mosaic=r["timing"], triton=r["triton_timing"]))
    save(
        "decode_mgpu",
        "Paged MLA decode: Mosaic GPU kernel beside the Triton kernel, page 64, bf16",
        [
            "batch x context",
            "N",
            "Triton us",
            "Mosaic us",
            "speedup",
            "Mosaic TFLOP/s",
            "Mosaic GB/s",
            "of copy BW",
            "Mosaic rel err",
            "Triton rel err",
        ],
        rows,
        [
            f"Copy bandwidth measured in the same run: {copy.gbs:.0f} GB/s (read + write; "
            f"{copy.method}).",
            "Both kernels on the same inputs in the same run, each with its own default "
            "launch (Mosaic: 64 heads a program, one program a multiprocessor; Triton: "
            "decode.default_config) and its own split-KV plan; us includes the combine kernel.",
            "TFLOP/s counts 2 x N x context x (576 + 512) (N = 16 is padded to 64 rows in the "
            "Mosaic kernel: 4x the counted work); GB/s counts 576 x 2 B per context token plus "
            "q and out.",
            "rel err: relative L2 error of out against the XLA reference on the same inputs.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=out_dir,
    )


# Compile options of the Mosaic GPU kernel, on the cases of the targets.
MOSAIC_SWEEP_CASES = ((128, ("128 x 4096", "64 x 16384")), (16, ("64 x 16384",)))
MOSAIC_SWEEP = [{}, dict(auto_barriers=True), dict(approx_math=False)]


CASES = [
    ("1 x 16384", [16384]),
    ("32 x 4096", [4096] * 32),
    ("128 x 4096", [4096] * 128),
    ("64 x 16384", [16384] * 64),
]


def _ragged(rng):
    lens = rng.integers(1, 8193, 128)
    uniform = [int(lens.sum()) // 128] * 128
    return [
        (f"ragged 128 in [1, 8192] ({lens.sum()} tok)", lens),
        ("uniform, same tokens", uniform),
    ]


# The variants behind kernels.decode.default_config (each on top of the default).
SWEEP = {
    16: [
        {},
        dict(programs_per_sm=1, num_stages=3),
        dict(programs_per_sm=3),
        dict(num_warps=8),
        dict(block_k=32, num_stages=3),
        dict(combine_block_h=16, combine_block_d=128, combine_block_items=4),
        dict(combine_block_h=1, combine_block_d=64, combine_block_items=64),
    ],
    128: [{}, dict(num_stages=2), dict(block_k=32, num_stages=4), dict(block_h=32, num_warps=4)],
}
# The FP8 cache against bf16 on the cases of its targets (H200: at N = 16, 128 x 4096 and
# 64 x 16384 in <= 0.65x bf16's time; at N = 128 no slower), each variant on top of the
# default config, in one run (``--sweep fp8``). bf16 num_stages=1 shows what Triton's
# pipelining is worth: if bf16 without it is as slow as FP8, FP8's loads are likely not
# pipelined (they are converted before their dot), which ``prefetch`` works around.
# split_tail=False where prefetch needs it (the N = 128 default has it on).
FP8_SWEEP_CASES = ((16, ("128 x 4096", "64 x 16384")), (128, ("128 x 4096",)))
FP8_SWEEP_BF16 = [{}, dict(num_stages=1), dict(prefetch=True, split_tail=False)]
FP8_SWEEP = [
    {},
    dict(num_stages=1),
    dict(num_stages=3),
    dict(prefetch=True, split_tail=False),
    dict(prefetch=True, split_tail=False, block_k=32),
    dict(prefetch=True, split_tail=False, num_warps=8),
    dict(fp8_compute="float16"),
    dict(fp8_compute="float16", prefetch=True, split_tail=False),
]


def _fp8_trials(rng) -> list:
    """``sweep`` trials of FP8_SWEEP and its bf16 baselines, cases by label from CASES."""
    lens_of = dict(CASES)
    return [
        (
            {"case": label, "N": n, "cache": cache},
            variant,
            lambda label=label, n=n, variant=variant, cache=cache: _case(
                rng,
                label,
                lens_of[label],
                n,
                variant,
                with_reference=cache == "fp8",  # the error of float16 conversion
                quantized=cache == "fp8",
            ),
        )
        for n, labels in FP8_SWEEP_CASES
        for label in labels
        for cache, variants in (("bf16", FP8_SWEEP_BF16), ("fp8", FP8_SWEEP))
        for variant in variants
    ]


def main():
    args = parse_args(__doc__, kernels=("triton", "mgpu"))
    rng = np.random.default_rng(0)
    if args.sweep == "fp8":
        sweep("decode_fp8", _fp8_trials(rng), args.out)
        return
    if args.sweep == "mgpu":
        lens_of = dict(CASES)
        trials = [
            (
                {"case": label, "N": n},
                v,
                lambda label=label, n=n, v=v: _mosaic_case(
                    rng, label, lens_of[label], n, v, with_triton=not v
                ),
            )
            for n, labels in MOSAIC_SWEEP_CASES
            for label in labels
            for v in MOSAIC_SWEEP
        ]
        sweep("decode_mgpu", trials, args.out)
        return
    if args.kernel == "mgpu":
        copy = copy_bandwidth()
        print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})")
        _mosaic_table(rng, copy, args.out)
        return
    if args.sweep:
        trials = [
            (
                {"case": label, "N": n},
                v,
                lambda label=label, lens=lens, n=n, v=v: _case(
                    rng, label, lens, n, v, with_reference=False
                ),
            )
            for n, cases in ((16, CASES[:3]), (128, CASES[2:3]))
            for label, lens in cases
            for v in SWEEP[n]
        ]
        sweep("decode", trials, args.out)
        return
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})")
    rows, fp8_rows = [], []
    ragged = _ragged(rng)
    # N = 8: a tensor-parallel shard (DeepSeek-V2-Lite's 16 heads over 2 GPUs), which the
    # kernel runs on 16 padded heads.
    for n, cases in ((16, CASES + ragged), (128, CASES + ragged), (8, CASES)):
        for label, lens in cases:
            r = _case(rng, label, lens, n)
            print(json.dumps(jsonable(r)), flush=True)
            cells = [
                r["case"],
                n,
                round(r["us"], 1),
                round(r["GB/s"]),
                f"{100 * r['GB/s'] / copy.gbs:.0f}%",
                round(r["TFLOP/s"], 1),
                round(r["xla_us"], 1),
                f"{r['xla_us'] / r['us']:.1f}x",
                f"{r['rel_err']:.1e}",
            ]
            rows.append(row(cells, pallas=r["timing"], xla_reference=r["xla_timing"]))
            if n in (16, 128):
                q = _case(rng, label, lens, n, quantized=True)
                print(json.dumps(jsonable(q)), flush=True)
                cells = [
                    q["case"],
                    n,
                    round(q["us"], 1),
                    round(r["us"], 1),
                    f"{q['us'] / r['us']:.2f}x",
                    round(q["GB/s"]),
                    f"{100 * q['GB/s'] / copy.gbs:.0f}%",
                    round(q["TFLOP/s"], 1),
                    f"{q['rel_err']:.1e}",
                ]
                fp8_rows.append(row(cells, pallas_fp8=q["timing"], pallas_bf16=r["timing"]))
    save(
        "decode",
        "Paged MLA decode (Pallas), page 64, bf16",
        [
            "batch x context",
            "N",
            "us",
            "GB/s",
            "of copy BW",
            "TFLOP/s",
            "XLA ref us",
            "speedup",
            "rel err vs ref",
        ],
        rows,
        [
            f"Copy bandwidth measured in the same run: {copy.gbs:.0f} GB/s (read + write; "
            f"{copy.method}).",
            "us: median over 30 warm calls of the summed CUPTI kernel durations (split-KV "
            "kernel + combine), caches rotated so that no call finds its pages in L2.",
            "GB/s counts 576 x 2 B per context token plus q and out; TFLOP/s counts "
            "2 x N x context x (576 + 512).",
            "The XLA reference gathers every page into a contiguous copy first.",
            "N = 8 is a tensor-parallel shard (DeepSeek-V2-Lite's 16 heads over 2 GPUs); "
            "the kernel pads it to 16 heads, so it reads the same bytes as N = 16.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=args.out,
    )
    save(
        "decode_fp8",
        "Paged MLA decode (Pallas) over the FP8 cache, page 64, beside bf16",
        [
            "batch x context",
            "N",
            "fp8 us",
            "bf16 us",
            "fp8 / bf16",
            "GB/s",
            "of copy BW",
            "TFLOP/s",
            "rel err vs ref",
        ],
        fp8_rows,
        [
            "FP8 cache (kernels/fp8.py, FlashMLA's layout): per token 512 e4m3 latent values, "
            "4 float32 power-of-two scales (one per 128), 64 bf16 rope values: 656 B "
            "(bf16: 1152 B); queries bf16, dots bf16 with float32 accumulation.",
            "bf16 us: the bf16 table's row of the same run (same case, same seed stream; "
            "the FP8 inputs are a fresh random cache of the same distribution, quantized).",
            "GB/s counts 656 B per context token plus q and out; the copy bandwidth is the "
            f"bf16 table's ({copy.gbs:.0f} GB/s).",
            "rel err: against the pure-jnp reference on the same FP8 cache (which dequantizes "
            "exactly in bf16).",
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
