"""mla_jax claims no top-level import name but its own: another package named ``kernels``
(Hugging Face's kernel hub client is one) changes nothing. CI's second leg also installs that
package itself and runs the whole suite beside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

IMPORTS = """
import kernels
assert kernels.OWNER == "someone else", kernels.__file__
import mla_jax
from mla_jax import kernels as ours
from mla_jax.kernels import decode, grouped_matmul, merge, prefill
assert ours.select("reference").mla_decode is not None
assert not hasattr(kernels, "select")
print("ok")
"""


def test_a_foreign_top_level_kernels_package_changes_nothing(tmp_path):
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text('OWNER = "someone else"\n')
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    # The generate script (run from the checkout as the README says) imports the same way.
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_project_installs_one_top_level_package():
    """pyproject lists mla_jax and its subpackages only (the kernels as mla_jax.kernels)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert {name.split(".")[0] for name in setuptools["packages"]} == {"mla_jax"}
    assert setuptools["package-dir"] == {"mla_jax.kernels": "kernels"}
