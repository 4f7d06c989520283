"""scripts/bench_serve.py's prefix-caching comparison, run whole and small (``--model tiny
--impl reference``, CPU) in a fresh process (it turns on JAX's persistent compilation cache,
a process-wide setting); a GPU run makes the table in BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_serve  # noqa: E402


def test_prefix_comparison_on_the_tiny_model(tmp_path):
    env = dict(os.environ, MLA_JAX_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    argv = ["--model", "tiny", "--prefix", "--impl", "reference"]
    argv += ["--no-publish", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_serve.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert not os.path.exists(os.path.join(ROOT, "benchmarks", "serve_prefix_tiny.json"))
    result = json.loads((tmp_path / "serve_prefix_tiny.json").read_text())
    assert result["columns"] == bench_serve.PREFIX_COLUMNS
    w = bench_serve.PrefixWorkloads(**result["workloads"])
    assert w == bench_serve.TINY_PREFIX_WORKLOADS
    rows = {(row["cells"][0].split(":")[0], row["cells"][1]): row for row in result["rows"]}
    assert list(rows) == [(k, c) for k in ("shared prefix", "multi-turn") for c in ("off", "on")]
    shared_prompt = w.shared_requests * (w.shared_prefix + w.own_tokens)
    for kind, requests in (("shared prefix", w.shared_requests), ("multi-turn", None)):
        off, on = rows[kind, "off"], rows[kind, "on"]
        requests = requests or w.conversations * w.turns
        assert len(off["ttft_ms"]) == len(on["ttft_ms"]) == requests
        prompt = off["cells"][4]
        assert on["cells"][4] == prompt and off["cells"][5] == prompt  # all computed when off
        assert off["cached_prompt_tokens"] == 0 and off["cells"][6] == "0.0%"
        # On: the cached tokens are whole blocks of 16 (page of the tiny settings).
        cached = on["cached_prompt_tokens"]
        assert cached > 0 and cached % 16 == 0 and on["cells"][5] == prompt - cached
        assert on["cells"][6] == f"{cached / prompt:.1%}"
    assert rows["shared prefix", "off"]["cells"][4] == shared_prompt
    # A later request of the shared workload takes the whole prefix (8 blocks of 16).
    assert rows["shared prefix", "on"]["cached_prompt_tokens"] % w.shared_prefix == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--model", "tiny"], "--model tiny runs only --prefix"),
        (["--prefix", "shared,nope"], "want a comma-separated subset of shared,multi-turn"),
        (["--prefix", "shared,shared"], "want a comma-separated subset of shared,multi-turn"),
        (["--prefix", "--no-publish"], "--no-publish needs --out"),
        (["--impl", "reference"], "--impl reference runs only --prefix"),
        (["--decode-window", "0"], "--decode-window must be >= 1, got 0"),
    ],
)
def test_bad_flags_are_named(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve.main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_compile_depths_default_to_none_where_the_deepest_model_does_not_fit():
    assert bench_serve.default_compile_depths("v2-lite", bench_serve.FULL) == "2,27,61"
    assert bench_serve.default_compile_depths("tiny", bench_serve.SMOKE) == "1"
    assert bench_serve.default_compile_depths("v3", bench_serve.FULL) == ""


def test_kernel_breakdown_accounts_for_every_kernel():
    """The ten largest kernels by name, then the rest in one entry with its launches: the
    entries add up to the step's total."""
    events = [{"name": f"k{i}", "dur": 100.0 * (i + 1)} for i in range(13) for _ in range(2)]
    total_ms, kernels = bench_serve.kernel_breakdown(events, steps=2)
    assert total_ms == pytest.approx(sum(100.0 * (i + 1) for i in range(13)) / 1e3)
    assert list(kernels)[:10] == [f"k{i}" for i in range(12, 2, -1)]
    assert kernels["k12"] == pytest.approx(1.3)
    assert kernels["other (3 kernels, 3 launches a step)"] == pytest.approx(0.6)
    assert sum(kernels.values()) == pytest.approx(total_ms)


def test_kernel_breakdown_counts_a_fusions_numbered_instances_together():
    """An unrolled step's per-layer fusions (``loop_slice_fusion``, ``loop_slice_fusion_1``
    ...) are one entry with every launch; other names are kept whole."""
    names = ["loop_slice_fusion", "loop_slice_fusion_1", "loop_slice_fusion_23", "fusion_4"]
    names += ["nvjet_sm90_tst_64x8_64x16_4x2_h_bz_NNT", "gemm_fusion_dot_general_7", "Memset 0"]
    events = [{"name": name, "dur": 10.0} for name in names]
    _, kernels = bench_serve.kernel_breakdown(events, steps=1)
    assert kernels == {
        "loop_slice_fusion": pytest.approx(0.03),
        "fusion": pytest.approx(0.01),
        "nvjet_sm90_tst_64x8_64x16_4x2_h_bz_NNT": pytest.approx(0.01),
        "gemm_fusion_dot_general": pytest.approx(0.01),
        "Memset 0": pytest.approx(0.01),
    }


