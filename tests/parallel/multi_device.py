"""Runs tensor- and data-parallel generations on fake CPU devices, for ``test_sharding.py``.

JAX fixes its device count when it is imported, and pytest has imported it long before a
test runs, so the tests run this file in a fresh process:

    python tests/parallel/multi_device.py JOB.json RESULT.json

with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu`` in its
environment. The job names checkpoints, the ``generate.py`` flags they run with and the
(checkpoint, tensor_parallel, impl) runs; the result holds each run's generated tokens,
for the ``inspect`` checkpoint at ``inspect_tp`` every parameter's and the cache's placement
and the collectives of a compiled decode step, and the errors of the Pallas kernels run
under ``shard_map`` at ``inspect_tp`` (heads or experts split). The job's ``dp_runs``
(checkpoint, data_parallel, tensor_parallel, impl, decode window) run with ``dp_flags``; for
the ``inspect`` checkpoint at ``dp_inspect`` (data_parallel, tensor_parallel) the result
holds the cache's placement, each step's requests per DP rank and the collectives with their
device groups. The job's ``ep_runs`` (checkpoint, data_parallel, tensor_parallel, decode
window, ``--fp8-weights``) run with ``dp_flags`` and ``--ep`` (the routed experts over all
devices): the result holds each one's tokens, parameter placements and collectives.
The job's ``prefix`` runs its waves of prompts (one ``generate`` call each) on one engine with
prefix caching, its flags and (data_parallel, tensor_parallel): the result holds each
request's tokens, the DP rank it joined and each wave's cached prompt tokens. The test file
judges them.
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from conftest import generate_script  # (importing conftest also sets the matmul precision)
from flax import nnx

from mla_jax import kernels
from mla_jax.checkpoint.loader import load_model
from mla_jax.engine.engine import Engine, EngineConfig, Request
from mla_jax.parallel import sharding

# An HLO collective: its result shape, or a tuple of them (XLA combines small all-reduces).
_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"[a-z]+[0-9]*\[[0-9,]*\]")
_REPLICA_GROUPS = re.compile(
    r"replica_groups=(\{[{}0-9,]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)"
)
_IOTA_GROUPS = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def _placement(array: jax.Array) -> dict:
    return {
        "shape": list(array.shape),
        "nbytes": array.nbytes,
        "spec": [None if axis is None else str(axis) for axis in array.sharding.spec],
        "device_bytes": sorted(shard.data.nbytes for shard in array.addressable_shards),
        "devices": len(array.sharding.device_set),
    }


def _inspect(path: str, tensor_parallel: int) -> dict:
    """Placements of the parameters and cache, and the collectives of a few programs."""
    _, model = load_model(path)
    engine = Engine(
        model,
        EngineConfig(
            block_size=4,
            num_blocks=32,
            max_num_batched_tokens=8,
            max_num_seqs=4,
            workspace_size=8,
            impl="reference",
            tensor_parallel=tensor_parallel,
        ),
        log=lambda _: None,
    )
    engine.precompile([[(5, 1)] * 2])  # a decode step (a prefill's collectives are the same)
    runner = engine.runner
    paths = ["/".join(path) for path in sharding.param_paths(nnx.split(model)[1])]
    collectives = [[op, shape] for op, shape, _ in _collectives(runner.programs.values())]
    # Loaded straight to their shards (as generate.py --tp does): the same placements.
    _, placed = load_model(path, placement=sharding.placement(runner.mesh))
    loaded = jax.tree.leaves(nnx.split(placed)[1])
    return {
        "params": {p: _placement(a) for p, a in zip(paths, runner.params, strict=True)},
        "loaded_params": {p: _placement(a) for p, a in zip(paths, loaded, strict=True)},
        "cache": _placement(runner.cache),
        "collectives": collectives,
    }


def _collectives(programs) -> list[list]:
    """``[op, result shape, replica groups]`` of each collective of compiled ``programs``;
    the groups as a string ``{{0,2},{1,3}}`` (XLA prints them so or as an iota list)."""
    collectives = []
    for program in programs:
        for line in program.as_text().splitlines():
            if match := _COLLECTIVE.search(line):
                groups = _REPLICA_GROUPS.search(line)
                groups = groups and _explicit_groups(groups.group(1))
                for shape in _SHAPE.findall(match.group(1)):
                    collectives.append([match.group(2), shape, groups])
    return collectives


def _explicit_groups(text: str) -> str:
    """Replica groups as XLA's explicit list, from either form it prints: ``{{0,2},{1,3}}``
    as it is, or an iota list ``[2,2]<=[2,2]T(1,0)`` (the devices ``arange(4).reshape(2,
    2).transpose(1, 0)`` in rows of 2)."""
    iota = _IOTA_GROUPS.fullmatch(text)
    if iota is None:
        return text
    shape, dims, perm = (g and [int(v) for v in g.split(",")] for g in iota.groups())
    devices = np.arange(np.prod(dims)).reshape(dims).transpose(perm).reshape(shape)
    return "{" + ",".join("{" + ",".join(map(str, row)) + "}" for row in devices) + "}"


def _run_data_parallel(path: str, flags: list[str]) -> dict:
    """A data-parallel run of ``flags``' prompts (``generate.py``'s flags, ``--dp`` among
    them), its parameters loaded to their shards as ``generate.py`` loads them: the tokens,
    each step's ``[decodes, prompt chunks]`` per DP rank, the placements of the cache and
    of every parameter, and the collectives of the programs."""
    generate = generate_script()
    parser = generate._parser()
    args = parser.parse_args(["--model", path, *flags])
    prompts = args.prompt_ids
    mesh = sharding.make_mesh(args.tp, args.dp)
    _, model = load_model(
        path,
        dtype=jnp.dtype(args.dtype),
        placement=sharding.placement(mesh, args.ep),
        fp8_weights=args.fp8_weights,
    )
    engine = Engine(model, generate._engine_config(parser, args, prompts), log=lambda _: None)
    runner = engine.runner
    per_rank = []
    launch = engine._launch

    def recording_launch(scheduled, *args, **kwargs):
        per_rank.append(
            [
                [sum(e.is_decode for e in batch), sum(not e.is_decode for e in batch)]
                for batch in scheduled
            ]
        )
        return launch(scheduled, *args, **kwargs)

    engine._launch = recording_launch
    requests = [Request(p, args.max_new_tokens) for p in prompts]
    engine.generate(requests)
    paths = ["/".join(path) for path in sharding.param_paths(nnx.split(model)[1])]
    return {
        "tokens": [req.output_ids for req in requests],
        "requests_per_rank": per_rank,
        "cache": _placement(runner.cache),
        "params": {p: _placement(a) for p, a in zip(paths, runner.params, strict=True)},
        "collectives": _collectives(runner.programs.values()),
    }


def _prefix_caching(path: str, flags: list[str], prefix: dict) -> dict:
    """The ``prefix`` job's waves on one engine (``generate.py``'s settings from ``flags``,
    sized for all the waves' prompts): tokens, DP rank and cached prompt tokens."""
    generate = generate_script()
    parser = generate._parser()
    data_parallel, tensor_parallel = prefix["data_parallel"], prefix["tensor_parallel"]
    argv = ["--model", path, *flags, "--dp", str(data_parallel), "--tp", str(tensor_parallel)]
    args = parser.parse_args(argv)
    prompts = [prompt for wave in prefix["waves"] for prompt in wave]
    _, model = load_model(path)
    engine = Engine(model, generate._engine_config(parser, args, prompts), log=lambda _: None)
    ranks = []
    rank_for = engine._rank_for

    def recording_rank_for(req):
        ranks.append(rank_for(req))
        return ranks[-1]

    engine._rank_for = recording_rank_for
    tokens, cached = [], []
    for wave in prefix["waves"]:
        before = engine.stats.cached_prompt_tokens
        requests = engine.generate([Request(p, args.max_new_tokens) for p in wave])
        tokens.append([req.output_ids for req in requests])
        cached.append(engine.stats.cached_prompt_tokens - before)
    return {"prefix_tokens": tokens, "prefix_ranks": ranks, "prefix_cached": cached}


