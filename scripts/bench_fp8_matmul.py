"""FP8 weights kept FP8 vs bf16 weights, on the GPU, in one run: DeepSeek-V3's MoE layer
(router, routed experts through the grouped matmul, shared experts) at decode (64 tokens) and
at prefill (8192 tokens), and its dense projections (attention's q_a, q_b, kv_a, o_proj; a
dense layer's MLP) at 1, 64 and 8192 tokens. Random weights with 128 x 128 block scales;
bf16 activations.

    python scripts/bench_fp8_matmul.py [--out DIR] [--smoke]

Each row: the bf16 time, the time of what the product runs with FP8 weights (the GPU kernel
set's, the FP8 weights in HF's ``[N, K]`` layout: w8a8 on a Hopper GPU where it takes the
weight and pays off (``w8a8_matmul.pays_off``), else ``fp8_matmul.fastest`` for the
projections, the Triton grouped matmul with the
tuned FP8 configs for the experts), their ratio (issue 23 asks <= 0.6x at decode, <= 1x at
prefill and <= 0.77x there for w8a8), its relative error against the reference (the weights
dequantized, then one matmul), and for the projections the paths the product did not pick
at that row count: the Pallas kernel, or the weight dequantized into a bf16 temporary then
XLA's dot (cuBLAS), and w8a8; for the MoE layer whose experts ran w8a8, its experts on the
Triton grouped matmul.
``scripts/tune_fp8_matmul.py`` measures the kernels' launch parameters and
``scripts/explore_fp8.py`` the other variants (XLA with the dequantization written into the
dot's operand, w8a8 on FP8 tensor cores; ``benchmarks/tuning/fp8_matmul_variants.json``).
``--sweep split_k``: bf16 projections of DeepSeek-V2-Lite and V3 at decode rows (16, 64) as
one matmul and as K split into 2-16 slices (``layers.split_k_dot``), each weight a layer of a
stacked ``[layers, K, N]`` array as the decode step reads it, beside the copy bandwidth:
the measurement behind ``layers.k_splits`` (``benchmarks/tuning/split_k_sweep.json``).

``--smoke``: V3's layer shrunk (hidden 128, 16 experts of width 128, V3's 128 x 128 scale
blocks) and small projections (w8a8 takes gate_proj's whole blocks where Mosaic GPU's
interpret mode runs), few tokens, on the CPU, results under --out only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
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
from flax import nnx

from mla_jax import kernels
from mla_jax.engine.runner import GPU_COMPILER_OPTIONS
from mla_jax.kernels import fp8_blocks
from mla_jax.kernels import fp8_matmul as fm
from mla_jax.kernels import w8a8_matmul as w8a8
from mla_jax.model.config import MoEConfig, moe_preset
from mla_jax.model.layers import Linear, k_splits, split_k_dot
from mla_jax.model.moe import MoE

V3 = moe_preset("deepseek-v3")
BLOCKS = (128, 128)
ERROR_EXPERTS = 16  # experts of the MoE layer whose FP8 error is measured
ERROR_TOKENS = 1024  # at most, the tokens it is measured on


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a run measures: the MoE layer, the projections ``name -> (in, out)`` and the
    token counts (decode, prefill)."""

    moe: MoEConfig
    projections: dict
    tokens: tuple[int, int]
    blocks: tuple[int, int]
    projection_tokens: tuple[int, ...]


FULL = Sizes(
    moe=V3,
    projections={
        "fused_qkv_a_proj": (7168, 1536 + 576),  # q_a_proj and kv_a_proj_with_mqa
        "q_b_proj": (1536, 128 * 192),
        "o_proj": (128 * 128, 7168),
        "mlp.gate_proj": (7168, 18432),
        "mlp.down_proj": (18432, 7168),
    },
    tokens=(64, 8192),
    blocks=BLOCKS,
    projection_tokens=(1, 64, 8192),
)
SMOKE = Sizes(
    moe=dataclasses.replace(V3, hidden_size=128, n_routed_experts=16, moe_intermediate_size=128),
    projections={
        "q_a_proj": (64, 48),
        "o_proj": (40, 64),
        "mlp.gate_proj": (128, 256),
        "mlp.down_proj": (256, 64),
    },
    tokens=(4, 160),  # 80 rows an expert at prefill: w8a8's 128-row tiles
    blocks=(128, 128),  # V3's: w8a8 takes gate_proj, the others end in partial blocks
    projection_tokens=(1, 300),
)