def test_kernel_kinds_sort_kernels_by_name():
    """cuBLAS's and XLA's matmuls, copies, slices and memsets, XLA's fusions, the rest Pallas: each
    kind's milliseconds and launches a step, adding up to the events."""
    names = [
        "nvjet_sm90_tst_64x8_64x16_4x2_h_bz_NNT",
        "gemm_fusion_dot_general_5",
        "MemcpyD2D",
        "Memset 3",
        "loop_dynamic_slice_fusion",
        "loop_multiply_fusion_26",
        "input_scatter_fusion",
        "void cub::DeviceRadixSortOnesweepKernel",
        "mla_decode",
        "anonymous_mosaic_gpu_kernel",
    ]
    events = [{"name": name, "dur": 10.0 * (i + 1)} for i, name in enumerate(names) for _ in "ab"]
    kinds = bench_serve.kernel_kinds(events, steps=2)
    assert kinds == {
        "matmuls": {"ms": pytest.approx(0.03), "launches": 2},
        "copies, slices and memsets": {"ms": pytest.approx(0.12), "launches": 3},
        "XLA fusions": {"ms": pytest.approx(0.21), "launches": 3},
        "Pallas": {"ms": pytest.approx(0.19), "launches": 2},
    }


def test_fp8_weights_serving_tables_on_the_tiny_model(tmp_path):
    """``--smoke --fp8-weights``: the serving and cache-layout tables of a model whose
    projections and experts hold float8_e4m3fn weights, under names of their own; each
    decode row's host work by part."""
    env = dict(os.environ, MLA_JAX_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    argv = ["--smoke", "--fp8-weights", "--rows", "decode", "--compile-depths", ""]
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_serve.py"),
            *argv,
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    written = sorted(path.name for path in tmp_path.glob("*.json"))
    assert written == ["serve_kv_cache_tiny_fp8_weights.json", "serve_tiny_fp8_weights.json"]
    result = json.loads((tmp_path / "serve_tiny_fp8_weights.json").read_text())
    assert result["title"].endswith("tiny-shaped model with FP8 weights through Engine.generate")
    assert "float8_e4m3fn with 128 x 128 block scales" in result["notes"][0]
    assert [row["cells"][0] for row in result["rows"]] == ["decode 1 x 16", "decode 4 x 16"]
    for row in result["rows"]:  # the host's work by part, each a share of it
        for parts in row["host_parts_ms"].values():
            assert set(parts) == {"batch", "prepare", "call", "rest"}
            assert all(value >= 0 for value in parts.values()), parts
            assert parts["prepare"] > 0 and parts["call"] > 0, parts


def test_fp8_weights_model_keeps_its_projections_fp8():
    model = bench_serve.new_model(bench_serve.TINY, fp8_weights=True)
    attention = model.layers[0].self_attn
    assert attention.fused_qkv_a_proj.weight.dtype == jnp.float8_e4m3fn
    assert attention.fused_qkv_a_proj.weight_scale_inv.dtype == jnp.float32
    plain = bench_serve.new_model(bench_serve.TINY, fp8_weights=False)
    assert plain.layers[0].self_attn.fused_qkv_a_proj.kernel.dtype == jnp.bfloat16


def test_breakdown_note_bounds_the_step_by_its_other_kernels():
    """The note's bound: the weights at the copy bandwidth plus every non-matmul kernel's time
    (2 GB at 4000 GB/s: 0.5 ms; plus 0.3 ms), against the row's roofline (0.5 ms)."""
    kinds = {
        "matmuls": {"ms": 1.0, "launches": 100},
        "XLA fusions": {"ms": 0.2, "launches": 150},
        "Pallas": {"ms": 0.1, "launches": 50},
    }
    row = {"cells": ["decode 1 x 512", 1.0, 1.3, 1.3, *[0] * 5, 0.5, 2.6]}
    row["device_kernel_kinds"] = kinds
    note = bench_serve.breakdown_note([{"cells": ["prefill"]}, row], 2e9, 4000.0)
    assert "stream at 2000 GB/s, 50% of the copy bandwidth" in note
    assert "the step would take 0.80 ms (1.60x the roofline)" in note
    assert "the other kernels' 0.30 ms in 200 launches unchanged." in note
