"""Materializes a small model's parameters and latent caches on fake CPU devices and counts
each device's bytes, for ``test_memory_plan.py`` (the plan computes them from shapes alone).

JAX fixes its device count when it is imported, so the test runs this file in a fresh process:

    python tests/parallel/memory_plan_devices.py JOB.json RESULT.json

with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu``. The
job holds a config.json dict, the layouts ``[data_parallel, tensor_parallel,
expert_parallel]``, a block size and the tokens each DP rank's cache holds.

Built and placed as the runtime builds and places them: the model in bf16, and with the FP8
checkpoint's weights kept (``DeepseekModel``'s ``fp8_blocks``, as ``load_model(...,
fp8_weights="keep")`` makes it: FP8 weights with their block scales, ``kv_b_proj`` in bf16);
the parameters by ``sharding.param_shardings`` on ``sharding.make_mesh`` (the runner's), the
cache by ``init_cache(..., sharding=sharding.per_data_rank(mesh, axis=1))`` (the engine's).
"""

from __future__ import annotations

import collections
import json
import math
import sys

import jax
import jax.numpy as jnp
from flax import nnx

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


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    cfg = config_from_dict(job["config"])
    states = {
        kind: nnx.split(
            DeepseekModel(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=blocks)
        )[1]
        for kind, blocks in (("bfloat16", None), ("fp8", cfg.quantization.weight_block_size))
    }
    result = {}
    for data_parallel, tensor_parallel, expert_parallel in job["layouts"]:
        mesh = sharding.make_mesh(tensor_parallel, data_parallel)
        placed = {
            kind: [
                jax.device_put(leaf, placement)
                for leaf, placement in zip(
                    jax.tree.leaves(state),
                    sharding.param_shardings(state, mesh, expert_parallel),
                    strict=True,
                )
            ]
            for kind, state in states.items()
        }
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
        paths = sharding.param_paths(states["bfloat16"])
        experts = next(
            array
            for path, array in zip(paths, placed["bfloat16"], strict=True)
            if path[-2:] == ("experts", "down_proj")
        )
        key = f"{data_parallel}/{tensor_parallel}/{int(expert_parallel)}"
        result[key] = {
            **{kind: _per_device(arrays) for kind, arrays in placed.items()},
            "cache": {kv: _per_device(parts) for kv, parts in caches.items()},
            "experts_per_device": sorted(s.data.shape[1] for s in experts.addressable_shards),
        }
    with open(result_path, "w") as f:
        json.dump({"devices": jax.device_count(), "layouts": result}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
