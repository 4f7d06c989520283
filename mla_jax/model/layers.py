"""Building blocks shared by the attention module and the decoder."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import kernels
from mla_jax.kernels.fp8_blocks import FP8, Fp8Blocks

# How tensor parallelism splits a projection's kernel ``[n_in, n_out]`` (``Linear.tensor_split``;
# ``mla_jax.parallel.sharding``'s rules place the parameters so): by output columns (each rank
# computes its columns of the output) or by input rows (each rank a partial product, summed
# across ranks); ``None``: every rank holds it whole.
COLUMNS = "columns"
ROWS = "rows"


def check_tensor_split(tensor_split) -> None:
    """ValueError (one line) unless ``tensor_split`` is None, ``COLUMNS`` or ``ROWS``."""
    if tensor_split not in (None, COLUMNS, ROWS):
        raise ValueError(f"tensor_split {tensor_split!r} (None, {COLUMNS!r} or {ROWS!r})")


class RMSNorm(nnx.Module):
    """``weight * (x / rms(x))``, normalised in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * y.astype(x.dtype)).astype(x.dtype)


# Skinny projections split along K (decode steps on a GPU). cuBLAS runs a matmul of few rows
# and few output columns on few of the GPU's multiprocessors: at 16 rows DeepSeek-V3's
# kv_a_proj_with_mqa [7168, 576] took 11.7 us (17% of the copy bandwidth) and q_a_proj
# [7168, 1536] 12.2 us; as 16 slices of K, batched, and the float32 parts summed, 4.9 and
# 8.8 us (H200, 2026-11-27, ``bench_fp8_matmul.py --sweep split_k``,
# ``benchmarks/tuning/split_k_sweep.json``); the two fused into V3's fused_qkv_a_proj [7168,
# 2112], 12.4 us as one matmul and 11.0 as 16 slices (a trial, H200, 2026-12-05; the sweep
# holds the fused shape for its next run). Wider outputs fill the GPU already and lose to
# the extra pass (V3's q_b_proj [1536, 24576]: 19.6 -> 22.5 us at 2 slices).
SPLIT_K_MAX_OUT = (16, 2112), (64, 1536)  # (rows up to, widest output that splits there)
SPLIT_K_MIN_SLICE = 256  # K of a slice: no thinner
SPLIT_K_MAX_SLICES = 16


def k_splits(rows: int, n_in: int, n_out: int) -> int:
    """How many slices of K a GPU runs a 2-byte projection ``[rows, n_in] @ [n_in, n_out]``
    as (1: one matmul): the most, a power of two up to ``SPLIT_K_MAX_SLICES``, that leave
    slices of at least ``SPLIT_K_MIN_SLICE`` rows of the weight (a multiple of 64), for up
    to 64 rows and outputs no wider than ``SPLIT_K_MAX_OUT`` allows at that many rows."""
    widest = next((out for most, out in SPLIT_K_MAX_OUT if rows <= most), 0)
    if n_out > widest:
        return 1
    splits = SPLIT_K_MAX_SLICES
    while splits > 1:
        width = n_in // splits
        if n_in % splits == 0 and width >= SPLIT_K_MIN_SLICE and width % 64 == 0:
            return splits
        splits //= 2
    return 1


