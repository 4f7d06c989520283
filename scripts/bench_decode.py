"""Paged MLA decode: the Pallas kernel against the XLA gather reference, on the GPU.

    python scripts/bench_decode.py [--out DIR] [--sweep [all|fp8|mgpu|combine|short]]
        [--kernel triton|mgpu] [--smoke]

Page 64, bf16, Lkv 512 + R 64. Per row: median device microseconds (warm, CUPTI kernel
time), GB/s over the bytes the math needs (576 x 2 B per context token, plus q and out),
TFLOP/s (2 x N x context x (576 + 512)), the copy bandwidth measured in the same run, and the
reference's time. For N = 16 and 128 the same run times the FP8 cache (``kernels.fp8``: 656 B
a token) on the same inputs quantized, beside the bf16 time (``decode_fp8.json``).
``--sweep`` times kernel variants instead (written only under --out); ``--sweep fp8``
the FP8 cache's variants beside bf16 on the cases of its targets (``decode_fp8_sweep.json``).
``--kernel mgpu`` times the Mosaic GPU kernel (``mla_jax/kernels/decode/pallas_mosaic_gpu.py``)
beside the Triton one on the same inputs in the same run, N = 16 and 128 over the cases
below (``decode_mgpu.json``), and both again over the FP8 layout of the same caches
(``decode_mgpu_fp8.json``: Mosaic bf16, Mosaic FP8 and Triton FP8 from one run);
``--sweep mgpu`` its compile options on the cases of its
targets (``decode_mgpu_sweep.json``, under --out only); ``--sweep combine`` the merge
kernel's launch on batches padded as the engine pads them, on the decode kernel the Hopper
set runs (``decode_combine_sweep.json``); ``--sweep short`` the Triton kernel's launch at 16
heads on batches of 512-token requests (``decode_short_sweep.json``).
``--smoke``: the same tables (or sweeps) at tiny shapes on the CPU, results under --out only
(the Mosaic GPU kernel hands the smoke shapes, page 16, to the Triton kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import (
    copy_bandwidth,
    jsonable,
    parse_args,
    parser,
    row,
    run,
    save,
    sweep,
    time_us,
)

from mla_jax.kernels import KernelPlan, decode, fp8, mosaic_gpu
from mla_jax.kernels.decode import pallas_mosaic_gpu as mosaic

SCALE = 192**-0.5


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes a run measures: the benchmark's, or a smoke run's."""

    lkv: int  # latent width (values, and keys with the rope part)
    rope: int
    page: int
    cases: tuple[tuple[str, tuple[int, ...]], ...]  # (label, context of each request)
    ragged: tuple[int, int]  # requests, longest context of the ragged pair of cases
    # (heads, whether the ragged cases and the FP8 table run too) of each part of the table
    heads: tuple[tuple[int, bool], ...]
    sweep_cases: dict  # heads -> labels of ``cases`` the sweep times
    fp8_sweep_cases: tuple  # (heads, labels) the FP8 sweep times
    mosaic_heads: tuple[int, ...]  # heads of the Mosaic GPU table (over ``cases``)
    mosaic_sweep_cases: tuple  # (heads, labels) the Mosaic GPU sweep times
    # The merge kernel's sweep: heads, and batches as the engine pads them (label, context
    # of each row, 0 for a padding row)
    combine_heads: tuple[int, ...]
    combine_cases: tuple[tuple[str, tuple[int, ...]], ...]
    # The short-context sweep at 16 heads (V2-Lite's serving rows at context 512)
    short_cases: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def fp8_token_bytes(self) -> int:
        """Bytes of a token in the FP8 cache (656 for DeepSeek's 512 + 64)."""
        return self.lkv + fp8.num_groups(self.lkv) * 4 + self.rope * 2