def _kernel_errors(tensor_parallel: int, seed: int) -> dict[str, float]:
    """The Pallas kernels (interpreted) under ``sharding.sharded_kernels``, each rank on its
    heads or experts, against the unsharded references: relative error of each output."""
    mesh = sharding.make_mesh(tensor_parallel)
    pallas = sharding.sharded_kernels(kernels.select("pallas"), mesh)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    heads, lkv, rope, block_size = 2 * tensor_parallel, 32, 16, 4
    cache = normal(12, block_size, lkv + rope)
    table = jnp.asarray(rng.permutation(12).reshape(3, 4), jnp.int32)
    seq_lens = jnp.asarray([5, 16, 1], jnp.int32)
    decode = (normal(3, heads, lkv), normal(3, heads, rope), cache, table, seq_lens)
    cu_q, cu_k = jnp.asarray([0, 3, 9], jnp.int32), jnp.asarray([0, 5, 12], jnp.int32)
    prefill = (normal(10, heads, 24), normal(12, heads, 24), normal(12, heads, 8), cu_q, cu_k)
    merge = (normal(10, heads, 8), normal(10, heads), normal(10, heads, 8), normal(10, heads))
    experts = 2 * tensor_parallel
    group_sizes = jnp.asarray(rng.multinomial(18, np.ones(experts) / experts), jnp.int32)
    grouped = (normal(20, 24), normal(3 * experts, 24, 16), group_sizes)  # 3 layers' experts
    calls = {
        "mla_decode": (decode, dict(scale=0.3)),
        "flash_prefill": (prefill, dict(scale=0.2, causal=True)),
        "merge_attn_states": (merge, {}),
        # 2 experts a rank, the second layer's, 2 padding rows.
        "grouped_matmul": (grouped, dict(group_offset=experts)),
    }
    errors = {}
    for name, (args, options) in calls.items():
        got = getattr(pallas, name)(*args, **options)
        want = getattr(kernels.REFERENCE, name)(*args, **options)
        if name == "grouped_matmul":  # one output, not a tuple
            got, want = (got,), (want,)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            finite = np.isfinite(w)
            assert (np.isfinite(g) == finite).all(), name
            errors[f"{name}[{i}]"] = float(
                np.linalg.norm(g[finite] - w[finite]) / np.linalg.norm(w[finite])
            )
    return errors


