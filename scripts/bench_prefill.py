"""Prefill: the Pallas ragged flash attention (Triton and Mosaic GPU lowerings) against cuDNN,
XLA and, where installed, tokamax's Mosaic GPU attention; the chunked-context path at two
workspace sizes, and the LSE merge, on the GPU.

    python scripts/bench_prefill.py [--out DIR] [--sweep all|mosaic] [--smoke]

bf16, q/k 192 = 128 + 64, v 128 (cuDNN needs v padded to 192). TFLOP/s counts the useful
work: 2 x causal pairs x N x (192 + 128). Times are median device microseconds (warm,
CUPTI kernel time). ``--smoke``: the same tables at tiny shapes on the CPU (XLA in cuDNN's
place, the Mosaic GPU kernel interpreted where jax has its interpret mode, >= 0.11),
results under --out only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import (
    DonatedCache,
    copy_bandwidth,
    parse_args,
    parser,
    row,
    run,
    save,
    sweep,
    time_us,
)
from flax import nnx

from mla_jax.cache.metadata import build_metadata
from mla_jax.checkpoint.tiny import TINY
from mla_jax.kernels import KernelPlan, merge, prefill
from mla_jax.kernels.prefill import pallas_mosaic_gpu
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import MLAConfig, preset


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes a run measures: the benchmark's, or a smoke run's."""

    qk_dim: int  # q/k head width (nope + rope)
    v_dim: int
    heads: tuple[int, ...]
    single: tuple[int, ...]  # one-sequence lengths of the causal table
    ragged: tuple[int, int, int, int]  # sequences, shortest, longest, total tokens
    baseline: str  # dot_product_attention's implementation beside the kernel
    context_model_name: str
    context_model: MLAConfig  # the chunked-context table's attention
    context: int  # cached tokens
    new: int  # prefill tokens on them
    block_size: int
    workspaces: tuple[int, ...]  # the last one holds the whole context: unchunked
    merge: tuple[int, int, int]  # tokens, heads, dim
    sweep_tokens: int
    mosaic_sweep_tokens: tuple[int, ...]  # one-sequence lengths of the Mosaic GPU sweep

    @property
    def scale(self) -> float:
        return self.qk_dim**-0.5


FULL = Sizes(
    qk_dim=192,
    v_dim=128,
    heads=(16, 128),
    single=(1024, 4096, 16384),
    ragged=(16, 256, 1792, 16384),
    baseline="cudnn",
    context_model_name="DeepSeek-V3",
    context_model=preset("deepseek-v3"),
    context=32768,
    new=2048,
    block_size=64,
    workspaces=(8192, 65536),
    merge=(8192, 128, 128),
    sweep_tokens=4096,
    mosaic_sweep_tokens=(1024, 2048, 4096),
)
SMOKE = Sizes(
    qk_dim=64,  # the Mosaic GPU kernel's smallest widths
    v_dim=64,
    heads=(4,),
    single=(),
    ragged=(3, 8, 24, 72),
    baseline="xla",
    context_model_name="the tiny model's",
    context_model=TINY.mla,
    context=96,
    new=16,
    block_size=16,
    workspaces=(32, 128),
    merge=(64, 4, 16),
    sweep_tokens=40,
    mosaic_sweep_tokens=(40,),
)
BASELINE_NAMES = {"cudnn": "cuDNN", "xla": "XLA"}


def _qkv(key, t, n, sizes: Sizes):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (t, n, sizes.qk_dim), jnp.bfloat16),
        jax.random.normal(kk, (t, n, sizes.qk_dim), jnp.bfloat16),
        jax.random.normal(kv, (t, n, sizes.v_dim), jnp.bfloat16),
    )


