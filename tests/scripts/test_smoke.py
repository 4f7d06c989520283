"""Every script in scripts/ runs end to end in its smoke mode (``--smoke``: tiny shapes on the
CPU, the Pallas kernels interpreted, seconds), so that a change that breaks a benchmark fails
here. Scripts are found by glob: a new one without a smoke mode fails too."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPTS = sorted(
    str(path)
    for path in Path(ROOT, "scripts").glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()  # not a library (benchlib.py)
)
# Where a script's smoke run writes (``{out}``: a fresh folder): the benchmarks take --out.
OUTPUT_FLAGS = {"generate.py": ["--output", "{out}/result.json"]}
PUBLISHED = Path(ROOT, "benchmarks")


def _published() -> dict[Path, str]:
    """Digest of each published result and of the page rendered from them."""
    paths = [*PUBLISHED.glob("*.json"), Path(ROOT, "BENCHMARKS.md")]
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


def test_scripts_are_found():
    names = {os.path.basename(path) for path in SCRIPTS}
    assert {"generate.py", "bench_decode.py", "bench_serve.py"} <= names
    assert "benchlib.py" not in names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_smoke_run(script, tmp_path):
    name = os.path.basename(script)
    out = tmp_path / "out"
    flags = [flag.format(out=out) for flag in OUTPUT_FLAGS.get(name, ["--out", "{out}"])]
    out.mkdir()
    before = _published()
    # Run from an empty folder, with the tiny checkpoint and compiled programs kept in it.
    env = dict(os.environ, MLA_JAX_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, script, "--smoke", *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{name} --smoke failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file() and "cache" not in p.parts)
    assert written and all(p.is_relative_to(out) or p == out for p in written), written
    for path in written:
        result = json.loads(path.read_text())
        if (PUBLISHED / path.name).is_file():
            # A table the full run publishes: the same table, marked as a smoke run's.
            assert result["smoke"] is True, path.name
            assert result["rows"], path.name
            for row in result["rows"]:
                assert len(row["cells"]) == len(result["columns"]), (path.name, row["cells"])
    assert _published() == before, f"{name} --smoke changed benchmarks/ or BENCHMARKS.md"
