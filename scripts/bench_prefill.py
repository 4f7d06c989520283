"""Prefill: the Pallas ragged flash attention against cuDNN and XLA, the chunked-context path
at two workspace sizes, and the LSE merge, on the GPU.

    PYTHONPATH=. python scripts/bench_prefill.py [--out DIR] [--sweep]

bf16, q/k 192 = 128 + 64, v 128 (cuDNN needs v padded to 192). TFLOP/s counts the useful
work: 2 x causal pairs x N x (192 + 128). Times are median device microseconds (warm,
CUPTI kernel time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import copy_bandwidth, parse_args, row, save, sweep, time_us
from flax import nnx

from mla_jax.cache.metadata import build_metadata
from mla_jax.kernels import PALLAS, KernelPlan, merge, prefill
from mla_jax.model.attention import MLAAttention
from mla_jax.model.config import preset

DQK, DV = 192, 128
SCALE = DQK**-0.5


def _qkv(key, t, n):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (t, n, DQK), jnp.bfloat16),
        jax.random.normal(kk, (t, n, DQK), jnp.bfloat16),
        jax.random.normal(kv, (t, n, DV), jnp.bfloat16),
    )


def _pallas(lens, n, variant=None):
    config = prefill.PrefillConfig(**(variant or {}))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    schedule = jax.device_put(prefill.schedule_query_tiles(cu, int(cu[-1]), config.block_q))
    cu = jnp.asarray(cu)
    # Offsets and schedule are arguments (as they are in the model), not baked-in constants.
    f = jax.jit(
        lambda q, k, v, cu, schedule: prefill.flash_prefill(
            q, k, v, cu, cu, scale=SCALE, causal=True, schedule=schedule, config=config
        )
    )
    return lambda q, k, v: f(q, k, v, cu, schedule)


def _padded(lens, q, k, v):
    """cuDNN / XLA take a padded batch ``[S, max_len, N, D]`` plus per-sequence lengths."""
    s, m = len(lens), int(max(lens))
    idx = np.zeros((s, m), np.int32)
    for i, (start, n) in enumerate(zip(np.cumsum([0, *lens[:-1]]), lens, strict=True)):
        idx[i, :n] = start + np.arange(n)
    pad = jnp.pad(v, ((0, 0), (0, 0), (0, DQK - DV)))
    return q[idx], k[idx], pad[idx], jnp.asarray(lens, jnp.int32)


def _dpa(implementation):
    def f(q, k, v, lens):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=SCALE,
            is_causal=True,
            query_seq_lengths=lens,
            key_value_seq_lengths=lens,
            implementation=implementation,
        )

    return jax.jit(f)


def causal_rows(rng):
    rows = []
    for n in (16, 128):
        ragged = rng.integers(256, 1793, 16)
        ragged[-1] += 16384 - ragged.sum()
        for label, lens in [
            ("1 x 1024", [1024]),
            ("1 x 4096", [4096]),
            ("1 x 16384", [16384]),
            (f"16 ragged, {min(ragged)}..{max(ragged)}", list(ragged)),
        ]:
            lens = np.asarray(lens)
            q, k, v = _qkv(jax.random.key(int(rng.integers(2**31))), int(lens.sum()), n)
            flops = 2 * float((lens * (lens + 1) // 2).sum()) * n * (DQK + DV)
            timings = {"pallas": time_us(_pallas(lens, n), [(q, k, v)])}
            padded = _padded(lens, q, k, v)
            timings["cudnn_padded"] = time_us(_dpa("cudnn"), [padded], reps=10)
            scores = len(lens) * int(lens.max()) ** 2 * n * 4
            if scores < 8 * 2**30:
                timings["xla_padded"] = time_us(_dpa("xla"), [padded], reps=5)
            us, cudnn_us = timings["pallas"].us, timings["cudnn_padded"].us
            xla = timings.get("xla_padded")
            out, _ = _pallas(lens, n)(q, k, v)
            ref = _dpa("cudnn")(*padded)[..., :DV]
            want = jnp.concatenate([ref[i, :m] for i, m in enumerate(lens)])
            err = float(
                jnp.linalg.norm((out - want).astype(jnp.float32))
                / jnp.linalg.norm(want.astype(jnp.float32))
            )
            cells = [
                label,
                n,
                round(us, 1),
                round(flops / us / 1e6, 1),
                round(cudnn_us, 1),
                round(flops / cudnn_us / 1e6, 1),
                "-" if xla is None else round(xla.us, 1),
                f"{cudnn_us / us:.2f}x",
                f"{err:.1e}",
            ]
            print(cells, flush=True)
            rows.append(row(cells, **timings))
    return rows


def context_rows(rng):
    """2048 new tokens on 32768 cached ones, N=128, through the module's prefill path."""
    cfg = preset("deepseek-v3")
    attn = MLAAttention(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ctx, new, bs = 32768, 2048, 64
    num_blocks = (ctx + new) // bs
    key = jax.random.key(int(rng.integers(2**31)))
    k1, k2, k3 = jax.random.split(key, 3)
    cache = jax.random.normal(k1, (num_blocks, bs, cfg.cache_width), jnp.bfloat16)
    q = jax.random.normal(k2, (new, cfg.num_heads, cfg.qk_head_dim), jnp.bfloat16)
    lat = jax.random.normal(k3, (new, cfg.cache_width), jnp.bfloat16)
    table = rng.permutation(num_blocks)[None].astype(np.int32)
    graphdef, state = nnx.split(attn)
    rows = []
    for workspace in (8192, 65536):
        md = build_metadata(
            np.array([ctx]),
            np.array([new]),
            table,
            block_size=bs,
            num_blocks=num_blocks,
            workspace_size=workspace,
            kernel_plan=KernelPlan(cfg.num_heads),
        )
        pmd = jax.device_put(md.prefill)

        @jax.jit
        def run(state, q, lat, cache, pmd):
            a = nnx.merge(graphdef, state)
            return a._prefill(
                PALLAS, q, lat[:, : cfg.kv_lora_rank], lat[:, cfg.kv_lora_rank :], cache, pmd
            )

        timing = time_us(run, [(state, q, lat, cache, pmd)], reps=10)
        temp = run.lower(state, q, lat, cache, pmd).compile().memory_analysis().temp_size_in_bytes
        chunks = md.prefill.chunks.starts.shape[0]
        cells = [f"workspace {workspace}", chunks, round(timing.us, 1), round(temp / 2**30, 2)]
        print(cells, flush=True)
        rows.append(row(cells, pallas=timing))
    unchunked = rows[-1]["cells"][2]
    for r in rows:
        r["cells"].append(f"{r['cells'][2] / unchunked:.2f}x")
    return rows


def merge_row(copy):
    t, n, d = 8192, 128, 128
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
        "8192 x 128 x 128",
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


def _sweep_trial(n, var):
    lens = np.array([4096])
    q, k, v = _qkv(jax.random.key(n), 4096, n)
    timing = time_us(_pallas(lens, n, var), [(q, k, v)], reps=10)
    tflops = 2 * 4096 * 4097 / 2 * n * (DQK + DV) / timing.us / 1e6
    return {"us": timing.us, "TFLOP/s": tflops, "timing": timing}


def main():
    args = parse_args(__doc__)
    rng = np.random.default_rng(0)
    if args.sweep:
        trials = [
            ({"N": n}, v, lambda n=n, v=v: _sweep_trial(n, v)) for n in (16, 128) for v in SWEEP
        ]
        sweep("prefill", trials, args.out)
        return
    copy = copy_bandwidth()
    save(
        "prefill_causal",
        "Causal prefill (Pallas ragged flash attention), bf16, q/k 192, v 128",
        [
            "sequences",
            "N",
            "us",
            "TFLOP/s",
            "cuDNN us",
            "cuDNN TFLOP/s",
            "XLA us",
            "cuDNN / ours",
            "rel err vs cuDNN",
        ],
        causal_rows(rng),
        [
            "cuDNN and XLA ran on a padded batch: jax.nn.dot_product_attention over the "
            "sequences padded to the longest one, with per-sequence lengths, v padded to 192; "
            "the Pallas kernel runs them packed. On the ragged rows cuDNN / ours compares "
            "against cuDNN on that padded batch. XLA is skipped ('-') where its score matrix "
            "exceeds 8 GiB.",
            "TFLOP/s over the useful FLOPs: 2 x causal pairs x N x (192 + 128).",
        ],
        out_dir=args.out,
    )
    save(
        "prefill_context",
        "Chunked-context prefill: 2048 new tokens on a 32768-token cached context, N=128",
        ["workspace (tokens)", "chunks", "us", "temp memory GiB", "vs unchunked"],
        context_rows(rng),
        [
            "Through MLAAttention._prefill (DeepSeek-V3 dims, bf16, page 64): gather each chunk "
            "from the paged cache, up-project with W_UK/W_UV, non-causal flash attention, LSE "
            "merge; plus the causal attention of the new tokens.",
            "A 65536-token workspace holds the whole context: one chunk, i.e. unchunked.",
            "temp memory: XLA's temporary allocation for the compiled step "
            "(memory_analysis), which scales with the workspace, not the context.",
        ],
        out_dir=args.out,
    )
    save(
        "merge",
        "merge_attn_states (Pallas), bf16 out, float32 lse",
        ["tokens x heads x dim", "us", "GB/s", "of copy BW", "XLA (reference) us"],
        merge_row(copy),
        [
            f"Copy bandwidth measured in the same run: {copy.gbs:.0f} GB/s (read + write; "
            f"{copy.method}).",
            "Bytes: two outputs and two lses read, one output and lse written.",
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
