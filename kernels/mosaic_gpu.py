"""What the Mosaic GPU kernels (Hopper, ``jax.experimental.pallas.mosaic_gpu``) share:
whether this device and jax run them, and the fallbacks to Triton logged once."""

from __future__ import annotations

import logging

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

_logged: set[str] = set()


def log_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time ``message`` is seen in this process: a
    kernel chosen or passed over automatically is said once, not at every trace."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def device_unsupported() -> str | None:
    """Why the Mosaic GPU kernels cannot run on this device and jax (None: they can,
    compiled on an sm90 GPU or in Mosaic GPU's interpret mode elsewhere)."""
    if jax.default_backend() != "gpu":
        if not hasattr(plgpu, "InterpretGPUParams"):
            return f"on jax {jax.__version__} interpreted (Mosaic GPU's interpret mode needs 0.11)"
        return None
    cc = getattr(jax.devices()[0], "compute_capability", "")
    if cc and not str(cc).startswith("9"):
        return f"on compute capability {cc} (they run on sm90)"
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11):
        # Compiled and run on 0.11.2. The Mosaic GPU lowering of 0.12 refuses the decode
        # output's register-to-global stores (a warp's bf16 row is half a 32-byte sector);
        # interpret mode runs on 0.11 and 0.12.
        return f"on jax {jax.__version__} compiled (they run on 0.11)"
    return None


def kernel_options(config, interpret: bool) -> dict:
    """``plgpu.kernel``'s compile and interpret options from a Mosaic GPU kernel's frozen
    config (its ``approx_math`` and ``auto_barriers``)."""
    return dict(
        compiler_params=plgpu.CompilerParams(
            approx_math=config.approx_math,
            unsafe_no_auto_barriers=not config.auto_barriers,
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
