"""scripts/generate.py refuses bad flags before loading anything, in one line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, generate_script

from mla_jax.checkpoint.hf_config import config_to_dict
from mla_jax.checkpoint.tiny import TINY, tiny_checkpoint
from mla_jax.engine.engine import RequestError
from mla_jax.model.config import ConfigError

SCRIPT = os.path.join(ROOT, "scripts", "generate.py")
generate = generate_script()

# A model folder that does not exist: a flag error reported with it shows that the flags are
# checked before the model is looked at.
NOWHERE = "/nonexistent/model"
REQUEST = ["--prompt-ids", "3,14,15", "--max-new-tokens", "4"]
ARGV = ["--model", NOWHERE, *REQUEST]


def _usage_error(capsys, argv: list[str]) -> str:
    """The one error line argparse prints for ``argv`` (after the usage lines)."""
    with pytest.raises(SystemExit) as exit_info:
        generate.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage:") and "Traceback" not in "\n".join(lines)
    return lines[-1]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-size", "0"], "argument --block-size: want an integer >= 1, got '0'"),
        (["--block-size", "-16"], "argument --block-size: want an integer >= 1, got '-16'"),
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: want an integer >= 1"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: want an integer >= 1"),
        (["--num-blocks", "0"], "argument --num-blocks: want an integer >= 1, got '0'"),
        (["--workspace-size", "2.5"], "argument --workspace-size: want an integer >= 1"),
        (["--temperature", "-1"], "argument --temperature: want a number >= 0, got '-1'"),
        (["--temperature", "nan"], "argument --temperature: want a number >= 0"),
        (["--block-size", "32", "--workspace-size", "16"], "workspace_size (16) must hold"),
        (["--impl", "cuda"], "argument --impl: invalid choice: 'cuda'"),
        (["--decode-window", "0"], "argument --decode-window: want an integer >= 1, got '0'"),
    ],
)
def test_bad_numbers_are_named(capsys, flags, message):
    assert message in _usage_error(capsys, ARGV + flags)


@pytest.mark.parametrize(
    "ids,message",
    [
        ("1.5", "'1.5' is not a token id in '1.5'"),
        ("3,1.5,4", "'1.5' is not a token id in '3,1.5,4'"),
        ("3,-1", "'-1' is not a token id in '3,-1'"),
        ("1,,2", "an empty item in '1,,2'"),
        ("1,2,", "an empty item in '1,2,'"),
        ("", "an empty item in ''"),
    ],
)
def test_bad_prompt_ids_are_named(capsys, ids, message):
    line = _usage_error(capsys, ARGV + ["--prompt-ids", ids])
    assert f"argument --prompt-ids: {message} (want comma-separated integers >= 0)" in line


def test_model_is_required_but_in_a_smoke_run(capsys):
    line = _usage_error(capsys, REQUEST)
    assert line.endswith("error: the following arguments are required: --model")
    line = _usage_error(capsys, ["--smoke"])  # refused before anything runs
    assert line.endswith("error: --smoke needs --output (the result JSON)")


def test_prompt_ids_allow_spaces():
    args = generate._parser().parse_args(
        ["--model", NOWHERE, "--prompt-ids", " 3, 14 ,15", "--max-new-tokens", "4"]
    )
    assert args.prompt_ids == [[3, 14, 15]]


def test_unwritable_output_is_refused_before_loading(capsys, tmp_path):
    missing = tmp_path / "missing" / "result.json"
    line = _usage_error(capsys, ARGV + ["--output", str(missing)])
    assert f"--output {missing}: {missing.parent} is not an existing directory" in line
    line = _usage_error(capsys, ARGV + ["--output", str(tmp_path)])
    assert f"--output {tmp_path} is a directory" in line


def test_checkpoint_errors_are_raised_by_main(tmp_path):
    """``main`` raises the library's errors (``cli`` prints them)."""
    (tmp_path / "config.json").write_text(
        json.dumps(dict(config_to_dict(TINY), quantization_config="fp8"))
    )
    with pytest.raises(ConfigError, match="quantization_config"):
        generate.main(["--model", str(tmp_path), *REQUEST])


