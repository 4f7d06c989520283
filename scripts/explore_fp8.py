"""The FP8 matmul variants of issue 23, per shape and row count, timed with CUPTI in one
trace per group: the Pallas kernels' configs (``fp8_matmul`` over the weight in HF's [N, K]
layout), XLA with the dequantization written into the dot's operand (and whether its
compiled HLO fuses it: it does not, a bf16 copy is made), a bf16 temporary then cuBLAS, and
w8a8 (activations quantized per token and 128 columns, an FP8 x FP8 Pallas kernel, the
weight [K, N] or [N, K]). Prints a table and writes
explore.json (and the compiled HLO texts) under --out (or $OUT); its GPU run of 2026-11-25
is benchmarks/tuning/fp8_matmul_variants.json.

    python scripts/explore_fp8.py [grouped] [dense] --out DIR [--smoke]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.dirname(__file__))
import benchlib  # noqa: E402

from mla_jax.kernels import fp8_blocks  # noqa: E402
from mla_jax.kernels import fp8_matmul as fm  # noqa: E402
from mla_jax.kernels import grouped_matmul as gm  # noqa: E402

SMOKE = "--smoke" in sys.argv
OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else os.environ["OUT"]
os.makedirs(OUT, exist_ok=True)
FP8 = jnp.float8_e4m3fn
B = 16 if SMOKE else 128
BLOCKS = fp8_blocks.Fp8Blocks(B, B)
REPS = 2 if SMOKE else 10
RESULTS = []
T0 = time.time()

if SMOKE:  # a check of the script: one shape, a decode and a prefill row count
    SHAPES = {"q_a": (64, 48)}
    ROWS = (1, 40)
else:
    SHAPES = {
        "o_proj": (16384, 7168),
        "mlp.gate_proj": (7168, 18432),
        "q_b_proj": (1536, 24576),
        "kv_a_proj": (7168, 576),
    }
    ROWS = (1, 64, 8192)


def dump():
    with open(os.path.join(OUT, "explore.json"), "w") as f:
        json.dump(RESULTS, f, indent=0)


def time_many(fns: dict, reps: int = REPS) -> dict:
    """benchlib.time_many, failures recorded in the results."""
    return benchlib.time_many(
        fns,
        reps,
        on_failure=lambda name, e: RESULTS.append({"failed": name, "error": str(e)[-1500:]}),
        smoke=SMOKE,
    )


def rand_fp8(key, shape, blocks):
    k1, k2 = jax.random.split(key)
    w = jax.random.uniform(k1, shape, jnp.float32, -448, 448).astype(FP8)
    *lead, depth, width = shape
    s = jax.random.uniform(k2, (*lead, *blocks.scale_shape(depth, width)), jnp.float32, 0.5, 2)
    return w, s * (1.0 / (448 * depth**0.5))


# ---- dense variants -------------------------------------------------------------------------


def expand(scale, k, n):
    return jnp.repeat(jnp.repeat(scale, B, 0), B, 1)[:k, :n]


def xla_fused_f32(x, w, s):
    """The dequantization written for XLA to fuse into the GEMM (scales in float32)."""
    k, n = w.shape
    dense = (w.astype(jnp.float32) * expand(s, k, n)).astype(x.dtype)
    return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)


def xla_fused_bf16(x, w, s):
    """bf16 convert times bf16 scales, as a blocked broadcast (K, N multiples of B)."""
    k, n = w.shape
    if k % B or n % B:
        return xla_fused_f32(x, w, s)
    w4 = w.reshape(k // B, B, n // B, B).astype(x.dtype)
    dense = (w4 * s.astype(x.dtype)[:, None, :, None]).reshape(k, n)
    return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)


def dequant_cublas(x, w, s):
    """A bf16 temporary (kept apart from the dot by an optimization barrier), then the dot."""
    dense = jax.lax.optimization_barrier(fp8_blocks.dequantize(w, s, BLOCKS, x.dtype))
    return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)


def _w8a8_kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, *, m, k, n, bm, bn, nk_layout):
    j, i = pl.program_id(0), pl.program_id(1)
    r0, n0 = i * bm, j * bn
    rows = r0 + jnp.arange(bm, dtype=jnp.int32)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    row_ok, col_ok = rows < m, cols < n

    def step(s, acc):
        k0 = s * B
        a = plgpu.load(a_ref.at[pl.ds(r0, bm), pl.ds(k0, B)], mask=row_ok[:, None])
        if nk_layout:
            b = plgpu.load(b_ref.at[pl.ds(n0, bn), pl.ds(k0, B)], mask=col_ok[:, None])
            dims = (((1,), (1,)), ((), ()))
        else:
            b = plgpu.load(b_ref.at[pl.ds(k0, B), pl.ds(n0, bn)], mask=col_ok[None, :])
            dims = (((1,), (0,)), ((), ()))
        p = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
        sa = plgpu.load(as_ref.at[pl.ds(r0, bm), s], mask=row_ok, other=0.0)
        sb = plgpu.load(bs_ref.at[s, cols // B], mask=col_ok, other=0.0)
        return acc + p * sa[:, None] * sb[None, :]

    acc = jax.lax.fori_loop(0, k // B, step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(
        o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)],
        acc.astype(o_ref.dtype),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def quantize_rows(x):
    """Per-token 1 x B activation scales (DeepSeek's act_quant): fp8 x and float32 scales."""
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // B, B)
    scale = jnp.maximum(jnp.abs(xb).max(-1), 1e-12) / 448.0
    return (xb / scale[..., None]).astype(FP8).reshape(m, k), scale


def w8a8(x, w, s, *, nk_layout=False, bm=128, warps=8, stages=3):
    m, k = x.shape
    n = w.shape[0] if nk_layout else w.shape[1]
    xq, xs = quantize_rows(x)
    bm = max(16, min(bm, 1 << (max(m, 16) - 1).bit_length()))
    bn = 128 if n % 128 == 0 else 64
    rows = max(m, bm)
    if rows != m:
        xq = jnp.pad(xq, ((0, rows - m), (0, 0)))
        xs = jnp.pad(xs, ((0, rows - m), (0, 0)))
    kern = functools.partial(_w8a8_kernel, m=m, k=k, n=n, bm=bm, bn=bn, nk_layout=nk_layout)
    out = pl.pallas_call(
        kern,
        grid=(pl.cdiv(n, bn), pl.cdiv(m, bm)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=SMOKE,
        name="w8a8",
    )(xq, xs, w, s)
    return out[:m]


def hlo_info(compiled, k, n, tag):
    try:
        txt = compiled.as_text()
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:200]}
    if not SMOKE:
        with open(os.path.join(OUT, f"hlo_{tag}.txt"), "w") as f:
            f.write(txt)
    entry = txt[txt.find("ENTRY") :]
    lines = entry.splitlines()
    gemm = [ln for ln in lines if "__triton_gemm" in ln or "__cublas" in ln or "triton" in ln]
    return {
        "triton_gemm_reads_f8": any("f8e4m3fn[" in ln and "triton" in ln for ln in gemm),
        "cublas": "__cublas" in entry,
        "triton": "triton" in entry,
        "bf16_KN_materialized": any(
            f"= bf16[{k},{n}]" in ln and "parameter(" not in ln for ln in lines
        ),
        "gemm_lines": [ln.strip()[:400] for ln in gemm][:4],
    }


