"""Materializes a small model's parameters and latent caches on fake CPU devices and counts
each device's bytes, for ``test_memory_plan.py`` (the plan computes them from shapes alone).

JAX fixes its device count when it is imported, so the test runs this file in a fresh process:

    python tests/parallel/memory_plan_devices.py JOB.json RESULT.json

with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu``. The
job holds a config.json dict, the layouts ``[data_parallel, tensor_parallel,
experts_over_all_ranks]``, a block size and the tokens each DP rank's cache holds.

Placed as the runtime places them: the parameters by ``sharding.param_shardings`` on
``sharding.make_mesh`` (the runner's), the cache by ``init_cache(..., sharding=
sharding.per_data_rank(mesh, axis=1))`` (the engine's). FP8 weights and the layouts with the
routed experts over all ranks have no runtime yet: here every decoder kernel but the router's and
routed expert stack becomes float8_e4m3fn zeros plus a float32 grid of one scale per block
(the routed gate_up_proj: gate's grid beside up's), placed as its weight; the routed experts
of an all-ranks layout split on their expert axis over ``("dp", "tp")``.
"""

from __future__ import annotations

import collections
import json
import math
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax.cache.latent_cache import cache_dtype, init_cache
from mla_jax.checkpoint.hf_config import config_from_dict
from mla_jax.model.deepseek import DeepseekModel
from mla_jax.parallel import sharding


def _per_device(arrays) -> list[int]:
    """Bytes of ``arrays``' shards on each device, by device id."""
    counts = collections.Counter()
    for array in arrays:
        for shard in array.addressable_shards:
            counts[shard.device.id] += shard.data.nbytes
    return [counts[device.id] for device in jax.devices()]


def _is_fp8(path: tuple[str, ...]) -> bool:
    """A decoder layer's kernel (not the router's, ``mlp.gate``) or a routed expert stack."""
    kernel = path[-1] == "kernel" and path[-2:] != ("gate", "kernel")
    return path[0] == "layers" and (kernel or path[-2] == "experts")


def _scale_grid(path, shape, block) -> tuple[int, ...]:
    """One scale per ``block = (rows of HF's [out, in], columns)`` of the weight; the
    parameter is ``[..., in, out]``."""
    block_out, block_in = block
    *lead, n_in, n_out = shape
    if path[-2:] == ("experts", "gate_up_proj"):  # [gate | up] columns, a grid each
        return (*lead, -(-n_in // block_in), 2 * -(-(n_out // 2) // block_out))
    return (*lead, -(-n_in // block_in), -(-n_out // block_out))


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    cfg = config_from_dict(job["config"])
    block = tuple(job["config"]["quantization_config"]["weight_block_size"])
    model = DeepseekModel(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    state = nnx.split(model)[1]
    paths, leaves = sharding.param_paths(state), jax.tree.leaves(state)
    result = {}
    for data_parallel, tensor_parallel, all_ranks in job["layouts"]:
        mesh = sharding.make_mesh(tensor_parallel, data_parallel)
        placements = sharding.param_shardings(state, mesh)
        if all_ranks:
            placements = [
                NamedSharding(mesh, P(None, ("dp", "tp"), None, None))
                if path[-2] == "experts"
                else placement
                for path, placement in zip(paths, placements, strict=True)
            ]
        bf16 = [
            jax.device_put(leaf, placement)
            for leaf, placement in zip(leaves, placements, strict=True)
        ]
        fp8 = []
        for path, leaf, placement in zip(paths, leaves, placements, strict=True):
            if not _is_fp8(path):
                fp8.append(jax.device_put(leaf, placement))
                continue
            fp8.append(jnp.zeros(leaf.shape, jnp.float8_e4m3fn, device=placement))
            grid = _scale_grid(path, leaf.shape, block)
            fp8.append(jnp.ones(grid, jnp.float32, device=placement))
        blocks = data_parallel * math.ceil(job["tokens_per_rank"] / job["block_size"])
        caches = {
            kv: jax.tree.leaves(
                init_cache(
                    cfg.num_layers,
                    blocks,
                    job["block_size"],
                    cfg.mla.cache_width,
                    cache_dtype(kv, jnp.bfloat16),
                    kv_lora_rank=cfg.mla.kv_lora_rank,
                    sharding=sharding.per_data_rank(mesh, axis=1),
                )
            )
            for kv in ("auto", "fp8")
        }
        experts = next(
            array
            for path, array in zip(paths, bf16, strict=True)
            if path[-2:] == ("experts", "down_proj")
        )
        key = f"{data_parallel}/{tensor_parallel}/{int(all_ranks)}"
        result[key] = {
            "bfloat16": _per_device(bf16),
            "fp8": _per_device(fp8),
            "cache": {kv: _per_device(parts) for kv, parts in caches.items()},
            "experts_per_device": sorted(s.data.shape[1] for s in experts.addressable_shards),
        }
    with open(result_path, "w") as f:
        json.dump({"devices": jax.device_count(), "layouts": result}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
