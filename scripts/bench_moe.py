"""Mixture-of-experts layers on the GPU, bf16: DeepSeek-V2-Lite's (64 routed experts, top 6,
2 shared, hidden 2048, expert width 1408) and DeepSeek-V3's (256 experts, top 8 within 4 of 8
groups, 1 shared, hidden 7168, expert width 2048), random weights.

    python scripts/bench_moe.py [--out DIR] [--sweep] [--smoke]

Decode (64 tokens): the layer's time against the memory roofline of the weights it must read
(the experts the batch chose, the shared experts and the router) at the copy bandwidth
measured in the same run. Prefill (8192 tokens): the routed experts' rate (sort, two grouped
matmuls, weighted combine) against a dense bf16 matmul of the same FLOPs measured in the same
run. Per row also the router alone and the whole layer, and at prefill the routed experts
on the Mosaic GPU grouped matmul (``grouped_matmul.prefill_on_mosaic_gpu``; where it cannot
run, the cell says why). Before timing, the Pallas grouped matmul is checked against the
reference (``jax.lax.ragged_dot``) with each of its default launch configurations.
``--sweep`` times launch variants of the grouped matmul instead (written only under --out).
``--smoke``: the same tables and sweep with V3's layer shrunk (hidden 128, 16 experts of
width 64; its routing unchanged) and few tokens on the CPU, results under --out only.
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
from flax import nnx

from mla_jax import kernels
from mla_jax.kernels import grouped_matmul as gm
from mla_jax.model.config import MoEConfig, moe_preset
from mla_jax.model.moe import MoE, route, routed_experts

V2_LITE = moe_preset("deepseek-v2-lite")
V3 = moe_preset("deepseek-v3")
BF16 = 2  # bytes


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the benchmark's layers and token counts, or a smoke run's."""

    layers: dict  # name -> MoEConfig
    decode_tokens: int
    prefill_tokens: int
    check_experts: int  # experts the kernel check runs on


def _shrunk(cfg: MoEConfig) -> MoEConfig:
    """``cfg``'s routing (scoring, top-k, groups) on a layer small enough to interpret."""
    return dataclasses.replace(cfg, hidden_size=128, n_routed_experts=16, moe_intermediate_size=64)


FULL = Sizes(
    layers={"DeepSeek-V2-Lite": V2_LITE, "DeepSeek-V3": V3},
    decode_tokens=64,
    prefill_tokens=8192,
    check_experts=16,
)
SMOKE = Sizes(
    layers={"DeepSeek-V3": _shrunk(V3)},
    decode_tokens=8,
    prefill_tokens=160,  # 80 rows an expert: a prefill's, which the Mosaic GPU kernel takes
    check_experts=4,
)


