"""Tensor and data parallelism (``mla_jax/parallel/sharding.py``, ``generate.py --tp/--dp``) on 4
fake CPU devices.

The device count is fixed when JAX is imported, so the multi-device runs happen in a fresh
process (``multi_device.py``, with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``):
greedy float32 tokens at TP 2 and 4 on transformers test checkpoints (8 heads with q LoRA;
4 heads, no q LoRA, a run of two MoE layers with their experts split by expert), chunked
prefill included, against transformers' greedy generate; at TP 4, where every parameter and
the cache live and which collectives a compiled step runs; the Pallas kernels under
shard_map. Data parallelism: greedy tokens at DP 2 and DP 2 x TP 2 on three prompts of
different lengths (ranks idle or lacking a part in some steps), at DP 2 in decode windows
too, the cache split over the DP ranks, collectives only within a DP rank; prefix caching
at DP 2 x TP 2 (requests steered to the rank that caches their prefix while it has room).
Expert parallelism (``--ep``, the routed experts over all devices): greedy tokens on the V3-
and V2-router MoE checkpoints and on an FP8 one (weights kept FP8), each device's 1/D of the
routed experts, and the collectives across DP ranks (the dispatch's all-gathers and the
combine's reduce-scatter only). Refusals run here, on this process's one device.
"""

from __future__ import annotations

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _BASE_SEED, TESTS, generate_script, run_on_fake_devices

from mla_jax import kernels
from mla_jax.engine.engine import EngineConfig
from mla_jax.kernels import fp8_blocks
from mla_jax.parallel import sharding