FULL = Sizes(
    lkv=512,
    rope=64,
    page=64,
    cases=(
        ("1 x 16384", (16384,)),
        ("32 x 4096", (4096,) * 32),
        ("128 x 4096", (4096,) * 128),
        ("64 x 16384", (16384,) * 64),
    ),
    ragged=(128, 8192),
    heads=((16, True), (128, True), (8, False)),
    # N = 16 on its first three cases, N = 128 on 128 x 4096.
    sweep_cases={16: ("1 x 16384", "32 x 4096", "128 x 4096"), 128: ("128 x 4096",)},
    # The FP8 cache against bf16 on the cases of its targets (H200: at N = 16, 128 x 4096 and
    # 64 x 16384 in <= 0.65x bf16's time; at N = 128 no slower).
    fp8_sweep_cases=((16, ("128 x 4096", "64 x 16384")), (128, ("128 x 4096",))),
    mosaic_heads=(16, 128),
    # The Mosaic GPU kernel's targets (issue 19): N = 128 at 128 x 4096 and 64 x 16384,
    # N = 16 at 64 x 16384.
    mosaic_sweep_cases=((128, ("128 x 4096", "64 x 16384")), (16, ("64 x 16384",))),
    combine_heads=(16, 128),
    combine_cases=(
        ("1 of 16 x 512", (512,) + (0,) * 15),
        ("1 of 16 x 4096", (4096,) + (0,) * 15),
        ("1 of 16 x 16384", (16384,) + (0,) * 15),
        ("16 x 4096", (4096,) * 16),
        ("64 x 4096", (4096,) * 64),
    ),
    short_cases=(("16 x 512", (512,) * 16), ("64 x 512", (512,) * 64), ("256 x 512", (512,) * 256)),
)
SMOKE = Sizes(
    lkv=64,
    rope=16,
    page=16,
    cases=(("3 x 40", (40,) * 3),),
    ragged=(4, 64),
    heads=((16, True),),
    sweep_cases={16: ("3 x 40",), 128: ("3 x 40",)},
    fp8_sweep_cases=((16, ("3 x 40",)),),
    mosaic_heads=(16,),
    mosaic_sweep_cases=((16, ("3 x 40",)),),
    combine_heads=(16,),
    combine_cases=(("1 of 4 x 40", (40, 0, 0, 0)),),
    short_cases=(("3 x 40", (40,) * 3),),
)


