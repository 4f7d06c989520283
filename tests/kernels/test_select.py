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


@pytest.mark.skipif(
    not hasattr(kernels.mosaic_gpu.plgpu, "InterpretGPUParams"),
    reason="Mosaic GPU interpret mode needs jax >= 0.11",
)
def test_small_interpret_pool_is_named(monkeypatch, caplog):
    """Interpreted, a CPU pool without a thread per warpgroup (of every program of a
    cluster) and one for their caller is a warning naming the setting (once); a large
    enough one, or compiled, says nothing."""
    config = pallas_mosaic_gpu.MosaicDecodeConfig()
    monkeypatch.setattr(kernels.mosaic_gpu, "_logged", set())
    monkeypatch.setenv("PJRT_NPROC", "3")
    kernels.mosaic_gpu.kernel_options(config, False, 3)
    assert not caplog.records
    kernels.mosaic_gpu.kernel_options(config, True, 3)
    kernels.mosaic_gpu.kernel_options(config, True, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "Mosaic GPU interpret mode: XLA's CPU pool has 3 threads and the kernel's 3 "
        "warpgroups and their caller block 4, so it can deadlock: set PJRT_NPROC=4 or more "
        "before jax starts"
    ]
    caplog.clear()
    monkeypatch.setenv("PJRT_NPROC", "4")
    kernels.mosaic_gpu.kernel_options(config, True, 3)
    assert not caplog.records
    # A cluster of two programs: each program's warpgroups block a thread.
    monkeypatch.setattr(kernels.mosaic_gpu, "_logged", set())
    kernels.mosaic_gpu.kernel_options(config, True, 2, programs_per_cluster=2)
    assert [r.getMessage() for r in caplog.records] == [
        "Mosaic GPU interpret mode: XLA's CPU pool has 4 threads and the kernel's 4 "
        "warpgroups and their caller block 5, so it can deadlock: set PJRT_NPROC=5 or more "
        "before jax starts"
    ]


def _assert_schedules_equal(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def _mosaic_schedule(lens: np.ndarray, heads: int) -> pallas_triton.DecodeSchedule:
    programs = pallas_mosaic_gpu.num_programs(heads, 132)
    num_items = pallas_triton.max_items(len(lens), programs)
    return pallas_mosaic_gpu.schedule(lens, heads, 132, num_items)


def test_plan_follows_the_decode_kernel():
    """The Mosaic GPU plan: one program a multiprocessor per 64 heads, in pages; below 64
    heads (or over pages other than 64 rows) the Hopper set runs the Triton decode, and its
    plan is Triton's, except over an FP8 cache from ``FP8_MIN_BATCH`` requests, where both
    are the Mosaic GPU kernel's."""
    lens = np.array([4096, 100, 0, 64 * 33], np.int64)
    mosaic = kernels.KernelPlan(128, num_sms=132, backend="mosaic_gpu")
    assert mosaic.mosaic_decode(4)
    assert mosaic.decode_programs(4) == pallas_mosaic_gpu.num_programs(128, 132) == 66
    _assert_schedules_equal(mosaic.decode_schedule(lens), _mosaic_schedule(lens, 128))
    for heads in (16, 32):
        for quantized in (False, True):
            small = kernels.KernelPlan(
                heads, num_sms=132, backend="mosaic_gpu", quantized_cache=quantized
            )
            triton = kernels.KernelPlan(heads, num_sms=132, quantized_cache=quantized)
            assert not small.mosaic_decode(4)
            assert small.decode_programs(4) == triton.decode_programs(4)
            _assert_schedules_equal(small.decode_schedule(lens), triton.decode_schedule(lens))
    many = np.resize(lens, pallas_mosaic_gpu.FP8_MIN_BATCH)
    fp8_plan = kernels.KernelPlan(16, num_sms=132, backend="mosaic_gpu", quantized_cache=True)
    assert fp8_plan.mosaic_decode(len(many))
    assert fp8_plan.decode_programs(len(many)) == pallas_mosaic_gpu.num_programs(16, 132) == 132
    _assert_schedules_equal(fp8_plan.decode_schedule(many), _mosaic_schedule(many, 16))
    bf16_plan = kernels.KernelPlan(16, num_sms=132, backend="mosaic_gpu")
    assert not bf16_plan.mosaic_decode(len(many))
    # Pages other than 64 rows: the Hopper set's decode runs the Triton kernel, on its plan.
    pages_of_16 = kernels.KernelPlan(128, num_sms=132, backend="mosaic_gpu", page_size=16)
    assert not pages_of_16.mosaic_decode(len(many))
    _assert_schedules_equal(
        pages_of_16.decode_schedule(many), kernels.KernelPlan(128, 132).decode_schedule(many)
    )
    with pytest.raises(ValueError, match="KernelPlan backend 'reference'"):
        kernels.KernelPlan(16, backend="reference")


@pytest.mark.parametrize(
    "heads, batch, quantized, mosaic",
    [
        (16, 2, False, False),
        (16, 64, False, False),
        (16, pallas_mosaic_gpu.FP8_MIN_BATCH - 1, True, False),
        (16, pallas_mosaic_gpu.FP8_MIN_BATCH, True, True),
        (64, 2, False, True),
        (128, 2, True, True),
    ],
)
@pytest.mark.parametrize("heads_major", [False, True])
def test_hopper_decode_dispatch(monkeypatch, heads, batch, quantized, mosaic, heads_major):
    """The Hopper set's decode calls the Mosaic GPU kernel from 64 heads, and below that over
    an FP8 cache from ``FP8_MIN_BATCH`` requests; Triton's elsewhere (in either layout of the
    queries)."""
    calls = []
    monkeypatch.setattr(pallas_mosaic_gpu, "mla_decode", lambda *a, **k: calls.append("mosaic"))
    monkeypatch.setattr(kernels.decode, "mla_decode", lambda *a, **k: calls.append("triton"))
    q_lat = np.zeros((heads, batch, 128) if heads_major else (batch, heads, 128), np.float32)
    cache = kernels.fp8.Fp8Cache(None, None, None) if quantized else np.zeros((1, 64, 192))
    kernels.MOSAIC_GPU.mla_decode(
        q_lat, None, cache, None, None, scale=1.0, heads_major=heads_major
    )
    assert calls == ["mosaic" if mosaic else "triton"]
    assert pallas_triton.mla_decode is not None
