"""scripts/benchlib.py: the page it renders and the command line every benchmark shares."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import benchlib  # noqa: E402


def test_page_is_rendered_from_the_results(tmp_path, monkeypatch):
    """BENCHMARKS.md is never edited by hand: it is what the results in benchmarks/ render."""
    monkeypatch.setattr(benchlib, "PAGE", str(tmp_path / "BENCHMARKS.md"))
    benchlib.render()
    rendered = (tmp_path / "BENCHMARKS.md").read_text().splitlines()
    assert rendered == Path(ROOT, "BENCHMARKS.md").read_text().splitlines()


@pytest.mark.parametrize("sweeps", [(), ("all", "fp8")])
def test_smoke_needs_an_output_folder(capsys, sweeps):
    with pytest.raises(SystemExit) as exit_info:
        benchlib.parse_args(benchlib.parser("a benchmark", sweeps=sweeps), ["--smoke"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("error: --smoke needs --out DIR (a smoke run never writes benchmarks/)")
    )


def test_sweep_names_are_checked(capsys):
    ap = benchlib.parser("a benchmark", sweeps=("all", "fp8"))
    assert benchlib.parse_args(ap, ["--sweep"]).sweep == "all"
    assert benchlib.parse_args(ap, ["--sweep", "fp8"]).sweep == "fp8"
    with pytest.raises(SystemExit):
        benchlib.parse_args(ap, ["--sweep", "fp16"])
    assert "argument --sweep: invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchlib.parse_args(benchlib.parser("no sweeps"), ["--sweep"])
    assert "unrecognized arguments: --sweep" in capsys.readouterr().err


def test_kernel_medians_sum_a_kernels_instances_in_each_call():
    """A kernel that runs at two sizes in a call (the chunked context's attention: the new
    tokens' 366 us and four chunks of 1936 us) counts its instances' sum per call, the median
    over the calls; not its median instance times its count (9680 us here)."""
    calls = [
        [{"name": "attention", "dur": 366.0}]
        + [{"name": "attention", "dur": 1936.0 + c}] * 4
        + [{"name": "merge", "dur": 92.0}]
        for c in (0.0, 1.0, 2.0)
    ]
    medians = benchlib.kernel_medians(calls)
    assert medians == {"attention": 366.0 + 4 * 1937.0, "merge": 92.0}
    # A kernel missing from some calls counts 0 in those.
    assert benchlib.kernel_medians([[{"name": "a", "dur": 5.0}], [], []]) == {"a": 0.0}


def test_call_spans_hold_the_gaps_between_a_calls_kernels():
    """A call's span runs from its first kernel's start to its last one's end, gaps
    included (the summed durations leave them out); the JSON keeps every call's and their
    median."""
    calls = [
        [{"name": "a", "ts": 100.0, "dur": 10.0}, {"name": "b", "ts": 150.0, "dur": 20.0}],
        [{"name": "b", "ts": 500.0, "dur": 20.0}, {"name": "a", "ts": 470.0, "dur": 10.0}],
    ]
    assert benchlib.call_spans(calls) == [70.0, 50.0]
    record = benchlib.Timing.of([30.0, 30.0], "cupti", warmup=1, rotation=1, spans=[70.0, 50.0])
    record = record.record()
    assert record["span_median_us"] == 60.0 and record["spans_us"] == [70.0, 50.0]
    assert "spans_us" not in benchlib.Timing.of([1.0], "wall", warmup=0, rotation=1).record()