def _pallas(lens, n, sizes: Sizes, variant=None):
    config = prefill.PrefillConfig(**(variant or {}))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    schedule = jax.device_put(prefill.schedule_query_tiles(cu, int(cu[-1]), config.block_q))
    cu = jnp.asarray(cu)
    # Offsets and schedule are arguments (as they are in the model), not baked-in constants.
    f = jax.jit(
        lambda q, k, v, cu, schedule: prefill.flash_prefill(
            q, k, v, cu, cu, scale=sizes.scale, causal=True, schedule=schedule, config=config
        )
    )
    return lambda q, k, v: f(q, k, v, cu, schedule)


def _mosaic(lens, n, sizes: Sizes, variant=None):
    """The Mosaic GPU kernel as ``_pallas`` runs the Triton one, or None (with the reason
    printed) where it cannot run these shapes (it would fall back to Triton)."""
    config = pallas_mosaic_gpu.MosaicPrefillConfig(**(variant or {}))
    probe = jax.ShapeDtypeStruct((1, n, sizes.qk_dim), jnp.bfloat16)
    probe_v = jax.ShapeDtypeStruct((1, n, sizes.v_dim), jnp.bfloat16)
    reason = pallas_mosaic_gpu.unsupported(probe, probe, probe_v, config)
    if reason is not None:
        print(f"Mosaic GPU prefill skipped: it does not run {reason}", flush=True)
        return None
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    schedule = prefill.schedule_query_tiles(cu, int(cu[-1]), pallas_mosaic_gpu.BLOCK_Q)
    schedule, cu = jax.device_put(schedule), jnp.asarray(cu)

    def f(q, k, v, cu, schedule):
        return pallas_mosaic_gpu.flash_prefill(
            q, k, v, cu, cu, scale=sizes.scale, causal=True, schedule=schedule, config=config
        )

    f = jax.jit(f)  # offsets and schedule as arguments, as in the model
    return lambda q, k, v: f(q, k, v, cu, schedule)


def _tokamax(sizes: Sizes):
    """tokamax's Mosaic GPU attention on the padded batch (an optional peer: None where
    tokamax is not installed or off a GPU)."""
    if jax.default_backend() != "gpu":
        return None
    try:
        tokamax = importlib.import_module("tokamax")
    except ImportError:
        print("tokamax not installed: its Mosaic GPU attention is skipped", flush=True)
        return None

    def f(q, k, v, lens):
        return tokamax.dot_product_attention(
            q,
            k,
            v[..., : sizes.v_dim],
            scale=sizes.scale,
            is_causal=True,
            query_seq_lengths=lens,
            key_value_seq_lengths=lens,
            implementation="mosaic",
        )

    return jax.jit(f)


def _rel_err(out, want) -> float:
    return float(
        jnp.linalg.norm((out - want).astype(jnp.float32))
        / jnp.linalg.norm(want.astype(jnp.float32))
    )


def _padded(lens, q, k, v):
    """cuDNN / XLA take a padded batch ``[S, max_len, N, D]`` plus per-sequence lengths (and
    v as wide as q and k, as cuDNN needs)."""
    s, m = len(lens), int(max(lens))
    idx = np.zeros((s, m), np.int32)
    for i, (start, n) in enumerate(zip(np.cumsum([0, *lens[:-1]]), lens, strict=True)):
        idx[i, :n] = start + np.arange(n)
    pad = jnp.pad(v, ((0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])))
    return q[idx], k[idx], pad[idx], jnp.asarray(lens, jnp.int32)


def _dpa(implementation, sizes: Sizes):
    def f(q, k, v, lens):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=sizes.scale,
            is_causal=True,
            query_seq_lengths=lens,
            key_value_seq_lengths=lens,
            implementation=implementation,
        )

    return jax.jit(f)


