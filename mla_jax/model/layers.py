"""Building blocks shared by the attention module and the decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import kernels
from mla_jax.kernels.fp8_blocks import FP8, Fp8Blocks


class RMSNorm(nnx.Module):
    """``weight * (x / rms(x))``, normalised in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * y.astype(x.dtype)).astype(x.dtype)


def matmul_precision(dtype) -> jax.lax.Precision | None:
    """True float32 products for float32 operands (GPUs would otherwise round them to TF32,
    and float32 runs are what is compared with transformers); the default for the rest."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class Linear(nnx.Module):
    """Bias-free projection ``[..., n_in] -> [..., n_out]`` computing in ``param_dtype``:
    ``kernel [n_in, n_out]`` in ``param_dtype`` (initialised as ``nnx.Linear``'s), or, with
    ``fp8_blocks = (bo, bi)`` (a checkpoint's ``weight_block_size``), ``kernel`` in
    float8_e4m3fn and ``kernel_scale_inv [cdiv(n_in, bi), cdiv(n_out, bo)]`` float32, HF's
    ``weight`` and ``weight_scale_inv`` transposed, multiplied by the kernel set's
    ``fp8_matmul`` (dequantized tile by tile on a GPU)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        param_dtype,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        self.dtype = param_dtype
        self.blocks = None if fp8_blocks is None else Fp8Blocks(*fp8_blocks)
        init = nnx.initializers.lecun_normal()
        if self.blocks is None:
            self.kernel = nnx.Param(init(rngs.params(), (n_in, n_out), param_dtype))
            return
        self.kernel = nnx.Param(init(rngs.params(), (n_in, n_out)).astype(FP8))
        self.kernel_scale_inv = nnx.Param(
            jnp.ones(self.blocks.scale_shape(n_in, n_out), jnp.float32)
        )

    def __call__(self, x: jax.Array, *, impl: str | kernels.KernelSet = "auto") -> jax.Array:
        """``x [..., n_in]`` -> ``[..., n_out]`` in ``param_dtype``; ``impl``
        (``kernels.select``) picks the FP8 matmul."""
        x = x.astype(self.dtype)
        if self.blocks is None:
            dims = (((x.ndim - 1,), (0,)), ((), ()))
            kernel = self.kernel[...]
            return jax.lax.dot_general(x, kernel, dims, precision=matmul_precision(self.dtype))
        rows = x.reshape(-1, x.shape[-1])
        y = kernels.select(impl).fp8_matmul(
            rows, self.kernel[...], self.kernel_scale_inv[...], blocks=self.blocks
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(
    n_in: int,
    n_out: int,
    param_dtype,
    rngs: nnx.Rngs,
    fp8_blocks: tuple[int, int] | None = None,
) -> Linear:
    """Bias-free ``[n_in, n_out]`` projection computing in ``param_dtype`` (``Linear``)."""
    return Linear(n_in, n_out, param_dtype, rngs, fp8_blocks)


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
        self.gate_proj = linear(hidden, intermediate, param_dtype, rngs, fp8_blocks)
        self.up_proj = linear(hidden, intermediate, param_dtype, rngs, fp8_blocks)
        self.down_proj = linear(intermediate, hidden, param_dtype, rngs, fp8_blocks)

    def __call__(self, x: jax.Array, *, impl: str | kernels.KernelSet = "auto") -> jax.Array:
        hidden = jax.nn.silu(self.gate_proj(x, impl=impl)) * self.up_proj(x, impl=impl)
        return self.down_proj(hidden, impl=impl)
