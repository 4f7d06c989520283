"""Expert parallelism over data-parallel ranks: each rank's tokens reach the routed experts of
every rank, and each token's expert outputs come back to its own rank.

Inside the runner's ``shard_map`` over ``"dp"`` each DP rank holds its own tokens ``[T, H]``
(every rank the same padded T: the step's shape is one for all ranks) and ``E / M`` of the
routed experts (``sharding.partition_spec(..., expert_parallel=True)``: rank r the range
``[r E/M, (r + 1) E/M)``, split further over its ``"tp"`` devices). ``dispatch_and_combine``:

1. all-gathers the ranks' hidden states and their router outputs (expert ids and weights)
   over the axis: every rank sees all ``M T`` tokens;
2. runs this rank's experts on the (token, expert) pairs whose expert it holds: the other
   pairs get expert id ``E / M`` (past the last local group: sorted after every local row,
   counted in no group, so no weight is read for them) and weight 0;
3. reduce-scatters the ``[M T, H]`` partial sums back: rank r receives rows ``[r T, (r + 1)
   T)``, the sum over the ranks of its tokens' expert outputs. In float32, as the one-rank
   path sums a token's experts (a bf16 sum would round each rank's share).

Why all-gather + reduce-scatter rather than all-to-all: under jit an all-to-all moves
fixed-size buffers, so each rank would send every other rank a buffer of the most rows it
could route there (all of its ``T k`` pairs, k = experts per token), or a capacity that drops
tokens (then the tokens differ from the model's). The gather is exact and static-shaped, and
moves no more: each rank receives ``(M - 1) T`` hidden rows, where an exact all-to-all
would move up to ``min(k, M)`` copies of each token (V3 on 8 ranks: k = 8 = M). Ranks with
no work still take part, on their padding rows (every rank calls both collectives once per
MoE layer of every step).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def dispatch_and_combine(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    local_experts: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    *,
    axis_name: str,
    num_local_experts: int,
) -> jax.Array:
    """The routed experts' output for this rank's tokens, the experts split over
    ``axis_name`` (manual in the caller's ``shard_map``; rank r holds experts
    ``[r num_local_experts, (r + 1) num_local_experts)``).

    Args:
      x: ``[T, H]`` this rank's hidden states (any float dtype).
      expert_ids: ``[T, k]`` int32 global expert ids; weights: ``[T, k]`` float32 (``route``).
      local_experts: ``(x [R, H], local ids [R, k] int32 in [0, num_local_experts], weights
        [R, k] float32) -> [R, H]`` float32, the weighted sum over each row's pairs of this
        rank's experts (``moe.routed_experts`` on its experts); id ``num_local_experts``
        marks a pair of another rank's expert (its weight is 0).
      axis_name: the mesh axis the experts are split over.
      num_local_experts: the experts this rank holds.

    Returns:
      ``[T, H]`` float32.
    """
    first = jax.lax.axis_index(axis_name) * num_local_experts

    def gather(a: jax.Array) -> jax.Array:
        return jax.lax.all_gather(a, axis_name, axis=0, tiled=True)

    all_x, all_ids, all_weights = gather(x), gather(expert_ids), gather(weights)
    local_ids = all_ids - first
    here = (local_ids >= 0) & (local_ids < num_local_experts)
    partial = local_experts(
        all_x,
        jnp.where(here, local_ids, num_local_experts),
        jnp.where(here, all_weights, 0.0),
    )
    return jax.lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
