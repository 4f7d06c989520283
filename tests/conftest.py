"""Shared test helpers: small configs, random weights, and a one-step harness."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

from mla_jax import kernels  # noqa: E402
from mla_jax.cache.metadata import build_metadata  # noqa: E402
from mla_jax.engine import compilation  # noqa: E402
from mla_jax.kernels import KernelPlan  # noqa: E402
from mla_jax.kernels.mosaic_gpu import widen_cpu_pool  # noqa: E402
from mla_jax.model.config import MLAConfig, RopeConfig  # noqa: E402
from mla_jax.model.rope import cos_sin_scale, inv_freq  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Compiling dominates the suite on a CPU (every engine compiles its programs, the
# interpreted kernels make large ones): unoptimized machine code without LLVM's expensive
# passes compiles them in about half the time (benchlib's smoke runs take the first flag for
# the same reason). Without fast math the code computes the same values. Not where jax has
# a CUDA plugin: the flags would reach the GPU compiler too, and its tests run the kernels as
# they ship. Set before the first computation, when XLA reads the flags; the subprocesses
# tests start inherit them, and flags already in XLA_FLAGS come after these and win.
if not any(
    importlib.util.find_spec(plugin) for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin")
):
    os.environ["XLA_FLAGS"] = " ".join(
        [
            "--xla_backend_optimization_level=0",
            "--xla_llvm_disable_expensive_passes=true",
            os.environ.get("XLA_FLAGS", ""),
        ]
    ).strip()

# Mosaic GPU's interpreter blocks a thread of XLA's CPU pool per warpgroup (the pool has as
# many as cores: it deadlocked on 2); before the first computation, like the flags above.
widen_cpu_pool()

# Many tests compile the same programs (engines of the tiny model, the interpreted kernels at
# the same shapes): the test processes of one run share JAX's persistent compilation cache in
# a folder of the run's, MLA_JAX_CACHE (unless set), so that the scripts run in-process and
# the subprocesses that keep it keep their programs and the tiny checkpoint there too, not in
# ~/.cache/mla_jax (tests that check a cache give their subprocess a folder of its own). A
# cached program is the one its HLO, flags and jax would compile.
_RUNS = os.path.join(tempfile.gettempdir(), "mla_jax_tests")
# Earlier runs' folders go after a day (a run's processes end within hours).
for _old in os.listdir(_RUNS) if os.path.isdir(_RUNS) else []:
    _path = os.path.join(_RUNS, _old)
    if time.time() - os.path.getmtime(_path) > 86400:
        shutil.rmtree(_path, ignore_errors=True)
os.environ.setdefault(
    "MLA_JAX_CACHE",
    os.path.join(_RUNS, os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())),
)
SHARED_XLA_CACHE = compilation.enable_cache()

# Pallas' Triton lowering for a GPU, run where there is none: jax 0.10 lowers there; from
# 0.11 the lowering asks the device for its compute capability ("No supported GPU devices
# found"). On a GPU the kernels' own tests compile them.
triton_lowering_without_gpu = pytest.mark.skipif(
    jax.default_backend() == "gpu"
    or tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11),
    reason="Pallas' Triton lowering needs a GPU from jax 0.11 (on one, the kernels compile)",
)


# The Mosaic GPU kernels compiled on a GPU, or interpreted elsewhere (jax 0.11 added the
# interpret mode).
mosaic_gpu_runs = pytest.mark.skipif(
    jax.default_backend() != "gpu" and not hasattr(kernels.mosaic_gpu.plgpu, "InterpretGPUParams"),
    reason="Mosaic GPU interpret mode needs jax >= 0.11",
)


def run_on_fake_devices(script: str, *args, devices: int) -> subprocess.CompletedProcess:
    """Runs ``script`` (a path under tests/) with ``args`` in a fresh Python process on
    ``devices`` fake CPU devices (the device count is fixed when JAX is imported), with the
    repository and tests/ importable; the child's crash prints its Python stack to stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", os.path.join(TESTS, script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def generate_script():
    """``scripts/generate.py`` as a module (scripts/ is not a package)."""
    path = os.path.join(ROOT, "scripts", "generate.py")
    spec = importlib.util.spec_from_file_location("generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_mla(
    *, q_lora: bool = True, heads: int = 4, yarn: bool = True, interleaved: bool = True
) -> MLAConfig:
    rope = (
        RopeConfig(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=0.707,
            mscale_all_dim=0.707,
            interleaved=interleaved,
        )
        if yarn
        else RopeConfig(interleaved=interleaved)
    )
    return MLAConfig(
        hidden_size=48,
        num_heads=heads,
        q_lora_rank=24 if q_lora else None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope=rope,
    )