def dense():
    key = jax.random.key(0)
    for name, (k, n) in SHAPES.items():
        w, s = rand_fp8(key, (k, n), BLOCKS)
        wb = fp8_blocks.dequantize(w, s, BLOCKS, jnp.bfloat16)
        wt = w.T.copy() if not SMOKE else w.T
        st = s.T  # wt's scales: fp8_matmul takes HF's [N, K] layout
        for m in ROWS:
            xs = [
                (jax.random.normal(jax.random.key(i + m), (m, k), jnp.float32) * 0.5).astype(
                    jnp.bfloat16
                )
                for i in range(2)
            ]
            cur = fm.Fp8MatmulConfig.for_shape(m, k, n)
            sp = dict(scale_product=True)
            configs = {"pallas_cur": cur, "pallas_sp": cur.__class__(**{**cur.__dict__, **sp})}
            if m == 1:
                pass
            elif m <= 64:
                base = configs["pallas_sp"]
                configs["pallas_sp_swap"] = base.__class__(**{**base.__dict__, "swap_ab": True})
                configs["pallas_sp_bn128"] = base.__class__(**{**base.__dict__, "block_n": 128})
                configs["pallas_sp_st6"] = base.__class__(**{**base.__dict__, "num_stages": 6})
            else:
                configs["pallas_p128k128_sp"] = fm.Fp8MatmulConfig(128, 128, 128, 1, 8, 3, **sp)
                configs["pallas_p128k128_sp_swap"] = fm.Fp8MatmulConfig(
                    128, 128, 128, 1, 8, 3, scale_product=True, swap_ab=True
                )
                configs["pallas_p64k128_sp_swap_w4"] = fm.Fp8MatmulConfig(
                    64, 128, 128, 1, 4, 4, scale_product=True, swap_ab=True
                )
            fns = {
                "bf16_xla": (jax.jit(lambda x, wb: x @ wb), [(x, wb) for x in xs]),
            }
            for cname, cfg in configs.items():
                f = jax.jit(functools.partial(fm.fp8_matmul, blocks=BLOCKS, config=cfg))
                fns[cname] = (f, [(x, wt, st) for x in xs])
            for vname, v in [
                ("xla_fused_f32", xla_fused_f32),
                ("xla_fused_bf16", xla_fused_bf16),
                ("dequant_cublas", dequant_cublas),
            ][: 2 if m == 1 else 3]:
                fns[vname] = (jax.jit(v), [(x, w, s) for x in xs])
            if m > 1 and k % B == 0:
                fns["w8a8_kn"] = (jax.jit(w8a8), [(x, w, s) for x in xs])
                fns["w8a8_nk"] = (
                    jax.jit(functools.partial(w8a8, nk_layout=True)),
                    [(x, wt, s) for x in xs],
                )
            times = time_many(fns)
            # accuracy of each against the dequantized reference (bf16 weight dot, f32)
            want = np.asarray(jnp.dot(xs[0], wb, preferred_element_type=jnp.float32), np.float64)
            res = {"kind": "dense", "shape": name, "k": k, "n": n, "rows": m, "us": {}, "err": {}}
            for v, (us, kern) in times.items():
                got = np.asarray(fns[v][0](*fns[v][1][0]), np.float64)
                res["us"][v] = round(us, 2)
                res["err"][v] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                res.setdefault("kernels", {})[v] = kern[:6]
            if m in (64, 8192) or SMOKE:
                for v in ("xla_fused_f32", "xla_fused_bf16", "dequant_cublas", "bf16_xla"):
                    if v in times:
                        res.setdefault("hlo", {})[v] = hlo_info(fns[v][0], k, n, f"{name}_{m}_{v}")
            RESULTS.append(res)
            dump()
            b = res["us"].get("bf16_xla", float("nan"))
            cells = " ".join(f"{v}={u:.1f}({u / b:.2f})" for v, u in res["us"].items())
            print(f"[{time.time() - T0:.0f}s] {name} m={m}: {cells}", flush=True)
            hl = res.get("hlo", {})
            for v, h in hl.items():
                print(
                    f"   hlo {v}: triton_reads_f8={h.get('triton_gemm_reads_f8')} "
                    f"cublas={h.get('cublas')} bf16_KN={h.get('bf16_KN_materialized')}",
                    flush=True,
                )
        del w, s, wb, wt, st


