"""mla_jax claims no top-level import name but its own: another package named ``kernels``
(Hugging Face's kernel hub client is one) changes nothing. CI's second leg also installs that
package itself and runs the whole suite beside it."""

from __future__ import annotations

import ast
import os
import pathlib
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


def _foreign_kernels(tmp_path) -> dict:
    """An environment whose path holds a foreign top-level ``kernels`` package."""
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text('OWNER = "someone else"\n')
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )


@pytest.mark.parametrize("where", ["elsewhere", "checkout"])
def test_a_foreign_top_level_kernels_package_changes_nothing(tmp_path, where):
    """Run elsewhere or from the checkout's root (the current directory first on the path,
    as with ``python -m pytest`` or a script started there, which is how transformers found
    this checkout's kernels in place of Hugging Face's when they lived in a top-level
    folder)."""
    env = _foreign_kernels(tmp_path)
    cwd = ROOT if where == "checkout" else tmp_path
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True, cwd=cwd
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    # The generate script (run from the checkout as the README says) imports the same way.
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_project_installs_one_top_level_package():
    """pyproject lists mla_jax and its subpackages only, each in its own folder, and the
    checkout's root holds no other package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert {name.split(".")[0] for name in setuptools["packages"]} == {"mla_jax"}
    assert "package-dir" not in setuptools
    root = pathlib.Path(ROOT)
    for name in setuptools["packages"]:
        assert (root.joinpath(*name.split(".")) / "__init__.py").exists(), name
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == {"mla_jax"}, packages


def test_the_kernels_import_nothing_else_of_the_library():
    """Every module under mla_jax/kernels/ imports only mla_jax/kernels/ itself (relatively,
    never past its top), jax, numpy and the standard library: no ``mla_jax`` outside
    ``mla_jax.kernels``."""
    kernels_dir = pathlib.Path(ROOT) / "mla_jax" / "kernels"
    modules = sorted(kernels_dir.rglob("*.py"))
    assert len(modules) > 10
    for path in modules:
        depth = len(path.relative_to(kernels_dir).parts)  # decode/x.py: 2
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level <= depth, f"{path}: relative import above mla_jax/kernels/"
                names = [] if node.level else [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in {"jax", "numpy"} or top in sys.stdlib_module_names, f"{path}: {name}"
