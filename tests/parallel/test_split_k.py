"""Split-K projections under tensor parallelism (``split_k_devices.py``, a fresh process on 4
fake CPU devices): the same collectives as the whole matmul, and the float64 product."""

from __future__ import annotations

import json

import pytest
from conftest import run_on_fake_devices

DEVICES = 4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("split_k") / "out.json"
    done = run_on_fake_devices("parallel/split_k_devices.py", out, devices=DEVICES)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["devices"] == DEVICES
    return result


@pytest.mark.parametrize("name", ["o_proj", "shared gate_proj"])
def test_split_adds_no_collective(compiled, name):
    r = compiled[name]
    assert r["splits"] > 1  # the rule splits these at 16 rows
    assert r["split"] == r["whole"], r
    # Rows-split weights reduce their parts across devices; column-split ones do not.
    assert r["whole"]["all-reduce"] == (1 if "'tp', None" in r["weight_spec"] else 0), r
    # Against float64: the bf16 output's rounding (one device: up to 1.7e-3, test_layers).
    assert r["split_error"] < 3e-3, r