def randomize(module: nnx.Module, seed: int) -> None:
    """Fresh random weights everywhere, norm weights included (not left at 1); a matrix's
    scaled by its fan-in (its second-last axis: ``[in, out]``, per head ``[N, in, out]``)."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        shape, dtype = var.shape, var[...].dtype
        if len(shape) == 1:
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-2])
        var[...] = jnp.asarray(value, dtype)


def mla_weights_np(attn) -> dict[str, np.ndarray]:
    """The module's weights as float64 arrays under HF's names (``[in, out]``; the fused
    ``fused_qkv_a_proj`` as its ``q_a_proj`` columns, then ``kv_a_proj_with_mqa``'s), and the
    per-head ``W_UK``, ``W_UV``."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(attn, nnx.Param)):
        out[path[0]] = np.asarray(var[...], np.float64)
    return split_fused_qkv_a(out, attn.cfg)


def split_fused_qkv_a(weights: dict[str, np.ndarray], cfg: MLAConfig) -> dict[str, np.ndarray]:
    """``weights`` (an attention module's, by name) with ``fused_qkv_a_proj [H, Lq + Lkv +
    R]`` as HF's ``q_a_proj`` (its first Lq columns) and ``kv_a_proj_with_mqa`` (the rest)."""
    out = dict(weights)
    fused = out.pop("fused_qkv_a_proj", None)
    if fused is not None:
        lq = cfg.q_lora_rank
        out["q_a_proj"], out["kv_a_proj_with_mqa"] = fused[:, :lq], fused[:, lq:]
    return out


def mla_dims(cfg: MLAConfig) -> dict:
    return dict(
        N=cfg.num_heads,
        P=cfg.qk_nope_head_dim,
        R=cfg.qk_rope_head_dim,
        V=cfg.v_head_dim,
        Lkv=cfg.kv_lora_rank,
        eps=cfg.rms_norm_eps,
        scale=cfg.softmax_scale,
        inv_freq=inv_freq(cfg.rope, cfg.qk_rope_head_dim).astype(np.float64),
        mag=cos_sin_scale(cfg.rope),
        interleaved=cfg.rope.interleaved,
    )


class Step:
    """Runs one attention step of several requests through the module.

    ``requests``: ``(context_len, x_new [q, H])`` in vLLM order (decodes first);
    ``tables``: ``[R, W]`` block ids. Returns per-request outputs and the new cache.
    """

    def __init__(self, block_size: int, num_blocks: int, workspace_size: int = 4096):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.workspace_size = workspace_size

    def __call__(self, attn, cache, requests, tables, *, impl="reference"):
        ctx = np.array([c for c, _ in requests])
        qlen = np.array([len(x) for _, x in requests])
        md = build_metadata(
            ctx,
            qlen,
            np.asarray(tables),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            workspace_size=self.workspace_size,
            kernel_plan=_plan(impl, attn.cfg.num_heads, self.block_size),
        )
        x = np.zeros((md.positions.shape[0], requests[0][1].shape[1]), np.float32)
        x[md.token_rows()] = np.concatenate([x for _, x in requests])
        y, cache = _run(attn, jnp.asarray(x), cache, jax.device_put(md), impl)
        y = np.asarray(y)[md.token_rows()]
        return np.split(y, np.cumsum(qlen)[:-1]), cache


def _plan(impl: str, num_heads: int, block_size: int) -> KernelPlan | None:
    """The schedules of ``impl``'s kernel set on 4 multiprocessors (None: the references)."""
    backend = kernels.select(impl).backend
    if backend == "reference":
        return None
    return KernelPlan(num_heads, num_sms=4, backend=backend, page_size=block_size)


@nnx.jit(static_argnames="impl")
def _run(attn, x, cache, md, impl):
    return attn(x, cache, md, impl=impl)


def refused_only_compiled(run, refused: bool, match: str) -> None:
    """``run(interpret)`` (a kernel call traced on abstract arrays) goes through in
    interpret mode, and compiled raises ValueError matching ``match`` if ``refused``, else
    goes through too."""
    run(True)
    if refused:
        with pytest.raises(ValueError, match=match):
            run(False)
    else:
        run(False)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# Every test draws fresh random inputs from this seed and its own node id. The default is
# fixed so that CI is repeatable; MLA_TEST_SEED picks other inputs (or replays a failure).
_BASE_SEED = int(os.environ.get("MLA_TEST_SEED", "0"))


def pytest_report_header(config):
    kernels_run = "compiled (Triton)" if jax.default_backend() == "gpu" else "interpreted"
    return [
        f"random inputs: MLA_TEST_SEED={_BASE_SEED} (set it to draw others)",
        f"jax {jax.__version__} on {jax.default_backend()}: Pallas kernels {kernels_run}",
    ]


def pytest_collection_modifyitems(config, items):
    """The scripts' smoke runs first; tests marked ``gpu`` (shapes too large to interpret)
    run only on a GPU."""
    # The smoke runs are one file of many minutes: xdist's loadfile gives a file to one
    # worker, and started last it would run alone while the other workers idle.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/scripts/test_smoke.py"))
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: shapes too large to interpret")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "rng" in getattr(item, "fixturenames", ()):
        report.sections.append(("random inputs", f"MLA_TEST_SEED={_BASE_SEED}"))
    return report


@pytest.fixture
def rng(request):
    """Random inputs from MLA_TEST_SEED and the test's id (printed with any failure)."""
    digest = sum(ord(c) * 31**i for i, c in enumerate(request.node.nodeid)) % 2**31
    return np.random.default_rng([_BASE_SEED, digest])