def _fp8_splits(tensor_parallel: int, seed: int) -> dict[str, dict]:
    """The FP8 matmul (the Pallas kernel, interpreted) under ``sharding.sharded_kernels`` on a
    stack of 3 layers' weights placed split by columns or by rows as the rules place them,
    compiled with a traced layer: each split's relative error against float64 NumPy and the
    compiled program's collectives; ``unsplit``: the same columns-split stack handed over as
    if it were whole (``tensor_split=None``), what the partitioner does around the opaque
    kernel then."""
    from mla_jax.kernels.fp8_blocks import FP8, Fp8Blocks
    from mla_jax.model.layers import COLUMNS, ROWS

    mesh = sharding.make_mesh(tensor_parallel)
    pallas = sharding.sharded_kernels(kernels.select("pallas"), mesh)
    rng = np.random.default_rng(seed)
    blocks, rows, layer = Fp8Blocks(16, 16), 5, 1
    results = {}
    for name, split in ((COLUMNS, COLUMNS), (ROWS, ROWS), ("unsplit", None)):
        # The split axis in whole blocks on every rank, the other with a partial edge block.
        depth, width = (40, 32 * tensor_parallel) if name != ROWS else (32 * tensor_parallel, 40)
        weight = rng.standard_normal((3, width, depth)).astype(FP8)  # [L, N, K], HF's layout
        scales = 2.0 ** rng.integers(-3, 3, (3, -(-width // 16), -(-depth // 16)))
        weight[[0, 2]], scales[[0, 2]] = np.nan, np.nan  # the other layers: never read
        x = rng.standard_normal((rows, depth)).astype(np.float32)
        spec = sharding.partition_spec(
            ["mlp", "down_proj" if split == ROWS else "gate_proj", "weight"], 3
        )
        placed = jax.sharding.NamedSharding(mesh, spec)
        operands = (
            jax.device_put(x, sharding.replicated(mesh)),
            jax.device_put(jnp.asarray(weight), placed),
            jax.device_put(jnp.asarray(scales, jnp.float32), placed),
            jnp.int32(layer),
        )

        def call(x, weight, scales, layer, split=split):
            return pallas.fp8_matmul(
                x, weight, scales, blocks=blocks, layer=layer, tensor_split=split
            )

        compiled = jax.jit(call).lower(*operands).compile()
        got = np.asarray(compiled(*operands), np.float64)
        dequantized = (
            weight[layer].astype(np.float64)
            * np.repeat(np.repeat(scales[layer], 16, axis=0), 16, axis=1)[:width, :depth]
        )
        want = x.astype(np.float64) @ dequantized.T
        eager = np.asarray(call(*operands[:3], layer), np.float64)  # the layer an int
        results[name] = {
            "error": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "int_layer_error": float(np.linalg.norm(eager - want) / np.linalg.norm(want)),
            "collectives": [[op, shape] for op, shape, _ in _collectives([compiled])],
            "shape": [rows, width],
        }
    return results


def _fp8_step_collectives(tensor_parallel: int) -> list[list]:
    """The collectives of a compiled decode step of the built-in tiny model with FP8
    weights kept (128 x 128 blocks, random) at ``tensor_parallel``, its FP8 matmul the
    Pallas kernel (interpreted; the other kernels the references)."""
    from mla_jax.checkpoint.tiny import TINY
    from mla_jax.model.deepseek import DeepseekModel

    model = DeepseekModel(TINY, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=(128, 128))
    impl = kernels.REFERENCE._replace(fp8_matmul=kernels.TRITON.fp8_matmul)
    engine = Engine(
        model,
        EngineConfig(
            block_size=16,
            num_blocks=16,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            workspace_size=64,
            impl=impl,
            tensor_parallel=tensor_parallel,
        ),
        log=lambda _: None,
    )
    engine.precompile([[(5, 1)] * 2])
    return [[op, shape] for op, shape, _ in _collectives(engine.runner.programs.values())]


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    generate = generate_script()
    tokens = {}
    for name, tensor_parallel, impl in job["runs"]:
        argv = ["--model", job["checkpoints"][name], *job["flags"], "--impl", impl]
        start = time.perf_counter()
        result = generate.main([*argv, "--tp", str(tensor_parallel)])
        print(
            f"{name} tp {tensor_parallel} {impl}: {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
        key = f"{name}/{tensor_parallel}/{impl}"
        tokens[key] = [output["generated_ids"] for output in result["outputs"]]
    for name, data_parallel, tensor_parallel, impl, window in job["dp_runs"]:
        argv = ["--model", job["checkpoints"][name], *job["dp_flags"], "--impl", impl]
        argv += ["--decode-window", str(window)]
        start = time.perf_counter()
        result = generate.main([*argv, "--dp", str(data_parallel), "--tp", str(tensor_parallel)])
        key = f"{name}/dp{data_parallel}xtp{tensor_parallel}/{impl}/window{window}"
        print(f"{key}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        tokens[key] = [output["generated_ids"] for output in result["outputs"]]
    inspected = _inspect(job["checkpoints"][job["inspect"]], job["inspect_tp"])
    errors = _kernel_errors(job["inspect_tp"], job["seed"])
    fp8_splits = _fp8_splits(job["inspect_tp"], job["seed"])
    fp8_splits["step_collectives"] = _fp8_step_collectives(job["inspect_tp"])
    dp_tensor_parallel = ["--dp", str(job["dp_inspect"][0]), "--tp", str(job["dp_inspect"][1])]
    data_parallel = _run_data_parallel(
        job["checkpoints"][job["inspect"]],
        [*job["dp_flags"], "--impl", "reference", *dp_tensor_parallel],
    )
    inspected.update({f"dp_{key}": value for key, value in data_parallel.items()})
    expert_parallel = {}
    for name, data_parallel, tensor_parallel, window, fp8_weights in job["ep_runs"]:
        argv = [*job["dp_flags"], "--impl", "reference", "--decode-window", str(window)]
        argv += ["--fp8-weights", fp8_weights, "--ep"]
        argv += ["--dp", str(data_parallel), "--tp", str(tensor_parallel)]
        start = time.perf_counter()
        key = f"{name}/dp{data_parallel}xtp{tensor_parallel}/window{window}/{fp8_weights}"
        run = _run_data_parallel(job["checkpoints"][name], argv)
        expert_parallel[key] = {k: run[k] for k in ("tokens", "params", "collectives")}
        print(f"{key} --ep: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    inspected["ep"] = expert_parallel
    if "prefix" in job:
        prefix = job["prefix"]
        inspected.update(
            _prefix_caching(
                job["checkpoints"][prefix["checkpoint"]],
                [*prefix["flags"], "--impl", "reference"],
                prefix,
            )
        )
    with open(result_path, "w") as f:
        json.dump(
            {
                "devices": jax.device_count(),
                "tokens": tokens,
                "kernel_errors": errors,
                "fp8_splits": fp8_splits,
                **inspected,
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
