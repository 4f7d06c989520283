"""scripts/bench_multi.py's own logic: its mode list and how it reads a GPU trace. (The whole
script ran on 2 fake CPU devices with ``--model tiny``; a GPU run makes its table.)"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_multi  # noqa: E402


def _trace(kernels: dict[int, list[tuple[str, float]]]) -> dict:
    """A perfetto trace with one stream per GPU ``pid`` running ``(name, microseconds)``
    kernels, plus a host thread whose events must not count."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 99, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 99, "tid": 1, "args": {"name": "Stream #1"}},
        {"ph": "X", "pid": 99, "tid": 1, "name": "ncclHost", "dur": 1e6},
    ]
    for pid, runs in kernels.items():
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{pid}"}}
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7, "args": {"name": "Stream #7"}}
        )
        events += [{"ph": "X", "pid": pid, "tid": 7, "name": n, "dur": d} for n, d in runs]
    return {"traceEvents": events}


def test_device_and_collective_time_per_step():
    trace = _trace(
        {
            1: [("gemm", 3000.0), ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 1000.0)],
            2: [("gemm", 2000.0), ("all-gather-start", 3000.0), ("mla_decode", 1000.0)],
        }
    )
    device_ms, collective_ms = bench_multi.device_and_collective_ms(trace, steps=2)
    assert device_ms == pytest.approx(3.0)  # GPU 2: 6 ms over 2 steps
    assert collective_ms == pytest.approx((1.0 + 3.0) / 2 / 2)  # mean over GPUs, per step
    assert bench_multi.device_and_collective_ms({"traceEvents": []}, steps=2) == (None, None)


def test_modes():
    modes = bench_multi._modes("tp1,tp2, tp8,dp2,dp4,dp2xtp2,dp2+ep,dp2xtp2+ep")
    assert modes == [
        (1, 1, False),
        (1, 2, False),
        (1, 8, False),
        (2, 1, False),
        (4, 1, False),
        (2, 2, False),
        (2, 1, True),
        (2, 2, True),
    ]
    assert [m.label for m in modes] == [
        "1 GPU",
        "TP 2",
        "TP 8",
        "DP 2",
        "DP 4",
        "DP 2 x TP 2",
        "DP 2 + EP",
        "DP 2 x TP 2 + EP",
    ]
    assert [m.devices for m in modes] == [1, 2, 8, 2, 4, 4, 2, 4]
    for bad in ("dp0", "tp0", "dp2tp2", "tp2xdp2", "tp2+ep", "dp2+", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="want tpN, dpM or dpMxtpN"):
            bench_multi._modes(bad)