# ``--sweep split_k``: the dense bf16 projections of a decode step, name -> (K, N).
SPLIT_K_SHAPES = {
    "V2-Lite q_proj": (2048, 16 * 192),
    "V2-Lite kv_a_proj_with_mqa": (2048, 576),
    "V2-Lite o_proj": (16 * 128, 2048),
    "V2-Lite gate_proj": (2048, 10944),
    "V2-Lite down_proj": (10944, 2048),
    **{f"V3 {name.removeprefix('mlp.')}": shape for name, shape in FULL.projections.items()},
    "V3 shared experts' gate_proj": (7168, 2048),
}
SPLIT_K_SMOKE_SHAPES = {"small": (512, 64)}
SPLIT_K_ROWS = (16, 64)
SPLIT_K_SLICES = (1, 2, 4, 8, 16)


def _fp8_state(module: nnx.Module, seed: int) -> nnx.Module:
    """Random block scales (about 1 / 448 of a weight's size), so that FP8 values span e4m3."""
    key = jax.random.key(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if str(path[-1]).endswith("_scale_inv"):
            key, sub = jax.random.split(key)
            var[...] = jax.random.uniform(sub, var.shape, jnp.float32, 0.5, 2.0) * 1e-4
    return module


def _w8a8_product(x, weight, scale_inv, *, blocks, layer=None):
    """``fp8_matmul``'s signature on w8a8 (whole 128 x 128 blocks: the table's)."""
    del blocks
    return w8a8.w8a8_matmul(x, weight, scale_inv, layer=layer)


# The projections' alternatives: the GPU set with one FP8 path forced.
ALTERNATIVES = {
    "pallas": kernels.TRITON._replace(fp8_matmul=kernels.on_whole_weights(fm.fp8_matmul)),
    "dequant+cuBLAS": kernels.TRITON._replace(
        fp8_matmul=kernels.on_whole_weights(fm.reference.dequantized_dot)
    ),
    "w8a8": kernels.TRITON._replace(fp8_matmul=kernels.on_whole_weights(_w8a8_product)),
}


def _fp8_product(impl, weight: jax.Array, scale_inv: jax.Array, blocks: fp8_blocks.Fp8Blocks):
    """``x -> x @ dequantize(weight, scale_inv)^T`` by the FP8 matmul of ``impl``
    (``kernels.select``: as ``layers.Linear`` calls it) compiled, the weight passed as an
    argument (as ``_jitted``)."""
    matmul = kernels.select(impl).fp8_matmul
    step = jax.jit(lambda weight, scale_inv, x: matmul(x, weight, scale_inv, blocks=blocks))
    return functools.partial(step, weight, scale_inv)


def _jitted(module: nnx.Module, impl, **kwargs):
    """``module(x, impl=impl, **kwargs)`` compiled, its weights passed as arguments (closed
    over, XLA would fold gigabytes of constants into the program)."""
    graphdef, state = nnx.split(module)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, impl=impl, **kwargs))
    return functools.partial(step, state)