def grouped():
    if SMOKE:
        e, h, i, tokens = 8, 32, 16, (1, 100)
    else:
        e, h, i, tokens = 256, 7168, 2048, (1, 64, 8192)
    topk = 8
    key = jax.random.key(1)
    mats = {
        "gate_up": ((e, h, 2 * i), fp8_blocks.Fp8Blocks(B, B, parts=2)),
        "down": ((e, i, h), BLOCKS),
    }
    for mname, (shape, blocks) in mats.items():
        w, s = rand_fp8(key, shape, blocks)
        wb = fp8_blocks.dequantize(w, s, blocks, jnp.bfloat16)
        # the grouped matmul takes FP8 experts in HF's layout: [E, N, K], [E, N-grid, K-grid]
        w_nk, s_nk = jnp.swapaxes(w, -1, -2), jnp.swapaxes(s, -1, -2)
        for t in tokens:
            rows = t * topk
            ids = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:topk])(
                jax.random.split(jax.random.key(t), t)
            ).reshape(-1)
            sizes = jnp.bincount(ids, length=e).astype(jnp.int32)
            lhs = [
                (jax.random.normal(jax.random.key(j), (rows, shape[1])) * 0.5).astype(jnp.bfloat16)
                for j in range(2)
            ]
            cur = gm.GroupedMatmulConfig.for_shape(rows, e)
            cfgs = {"fp8_cur": cur}
            rep = lambda c, **kw: gm.GroupedMatmulConfig(**{**c.__dict__, **kw})  # noqa: E731
            cfgs["fp8_sp"] = rep(cur, scale_product=True)
            if rows < e:
                cfgs["fp8_sp_st6"] = rep(cur, scale_product=True, num_stages=6)
            elif rows / e <= 64:
                cfgs["fp8_sp_swap"] = rep(cur, scale_product=True, swap_ab=True)
                cfgs["fp8_sp_bn256"] = rep(cur, scale_product=True, block_n=256)
                cfgs["fp8_sp_st6"] = rep(cur, scale_product=True, num_stages=6)
                cfgs["fp8_sp_w8"] = rep(cur, scale_product=True, num_warps=8)
            else:
                cfgs["fp8_sp_swap"] = rep(cur, scale_product=True, swap_ab=True)
                cfgs["fp8_128x128x128_sp_swap"] = gm.GroupedMatmulConfig(
                    128, 128, 128, 8, 3, scale_product=True, swap_ab=True
                )
                cfgs["fp8_64x256x128_sp_swap_w4"] = gm.GroupedMatmulConfig(
                    64, 256, 128, 4, 4, scale_product=True, swap_ab=True
                )
                cfgs["fp8_128x256x64_swap"] = rep(cur, swap_ab=True)
            fns = {
                "bf16": (
                    jax.jit(functools.partial(gm.grouped_matmul, config=cur)),
                    [(x, wb, sizes) for x in lhs],
                )
            }
            for c, cfg in cfgs.items():
                f = functools.partial(gm.grouped_matmul, blocks=blocks, config=cfg)
                fns[c] = (
                    jax.jit(lambda x, w_, sz, s_, f=f: f(x, w_, sz, rhs_scale_inv=s_)),
                    [(x, w_nk, sizes, s_nk) for x in lhs],
                )
            if rows / e > 64:

                def deq(x, w_, sz, s_, blocks=blocks, cur=cur):
                    dense_w = fp8_blocks.dequantize(w_, s_, blocks, jnp.bfloat16)
                    return gm.grouped_matmul(x, dense_w, sz, config=cur)

                fns["dequant_then_bf16"] = (jax.jit(deq), [(x, w, sizes, s) for x in lhs])
            times = time_many(fns, reps=REPS if rows < 10000 else 5)
            want = np.asarray(fns["bf16"][0](*fns["bf16"][1][0]), np.float64)
            res = {
                "kind": "grouped",
                "shape": mname,
                "rows": rows,
                "tokens": t,
                "us": {},
                "err": {},
            }
            for v, (us, _kern) in times.items():
                got = np.asarray(fns[v][0](*fns[v][1][0]), np.float64)
                res["us"][v] = round(us, 2)
                res["err"][v] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
            RESULTS.append(res)
            dump()
            b = res["us"].get("bf16", float("nan"))
            cells = " ".join(f"{v}={u:.0f}({u / b:.2f})" for v, u in res["us"].items())
            print(f"[{time.time() - T0:.0f}s] {mname} tokens={t}: {cells}", flush=True)
        del w, s, wb, w_nk, s_nk


if __name__ == "__main__":
    print(jax.devices(), jax.__version__, flush=True)
    which = [a for a in sys.argv[1:] if a in ("grouped", "dense")] or ["grouped", "dense"]
    for part in which:
        try:
            {"grouped": grouped, "dense": dense}[part]()
        except Exception:  # noqa: BLE001
            if SMOKE:  # a smoke run checks the script: its failures fail it
                raise
            traceback.print_exc()
            RESULTS.append({"failed": part, "error": traceback.format_exc()[-3000:]})
            dump()
    print(f"done in {time.time() - T0:.0f}s")
