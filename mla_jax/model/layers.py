"""Building blocks shared by the attention module and the decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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


def linear(n_in: int, n_out: int, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """Bias-free ``[n_in, n_out]`` projection computing in ``param_dtype``."""
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=param_dtype,
        param_dtype=param_dtype,
        precision=matmul_precision(param_dtype),
        rngs=rngs,
    )


class MLP(nnx.Module):
    """SwiGLU, ``down(silu(gate(x)) * up(x))``, as HF's DeepseekV2MLP / DeepseekV3MLP (the
    dense layers' MLP and an MoE layer's shared experts), parameters under HF names."""

    def __init__(self, hidden: int, intermediate: int, *, param_dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(hidden, intermediate, param_dtype, rngs)
        self.up_proj = linear(hidden, intermediate, param_dtype, rngs)
        self.down_proj = linear(intermediate, hidden, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