class Layer:
    """A bf16 MoE layer with random weights and its jitted pieces."""

    def __init__(self, cfg: MoEConfig, seed: int = 0):
        self.cfg = cfg
        module = MoE(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
        if cfg.scoring_func == "sigmoid":
            bias = 0.01 * jax.random.normal(jax.random.key(seed), (cfg.n_routed_experts,))
            module.gate.e_score_correction_bias[...] = bias
        graphdef, self.state = nnx.split(module)
        self.module = module
        # The whole layer (router, routed and shared experts) by grouped-matmul path.
        self.layer = {
            impl: jax.jit(lambda state, x, impl=impl: nnx.merge(graphdef, state)(x, impl=impl))
            for impl in ("pallas", "reference")
        }

    def router_fn(self):
        return jax.jit(functools.partial(route, cfg=self.cfg))

    def experts_fn(self, grouped_matmul):
        return jax.jit(functools.partial(routed_experts, grouped_matmul=grouped_matmul))

    def router_args(self, x):
        bias = getattr(self.module.gate, "e_score_correction_bias", None)
        return (x, self.module.gate.kernel[...], None if bias is None else bias[...])

    def experts_args(self, x, expert_ids, weights):
        e = self.module.experts
        return (x, expert_ids, weights, e.gate_up_proj[...], e.down_proj[...])

    def expert_bytes(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size * BF16

    def shared_and_router_bytes(self) -> int:
        cfg = self.cfg
        return (3 * cfg.shared_intermediate_size + cfg.n_routed_experts) * cfg.hidden_size * BF16

    def routed_flops(self, tokens: int) -> int:
        cfg = self.cfg
        per_pair = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return tokens * cfg.num_experts_per_tok * per_pair

    def layer_flops(self, tokens: int) -> int:
        cfg = self.cfg
        shared = 2 * 3 * cfg.hidden_size * cfg.shared_intermediate_size
        router = 2 * cfg.hidden_size * cfg.n_routed_experts
        return self.routed_flops(tokens) + tokens * (shared + router)


def _tokens(cfg: MoEConfig, tokens: int, seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (tokens, cfg.hidden_size), jnp.bfloat16)


def _rel_err(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def check_kernel(layer: Layer, num_experts: int = 16) -> dict:
    """Pallas against the reference on the first ``num_experts`` experts of the layer's
    gate_up weights, with rows per expert that select each default launch configuration.
    Kept to a few experts because the reference on a GPU (``ragged_dot``) is a dense matmul
    over every expert: V3's 256 experts at 160 rows each would take 86 GB."""
    cfg = layer.cfg
    errors = {}
    for per_expert in (6, 48, 160):
        rows = per_expert * num_experts
        config = gm.GroupedMatmulConfig.for_shape(rows, num_experts)
        sizes = np.random.default_rng(per_expert).multinomial(
            rows, np.ones(num_experts) / num_experts
        )
        sizes[: 3 if per_expert < 100 else 1] = 0  # empty experts too
        sizes[3] += rows - sizes.sum()
        lhs = _tokens(cfg, rows, per_expert)
        rhs = layer.module.experts.gate_up_proj[:num_experts]
        group_sizes = jnp.asarray(sizes, jnp.int32)
        got = gm.grouped_matmul(lhs, rhs, group_sizes)
        want = kernels.REFERENCE.grouped_matmul(lhs, rhs, group_sizes)
        errors[f"block_m={config.block_m}"] = _rel_err(got, want)
    return errors


def decode_case(layer: Layer, copy_gbs: float, tokens: int) -> dict:
    cfg = layer.cfg
    x = _tokens(cfg, tokens, 1)
    expert_ids, weights = layer.router_fn()(*layer.router_args(x))
    chosen = int(np.unique(np.asarray(expert_ids)).size)
    needed = chosen * layer.expert_bytes() + layer.shared_and_router_bytes()
    layer_t = time_us(layer.layer["pallas"], [(layer.state, x)])
    experts_t = time_us(
        layer.experts_fn(kernels.TRITON.grouped_matmul),
        [layer.experts_args(x, expert_ids, weights)],
    )
    router_t = time_us(layer.router_fn(), [layer.router_args(x)])
    roofline_us = needed / copy_gbs / 1e3
    want = layer.layer["reference"](layer.state, x)
    return {
        "tokens": tokens,
        "experts_chosen": chosen,
        "MB_needed": needed / 1e6,
        "us": layer_t.us,
        "experts_us": experts_t.us,
        "router_us": router_t.us,
        "roofline_us": roofline_us,
        "x_roofline": layer_t.us / roofline_us,
        "GB/s": needed / layer_t.us / 1e3,
        "rel_err_vs_reference": _rel_err(layer.layer["pallas"](layer.state, x), want),
        "timing": layer_t,
        "experts_timing": experts_t,
        "router_timing": router_t,
    }


def dense_matmul(layer: Layer, tokens: int) -> tuple[float, object]:
    """TFLOP/s of a dense bf16 matmul with the routed experts' FLOPs: ``[T*k, H] @ [H, 3I]``."""
    cfg = layer.cfg
    rows = tokens * cfg.num_experts_per_tok
    a = _tokens(cfg, rows, 2)
    b = jax.random.normal(
        jax.random.key(3), (cfg.hidden_size, 3 * cfg.moe_intermediate_size), jnp.bfloat16
    )
    t = time_us(jax.jit(jnp.dot), [(a, b)])
    return layer.routed_flops(tokens) / t.us / 1e6, t


def prefill_case(layer: Layer, tokens: int, grouped_matmul=None) -> dict:
    cfg = layer.cfg
    x = _tokens(cfg, tokens, 4)
    expert_ids, weights = layer.router_fn()(*layer.router_args(x))
    experts_t = time_us(
        layer.experts_fn(grouped_matmul or kernels.TRITON.grouped_matmul),
        [layer.experts_args(x, expert_ids, weights)],
    )
    result = {
        "tokens": tokens,
        "experts_us": experts_t.us,
        "experts_TFLOP/s": layer.routed_flops(tokens) / experts_t.us / 1e6,
        "experts_timing": experts_t,
    }
    if grouped_matmul is None:
        layer_t = time_us(layer.layer["pallas"], [(layer.state, x)])
        router_t = time_us(layer.router_fn(), [layer.router_args(x)])
        dense_tflops, dense_t = dense_matmul(layer, tokens)
        result.update(
            {
                "us": layer_t.us,
                "router_us": router_t.us,
                "layer_TFLOP/s": layer.layer_flops(tokens) / layer_t.us / 1e6,
                "dense_TFLOP/s": dense_tflops,
                "of_dense": result["experts_TFLOP/s"] / dense_tflops,
                "timing": layer_t,
                "router_timing": router_t,
                "dense_timing": dense_t,
            }
        )
    return result


def mosaic_prefill_case(layer: Layer, tokens: int, triton: dict) -> dict:
    """The routed experts at prefill on the Mosaic GPU grouped matmul (``triton``: the same
    case's ``prefill_case``), with its difference from the Triton kernel's experts (the
    reference, ``ragged_dot``, would run every expert over every row on a GPU: terabytes at
    V3's size; both kernels are tested against float64); where the kernel cannot run, why
    (the table's cell)."""
    cfg = layer.cfg
    x = _tokens(cfg, tokens, 4)
    rows = jnp.zeros((tokens * cfg.num_experts_per_tok, cfg.hidden_size), jnp.bfloat16)
    for weight in (layer.module.experts.gate_up_proj, layer.module.experts.down_proj):
        config = gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig.for_weight(weight.shape[-1])
        reason = gm.pallas_mosaic_gpu.unsupported(rows, weight[...], config)
        if reason is not None:
            return {"cell": f"n/a ({reason})"}
    expert_ids, weights = layer.router_fn()(*layer.router_args(x))
    args = layer.experts_args(x, expert_ids, weights)
    mosaic = layer.experts_fn(gm.prefill_on_mosaic_gpu)
    t = time_us(mosaic, [args])
    want = layer.experts_fn(kernels.TRITON.grouped_matmul)(*args)
    return {
        "experts_us": t.us,
        "of_triton": t.us / triton["experts_us"],
        "rel_diff_vs_triton": _rel_err(mosaic(*args), want),
        "experts_timing": t,
        "cell": f"{t.us:.0f} ({t.us / triton['experts_us']:.2f}x)",
    }


# Launch variants around GroupedMatmulConfig.for_shape: decode (16-row tiles) and prefill (128-row).
SWEEP = {
    "decode": [
        gm.GroupedMatmulConfig(16, 128, 128, 4, 4),
        gm.GroupedMatmulConfig(16, 64, 128, 4, 4),
        gm.GroupedMatmulConfig(16, 128, 64, 4, 3),
        gm.GroupedMatmulConfig(16, 256, 64, 8, 3),
        gm.GroupedMatmulConfig(16, 64, 256, 4, 3),
    ],
    "prefill": [
        gm.GroupedMatmulConfig(128, 128, 64, 8, 3),
        gm.GroupedMatmulConfig(128, 128, 64, 4, 4),
        gm.GroupedMatmulConfig(128, 256, 64, 8, 3),
        gm.GroupedMatmulConfig(128, 256, 64, 8, 3, band=4),
        gm.GroupedMatmulConfig(128, 256, 64, 8, 3, band=8),
        gm.GroupedMatmulConfig(64, 128, 64, 4, 4),
        gm.GroupedMatmulConfig(128, 128, 32, 4, 4),
    ],
    # The Mosaic GPU kernel at prefill (grouped_matmul/pallas_mosaic_gpu.py).
    "prefill_mosaic": [
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(block_n=64),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(block_m=64),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(stages=2),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(block_n=64, block_k=128),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(band=4),
        gm.pallas_mosaic_gpu.MosaicGroupedMatmulConfig(skip_empty_half=True),
    ],
}


def _sweep(out_dir, sizes: Sizes):
    """SWEEP's launch variants on the routed experts of the first layer of ``sizes``."""
    layer = Layer(next(iter(sizes.layers.values())))

    def trial(kind, config):
        kernel = kernels.TRITON.grouped_matmul
        if kind == "prefill_mosaic":
            kernel = gm.pallas_mosaic_gpu.grouped_matmul
        gmm = functools.partial(kernel, config=config)
        tokens = sizes.decode_tokens if kind == "decode" else sizes.prefill_tokens
        return prefill_case(layer, tokens, grouped_matmul=gmm)

    def runs(kind, config) -> bool:
        """Whether the trial's kernel takes the layer's experts here (the Mosaic GPU kernel
        needs Mosaic GPU, and shapes that tile)."""
        if kind != "prefill_mosaic":
            return True
        experts = layer.module.experts
        rows = jnp.zeros((1, 1), jnp.bfloat16)
        return all(
            gm.pallas_mosaic_gpu.unsupported(rows, weight[...], config) is None
            for weight in (experts.gate_up_proj, experts.down_proj)
        )

    trials = [
        ({"case": kind}, dataclasses.asdict(config), functools.partial(trial, kind, config))
        for kind, configs in SWEEP.items()
        for config in configs
        if runs(kind, config)
    ]
    sweep("moe", trials, out_dir)


def main():
    args = parse_args(parser(__doc__, sweeps=("all",)))
    sizes = SMOKE if args.smoke else FULL
    run(args, lambda: tables(sizes, args.out), {"all": lambda: _sweep(args.out, sizes)})


def tables(sizes: Sizes, out_dir: str | None) -> None:
    """The decode table and the prefill one."""
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy.gbs:.0f} GB/s ({copy.method})")
    decode_rows, prefill_rows, checks = [], [], {}
    for name, cfg in sizes.layers.items():
        layer = Layer(cfg)
        checks[name] = check_kernel(layer, sizes.check_experts)
        print(name, "Pallas vs reference:", checks[name], flush=True)
        r = decode_case(layer, copy.gbs, sizes.decode_tokens)
        print(json.dumps(jsonable(r)), flush=True)
        decode_rows.append(
            row(
                [
                    name,
                    r["tokens"],
                    r["experts_chosen"],
                    round(r["MB_needed"]),
                    round(r["us"], 1),
                    round(r["experts_us"], 1),
                    round(r["router_us"], 1),
                    round(r["roofline_us"], 1),
                    f"{r['x_roofline']:.2f}x",
                    f"{100 * r['GB/s'] / copy.gbs:.0f}%",
                    f"{r['rel_err_vs_reference']:.1e}",
                ],
                layer=r["timing"],
                experts=r["experts_timing"],
                router=r["router_timing"],
            )
        )
        r = prefill_case(layer, sizes.prefill_tokens)
        mosaic = mosaic_prefill_case(layer, sizes.prefill_tokens, r)
        print(json.dumps(jsonable(r)), json.dumps(jsonable(mosaic)), flush=True)
        timings = {} if "experts_timing" not in mosaic else {"mosaic": mosaic["experts_timing"]}
        prefill_rows.append(
            row(
                [
                    name,
                    r["tokens"],
                    round(r["us"]),
                    round(r["experts_us"]),
                    round(r["router_us"], 1),
                    round(r["experts_TFLOP/s"]),
                    round(r["dense_TFLOP/s"]),
                    f"{100 * r['of_dense']:.0f}%",
                    round(r["layer_TFLOP/s"]),
                    mosaic["cell"],
                ],
                layer=r["timing"],
                experts=r["experts_timing"],
                router=r["router_timing"],
                dense=r["dense_timing"],
                **timings,
            )
        )
        del layer
    errors = {name: {c: f"{e:.1e}" for c, e in v.items()} for name, v in checks.items()}
    common = [
        "bf16 weights and activations, random; times are medians of the summed CUPTI kernel "
        "durations of warm calls.",
        "Pallas grouped matmul vs the ragged_dot reference (relative error, by launch "
        f"configuration): {json.dumps(errors)}.",
    ]
    save(
        "moe_decode",
        f"MoE layer at decode ({sizes.decode_tokens} tokens) vs the memory roofline, bf16",
        [
            "layer",
            "tokens",
            "experts chosen",
            "MB read",
            "layer us",
            "experts us",
            "router us",
            "roofline us",
            "x roofline",
            "of copy BW",
            "rel err vs ref",
        ],
        decode_rows,
        [
            f"Roofline: the bytes the layer must read (the chosen experts' gate, up and down "
            f"weights, the shared experts', the router's) over the copy bandwidth measured in "
            f"the same run, {copy.gbs:.0f} GB/s ({copy.method}).",
            "experts us: sort by expert, the two grouped matmuls, the weighted combine; "
            "layer us adds the router and the shared experts.",
            *common,
        ],
        extra={"copy_bandwidth": copy.record()},
        out_dir=out_dir,
    )
    save(
        "moe_prefill",
        f"MoE layer at prefill ({sizes.prefill_tokens} tokens) vs a dense matmul, bf16",
        [
            "layer",
            "tokens",
            "layer us",
            "experts us",
            "router us",
            "experts TFLOP/s",
            "dense TFLOP/s",
            "of dense",
            "layer TFLOP/s",
            "experts us, Mosaic GPU (/ Triton)",
        ],
        prefill_rows,
        [
            "experts TFLOP/s: 2 x tokens x top-k x 3 x hidden x expert width over the routed "
            "experts' time (sort, two grouped matmuls, weighted combine); dense: a bf16 "
            "[tokens x top-k, hidden] @ [hidden, 3 x expert width] matmul (the same FLOPs) in "
            "the same run.",
            "Mosaic GPU: the routed experts with both grouped matmuls on the Mosaic GPU kernel "
            "(grouped_matmul/pallas_mosaic_gpu.py, bf16 weights; no kernel set runs it), "
            "over the Triton kernel's experts us; its relative difference from the "
            "Triton kernel's experts is in the JSON.",
            *common,
        ],
        out_dir=out_dir,
    )


if __name__ == "__main__":
    main()