def test_cli_prints_a_request_error_in_one_line(monkeypatch, tmp_path):
    model_dir = tiny_checkpoint(str(tmp_path / "tiny"))
    argv = ["generate.py", "--model", model_dir, "--prompt-ids", "3,600", "--max-new-tokens", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        generate.cli()
    assert (
        exit_info.value.code == "error: prompt token ids [600] are outside the vocabulary [0, 512)"
    )
    with pytest.raises(RequestError):
        generate.main(argv[1:])


def _run_script(flags: list[str], *, cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLA_JAX_CACHE=cache)
    cmd = [sys.executable, SCRIPT, *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_script_names_a_bad_flag_without_a_traceback(tmp_path):
    proc = _run_script(["--model", "tiny", *REQUEST, "--block-size", "0"], cache=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "generate.py: error: argument --block-size: want an integer >= 1, got '0'"
    )
    assert not os.listdir(tmp_path)  # refused before the tiny checkpoint was built


def test_script_prints_a_checkpoint_error_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(config_to_dict(TINY), moe_layer_freq=0)))
    proc = _run_script(["--model", str(tmp_path), *REQUEST], cache=str(tmp_path / "cache"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: moe_layer_freq must be an integer >= 1, got 0"


V3_DIR = os.path.join(ROOT, "tests", "data", "deepseek-v3")  # config.json only, no weights


def test_plan_only_reads_the_config_alone(capsys, tmp_path):
    output = tmp_path / "plan.json"
    result = generate.main(["--model", V3_DIR, "--plan-only", "--output", str(output)])
    table = capsys.readouterr().out
    assert "671.03 B parameters" in table
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    tp8 = result["plan"][1]
    gib = tp8["weight_bytes_per_device"] / 2**30
    assert f"| tp8 | fp8 | 3 + 58 | {gib:.1f} | 70,272 / 40,016 | 8 |" in table
    assert [row["expert_parallel"] for row in result["plan"]] == [False] * 8 + [True] * 6
    assert result["settings"]["dtype"] == "bfloat16"  # --dtype's default for a plan
    names = [(row["layout"], row["weights"]) for row in result["plan"]]
    assert names[:2] == [("tp8", "bfloat16"), ("tp8", "fp8")] and len(names) == 14


@pytest.mark.parametrize("headroom", ["1", "-0.1", "ten"])
def test_plan_headroom_must_be_a_fraction(capsys, headroom):
    message = _usage_error(capsys, ["--model", V3_DIR, "--plan-only", "--headroom", headroom])
    assert f"argument --headroom: want a number in [0, 1), got '{headroom}'" in message


def test_plan_only_in_a_smoke_run(tmp_path):
    output = tmp_path / "plan.json"
    flags = ["--smoke", "--plan-only", "--output", str(output)]
    proc = _run_script(flags, cache=str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(output.read_text())["plan"]
    assert rows[0]["layout"] == "tp8" and rows[0]["weight_bytes_per_device"] > 0
    assert not (tmp_path / "cache").exists()  # the tiny model's config: no checkpoint written


def _cli_error(monkeypatch, argv: list[str]) -> str:
    """What ``cli`` exits with for ``argv``: the one line it prints (a SystemExit message)."""
    monkeypatch.setattr(sys, "argv", ["generate.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        generate.cli()
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message, message
    return message


def test_cli_names_an_integer_block_scale_in_one_line(monkeypatch, tmp_path):
    """An FP8 checkpoint whose weight_scale_inv is an integer tensor: refused from the
    headers, in one line naming the tensor (it was a traceback from reading its data)."""
    torch = pytest.importorskip("torch")
    from fp8_checkpoint import quantize_checkpoint
    from safetensors.torch import load_file, save_file

    from mla_jax.checkpoint.fp8_weights import FP8BlockQuantization

    model_dir = tiny_checkpoint(str(tmp_path / "tiny"))
    quantize_checkpoint(model_dir, FP8BlockQuantization((128, 128)))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    argv = ["--model", model_dir, *REQUEST, "--no-compilation-cache"]
    assert _cli_error(monkeypatch, argv) == (
        f"error: tensor {name} has dtype I32; block scales must be floating point (F32, BF16, F16)"
    )


@pytest.mark.parametrize("below", [False, True], ids=["a_file", "below_a_file"])
def test_a_compilation_cache_that_cannot_be_a_folder_is_named(capsys, tmp_path, below):
    """A --compilation-cache that is a file, or lies below one, is refused before the model
    is looked at (it was a FileExistsError or NotADirectoryError traceback)."""
    file = tmp_path / "programs"
    file.write_text("")
    path = file / "xla" if below else file
    line = _usage_error(capsys, ARGV + ["--compilation-cache", str(path)])
    assert line.endswith(f"error: --compilation-cache {path}: {file} is a file, not a folder")


@pytest.fixture
def no_weights(monkeypatch):
    """Fails a run that loads the weights: what it refuses, it refuses before."""

    def load_model(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(generate, "load_model", load_model)


def test_max_model_len_above_the_model_is_refused_before_loading(capsys, tmp_path, no_weights):
    model_dir = tiny_checkpoint(str(tmp_path / "tiny"))
    flags = ["--model", model_dir, *REQUEST, "--no-compilation-cache", "--max-model-len", "1025"]
    line = _usage_error(capsys, flags)
    assert line.endswith(
        "error: --max-model-len 1025 exceeds the model's max_position_embeddings (1024)"
    )
    line = _usage_error(capsys, [*flags, "--list-buckets"])
    assert line.endswith(
        "error: --max-model-len 1025 exceeds the model's max_position_embeddings (1024)"
    )


def test_a_corrupt_tokenizer_is_named(capsys, tmp_path, no_weights):
    pytest.importorskip("tokenizers")
    model_dir = tiny_checkpoint(str(tmp_path / "tiny"))
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path, "w") as f:
        f.write('{"version": "1.0", "model": ')
    flags = ["--model", model_dir, "--prompt", "w3 w14", "--max-new-tokens", "2"]
    line = _usage_error(capsys, [*flags, "--no-compilation-cache"])
    assert line.endswith(
        f"error: --prompt: {path} is not a tokenizer file the tokenizers package reads: EOF "
        "while parsing a value at line 1 column 28"
    )