def split_k_dot(x: jax.Array, kernel: jax.Array, splits: int, precision=None) -> jax.Array:
    """``x [M, K] @ kernel [K, N]`` as ``splits`` products of K slices (one batched matmul),
    their float32 parts summed, cast to x's dtype; ``K % splits == 0``."""
    m, k = x.shape
    parts = jnp.einsum(
        "msk,skn->smn",
        x.reshape(m, splits, k // splits),
        kernel.reshape(splits, k // splits, kernel.shape[-1]),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return parts.sum(axis=0).astype(x.dtype)


def _splits_k_here() -> bool:
    """Whether projections split along K (``k_splits``): on GPUs, where the rule was measured."""
    return jax.default_backend() == "gpu"


def matmul_precision(dtype) -> jax.lax.Precision | None:
    """True float32 products for float32 operands (GPUs would otherwise round them to TF32,
    and float32 runs are what is compared with transformers); the default for the rest."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class Linear(nnx.Module):
    """Bias-free projection ``[..., n_in] -> [..., n_out]`` computing in ``param_dtype``:
    ``kernel [n_in, n_out]`` in ``param_dtype`` (initialised as ``nnx.Linear``'s), or, with
    ``fp8_blocks = (bo, bi)`` (a checkpoint's ``weight_block_size``), HF's ``weight [n_out,
    n_in]`` float8_e4m3fn and ``weight_scale_inv [cdiv(n_out, bo), cdiv(n_in, bi)]`` float32
    as the checkpoint holds them (Hopper's FP8 tensor cores read the weight K-major),
    multiplied by the kernel set's ``fp8_matmul``. ``tensor_split`` (``COLUMNS``, ``ROWS`` or
    None) says how tensor parallelism splits the weight, for the FP8 matmul, which the
    partitioner cannot split itself (``sharding.sharded_kernels``)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        param_dtype,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
        tensor_split: str | None = None,
    ):
        check_tensor_split(tensor_split)
        self.dtype = param_dtype
        self.tensor_split = tensor_split
        self.blocks = None if fp8_blocks is None else Fp8Blocks(*fp8_blocks)
        init = nnx.initializers.lecun_normal()
        if self.blocks is None:
            self.kernel = nnx.Param(init(rngs.params(), (n_in, n_out), param_dtype))
            return
        self.weight = nnx.Param(init(rngs.params(), (n_in, n_out)).T.astype(FP8))
        self.weight_scale_inv = nnx.Param(
            jnp.ones(self.blocks.scale_shape_nk(n_out, n_in), jnp.float32)
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        impl: str | kernels.KernelSet = "auto",
        layer_in_run: int | jax.Array | None = None,
    ) -> jax.Array:
        """``x [..., n_in]`` -> ``[..., n_out]`` in ``param_dtype``; ``impl``
        (``kernels.select``) picks the FP8 matmul. On a GPU a bf16 projection of few rows
        and a narrow output runs split along K (``k_splits``). ``layer_in_run``: where the FP8
        ``weight`` holds a stack of layers' weights ``[L, n_out, n_in]`` (the model's scan
        keeps them whole, ``DeepseekModel``), which of them to use; the FP8 matmul reads
        it in place. A weight of one layer is that layer's already."""
        x = x.astype(self.dtype)
        if self.blocks is None:
            kernel = self.kernel[...]
            precision = matmul_precision(self.dtype)
            rows = math.prod(x.shape[:-1])
            two_bytes = jnp.dtype(self.dtype).itemsize == 2
            splits = k_splits(rows, *kernel.shape) if two_bytes and _splits_k_here() else 1
            if splits > 1:
                y = split_k_dot(x.reshape(rows, -1), kernel, splits, precision)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            dims = (((x.ndim - 1,), (0,)), ((), ()))
            return jax.lax.dot_general(x, kernel, dims, precision=precision)
        rows = x.reshape(-1, x.shape[-1])
        weight = self.weight[...]
        y = kernels.select(impl).fp8_matmul(
            rows,
            weight,
            self.weight_scale_inv[...],
            blocks=self.blocks,
            layer=layer_in_run if weight.ndim == 3 else None,
            tensor_split=self.tensor_split,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(
    n_in: int,
    n_out: int,
    param_dtype,
    rngs: nnx.Rngs,
    fp8_blocks: tuple[int, int] | None = None,
    tensor_split: str | None = None,
) -> Linear:
    """Bias-free ``[n_in, n_out]`` projection computing in ``param_dtype`` (``Linear``)."""
    return Linear(n_in, n_out, param_dtype, rngs, fp8_blocks, tensor_split)


class MLP(nnx.Module):
    """SwiGLU, ``down(silu(gate(x)) * up(x))``, as HF's DeepseekV2MLP / DeepseekV3MLP (the
    dense layers' MLP and an MoE layer's shared experts), parameters under HF names; with
    ``fp8_blocks``, FP8 projections (``Linear``)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        param_dtype,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        self.gate_proj = linear(hidden, intermediate, param_dtype, rngs, fp8_blocks, COLUMNS)
        self.up_proj = linear(hidden, intermediate, param_dtype, rngs, fp8_blocks, COLUMNS)
        self.down_proj = linear(intermediate, hidden, param_dtype, rngs, fp8_blocks, ROWS)

    def __call__(
        self,
        x: jax.Array,
        *,
        impl: str | kernels.KernelSet = "auto",
        layer_in_run: int | jax.Array | None = None,
    ) -> jax.Array:
        """``x [T, H]`` -> ``[T, H]``; ``layer_in_run``: see ``Linear.__call__``."""
        gate = self.gate_proj(x, impl=impl, layer_in_run=layer_in_run)
        hidden = jax.nn.silu(gate) * self.up_proj(x, impl=impl, layer_in_run=layer_in_run)
        return self.down_proj(hidden, impl=impl, layer_in_run=layer_in_run)
