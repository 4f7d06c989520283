"""Kernel selection (``kernels.select``) and the host plan each backend gets
(``kernels.KernelPlan``): which set a name gives here, the one-line refusals, and that the
plan schedules for the decode kernel the set will run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mla_jax import kernels
from mla_jax.kernels.decode import pallas_mosaic_gpu, pallas_triton

CPU = jax.default_backend() != "gpu"


def test_names():
    assert kernels.select("reference") is kernels.REFERENCE
    assert kernels.select("triton") is kernels.TRITON
    assert kernels.select(kernels.TRITON) is kernels.TRITON
    with pytest.raises(ValueError, match="unknown kernel implementation 'cuda'"):
        kernels.select("cuda")


@pytest.mark.skipif(not CPU, reason="the CPU's choices")
def test_cpu_choices():
    """Off a GPU, auto runs the references and pallas the portable (interpreted) set."""
    assert kernels.select("auto") is kernels.REFERENCE
    assert kernels.select("pallas") is kernels.TRITON
    assert kernels.KernelPlan.for_impl("auto", 16) is None
    assert kernels.KernelPlan.for_impl("pallas", 16).backend == "triton"


def test_mosaic_gpu_forced():
    """Forced where it cannot run, Mosaic GPU is a one-line error naming why; where it can
    (sm90 compiled, or interpreted on jax >= 0.11) it is the Hopper set."""
    reason = kernels.mosaic_gpu.device_unsupported()
    if reason is None:
        assert kernels.select("mosaic_gpu") is kernels.MOSAIC_GPU
        assert kernels.KernelPlan.for_impl("mosaic_gpu", 128).backend == "mosaic_gpu"
    else:
        with pytest.raises(ValueError, match="impl='mosaic_gpu': the Mosaic GPU kernels do not"):
            kernels.select("mosaic_gpu")


def test_plan_follows_the_decode_kernel():
    """The Mosaic GPU plan: one program a multiprocessor per 64 heads, in pages; below 64
    heads the Hopper set runs the Triton decode, and its plan is Triton's."""
    lens = np.array([4096, 100, 0, 64 * 33], np.int64)
    mosaic = kernels.KernelPlan(128, num_sms=132, backend="mosaic_gpu")
    assert mosaic.mosaic_decode
    assert mosaic.decode_programs(4) == pallas_mosaic_gpu.num_programs(128, 132) == 66
    want = pallas_triton.schedule_splits(
        lens,
        num_programs=66,
        block_k=pallas_mosaic_gpu.PAGE,
        num_items=pallas_triton.max_items(4, 66),
    )
    for a, b in zip(mosaic.decode_schedule(lens), want, strict=True):
        np.testing.assert_array_equal(a, b)
    for heads in (16, 32):
        small = kernels.KernelPlan(heads, num_sms=132, backend="mosaic_gpu")
        triton = kernels.KernelPlan(heads, num_sms=132)
        assert not small.mosaic_decode
        assert small.decode_programs(4) == triton.decode_programs(4)
        got, want = small.decode_schedule(lens), triton.decode_schedule(lens)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="KernelPlan backend 'reference'"):
        kernels.KernelPlan(16, backend="reference")


@pytest.mark.parametrize("heads, mosaic", [(16, False), (64, True), (128, True)])
def test_hopper_decode_dispatch(monkeypatch, heads, mosaic):
    """The Hopper set's decode calls the Mosaic GPU kernel from 64 heads, Triton's below."""
    calls = []
    monkeypatch.setattr(pallas_mosaic_gpu, "mla_decode", lambda *a, **k: calls.append("mosaic"))
    monkeypatch.setattr(kernels.decode, "mla_decode", lambda *a, **k: calls.append("triton"))
    q_lat = np.zeros((2, heads, 128), np.float32)
    kernels.MOSAIC_GPU.mla_decode(q_lat, None, None, None, None, scale=1.0)
    assert calls == ["mosaic" if mosaic else "triton"]
    assert pallas_triton.mla_decode is not None
