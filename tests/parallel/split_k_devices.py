"""Compiles split-K projections (``layers.split_k_dot``) under tensor parallelism on fake CPU
devices and counts their collectives beside the whole matmul's, for ``test_split_k.py``.

JAX fixes its device count when it is imported, so the test runs this file in a fresh process:

    python tests/parallel/split_k_devices.py RESULT.json

with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and ``JAX_PLATFORMS=cpu``. The
weights are placed by ``sharding.partition_spec`` (the runtime's rules); each projection's
input as the layer before leaves it.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax.model import layers
from mla_jax.parallel import sharding

ROWS = 16
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
# name -> (parameter path, [K, N], the input's spec): V2-Lite's o_proj (split by rows, its
# input by heads) and V3's shared experts' gate (split by columns, its input replicated).
PROJECTIONS = {
    "o_proj": (("layers", "self_attn", "o_proj", "kernel"), (2048, 2048), P(None, "tp")),
    "shared gate_proj": (("mlp", "shared_experts", "gate_proj", "kernel"), (7168, 2048), P()),
}


def collectives(fn, *args) -> dict:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {op: len(re.findall(rf" {op}(-start)?\(", text)) for op in COLLECTIVES}


def main(out: str) -> None:
    mesh = sharding.make_mesh(jax.device_count())
    result = {"devices": jax.device_count()}
    for name, (path, (k, n), x_spec) in PROJECTIONS.items():
        splits = layers.k_splits(ROWS, k, n)
        w_spec = sharding.partition_spec(path, 2)
        kernel = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(1), (ROWS, k), jnp.bfloat16)
        kernel = jax.device_put(kernel, NamedSharding(mesh, w_spec))
        x = jax.device_put(x, NamedSharding(mesh, x_spec))

        def whole(kernel, x):
            return jnp.dot(x, kernel)

        def split(kernel, x, splits=splits):
            return layers.split_k_dot(x, kernel, splits)

        want = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)

        def error(fn, kernel=kernel, x=x, want=want):
            got = np.asarray(fn(kernel, x), np.float64)
            return float(np.linalg.norm(got - want) / np.linalg.norm(want))

        result[name] = {
            "weight_spec": str(w_spec),
            "splits": splits,
            "whole": collectives(whole, kernel, x),
            "split": collectives(split, kernel, x),
            "whole_error": error(whole),
            "split_error": error(split),
        }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