def _inputs(rng, seq_lens, n, sets, sizes: Sizes):
    """Random q, a paged cache with randomly placed pages, and block tables; ``sets`` copies
    of the cache (rotated between calls when one copy would sit in L2)."""
    b = len(seq_lens)
    pages = -(-seq_lens // sizes.page)
    width = int(pages.max())
    num_pages = int(pages.sum()) + 1
    perm = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    table[np.arange(width)[None, :] < pages[:, None]] = perm[: int(pages.sum())]
    key = jax.random.key(int(rng.integers(2**31)))
    ks = jax.random.split(key, 2 + sets)
    q_lat = jax.random.normal(ks[0], (b, n, sizes.lkv), jnp.bfloat16)
    q_pe = jax.random.normal(ks[1], (b, n, sizes.rope), jnp.bfloat16)
    cache_shape = (num_pages, sizes.page, sizes.lkv + sizes.rope)
    caches = [jax.random.normal(k, cache_shape, jnp.bfloat16) for k in ks[2:]]
    lens = jnp.asarray(seq_lens, jnp.int32)
    return [(q_lat, q_pe, c, jnp.asarray(table), lens) for c in caches]


@functools.partial(jax.jit, static_argnums=1)
def _quantized(cache: jax.Array, lkv: int) -> fp8.Fp8Cache:
    """The FP8 layout of a bf16 cache ``[pages, page, lkv + rope]`` (what ``write_cache``
    would have stored for the same rows)."""
    values, scales = fp8.quantize(cache[..., :lkv])
    return fp8.Fp8Cache(values, cache[..., lkv:], scales)


def _case(rng, label, seq_lens, n, sizes, variant=None, with_reference=True, quantized=False):
    """Times the kernel on one batch; ``quantized``: over the FP8 layout of the same kind of
    random cache."""
    seq_lens = np.asarray(seq_lens)
    lkv, rope = sizes.lkv, sizes.rope
    token_bytes = sizes.fp8_token_bytes if quantized else (lkv + rope) * 2
    cache_bytes = int(seq_lens.sum()) * token_bytes
    sets = int(min(8, max(1, -(-256 * 2**20 // cache_bytes))))
    arg_sets = _inputs(rng, seq_lens, n, sets, sizes)
    if quantized:
        arg_sets = [(*a[:2], _quantized(a[2], lkv), *a[3:]) for a in arg_sets]
    config = dataclasses.replace(
        decode.DecodeConfig.for_shape(n, len(seq_lens), quantized), **(variant or {})
    )
    programs = decode.num_programs(config, n, KernelPlan.for_device(n).num_sms)
    schedule = jax.device_put(
        decode.schedule_splits(seq_lens, num_programs=programs, block_k=config.block_k)
    )
    # The schedule is an argument (as it is in the model), not a constant baked in.
    kernel = jax.jit(
        lambda *a: decode.mla_decode(*a[:5], schedule=a[5], scale=SCALE, config=config)
    )
    arg_sets = [(*a, schedule) for a in arg_sets]
    timing = time_us(kernel, arg_sets)
    us = timing.us
    tokens = int(seq_lens.sum())
    b = len(seq_lens)
    nbytes = tokens * token_bytes + b * n * (lkv + rope) * 2 + b * n * lkv * 2
    result = {
        "case": label,
        "N": n,
        "cache": "fp8" if quantized else "bf16",
        "us": us,
        "GB/s": nbytes / us / 1e3,
        "TFLOP/s": 2 * n * tokens * (lkv + rope + lkv) / us / 1e6,
        "items": int(schedule.req_items[-1]),
        "programs": programs,
        "timing": timing,
    }
    if with_reference:
        ref = jax.jit(functools.partial(decode.reference.mla_decode, scale=SCALE))
        out, lse = kernel(*arg_sets[0])
        want, want_lse = ref(*arg_sets[0][:5])
        err = jnp.linalg.norm((out - want).astype(jnp.float32)) / jnp.linalg.norm(
            want.astype(jnp.float32)
        )
        result["rel_err"] = float(err)
        result["lse_err"] = float(
            jnp.max(jnp.abs(jnp.where(seq_lens[:, None] > 0, lse - want_lse, 0)))
        )
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


def _mosaic_case(
    rng, label, seq_lens, n, sizes, variant=None, with_triton=True, with_fp8=False, combine=None
) -> dict:
    """Times the Mosaic GPU kernel (compile options ``variant`` on the defaults, the merge's
    ``combine`` fields on ``DecodeConfig.for_shape``'s) and, on the same inputs, the Triton
    kernel with its default config; errors of both against the reference. ``with_fp8``: both
    kernels again over the FP8 layout of the same caches (``fp8_*`` and ``triton_fp8_*``,
    errors against the reference on that FP8 cache)."""
    seq_lens = np.asarray(seq_lens)
    lkv, rope = sizes.lkv, sizes.rope
    tokens = int(seq_lens.sum())
    sets = int(min(8, max(1, -(-256 * 2**20 // (tokens * (lkv + rope) * 2)))))
    arg_sets = _inputs(rng, seq_lens, n, sets, sizes)
    num_sms = KernelPlan.for_device(n).num_sms
    programs = mosaic.num_programs(n, num_sms)
    schedule = jax.device_put(mosaic.schedule(seq_lens, n, num_sms))
    config = mosaic.MosaicDecodeConfig(**(variant or {}))
    combine_config = dataclasses.replace(
        decode.DecodeConfig.for_shape(n, len(seq_lens)), **(combine or {})
    )
    kernel = jax.jit(
        lambda *a: mosaic.mla_decode(
            *a[:5], schedule=a[5], scale=SCALE, config=config, combine_config=combine_config
        )
    )
    want = jax.jit(functools.partial(decode.reference.mla_decode, scale=SCALE))(*arg_sets[0])
    timing = time_us(kernel, [(*a, schedule) for a in arg_sets])
    b = len(seq_lens)
    nbytes = tokens * (lkv + rope) * 2 + b * n * (lkv + rope) * 2 + b * n * lkv * 2
    result = {
        "case": label,
        "N": n,
        "us": timing.us,
        "GB/s": nbytes / timing.us / 1e3,
        "TFLOP/s": 2 * n * tokens * (lkv + rope + lkv) / timing.us / 1e6,
        "programs": programs,
        "items": int(schedule.req_items[-1]),
        "timing": timing,
        **_errors(kernel(*arg_sets[0], schedule), want, seq_lens),
    }
    if with_triton:
        t_config = decode.DecodeConfig.for_shape(n, b)
        t_programs = decode.num_programs(t_config, n, num_sms)
        t_schedule = jax.device_put(
            decode.schedule_splits(seq_lens, num_programs=t_programs, block_k=t_config.block_k)
        )
        triton = jax.jit(
            lambda *a: decode.mla_decode(*a[:5], schedule=a[5], scale=SCALE, config=t_config)
        )
        result["triton_timing"] = time_us(triton, [(*a, t_schedule) for a in arg_sets])
        result["triton_us"] = result["triton_timing"].us
        result["triton_rel_err"] = _errors(triton(*arg_sets[0], t_schedule), want, seq_lens)[
            "rel_err"
        ]
    if with_fp8:
        fp8_sets = [(*a[:2], _quantized(a[2], lkv), *a[3:]) for a in arg_sets]
        fp8_want = jax.jit(functools.partial(decode.reference.mla_decode, scale=SCALE))(
            *fp8_sets[0]
        )
        result["fp8_timing"] = time_us(kernel, [(*a, schedule) for a in fp8_sets])
        result["fp8_us"] = result["fp8_timing"].us
        result["fp8_rel_err"] = _errors(kernel(*fp8_sets[0], schedule), fp8_want, seq_lens)[
            "rel_err"
        ]
        if with_triton:
            # The FP8 cache's own launch parameters; its schedule is the bf16 one's.
            t_fp8_config = decode.DecodeConfig.for_shape(n, b, quantized=True)
            triton_fp8 = jax.jit(
                lambda *a: decode.mla_decode(
                    *a[:5], schedule=a[5], scale=SCALE, config=t_fp8_config
                )
            )
            result["triton_fp8_timing"] = time_us(triton_fp8, [(*a, t_schedule) for a in fp8_sets])
            result["triton_fp8_us"] = result["triton_fp8_timing"].us
    return result


def _mosaic_table(rng, sizes: Sizes, out_dir: str | None) -> None:
    """``decode_mgpu.json``: the Mosaic GPU kernel beside Triton, per ``sizes.mosaic_heads``."""
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})")
    rows, fp8_rows = [], []
    for n in sizes.mosaic_heads:
        for label, lens in sizes.cases:
            r = _mosaic_case(rng, label, lens, n, sizes, with_fp8=True)
            print(json.dumps(jsonable(r)), flush=True)
            fp8_cells = [
                r["case"],
                n,
                round(r["us"], 1),
                round(r["fp8_us"], 1),
                f"{r['fp8_us'] / r['us']:.2f}x",
                round(r["triton_fp8_us"], 1),
                f"{r['triton_fp8_us'] / r['fp8_us']:.2f}x",
                f"{r['fp8_rel_err']:.1e}",
            ]
            fp8_rows.append(
                row(
                    fp8_cells,
                    mosaic_bf16=r["timing"],
                    mosaic_fp8=r["fp8_timing"],
                    triton_fp8=r["triton_fp8_timing"],
                )
            )
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
    width = sizes.lkv + sizes.rope
    save(
        "decode_mgpu",
        f"Paged MLA decode: Mosaic GPU kernel beside the Triton kernel, page {sizes.page}, bf16",
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
            "launch (Mosaic: 64 heads a program, one program a multiprocessor, at 128 heads "
            "the two head blocks as a cluster sharing each page's copy; Triton: "
            "DecodeConfig.for_shape) and its own split-KV plan; us includes the combine "
            "kernel.",
            f"TFLOP/s counts 2 x N x context x ({width} + {sizes.lkv}) (N = 16 is padded to 64 "
            "rows in the Mosaic kernel: 4x the counted work); GB/s counts "
            f"{width} x 2 B per context token plus q and out.",
            "rel err: relative L2 error of out against the XLA reference on the same inputs.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=out_dir,
    )
    save(
        "decode_mgpu_fp8",
        f"Paged MLA decode: Mosaic GPU kernel over the FP8 cache, page {sizes.page}, beside "
        "bf16 and the Triton FP8 kernel",
        [
            "batch x context",
            "N",
            "Mosaic bf16 us",
            "Mosaic FP8 us",
            "FP8 / bf16",
            "Triton FP8 us",
            "speedup vs Triton FP8",
            "Mosaic FP8 rel err",
        ],
        fp8_rows,
        [
            "The three kernels in the same run, on the same inputs (the FP8 cache is the bf16 "
            "one quantized, mla_jax/kernels/fp8.py: "
            f"{sizes.fp8_token_bytes} B a token), each with its own default launch and "
            "split-KV plan; us includes the combine kernel.",
            "rel err: relative L2 error of out against the XLA reference on the same FP8 "
            "cache (which dequantizes exactly in bf16).",
        ],
        out_dir=out_dir,
    )


# Compile options of the Mosaic GPU kernel, each on top of the defaults.
MOSAIC_SWEEP = [
    {},
    dict(lazy_rescale=False),
    dict(auto_barriers=True),
    dict(approx_math=False),
    dict(float16_mma=False),
    dict(multicast=False),
    dict(fp8_multicast=True),
]


def _mosaic_trials(rng, sizes: Sizes) -> list:
    """``sweep`` trials of MOSAIC_SWEEP on ``sizes.mosaic_sweep_cases`` (Triton timed beside
    the defaults; the FP8 cache beside the defaults and its float16 MMA off)."""
    lens_of = dict(sizes.cases)
    return [
        (
            {"case": label, "N": n},
            v,
            lambda label=label, n=n, v=v: _mosaic_case(
                rng,
                label,
                lens_of[label],
                n,
                sizes,
                v,
                with_triton=not v,
                # (float16_mma and fp8_multicast are the FP8 cache's options)
                with_fp8=not v or "float16_mma" in v or "fp8_multicast" in v,
            ),
        )
        for n, labels in sizes.mosaic_sweep_cases
        for label in labels
        for v in MOSAIC_SWEEP
    ]


# The merge kernel's launch on top of DecodeConfig.for_shape's choice (``--sweep combine``).
COMBINE_SWEEP = [
    {},
    dict(combine_block_h=16, combine_block_d=128, combine_block_items=4),
    dict(combine_block_h=1, combine_block_d=64, combine_block_items=64),
    dict(combine_block_h=8, combine_block_d=64, combine_block_items=16),
]


def _combine_trials(rng, sizes: Sizes) -> list:
    """``sweep`` trials of COMBINE_SWEEP on ``sizes.combine_cases``, each on the decode kernel
    the Hopper set runs for its heads and batch (the Mosaic GPU one where it runs and pays
    off, else the Triton one); ``combine_us``: the merge kernel's share of ``us``."""

    def measure(label, lens, n, variant):
        if mosaic.pays_off(n, len(lens)) and mosaic_gpu.device_unsupported() is None:
            kernel, r = (
                "mosaic_gpu",
                _mosaic_case(rng, label, lens, n, sizes, with_triton=False, combine=variant),
            )
        else:
            kernel, r = "triton", _case(rng, label, lens, n, sizes, variant, with_reference=False)
        kernels = r["timing"].kernels or {}
        combine_us = sum(us for name, us in kernels.items() if "combine" in name)
        return {"kernel": kernel, "combine_us": combine_us, **r}

    return [
        (
            {"case": label, "N": n},
            v,
            lambda label=label, lens=lens, n=n, v=v: measure(label, lens, n, v),
        )
        for n in sizes.combine_heads
        for label, lens in sizes.combine_cases
        for v in COMBINE_SWEEP
    ]


# The Triton kernel's launch at 16 heads on short contexts (``--sweep short``), each on top
# of DecodeConfig.for_shape's choice: a request of 512 tokens is 8 pages, so a program runs
# few steps and its pipeline's start and its partial result weigh more than over long ones.
SHORT_SWEEP = [
    {},
    dict(programs_per_sm=1),
    dict(programs_per_sm=2),
    dict(programs_per_sm=3),
    dict(num_stages=2),
    dict(num_stages=4),
    dict(block_k=32, num_stages=4),
    dict(num_warps=8),
]


def _short_trials(rng, sizes: Sizes) -> list:
    """``sweep`` trials of SHORT_SWEEP on ``sizes.short_cases`` at 16 heads."""
    return [
        (
            {"case": label, "N": 16},
            v,
            lambda label=label, lens=lens, v=v: _case(
                rng, label, lens, 16, sizes, v, with_reference=False
            ),
        )
        for label, lens in sizes.short_cases
        for v in SHORT_SWEEP
    ]


def _ragged(rng, sizes: Sizes):
    count, longest = sizes.ragged
    lens = rng.integers(1, longest + 1, count)
    uniform = [int(lens.sum()) // count] * count
    return [
        (f"ragged {count} in [1, {longest}] ({lens.sum()} tok)", lens),
        ("uniform, same tokens", uniform),
    ]


# The variants behind DecodeConfig.for_shape (each on top of its choice).
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
# The FP8 cache against bf16 on Sizes.fp8_sweep_cases, each variant on top of the default
# config, in one run (``--sweep fp8``). bf16 num_stages=1 shows what Triton's
# pipelining is worth: if bf16 without it is as slow as FP8, FP8's loads are likely not
# pipelined (they are converted before their dot), which ``prefetch`` works around.
# split_tail=False where prefetch needs it (the N = 128 default has it on).
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


def _fp8_trials(rng, sizes: Sizes) -> list:
    """``sweep`` trials of FP8_SWEEP and its bf16 baselines, cases by label."""
    lens_of = dict(sizes.cases)
    return [
        (
            {"case": label, "N": n, "cache": cache},
            variant,
            lambda label=label, n=n, variant=variant, cache=cache: _case(
                rng,
                label,
                lens_of[label],
                n,
                sizes,
                variant,
                with_reference=cache == "fp8",  # the error of float16 conversion
                quantized=cache == "fp8",
            ),
        )
        for n, labels in sizes.fp8_sweep_cases
        for label in labels
        for cache, variants in (("bf16", FP8_SWEEP_BF16), ("fp8", FP8_SWEEP))
        for variant in variants
    ]


def _trials(rng, sizes: Sizes) -> list:
    """``sweep`` trials of SWEEP on ``sizes.sweep_cases``."""
    lens_of = dict(sizes.cases)
    return [
        (
            {"case": label, "N": n},
            v,
            lambda label=label, n=n, v=v: _case(
                rng, label, lens_of[label], n, sizes, v, with_reference=False
            ),
        )
        for n, labels in sizes.sweep_cases.items()
        for label in labels
        for v in SWEEP[n]
    ]


def main():
    ap = parser(__doc__, sweeps=("all", "fp8", "mgpu", "combine", "short"))
    ap.add_argument(
        "--kernel",
        choices=("triton", "mgpu"),
        default="triton",
        help="the tables of the Triton kernel (decode, decode_fp8) or the Mosaic GPU kernel "
        "beside it (decode_mgpu)",
    )
    args = parse_args(ap)
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    table = _mosaic_table if args.kernel == "mgpu" else tables
    run(
        args,
        lambda: table(rng, sizes, args.out),
        {
            "all": lambda: sweep("decode", _trials(rng, sizes), args.out),
            "fp8": lambda: sweep("decode_fp8", _fp8_trials(rng, sizes), args.out),
            "mgpu": lambda: sweep("decode_mgpu", _mosaic_trials(rng, sizes), args.out),
            "combine": lambda: sweep("decode_combine", _combine_trials(rng, sizes), args.out),
            "short": lambda: sweep("decode_short", _short_trials(rng, sizes), args.out),
        },
    )


def tables(rng, sizes: Sizes, out_dir: str | None) -> None:
    """The bf16 table and the FP8 one beside it."""
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})")
    rows, fp8_rows = [], []
    ragged = _ragged(rng, sizes)
    # N = 8: a tensor-parallel shard (DeepSeek-V2-Lite's 16 heads over 2 GPUs), which the
    # kernel runs on 16 padded heads.
    for n, ragged_and_fp8 in sizes.heads:
        for label, lens in list(sizes.cases) + (ragged if ragged_and_fp8 else []):
            r = _case(rng, label, lens, n, sizes)
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
            if ragged_and_fp8:
                q = _case(rng, label, lens, n, sizes, quantized=True)
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
    width = sizes.lkv + sizes.rope
    save(
        "decode",
        f"Paged MLA decode (Pallas), page {sizes.page}, bf16",
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
            f"GB/s counts {width} x 2 B per context token plus q and out; TFLOP/s counts "
            f"2 x N x context x ({width} + {sizes.lkv}).",
            "The XLA reference gathers every page into a contiguous copy first.",
            "N = 8 is a tensor-parallel shard (DeepSeek-V2-Lite's 16 heads over 2 GPUs); "
            "the kernel pads it to 16 heads, so it reads the same bytes as N = 16.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=out_dir,
    )
    save(
        "decode_fp8",
        f"Paged MLA decode (Pallas) over the FP8 cache, page {sizes.page}, beside bf16",
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
            f"FP8 cache (mla_jax/kernels/fp8.py, FlashMLA's layout): per token {sizes.lkv} e4m3 "
            f"latent values, {fp8.num_groups(sizes.lkv)} float32 power-of-two scales (one per "
            "128), "
            f"{sizes.rope} bf16 rope values: {sizes.fp8_token_bytes} B (bf16: {2 * width} B); "
            "queries bf16, dots bf16 with float32 accumulation.",
            "bf16 us: the bf16 table's row of the same run (same case, same seed stream; "
            "the FP8 inputs are a fresh random cache of the same distribution, quantized).",
            f"GB/s counts {sizes.fp8_token_bytes} B per context token plus q and out; the copy "
            "bandwidth is the "
            f"bf16 table's ({copy.gbs:.0f} GB/s).",
            "rel err: against the pure-jnp reference on the same FP8 cache (which dequantizes "
            "exactly in bf16).",
        ],
        out_dir=out_dir,
    )


if __name__ == "__main__":
    main()