DEVICES = 4
PROMPT_LENGTHS = (13,)
NEW_TOKENS = 6
# Block 4, workspace 8 and a budget of 8 tokens: the prompt is prefilled in two chunks, the
# second over its cached context (the merge kernel runs), then decoded: two programs per
# run (compiling dominates these tests' time).
FLAGS = ["--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS), "--no-compilation-cache"]
FLAGS += ["--block-size", "4", "--workspace-size", "8", "--max-num-batched-tokens", "8"]
FLAGS += ["--max-num-seqs", "4"]
# The kernels run the references here; multi_device.py checks the Pallas kernels under
# shard_map on their own (interpreting them through whole models would take minutes).
RUNS = [["v3", 2, "reference"], ["v3", 4, "reference"], ["v2-moe", 4, "reference"]]
INSPECT, INSPECT_TP = "v2-moe", 4  # a dense layer and a MoE layer
# Data parallelism: three prompts over two ranks (13 and 9 on rank 0, 5 on rank 1): rank 1
# prefills in one step while rank 0 takes three, and finishes first (then it is idle).
DP_PROMPT_LENGTHS = (13, 5, 9)
# The last run in decode windows of 4 steps: a rank that finishes first runs padding in them.
DP_RUNS = [["v3", 2, 1, "reference", 1], ["v3", 2, 2, "reference", 1], ["v3", 2, 1, "reference", 4]]
DP_INSPECT = [2, 2]  # data_parallel, tensor_parallel of the inspected (INSPECT) run
# Prefix caching at DP 2 x TP 2 (max_num_seqs 4 a rank), two generate calls: a prompt with a
# 10-token prefix (rank 0), then an unrelated prompt and four with the prefix. Rank 0 caches
# the prefix: three of them join it (the least loaded rank would be rank 1) until it holds
# max_num_seqs requests; the fourth finds no room there and goes to rank 1, uncached.
PREFIX_LEN = 10
PREFIX_WAVES = [[5], [0, 3, 4, 3, 2]]  # the tokens after the prefix (0: an unrelated prompt)
PREFIX_RANKS = [0, 0, 0, 0, 0, 1]
PREFIX_CACHED = [0, 3 * 8]  # the 10-token prefix: 2 blocks of 4 for each of the three
# Expert parallelism (--ep): the DP prompts with the routed experts (8 a layer) over every
# device: (checkpoint, data_parallel, tensor_parallel, decode window, --fp8-weights). The V3
# router at DP 2 x TP 2, the V2 router at DP 4 in windows of 4 (rank 3 idle throughout,
# ranks 1 and 2 finishing first), the FP8 checkpoint with its weights kept FP8 at DP 2 and 4,
# and one whose blocks TP 2 splits whole at DP 2 x TP 2 (the FP8 projections' matmul on each
# TP rank's columns or rows, inside the DP ranks' shard_map).
EP_RUNS = [
    ["v3-moe", 2, 2, 1, "dequantize"],
    ["v2-moe", 4, 1, 4, "dequantize"],
    ["fp8", 2, 1, 1, "keep"],
    ["fp8", 4, 1, 1, "keep"],
    ["fp8-tp", 2, 2, 1, "keep"],
]
if sharding.gspmd_for_data_parallel():  # jax 0.11: expert parallelism x TP is refused
    EP_RUNS = [run for run in EP_RUNS if run[2] == 1]
EP_KEYS = [f"{n}/dp{dp}xtp{tp}/window{w}/{fp8}" for n, dp, tp, w, fp8 in EP_RUNS]
# The FP8 checkpoints' blocks: test_hf's, edge blocks partial (at TP 1: experts are split
# whole); blocks TP 2 splits whole (the MLP's width 80 is 10 blocks of 8, TP 2 takes 5 each).
FP8_BLOCKS = {"fp8": (16, 8), "fp8-tp": (4, 4)}


@pytest.fixture(scope="module")
def multi_device(tmp_path_factory):
    """Runs ``multi_device.py`` once for the module; returns (its result, the
    transformers greedy tokens of each checkpoint)."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from hf_checkpoints import greedy_tokens, write_checkpoint

    rng = np.random.default_rng([_BASE_SEED, 12])
    prompts = [rng.integers(0, 96, n).tolist() for n in PROMPT_LENGTHS]
    dp_prompts = [rng.integers(0, 96, n).tolist() for n in DP_PROMPT_LENGTHS]
    prefix_rng = np.random.default_rng([_BASE_SEED, 12, 24])  # (the other draws unchanged)
    prefix = prefix_rng.integers(0, 96, PREFIX_LEN).tolist()
    prefix_waves = [
        [
            prefix + prefix_rng.integers(0, 96, n).tolist()
            if n
            else prefix_rng.integers(0, 96, 9).tolist()
            for n in wave
        ]
        for wave in PREFIX_WAVES
    ]
    flags, dp_flags = list(FLAGS), list(FLAGS)
    for prompt in prompts:
        flags += ["--prompt-ids", ",".join(map(str, prompt))]
    for prompt in dp_prompts:
        dp_flags += ["--prompt-ids", ",".join(map(str, prompt))]
    root = tmp_path_factory.mktemp("tp")
    checkpoints, expected, dp_expected, prefix_expected = {}, {}, {}, {}
    for name in sorted({run[0] for run in RUNS}):
        path = root / name
        hf = write_checkpoint(name, path, int(rng.integers(2**31)))
        checkpoints[name] = str(path)
        with torch.no_grad():
            expected[name], dp_expected[name], prefix_expected[name] = (
                [
                    hf.generate(
                        torch.tensor([p]),
                        max_new_tokens=NEW_TOKENS,
                        do_sample=False,
                        eos_token_id=None,
                    )[0, len(p) :].tolist()
                    for p in some
                ]
                for some in (prompts, dp_prompts, [p for wave in prefix_waves for p in wave])
            )
    ep_rng = np.random.default_rng([_BASE_SEED, 12, 36])  # (the other draws unchanged)
    for name in sorted({run[0] for run in EP_RUNS} - set(checkpoints)):
        path = root / name
        path.mkdir()
        if name in FP8_BLOCKS:
            from fp8_checkpoint import write_fp8_checkpoint

            from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization

            seed = int(ep_rng.integers(2**31))
            hf, _ = write_fp8_checkpoint(path, seed, FP8BlockQuantization(FP8_BLOCKS[name]))
        else:
            hf = write_checkpoint(name, path, int(ep_rng.integers(2**31)))
        checkpoints[name] = str(path)
        dp_expected[name] = [greedy_tokens(hf, p, NEW_TOKENS) for p in dp_prompts]
    job = dict(checkpoints=checkpoints, flags=flags, runs=RUNS, inspect=INSPECT)
    job.update(inspect_tp=INSPECT_TP, seed=int(rng.integers(2**31)))
    job.update(dp_flags=dp_flags, dp_runs=DP_RUNS, dp_inspect=DP_INSPECT, ep_runs=EP_RUNS)
    job["prefix"] = dict(
        checkpoint="v3", flags=FLAGS, waves=prefix_waves, data_parallel=2, tensor_parallel=2
    )
    (root / "job.json").write_text(json.dumps(job))
    done = run_on_fake_devices(
        "parallel/multi_device.py", root / "job.json", root / "out", devices=DEVICES
    )
    if done.returncode < 0:
        signal_name = signal.Signals(-done.returncode).name
        pytest.fail(f"multi_device.py died of {signal_name}:\n{done.stderr[-6000:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((root / "out").read_text())
    return result, {**expected, "dp": dp_expected, "prefix": prefix_expected}


@pytest.mark.parametrize("run", ["/".join(map(str, run)) for run in RUNS])
def test_tensor_parallel_greedy_tokens_match_transformers(multi_device, run):
    result, expected = multi_device
    assert result["devices"] == DEVICES
    assert result["tokens"][run] == expected[run.split("/")[0]]


# The parameter suffixes split by tensor parallelism and the axis (from the end) they split
# (the inspected checkpoint has no q LoRA: q_proj, not q_b_proj).
SPLIT = {
    "self_attn/q_proj/kernel": -1,  # by output heads
    "self_attn/W_UK": -3,  # [N, Lkv, P]: by heads
    "self_attn/W_UV": -3,
    "self_attn/o_proj/kernel": -2,  # by input heads
    "/mlp/gate_proj/kernel": -1,  # the dense layer's MLP
    "/mlp/up_proj/kernel": -1,
    "/mlp/down_proj/kernel": -2,
    "shared_experts/gate_proj/kernel": -1,
    "shared_experts/up_proj/kernel": -1,
    "shared_experts/down_proj/kernel": -2,
    "experts/gate_up_proj": -3,  # routed experts [E, H, 2I]: by expert
    "experts/down_proj": -3,
    "embed_tokens/embedding": -2,  # by vocabulary
    "lm_head/kernel": -1,
}


def test_parameters_are_split_and_the_cache_replicated(multi_device):
    result, _ = multi_device
    params = result["params"]
    split = set()
    for path, placement in params.items():
        assert placement["devices"] == DEVICES, path
        suffix = next((s for s in SPLIT if f"/{path}".endswith(s)), None)
        if suffix is None:  # norms, kv_a_proj, the router: every device holds all of it
            assert placement["device_bytes"] == [placement["nbytes"]] * DEVICES, path
            continue
        split.add(suffix)
        axis = SPLIT[suffix]
        spec = [None] * len(placement["shape"])
        spec[axis] = "tp"
        assert placement["spec"] + [None] * (len(spec) - len(placement["spec"])) == spec, path
        assert placement["device_bytes"] == [placement["nbytes"] // DEVICES] * DEVICES, path
    assert split == set(SPLIT)
    total = sum(p["nbytes"] for p in params.values())
    per_device = sum(p["device_bytes"][0] for p in params.values())
    assert per_device < 0.5 * total  # most of the weights are split four ways
    cache = result["cache"]
    assert cache["spec"] == [] and cache["device_bytes"] == [cache["nbytes"]] * DEVICES
    # load_model with sharding.placement (generate.py --tp) puts each parameter where the
    # engine wants it, without a whole copy on one device first.
    assert result["loaded_params"] == params


def test_only_activation_collectives(multi_device):
    """The compiled steps sum partial products: ``[T, H]`` ones (o_proj, the MLPs'
    down_proj, the vocabulary-split embedding lookup) and the routed experts' ``[T k, 2I]``
    and ``[T k, H]`` rows; they gather each rank's best logit and its index for sampling. No
    weight or cache moves between devices."""
    result, _ = multi_device
    params = result["params"]
    hidden = params["norm/weight"]["shape"][0]
    gate_up = next(p["shape"][-1] for path, p in params.items() if path.endswith("gate_up_proj"))
    widths = {"all-reduce": set(), "all-gather": set()}
    for op, shape in result["collectives"]:
        dims = [int(d) for d in shape.split("[")[1].split("]")[0].split(",")]
        assert op in widths and len(dims) == 2, (op, shape)
        widths[op].add(dims[-1])
    assert widths == {"all-reduce": {hidden, gate_up}, "all-gather": {DEVICES}}


def test_pallas_kernels_under_shard_map_match_the_references(multi_device):
    """Decode, prefill and merge kernels split by heads over 4 devices (2 heads each), the
    grouped matmul by experts (2 each), vs the unsharded references, float32: both compute
    the same sums in another order (observed ~1e-7; test_reference_kernels checks the
    references against float64 NumPy)."""
    result, _ = multi_device
    assert len(result["kernel_errors"]) == 7
    for name, error in result["kernel_errors"].items():
        assert error < 1e-6, name


@pytest.mark.parametrize(
    "tp,message",
    [
        (3, "--tp 3: tensor_parallel=3 does not divide the model's num_attention_heads (16)"),
        (32, "--tp 32: tensor_parallel=32 does not divide the model's num_attention_heads (16)"),
    ],
)
def test_tensor_parallel_not_dividing_the_heads_is_refused(tp, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_script().main(
            ["--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--tp", str(tp)]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_tensor_parallel_beyond_the_devices_is_refused(capsys):
    import jax

    tp = 2 * jax.device_count()
    with pytest.raises(SystemExit):
        generate_script().main(
            ["--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--tp", str(tp)]
        )
    assert f"--tp {tp}: tensor_parallel={tp} needs that many devices" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensor_parallel must be positive, got 0"):
        EngineConfig(tensor_parallel=0)


@pytest.mark.parametrize("run", ["/".join(map(str, run)) for run in DP_RUNS])
def test_data_parallel_greedy_tokens_match_transformers(multi_device, run):
    result, expected = multi_device
    name, data_parallel, tensor_parallel, impl, window = run.split("/")
    key = f"{name}/dp{data_parallel}xtp{tensor_parallel}/{impl}/window{window}"
    assert result["tokens"][key] == expected["dp"][name]


def test_data_parallel_ranks_run_their_own_requests_on_their_own_cache(multi_device):
    """The inspected run (MoE checkpoint, DP 2 x TP 2): its tokens; steps where one rank
    prefills while the other decodes, and where one rank has no request; the cache split in
    halves over the DP ranks (each half on both TP devices of its rank); every collective
    within a DP rank's TP pair (devices {0, 1} and {2, 3}): none crosses DP ranks."""
    result, expected = multi_device
    assert result["dp_tokens"] == expected["dp"][INSPECT]
    per_rank = result["dp_requests_per_rank"]
    assert any([0, 0] in ranks for ranks in per_rank), per_rank  # a rank without requests
    # A rank with decodes and no prompt chunk while the other has one (padding on each).
    assert any(
        any(decodes and not chunks for decodes, chunks in ranks)
        and any(chunks for _, chunks in ranks)
        for ranks in per_rank
    ), per_rank
    cache = result["dp_cache"]
    data_parallel, tensor_parallel = DP_INSPECT
    assert cache["spec"] == [None, "dp"]
    assert cache["devices"] == data_parallel * tensor_parallel
    assert cache["device_bytes"] == [cache["nbytes"] // data_parallel] * DEVICES
    groups = {groups for _, _, groups in result["dp_collectives"]}
    assert result["dp_collectives"] and groups == {"{{0,1},{2,3}}"}, groups


def test_data_parallel_prefix_caching(multi_device):
    """Prefix caching at DP 2 x TP 2: transformers' tokens; each request on the rank that
    caches its prefix while that rank has room; the cached prompt tokens that follow."""
    result, expected = multi_device
    tokens = [out for wave in result["prefix_tokens"] for out in wave]
    assert tokens == expected["prefix"]["v3"]
    assert result["prefix_ranks"] == PREFIX_RANKS
    assert result["prefix_cached"] == PREFIX_CACHED


@pytest.mark.parametrize("run", EP_KEYS)
def test_expert_parallel_greedy_tokens_match_transformers(multi_device, run):
    result, expected = multi_device
    assert result["ep"][run]["tokens"] == expected["dp"][run.split("/")[0]]


def _groups(data_parallel: int, tensor_parallel: int) -> tuple[str, str]:
    """XLA's replica groups of a ``("dp", "tp")`` mesh's two axes: the DP ranks' devices of
    each TP index, and each DP rank's TP devices."""
    grid = np.arange(data_parallel * tensor_parallel).reshape(data_parallel, tensor_parallel)

    def explicit(rows):
        return "{" + ",".join("{" + ",".join(map(str, row)) + "}" for row in rows) + "}"

    return explicit(grid.T), explicit(grid)


@pytest.mark.parametrize("run", EP_KEYS)
def test_expert_parallel_holds_1_over_d_of_the_routed_experts(multi_device, run):
    """Each of the run's D devices holds 1/D of every routed expert stack (and of an FP8
    stack's scales), split on the expert axis over ``("dp", "tp")``; every other parameter
    as under DP: split on ``"tp"`` at most, a whole copy per DP rank."""
    result, _ = multi_device
    _, data_parallel, tensor_parallel, _, fp8_weights = EP_RUNS[EP_KEYS.index(run)]
    devices = data_parallel * tensor_parallel
    routed = set()
    for path, placement in result["ep"][run]["params"].items():
        assert placement["devices"] == devices, path
        if "/experts/" not in f"/{path}":
            assert all(axis in (None, "tp") for axis in placement["spec"]), path
            continue
        routed.add(path.rsplit("/", 1)[-1])
        assert placement["spec"][:2] == [None, "('dp', 'tp')"], path  # [L, E, ...]
        assert placement["device_bytes"] == [placement["nbytes"] // devices] * devices, path
    want = {"gate_up_proj", "down_proj"}
    if fp8_weights == "keep":
        want |= {"gate_up_proj_scale_inv", "down_proj_scale_inv"}
    assert routed == want


@pytest.mark.parametrize("run", EP_KEYS)
def test_expert_parallel_collectives(multi_device, run):
    """Across the DP ranks only the dispatch and the combine: per MoE run, all-gathers of the
    ranks' hidden states ``[dp T, H]``, expert ids and weights ``[dp T, k]``, and a
    reduce-scatter of the experts' outputs back to ``[T, H]`` (a decode window runs a fixed
    number of steps on every rank: no "any rank still live" vote). Within a DP rank's TP devices,
    TP's activation all-reduces and sampling's gathers. No all-to-all, and no weight moves:
    every collective is of activations (at most 2 axes; expert stacks have 4)."""
    result, _ = multi_device
    _, data_parallel, tensor_parallel, _, _ = EP_RUNS[EP_KEYS.index(run)]
    across, within = _groups(data_parallel, tensor_parallel)
    params = result["ep"][run]["params"]
    hidden = params["norm/weight"]["shape"][0]
    top_k = 2  # hf_checkpoints.MOE's num_experts_per_tok
    seen = {"all-gather": [], "reduce-scatter": []}
    for op, shape, groups in result["ep"][run]["collectives"]:
        dims = [int(d) for d in shape.split("[")[1].split("]")[0].split(",") if d]
        assert len(dims) <= 2, (op, shape)
        if groups == within and tensor_parallel > 1:
            assert op in ("all-reduce", "all-gather"), (op, shape)
            continue
        assert groups == across, (op, shape, groups)
        assert op in seen and len(dims) == 2, (op, shape)
        seen[op].append(dims)
    gathered = sorted(tuple(dims) for dims in seen["all-gather"])
    scattered = sorted((rows * data_parallel, width) for rows, width in seen["reduce-scatter"])
    assert {width for _, width in scattered} == {hidden}
    # Each reduce-scatter's gathers: the hidden states and the router's ids and weights.
    want = sorted(
        [(rows, hidden) for rows, _ in scattered] + [(rows, top_k) for rows, _ in scattered] * 2
    )
    assert scattered and gathered == want


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            # DeepSeek-V3's config.json (no weights: refused before any would load).
            ["--model", os.path.join(TESTS, "data", "deepseek-v3"), "--dp", "3", "--ep"],
            "--dp 3 --tp 1 --ep: expert parallelism over data_parallel=3 x tensor_parallel=1 "
            "= 3 devices does not divide the model's n_routed_experts (256)",
        ),
        (
            ["--model", "tiny", "--ep"],
            "expert_parallel needs data_parallel > 1 (with one DP rank, tensor parallelism "
            "already splits the experts over every device)",
        ),
    ],
)
def test_bad_expert_parallel_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_script().main([*flags, "--prompt-ids", "1,2", "--max-new-tokens", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


@pytest.mark.skipif(not sharding.gspmd_for_data_parallel(), reason="jax 0.11's partitioner")
def test_expert_parallel_with_tensor_parallel_on_jax_0_11_is_refused(capsys):
    """jax 0.11's GSPMD partitioner aborts the process on the experts split over dp x tp
    (hlo_sharding_util's IsManualSubgroup check): refused in one line instead."""
    flags = ["--model", "tiny", "--dp", "2", "--tp", "2", "--ep"]
    with pytest.raises(SystemExit) as exit_info:
        generate_script().main([*flags, "--prompt-ids", "1,2", "--max-new-tokens", "1"])
    assert exit_info.value.code == 2
    assert (
        "expert_parallel with tensor_parallel > 1 does not compile on jax"
        in (capsys.readouterr().err.strip().splitlines()[-1])
    )


def test_fp8_weights_split_off_their_blocks_are_refused(tmp_path, capsys):
    """Kept FP8 weights split by TP must split on whole blocks (their scales then split as
    evenly): DeepSeek-V3's config.json with an MLP width of 145 blocks of 128, at TP 2,
    refused before any weight would load; dequantized at load, it passes this check."""
    with open(os.path.join(TESTS, "data", "deepseek-v3", "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 145 * 128}))
    flags = ["--model", str(tmp_path), "--tp", "2", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    with pytest.raises(SystemExit) as exit_info:
        generate_script().main([*flags, "--fp8-weights", "keep"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            "--tp 2: tensor_parallel=2 splits the model's FP8 intermediate_size (18560) off its "
            "128 x 128 weight blocks (each device's share must be whole blocks of 128)"
        )
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dp", "2"], "--dp 2 --tp 1: data_parallel=2 x tensor_parallel=1 needs 2 devices; 1"),
        (
            ["--dp", "2", "--num-blocks", "5"],
            "num_blocks (5) does not divide among data_parallel=2 ranks",
        ),
        (
            ["--dp", "2", "--num-blocks", "4"],
            "num_blocks (4) leaves no block to each of data_parallel=2 ranks after its 2 "
            "scratch blocks",
        ),
    ],
)
def test_bad_data_parallel_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_script().main(
            ["--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1", *flags]
        )
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(ValueError, match="data_parallel must be positive, got 0"):
        EngineConfig(data_parallel=0)


def test_fp8_matmul_split_by_columns_or_rows_moves_no_weight(multi_device):
    """The Pallas FP8 matmul (opaque to the partitioner) on a stack of weights split by
    columns or by rows over 4 devices, its layer traced (and a Python int, eagerly): float32
    against float64 NumPy
    (observed ~1e-7), the other layers' weights and scales NaN; the compiled program moves
    no weight: by columns no collective, by rows the output's partial sums alone. Handed
    over as if whole, the partitioner gathers the stack onto every device (what the wrapper
    prevents, and what this test would see)."""
    result, _ = multi_device
    splits = result["fp8_splits"]
    for name in ("columns", "rows", "unsplit"):
        assert splits[name]["error"] < 1e-6, name
        assert splits[name]["int_layer_error"] < 1e-6, name
    assert splits["columns"]["collectives"] == []
    rows, width = splits["rows"]["shape"]
    assert splits["rows"]["collectives"] == [["all-reduce", f"f32[{rows},{width}]"]]
    assert any(op == "all-gather" for op, _ in splits["unsplit"]["collectives"])


def test_fp8_weights_kept_move_no_weight_in_a_step(multi_device):
    """A compiled decode step of the tiny model with FP8 weights kept and the Pallas FP8
    matmul at TP 4 runs the activation collectives alone: all-reduces of ``[rows, hidden]``
    (o_proj, down_proj, the embedding lookup) and the gathers of each rank's best logit."""
    result, _ = multi_device
    from mla_jax.checkpoint.tiny import TINY

    collectives = result["fp8_splits"]["step_collectives"]
    ops = {(op, shape.split("[")[1].split(",")[-1].rstrip("]")) for op, shape in collectives}
    assert ops == {("all-reduce", str(TINY.mla.hidden_size)), ("all-gather", str(DEVICES))}


@pytest.mark.parametrize("q_lora_rank", [1536, None])
def test_linear_splits_match_the_rules(q_lora_rank):
    """Each projection's ``tensor_split`` (how ``sharded_kernels`` splits its FP8 matmul) is
    the split the placement rules give its weight and its FP8 scales, on DeepSeek-V3's
    config.json with FP8 weights (and without q LoRA: ``q_proj``)."""
    from flax import nnx

    from mla_jax.checkpoint.hf_config import config_from_dict
    from mla_jax.model import layers
    from mla_jax.model.deepseek import DeepseekModel

    with open(os.path.join(TESTS, "data", "deepseek-v3", "config.json")) as f:
        cfg = config_from_dict({**json.load(f), "q_lora_rank": q_lora_rank})
    model = nnx.eval_shape(
        lambda: DeepseekModel(
            cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fp8_blocks=(128, 128)
        )
    )
    split_axes = {None: (), layers.COLUMNS: (None, "tp"), layers.ROWS: ("tp", None)}
    seen = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, layers.Linear):
            continue
        # An FP8 weight is HF's [out, in], the kernel [in, out]: the split axes swap.
        fp8 = node.blocks is not None
        names = ("weight", "weight_scale_inv") if fp8 else ("kernel",)
        for name in names:
            ndim = getattr(node, name).ndim
            spec = tuple(sharding.partition_spec([*map(str, path), name], ndim))
            axes = split_axes[node.tensor_split][:: -1 if fp8 else 1]
            want = (None,) * (ndim - len(axes)) + axes if axes else ()
            assert spec == want, (path, name)
        seen[str(path[-1])] = node.tensor_split
    if q_lora_rank:
        projections = {"fused_qkv_a_proj", "q_b_proj"}
    else:
        projections = {"q_proj", "kv_a_proj_with_mqa"}
    projections |= {"o_proj", "lm_head"}
    assert projections | {"gate_proj", "up_proj", "down_proj"} == set(seen)
    assert {None, layers.COLUMNS, layers.ROWS} == set(seen.values())


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_up_projections_split_by_head_on_tp_only(expert_parallel):
    """``W_UK`` / ``W_UV`` (``[L, N, Lkv, P or V]`` in a run) split by head over ``"tp"``;
    expert parallelism, which splits the routed experts (a spec of the same form) over every
    device, leaves them so: each DP rank holds every head."""
    for name in ("W_UK", "W_UV"):
        spec = sharding.partition_spec(["layers", "0", "self_attn", name], 4, expert_parallel)
        assert tuple(spec) == (None, "tp", None, None), name
    experts = sharding.partition_spec(["layers", "1", "mlp", "experts", "down_proj"], 4, True)
    assert tuple(experts) == (None, ("dp", "tp"), None, None)


def test_fp8_matmul_wrapper_on_one_device_hands_over_the_stack_in_place():
    """On one device (``"tp"`` of 1) ``sharded_kernels``' FP8 matmul gives the kernel the
    run's stack in place with its layer, traced or a Python int (checked by the kernel),
    whatever the split, and no ``shard_map`` (a psum over one device stays in XLA's program
    as an all-reduce of singletons); an unknown split is refused in one line.
    ``test_fp8_matmul_split_by_columns_or_rows_moves_no_weight`` runs the splits on 4."""
    given = []

    def fp8_matmul(x, weight, scale_inv, *, blocks, layer=None, tensor_split=None):
        given.append((weight.shape, scale_inv.shape, isinstance(layer, int), tensor_split))
        return kernels.REFERENCE.fp8_matmul(x, weight, scale_inv, blocks=blocks, layer=layer)

    mesh = sharding.make_mesh(1)
    wrapped = sharding.sharded_kernels(kernels.REFERENCE._replace(fp8_matmul=fp8_matmul), mesh)
    blocks = fp8_blocks.Fp8Blocks(16, 16)
    rng = np.random.default_rng([_BASE_SEED, 47])
    stack = jnp.asarray(rng.standard_normal((3, 48, 32)), fp8_blocks.FP8)  # [L, N, K]
    scales = jnp.asarray(2.0 ** rng.integers(-2, 3, (3, 3, 2)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    want = kernels.REFERENCE.fp8_matmul(x, stack[2], scales[2], blocks=blocks)
    for split in (None, "columns", "rows"):
        given.clear()

        def call(layer, split=split):
            return wrapped.fp8_matmul(
                x, stack, scales, blocks=blocks, layer=layer, tensor_split=split
            )

        np.testing.assert_allclose(jax.jit(call)(jnp.int32(2)), want, rtol=1e-6)
        np.testing.assert_allclose(call(2), want, rtol=1e-6)
        assert given == [
            ((3, 48, 32), (3, 3, 2), False, None),
            ((3, 48, 32), (3, 3, 2), True, None),
        ]
    with pytest.raises(ValueError, match="tensor_split 'heads' \\(None, 'columns' or 'rows'\\)"):
        wrapped.fp8_matmul(x, stack, scales, blocks=blocks, layer=2, tensor_split="heads")