def _compare(bf16_fn, fp8_fn, args_sets, error_fns, error_args=None) -> dict:
    """Times of the bf16 and FP8 functions over the same inputs, and the FP8 path's error
    against its reference: ``error_fns`` = (the FP8 kernel path, its reference), on
    ``error_args`` (default: the first inputs)."""
    bf16, fp8 = time_us(bf16_fn, args_sets), time_us(fp8_fn, args_sets)
    error = _rel_err(*error_fns, error_args or args_sets[0])
    return {"bf16": bf16, "fp8": fp8, "ratio": fp8.us / bf16.us, "rel_err": error}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_array(key: jax.Array, shape: tuple[int, ...], dtype, fan_in: int) -> jax.Array:
    """Normal values over ``sqrt(fan_in)`` in ``dtype``, made one leading slice at a time
    where there are three or more axes: V3's experts drawn whole would need float32
    temporaries of their own size (28 GiB for one layer's gate_up_proj), more than an H100
    has beside the layers."""
    std = fan_in**-0.5
    if len(shape) < 3:
        return (std * jax.random.normal(key, shape)).astype(dtype)
    return jax.lax.map(
        lambda k: (std * jax.random.normal(k, shape[1:])).astype(dtype),
        jax.random.split(key, shape[0]),
    )


def _moe_layer(cfg: MoEConfig, blocks: tuple[int, int] | None) -> MoE:
    """V3's MoE layer with random weights (FP8 with block scales when ``blocks``) and a
    random score-correction bias, its weights made by ``_random_array``."""
    layer = nnx.eval_shape(
        lambda: MoE(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=blocks)
    )
    key = jax.random.key(0)
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        key, sub = jax.random.split(key)
        # fan-in: K of an FP8 projection's HF-layout weight [N, K], else of [..., K, N]
        fan_in = var.shape[-1] if str(path[-1]) == "weight" else var.shape[max(-2, -var.ndim)]
        var.set_value(_random_array(sub, var.shape, var.dtype, fan_in))
    if blocks:
        layer = _fp8_state(layer, 1)
    bias = 0.01 * jax.random.normal(jax.random.key(2), (cfg.n_routed_experts,))
    layer.gate.e_score_correction_bias[...] = bias
    return layer


def _stacked_twice(layer: MoE) -> MoE:
    """The layer's routed experts as a run of two layers' (``[2, E, ...]``, the layer's own
    twice; called with ``layer_in_run=0``), as the model stacks them: V3's FP8 ``down_proj`` of one
    layer fills 3.8 GB, where Pallas' Triton lowering cannot index 1-byte values
    (``fp8.check_triton_indexable``); a model's stack of layers is larger."""
    experts = layer.experts
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
        value = getattr(experts, name)[...]
        setattr(experts, name, nnx.Param(jnp.stack([value, value])))
    return layer


def moe_rows(sizes: Sizes) -> list[dict]:
    """The MoE layer's rows. Its error is measured on the same layer with 16 experts and at
    most ``ERROR_TOKENS`` of the tokens: the reference dequantizes every expert's weights
    and runs them all as one dense product over every group (``jax.lax.ragged_dot`` on a
    GPU; V3's 256 at 8192 tokens want more than an H200's memory, 16 at 8192 tokens 14 GiB
    more than an H100 had beside the layers), and the kernel path's rounding does not
    depend on the expert or token count (16 experts over 1024 tokens x 8 are a prefill's
    rows a group)."""
    cfg = sizes.moe
    bf16, fp8 = _moe_layer(cfg, None), _stacked_twice(_moe_layer(cfg, sizes.blocks))
    small = _moe_layer(dataclasses.replace(cfg, n_routed_experts=ERROR_EXPERTS), sizes.blocks)
    error_fns = (_jitted(small, "pallas"), _jitted(small, "reference"))
    rows = []
    for tokens in sizes.tokens:
        keys = jax.random.split(jax.random.key(tokens), 3)
        args = [(jax.random.normal(k, (tokens, cfg.hidden_size), jnp.bfloat16),) for k in keys]
        fp8_fn = _jitted(fp8, "pallas", layer_in_run=0)
        error_args = (args[0][0][:ERROR_TOKENS],)
        r = _compare(_jitted(bf16, "pallas"), fp8_fn, args, error_fns, error_args)
        if kernels.select("pallas") is kernels.MOSAIC_GPU:  # its experts ran w8a8
            r.update(_experts_on(kernels.TRITON, "triton", fp8, small, args, error_args))
        print("moe", tokens, jsonable(r), flush=True)
        rows.append(_row("MoE layer (V3)", tokens, r))
    return rows


