"""Pieces shared by the kernels: the online softmax, the LSE merge, dots, padded tiles and
backend selection for the Pallas kernels; the dense softmax with LSE for the references.

Inside a kernel, scores live in the log2 domain (already multiplied by
``scale * log2(e)``) so that ``exp2`` replaces ``exp``; ``finalize`` hands back the natural
log LSE of the contract. A row that has seen no key keeps ``m = -inf`` and ``l = 0``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Lazy rescaling (FlashAttention-4's; the Mosaic GPU kernels' ``lazy_rescale``): a row keeps
# the maximum its probabilities are taken against until a score exceeds it by this much
# (log2 units), so that probabilities reach 2^8 at most (exact in bf16's relative
# precision; float32 sums), and a step in which no row's maximum moved leaves the
# accumulator as it is instead of multiplying it by 1 (``mosaic_gpu.rescale_rows``).
RESCALE_SLACK = 8.0


def lazy_maximum(m_prev: jax.Array, row_max: jax.Array) -> jax.Array:
    """The rows' new maxima under lazy rescaling: ``row_max`` where it exceeds ``m_prev`` by
    more than ``RESCALE_SLACK``, else ``m_prev`` (-inf stays -inf; a row with no key yet
    moves at its first key)."""
    return jnp.where(row_max > m_prev + RESCALE_SLACK, row_max, m_prev)


def finite(m: jax.Array) -> jax.Array:
    """A row maximum to subtract: 0 where no key was seen yet (``m = -inf``), so that
    ``2^(-inf - m)`` is 0 and never NaN (``-inf - -inf``)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def rescale_factor(m_prev: jax.Array, m_new: jax.Array) -> jax.Array:
    """``2^(m_prev - m_new)``, the factor of what was summed under the maximum ``m_prev``
    (log2 domain): exactly 1 where the maximum did not move, which lazy rescaling's skip
    tests for (exp2 through the special-function unit does not promise ``2^0 == 1``), -inf
    staying -inf included (nothing summed yet: 0 times anything); 0 where the first keys
    arrive (``m_prev = -inf``)."""
    return jnp.where(m_new == m_prev, 1.0, jnp.exp2(m_prev - finite(m_new)))


def interpret_default() -> bool:
    """Pallas runs compiled (Triton) on GPUs and in interpret mode anywhere else."""
    return jax.default_backend() != "gpu"


def tile_width(d: int, minimum: int = 16) -> int:
    """The power-of-two tile that holds ``d`` columns (Triton tiles are powers of two, and a
    dot operand is at least 16 wide)."""
    return 1 << (max(d, minimum) - 1).bit_length()


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` zero-padded at the end of each axis to ``shape`` (itself when it fits)."""
    if x.shape == shape:
        return x
    return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape, strict=True)])


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D ``a @ b`` (or ``a @ b.T``) accumulated in float32; exact for float32 operands
    (Triton would otherwise round them to tf32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def softmax_with_lse(s: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The references' dense softmax: probabilities of scaled scores ``s [..., k]`` (natural
    log domain, float32) over the keys where ``mask`` (broadcast against ``s``), and the
    natural-log ``lse [...]``; rows with no key get all-zero probabilities and ``lse = -inf``."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return p, (m + jnp.log(denom))[..., 0]


class SoftmaxState(NamedTuple):
    acc: jax.Array  # [rows, width] float32: sum_j 2^(s_j - m) v_j
    m: jax.Array  # [rows] float32: running max of the log2 scores
    l: jax.Array  # [rows] float32: sum_j 2^(s_j - m)


def init(rows: int, width: int | tuple[int, ...]) -> SoftmaxState:
    """An empty state; a tuple of widths gives one accumulator per column group (``acc`` a
    tuple, see ``update``)."""
    acc = (
        tuple(jnp.zeros((rows, w), jnp.float32) for w in width)
        if isinstance(width, tuple)
        else jnp.zeros((rows, width), jnp.float32)
    )
    return SoftmaxState(
        acc, jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    )


def update(
    state: SoftmaxState,
    s: jax.Array,
    v: jax.Array | tuple[jax.Array, ...],
    v_scales: tuple[jax.Array | None, ...] | None = None,
) -> SoftmaxState:
    """Folds in a block of log2-domain scores ``s [rows, cols]`` (masked keys at -inf) and
    their values ``v [cols, width]``, or a tuple of column groups of them (``state.acc`` a
    tuple of the same widths). ``v_scales``: per group ``[cols]`` float32 factors of the
    values (an FP8 cache's dequantization scales, or None), applied to the probabilities:
    ``p @ (scale * v) = (p * scale) @ v`` multiplies ``rows`` values per key, not ``width``."""
    m_new = jnp.maximum(state.m, jnp.max(s, axis=1))
    m_safe = finite(m_new)
    alpha = jnp.exp2(state.m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_new = state.l * alpha + jnp.sum(p, axis=1)
    if not isinstance(v, tuple):
        return SoftmaxState(state.acc * alpha[:, None] + dot(p.astype(v.dtype), v), m_new, l_new)
    v_scales = v_scales or (None,) * len(v)
    acc = tuple(
        a * alpha[:, None] + dot((p if scale is None else p * scale[None, :]).astype(vg.dtype), vg)
        for a, vg, scale in zip(state.acc, v, v_scales, strict=True)
    )
    return SoftmaxState(acc, m_new, l_new)


def finalize(state: SoftmaxState, *, log2_domain: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(out [rows, width], lse [rows])``: normalised float32 output (a tuple of groups when
    ``state.acc`` is one) and natural-log LSE; rows without keys give 0 and -inf.
    ``log2_domain``: whether ``state.m`` is a log2 score (``update``) or a natural log
    (``merge_block``)."""
    nonempty = state.l > 0
    l_safe = jnp.where(nonempty, state.l, 1.0)
    out = jax.tree.map(lambda acc: acc / l_safe[:, None], state.acc)
    log_mass = (state.m + jnp.log2(l_safe)) * LN2 if log2_domain else state.m + jnp.log(l_safe)
    return out, jnp.where(nonempty, log_mass, -jnp.inf)


def merge(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """LSE-merge of two partial results over disjoint keys, in float32 (``out [rows, width]``,
    ``lse [rows]``, natural log). A -inf side contributes nothing; two -inf sides give 0 and
    -inf, never NaN."""
    m = jnp.maximum(lse_a, lse_b)
    m = finite(m)
    w_a = jnp.exp(lse_a - m)
    w_b = jnp.exp(lse_b - m)
    denom = w_a + w_b
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = (
        out_a.astype(jnp.float32) * (w_a * inv)[:, None]
        + out_b.astype(jnp.float32) * (w_b * inv)[:, None]
    )
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse


def merge_block(state: SoftmaxState, out: jax.Array, lse: jax.Array) -> SoftmaxState:
    """Folds in a block of partial results over disjoint keys, ``out [items, rows, width]``
    (each normalised) and natural-log ``lse [items, rows]`` (-inf: empty), weighting each by
    its softmax mass. ``state.m`` is kept in the natural-log domain here."""
    m_new = jnp.maximum(state.m, jnp.max(lse, axis=0))
    m_safe = finite(m_new)
    alpha = jnp.exp(state.m - m_safe)
    w = jnp.exp(lse - m_safe[None, :])
    acc = state.acc * alpha[:, None] + jnp.sum(w[:, :, None] * out, axis=0)
    return SoftmaxState(acc, m_new, state.l * alpha + jnp.sum(w, axis=0))
