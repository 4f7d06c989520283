"""``merge_attn_states`` (Pallas, Triton lowering): LSE-merge of two attention results over
disjoint key sets, one pass over memory, computed in float32.

The ``[T, N, D]`` outputs are viewed as ``T * N`` rows; each program merges ``block_rows`` of
them. A ``-inf`` side contributes nothing; two ``-inf`` sides give out 0 and lse ``-inf``.
A width that is not a power of two (a Triton tile) is zero-padded to one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import online_softmax


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """Launch parameters of the merge kernel (``dataclasses.replace`` makes variants)."""

    block_rows: int = 64  # (token, head) rows per program
    num_warps: int = 4


def _merge_kernel(
    prefix_out_ref,
    prefix_lse_ref,
    suffix_out_ref,
    suffix_lse_ref,
    out_ref,
    lse_ref,
    *,
    block_rows: int,
):
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    row_ids = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    live = row_ids < prefix_out_ref.shape[0]
    load_out = functools.partial(plgpu.load, mask=live[:, None], other=0)
    load_lse = functools.partial(plgpu.load, mask=live, other=-jnp.inf)
    out, lse = online_softmax.merge(
        load_out(prefix_out_ref.at[rows, :]),
        load_lse(prefix_lse_ref.at[rows]),
        load_out(suffix_out_ref.at[rows, :]),
        load_lse(suffix_lse_ref.at[rows]),
    )
    plgpu.store(out_ref.at[rows, :], out.astype(out_ref.dtype), mask=live[:, None])
    plgpu.store(lse_ref.at[rows], lse, mask=live)


def merge_attn_states(
    prefix_out: jax.Array,
    prefix_lse: jax.Array,
    suffix_out: jax.Array,
    suffix_lse: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
    config: MergeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``out [T, N, D]`` and ``lse [T, N]`` float32 (natural log) on each side -> the merged
    ``(out, lse)``; out in ``out_dtype`` (default: prefix_out's dtype; the sides' dtypes may
    differ: a float32 prefix accumulates bf16 suffixes without rounding, and the last merge
    of such a loop can write the model's dtype). ``config``: launch parameters (default:
    ``MergeConfig()``)."""
    t, n, d = prefix_out.shape
    if (
        suffix_out.shape != prefix_out.shape
        or prefix_lse.shape != (t, n)
        or suffix_lse.shape != (t, n)
    ):
        raise ValueError(
            f"merge_attn_states: outs {prefix_out.shape}, {suffix_out.shape} must match and "
            f"lses {prefix_lse.shape}, {suffix_lse.shape} must be [{t}, {n}]"
        )
    if prefix_lse.dtype != jnp.float32 or suffix_lse.dtype != jnp.float32:
        raise ValueError("merge_attn_states: lse must be float32")
    if interpret is None:
        interpret = online_softmax.interpret_default()
    return _merge(
        prefix_out,
        prefix_lse,
        suffix_out,
        suffix_lse,
        out_dtype=jnp.dtype(out_dtype or prefix_out.dtype),
        config=config or MergeConfig(),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _merge(prefix_out, prefix_lse, suffix_out, suffix_lse, *, out_dtype, config, interpret):
    t, n, d = prefix_out.shape
    block_rows = config.block_rows
    rows, width = t * n, online_softmax.tile_width(d, minimum=1)
    prefix_out = online_softmax.pad_to(prefix_out, (t, n, width))
    suffix_out = online_softmax.pad_to(suffix_out, (t, n, width))
    out, lse = pl.pallas_call(
        functools.partial(_merge_kernel, block_rows=block_rows),
        grid=(pl.cdiv(rows, block_rows),),
        out_shape=(
            jax.ShapeDtypeStruct((rows, width), out_dtype),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="merge_attn_states",
    )(
        prefix_out.reshape(rows, width),
        prefix_lse.reshape(rows),
        suffix_out.reshape(rows, width),
        suffix_lse.reshape(rows),
    )
    return out.reshape(t, n, width)[..., :d], lse.reshape(t, n)