def _experts_on(kernel_set, name: str, fp8: MoE, small: MoE, args, error_args) -> dict:
    """The FP8 layer with its routed experts on ``kernel_set``'s grouped matmul: ``others``
    (its time, for the table) and its error against the reference on the 16-expert layer,
    on ``error_args``."""
    timing = time_us(_jitted(fp8, kernel_set, layer_in_run=0), args, reps=10)
    error = _rel_err(_jitted(small, kernel_set), _jitted(small, "reference"), error_args)
    return {"others": [(name, timing)], f"{name}_rel_err": error}


def _rel_err(kernel_fn, reference_fn, args) -> float:
    got = np.asarray(kernel_fn(*args), np.float64)
    want = np.asarray(reference_fn(*args), np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def projection_rows(sizes: Sizes) -> list[dict]:
    rows = []
    blocks = fp8_blocks.Fp8Blocks(*sizes.blocks)
    for name, (n_in, n_out) in sizes.projections.items():
        bf16 = Linear(n_in, n_out, jnp.bfloat16, nnx.Rngs(0))
        weight, scale_inv = random_fp8_weight(jax.random.key(1), (n_out, n_in), blocks, nk=True)
        for tokens in sizes.projection_tokens:
            keys = jax.random.split(jax.random.key(tokens), 3)
            args = [(jax.random.normal(k, (tokens, n_in), jnp.bfloat16),) for k in keys]
            kernel_fn = _fp8_product("pallas", weight, scale_inv, blocks)
            error_fns = (kernel_fn, _fp8_product("reference", weight, scale_inv, blocks))
            r = _compare(_jitted(bf16, "pallas"), kernel_fn, args, error_fns)
            # The paths the product did not take at this row count: where the Hopper set
            # ran w8a8, the weight-only path fp8_matmul.fastest takes at these rows;
            # elsewhere fastest's other path, and w8a8 where it runs (interpreted off a GPU).
            w8a8_runs = w8a8.unsupported(args[0][0], weight, scale_inv) is None
            fastest = "pallas" if tokens <= fm.PALLAS_MAX_ROWS else "dequant+cuBLAS"
            hopper = kernels.select("pallas") is kernels.MOSAIC_GPU
            if hopper and w8a8_runs and w8a8.pays_off(args[0][0]):
                others = [fastest]
            else:
                others = ["dequant+cuBLAS" if fastest == "pallas" else "pallas"]
                others += ["w8a8"] if w8a8_runs else []
            r["others"] = []
            for other in others:
                alternative = _fp8_product(ALTERNATIVES[other], weight, scale_inv, blocks)
                r["others"].append((other, time_us(alternative, args, reps=10)))
            print(name, tokens, jsonable(r), flush=True)
            rows.append(_row(f"{name} [{n_in}, {n_out}]", tokens, r))
    return rows


def _row(name: str, tokens: int, r: dict) -> dict:
    cells = [name, tokens, round(r["bf16"].us, 1), round(r["fp8"].us, 1)]
    cells += [f"{r['ratio']:.2f}x", f"{r['rel_err']:.1e}"]
    timings = dict(bf16=r["bf16"], fp8=r["fp8"])
    alternatives = []
    for other, timing in r.get("others", []):
        alternatives.append(f"{other} {timing.us:.1f} ({timing.us / r['bf16'].us:.2f}x)")
        timings[other] = timing
    return row([*cells, "; ".join(alternatives)], **timings)


def split_k_trials(shapes: dict, bandwidth_gbs: float) -> list:
    """``(info, variant, measure)`` per projection, row count and slice count."""
    options = GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
    trials = []
    for name, (k, n) in shapes.items():
        for rows in SPLIT_K_ROWS:
            for splits in SPLIT_K_SLICES:
                if k % splits or (k // splits) % 64:
                    continue
                info = dict(projection=name, k=k, n=n, rows=rows, policy=k_splits(rows, k, n))
                case = functools.partial(_split_k_case, k, n, rows, splits, options, bandwidth_gbs)
                trials.append((info, f"{splits} slices", case))
    return trials


def _split_k_case(k, n, rows, splits, options, bandwidth_gbs) -> dict:
    """One trial: a layer of three rotating ``[2, k, n]`` stacks times ``[rows, k]``."""
    stacks = [jax.random.normal(jax.random.key(i), (2, k, n), jnp.bfloat16) for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (rows, k), jnp.bfloat16)

    def product(x, stack):
        return split_k_dot(x, stack[1], splits) if splits > 1 else jnp.dot(x, stack[1])

    f = jax.jit(product).lower(x, stacks[0]).compile(compiler_options=options)
    want = jnp.dot(x.astype(jnp.float32), stacks[0][1].astype(jnp.float32), precision="highest")
    got = f(x, stacks[0]).astype(jnp.float32)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    t = time_us(f, [(x, stack) for stack in stacks])
    return {
        "slices": splits,
        "us": t,
        "of_copy_bandwidth": 2 * k * n / t.us / 1e3 / bandwidth_gbs,
        "rel_err": error,
    }


def main():
    args = parse_args(parser(__doc__, sweeps=("split_k",)))
    run(args, functools.partial(tables, args), {"split_k": functools.partial(split_k, args)})


def split_k(args) -> None:
    shapes = SPLIT_K_SMOKE_SHAPES if args.smoke else SPLIT_K_SHAPES
    sweep("split_k", split_k_trials(shapes, copy_bandwidth().gbs), args.out)


def tables(args) -> None:
    sizes = SMOKE if args.smoke else FULL
    moe = moe_rows(sizes)  # first: the MoE layer's rows print before the projections'
    rows = projection_rows(sizes) + moe
    save(
        "fp8_matmul",
        "FP8 weights (what the product runs) vs bf16 weights, DeepSeek-V3 shapes",
        [
            "what",
            "tokens",
            "bf16 us",
            "fp8 us",
            "fp8 / bf16",
            "fp8 rel err vs ref",
            "fp8 alternative us (/ bf16)",
        ],
        rows,
        [
            "bf16 activations. bf16: the MoE layer with the Pallas grouped matmul, the "
            "projections as XLA dots. fp8: what the GPU kernel set runs with FP8 weights (in "
            "HF's [N, K] layout, the experts' stacked [E, N, K]): the layer's routed experts "
            "through the grouped matmul with rhs_scale_inv (on a Hopper GPU w8a8's grouped "
            "form, else the Triton kernel, launch parameters from mla_jax/kernels/tuned.py; "
            "the FP8 experts stacked as two layers', as a model stacks them: one V3 layer's "
            "FP8 down_proj, 3.8 GB, is more than Pallas' Triton lowering indexes), its shared "
            "experts and the projections: on a Hopper GPU w8a8 "
            "(x quantized to e4m3 per row and 128 columns, e4m3 wgmmas; its rel err is "
            "mostly x's rounding) where it takes the weight and pays off (not at up to "
            f"{w8a8.FEW_ROWS} rows of a K up to {w8a8.SHALLOW_DEPTH}), else "
            "fp8_matmul.fastest (the "
            f"Pallas kernel up to {fm.PALLAS_MAX_ROWS} rows, above them the weight "
            "dequantized into a bf16 temporary, then XLA's dot). Alternatives (10 calls): "
            "where w8a8 ran, the path fastest takes at that row count; elsewhere fastest's "
            "other path and w8a8 where it takes the product. The MoE layer's alternative, where "
            "its experts ran w8a8: the Triton grouped matmul (weight-only, the rows as they "
            "are). Times: medians of the summed CUPTI kernel "
            "durations of warm calls over 3 rotating inputs.",
            f"Block scales {list(sizes.blocks)}, random; rel err: L2 against the FP8 path's "
            "reference (the weights dequantized, then the same computation); the MoE "
            f"layer's on the same layer with {ERROR_EXPERTS} experts, over at most "
            f"{ERROR_TOKENS} tokens.",
        ],
        out_dir=args.out,
    )


if __name__ == "__main__":
    main()