def causal_rows(rng, sizes: Sizes):
    rows = []
    baseline = _dpa(sizes.baseline, sizes)
    tokamax = _tokamax(sizes)
    for n in sizes.heads:
        count, shortest, longest, total = sizes.ragged
        ragged = rng.integers(shortest, longest + 1, count)
        ragged[-1] += total - ragged.sum()
        cases = [(f"1 x {length}", [length]) for length in sizes.single]
        cases.append((f"{count} ragged, {min(ragged)}..{max(ragged)}", list(ragged)))
        for label, lens in cases:
            lens = np.asarray(lens)
            q, k, v = _qkv(jax.random.key(int(rng.integers(2**31))), int(lens.sum()), n, sizes)
            flops = 2 * float((lens * (lens + 1) // 2).sum()) * n * (sizes.qk_dim + sizes.v_dim)
            kernel = _pallas(lens, n, sizes)
            timings = {"pallas": time_us(kernel, [(q, k, v)])}
            mosaic = _mosaic(lens, n, sizes)
            if mosaic is not None:
                timings["pallas_mosaic_gpu"] = time_us(mosaic, [(q, k, v)])
            padded = _padded(lens, q, k, v)
            timings[f"{sizes.baseline}_padded"] = time_us(baseline, [padded], reps=10)
            if tokamax is not None:
                try:
                    timings["tokamax_mosaic_padded"] = time_us(tokamax, [padded], reps=10)
                except Exception as e:  # noqa: BLE001 (an optional peer: report, go on)
                    print(f"tokamax failed: {type(e).__name__}: {e}"[:300], flush=True)
            scores = len(lens) * int(lens.max()) ** 2 * n * 4
            if sizes.baseline != "xla" and scores < 8 * 2**30:
                timings["xla_padded"] = time_us(_dpa("xla", sizes), [padded], reps=5)
            us, baseline_us = timings["pallas"].us, timings[f"{sizes.baseline}_padded"].us
            xla = timings.get("xla_padded")
            ref = baseline(*padded)[..., : sizes.v_dim]
            want = jnp.concatenate([ref[i, :m] for i, m in enumerate(lens)])
            err = _rel_err(kernel(q, k, v)[0], want)
            mosaic_us = timings.get("pallas_mosaic_gpu")
            mosaic_cells = ["-", "-", "-"]
            if mosaic_us is not None:
                mosaic_cells = [
                    round(mosaic_us.us, 1),
                    round(flops / mosaic_us.us / 1e6, 1),
                    f"{_rel_err(mosaic(q, k, v)[0], want):.1e}",
                ]
            tokamax_us = timings.get("tokamax_mosaic_padded")
            cells = [
                label,
                n,
                round(us, 1),
                round(flops / us / 1e6, 1),
                round(baseline_us, 1),
                round(flops / baseline_us / 1e6, 1),
                "-" if xla is None else round(xla.us, 1),
                f"{baseline_us / us:.2f}x",
                f"{err:.1e}",
                *mosaic_cells,
                "-" if tokamax_us is None else round(tokamax_us.us, 1),
            ]
            print(cells, flush=True)
            rows.append(row(cells, **timings))
    return rows


def context_rows(rng, sizes: Sizes):
    """``sizes.new`` new tokens on ``sizes.context`` cached ones (one request), through the
    public ``MLAAttention`` call with the Pallas kernels, at each workspace size."""
    cfg = sizes.context_model
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    ctx, new, bs = sizes.context, sizes.new, sizes.block_size
    num_blocks = -(-(ctx + new) // bs)
    key = jax.random.key(int(rng.integers(2**31)))
    k1, k2 = jax.random.split(key)
    cache = jax.random.normal(k1, (num_blocks, bs, cfg.cache_width), jnp.bfloat16)
    table = rng.permutation(num_blocks)[None].astype(np.int32)

    # The cache is donated, as the engine donates it: the step writes the new tokens' rows
    # in place.
    @functools.partial(jax.jit, donate_argnums=2)
    def step(state, x, cache, metadata):
        return nnx.merge(graphdef, state)(x, cache, metadata, impl="pallas")

    rows = []
    for workspace in sizes.workspaces:
        metadata = build_metadata(
            np.array([ctx]),
            np.array([new]),
            table,
            block_size=bs,
            num_blocks=num_blocks,
            workspace_size=workspace,
            kernel_plan=KernelPlan.for_device(cfg.num_heads),
        )
        chunks = metadata.prefill.chunks.starts.shape[0]
        x = jax.random.normal(k2, (metadata.num_tokens, cfg.hidden_size), jnp.bfloat16)
        metadata = jax.device_put(metadata)
        compiled = step.lower(state, x, cache, metadata).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        timing = time_us(DonatedCache(compiled, cache.copy()), [(state, x, metadata)], reps=10)
        cells = [f"workspace {workspace}", chunks, round(timing.us, 1), round(temp / 2**30, 2)]
        print(cells, flush=True)
        rows.append(row(cells, pallas=timing))
    unchunked = rows[-1]["cells"][2]
    for r in rows:
        r["cells"].append(f"{r['cells'][2] / unchunked:.2f}x")
    return rows


def merge_row(copy, sizes: Sizes):
    t, n, d = sizes.merge
    ks = jax.random.split(jax.random.key(0), 4)
    args = (
        jax.random.normal(ks[0], (t, n, d), jnp.bfloat16),
        jax.random.normal(ks[1], (t, n), jnp.float32),
        jax.random.normal(ks[2], (t, n, d), jnp.bfloat16),
        jax.random.normal(ks[3], (t, n), jnp.float32),
    )
    nbytes = 3 * t * n * d * 2 + 3 * t * n * 4
    pallas = time_us(jax.jit(merge.merge_attn_states), [args])
    xla = time_us(jax.jit(merge.reference.merge_attn_states), [args])
    gbs = nbytes / pallas.us / 1e3
    cells = [
        f"{t} x {n} x {d}",
        round(pallas.us, 1),
        round(gbs),
        f"{100 * gbs / copy.gbs:.0f}%",
        round(xla.us, 1),
    ]
    return [row(cells, pallas=pallas, xla_reference=xla)]


# The variants behind the PrefillConfig defaults.
SWEEP = [
    dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    dict(block_q=128, block_k=32, num_warps=4, num_stages=3),
    dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
]


# The variants behind the MosaicPrefillConfig defaults, at several lengths: the default
# chooses 64- or 128-key blocks by the keys a tile visits (LONG_TILE_KEYS), its stages by
# what fits (at 192 / 128 wide: four of 64 keys, two of 128).
MOSAIC_SWEEP = [
    dict(),
    dict(lazy_rescale=False),
    dict(block_k=64),
    dict(block_k=64, num_stages=3),
    dict(block_k=128),
    dict(block_k=128, schedule_barrier=False),
    dict(block_k=64, schedule_barrier=False),
    dict(block_k=64, p_in_registers=False),
]


def _sweep_trial(n, variant, sizes: Sizes, kernel=_pallas, t=None):
    t = t or sizes.sweep_tokens
    q, k, v = _qkv(jax.random.key(n), t, n, sizes)
    f = kernel(np.array([t]), n, sizes, variant)
    if f is None:
        return {"skipped": "the Mosaic GPU kernel does not run these shapes here"}
    timing = time_us(f, [(q, k, v)], reps=10)
    tflops = 2 * t * (t + 1) / 2 * n * (sizes.qk_dim + sizes.v_dim) / timing.us / 1e6
    return {"us": timing.us, "TFLOP/s": tflops, "timing": timing}


def main():
    args = parse_args(parser(__doc__, sweeps=("all", "mosaic")))
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    trials = [
        ({"N": n}, v, lambda n=n, v=v: _sweep_trial(n, v, sizes))
        for n in sizes.heads
        for v in SWEEP
    ]
    mosaic_trials = [
        (
            {"N": n, "tokens": t},
            v,
            lambda n=n, v=v, t=t: _sweep_trial(n, v, sizes, kernel=_mosaic, t=t),
        )
        for n in sizes.heads
        for t in sizes.mosaic_sweep_tokens
        for v in MOSAIC_SWEEP
    ]
    run(
        args,
        lambda: tables(rng, sizes, args.out),
        {
            "all": lambda: sweep("prefill", trials, args.out),
            "mosaic": lambda: sweep("prefill_mosaic_gpu", mosaic_trials, args.out),
        },
    )


def tables(rng, sizes: Sizes, out_dir: str | None) -> None:
    """The causal table, the chunked-context one and the merge's."""
    copy = copy_bandwidth()
    baseline = BASELINE_NAMES[sizes.baseline]
    heads = sizes.context_model.num_heads
    save(
        "prefill_causal",
        "Causal prefill (Pallas ragged flash attention, Triton and Mosaic GPU), bf16, "
        f"q/k {sizes.qk_dim}, v {sizes.v_dim}",
        [
            "sequences",
            "N",
            "us",
            "TFLOP/s",
            f"{baseline} us",
            f"{baseline} TFLOP/s",
            "XLA us",
            f"{baseline} / ours",
            f"rel err vs {baseline}",
            "Mosaic GPU us",
            "Mosaic GPU TFLOP/s",
            f"Mosaic GPU rel err vs {baseline}",
            "tokamax (Mosaic GPU) us",
        ],
        causal_rows(rng, sizes),
        [
            f"{baseline} and XLA ran on a padded batch: jax.nn.dot_product_attention over the "
            "sequences padded to the longest one, with per-sequence lengths, v padded to "
            f"{sizes.qk_dim}; the Pallas kernel runs them packed. On the ragged rows "
            f"{baseline} / ours compares against {baseline} on that padded batch. XLA is "
            "skipped ('-') where its score matrix exceeds 8 GiB.",
            "TFLOP/s over the useful FLOPs: 2 x causal pairs x N x "
            f"({sizes.qk_dim} + {sizes.v_dim}).",
            "us, TFLOP/s and ours: the Pallas kernel through Triton; Mosaic GPU: the same "
            "contract through Mosaic GPU (mla_jax/kernels/prefill/pallas_mosaic_gpu.py, sm90, "
            "128-row tiles of the same host schedule; '-' where it cannot run). tokamax: "
            "tokamax.dot_product_attention(implementation='mosaic') on the padded batch, "
            "where tokamax is installed ('-' otherwise).",
        ],
        out_dir=out_dir,
    )
    save(
        "prefill_context",
        f"Chunked-context prefill: {sizes.new} new tokens on a {sizes.context}-token cached "
        f"context, N={heads}",
        ["workspace (tokens)", "chunks", "us", "temp memory GiB", "vs unchunked"],
        context_rows(rng, sizes),
        [
            f"The whole MLAAttention call under jit ({sizes.context_model_name} dims, bf16, "
            f"page {sizes.block_size}, Pallas kernels): projections, rope and the cache write "
            "of the new tokens, their causal attention, then each context chunk gathered from "
            "the paged cache, up-projected with W_UK/W_UV, attended non-causally and "
            "LSE-merged, and o_proj; the cache donated to the step, as the engine does.",
            f"A {sizes.workspaces[-1]}-token workspace holds the whole context: one chunk, "
            "i.e. unchunked.",
            "temp memory: XLA's temporary allocation for the compiled step "
            "(memory_analysis), which scales with the workspace, not the context.",
        ],
        out_dir=out_dir,
    )
    save(
        "merge",
        "merge_attn_states (Pallas), bf16 out, float32 lse",
        ["tokens x heads x dim", "us", "GB/s", "of copy BW", "XLA (reference) us"],
        merge_row(copy, sizes),
        [
            f"Copy bandwidth measured in the same run: {copy.gbs:.0f} GB/s (read + write; "
            f"{copy.method}).",
            "Bytes: two outputs and two lses read, one output and lse written.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=out_dir,
    )


if __name__ == "__main__":
    main()
