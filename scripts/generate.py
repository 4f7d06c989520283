"""Generate tokens with a DeepSeek checkpoint (or the built-in tiny model) through mla_jax.

    python scripts/generate.py --model tiny --prompt-ids 3,14,15 --prompt-ids 9,2,6 \
        --max-new-tokens 16 --output result.json

``--smoke --output result.json`` checks the script on the CPU in seconds: the tiny model,
two short prompts, 4 new tokens, no compilation cache (flags given still win).

``--plan-only`` prints the memory plan of the model's config.json (no weights are read, no
device is used; ``mla_jax.parallel.memory_plan``): per layout of ``--plan-devices`` devices,
the weights and the cache bytes per device, and how many requests of ``--request-tokens``
fit on 8 x H200 and 8 x H100 after the weights and ``--headroom``:

    python scripts/generate.py --model DIR --plan-only [--dtype bfloat16] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp

from mla_jax.cache.latent_cache import KV_CACHE_DTYPES, CacheFullError
from mla_jax.cache.metadata import MetadataError
from mla_jax.checkpoint.hf_config import load_config
from mla_jax.checkpoint.loader import FP8_WEIGHTS, WeightsError, keeps_fp8, load_model
from mla_jax.checkpoint.tiny import TINY, tiny_checkpoint
from mla_jax.engine import allocator, compilation
from mla_jax.engine.batch import scratch_blocks
from mla_jax.engine.engine import Engine, EngineConfig, Request, RequestError
from mla_jax.model.config import ConfigError
from mla_jax.parallel import memory_plan, sharding

# What a user can get wrong beyond the flags (the checkpoint, the requests' sizes): the
# command line prints these as one line, not a traceback.
_USER_ERRORS = (
    ConfigError,
    WeightsError,
    RequestError,
    CacheFullError,
    MetadataError,
)
_DIGITS = re.compile(r"[0-9]+")
# The request of a smoke run (--smoke) where its flags give none.
SMOKE_PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 3, 5]]
SMOKE_NEW_TOKENS = 4


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids 3,14,15``: every item a non-negative integer, none empty."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not _DIGITS.fullmatch(item):
            what = f"{item!r} is not a token id" if item else "an empty item"
            raise argparse.ArgumentTypeError(
                f"{what} in {text!r} (want comma-separated integers >= 0)"
            )
    return [int(item) for item in items]


def _positive_int(text: str) -> int:
    """A size or a count: an integer >= 1."""
    if not _DIGITS.fullmatch(text.strip()) or int(text) == 0:
        raise argparse.ArgumentTypeError(f"want an integer >= 1, got {text!r}")
    return int(text)


def _temperature(text: str) -> float:
    """0 (greedy) or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, with the same message as nan itself
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"want a number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """A fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"want a number in [0, 1), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder, or 'tiny' (required but with --smoke)")
    ap.add_argument("--prompt-ids", type=_token_ids, action="append", default=[])
    ap.add_argument("--prompt", action="append", default=[], help="text (needs tokenizer.json)")
    ap.add_argument("--max-new-tokens", type=_positive_int)
    ap.add_argument("--temperature", type=_temperature, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="the model's dtype (default: float32; bfloat16 with --plan-only)",
    )
    ap.add_argument("--block-size", type=_positive_int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    ap.add_argument(
        "--num-blocks", type=_positive_int, help="cache blocks (default: all requests at once)"
    )
    ap.add_argument("--workspace-size", type=_positive_int, default=8192)
    ap.add_argument("--max-num-seqs", type=_positive_int, default=64, help="running requests")
    ap.add_argument(
        "--max-model-len", type=_positive_int, help="longest sequence (default: the model's)"
    )
    ap.add_argument(
        "--list-buckets", action="store_true", help="print the programs the engine can run"
    )
    ap.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help=f"compiled programs on disk (default: {compilation.default_program_dir()})",
    )
    ap.add_argument("--no-compilation-cache", action="store_true", help="compile every run")
    ap.add_argument(
        "--impl",
        choices=["auto", "pallas", "mosaic_gpu", "triton", "reference"],
        default="auto",
        help="kernels (mla_jax.kernels.select): auto is pallas on a GPU, reference elsewhere",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: the model's dtype; fp8: e4m3 latent with a scale per 128 values",
    )
    ap.add_argument(
        "--fp8-weights",
        choices=FP8_WEIGHTS,
        default="dequantize",
        help="an FP8 checkpoint's weights: keep (FP8 with block scales on the device, "
        "dequantized tile by tile in the matmuls), dequantize (to --dtype at load; the default "
        "until the FP8 kernels have run compiled), auto (keep on a GPU, dequantize elsewhere); "
        "--dtype stays the activations' dtype",
    )
    ap.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor parallel: split heads, MLPs, experts and vocabulary over this many devices",
    )
    ap.add_argument(
        "--dp",
        type=_positive_int,
        default=1,
        help="data parallel attention: this many ranks (of --tp devices each), each running "
        "its own requests over its own part of the cache",
    )
    ap.add_argument(
        "--ep",
        action="store_true",
        help="with --dp: expert parallelism over all --dp x --tp devices, each holding 1/(dp x "
        "tp) of the routed experts (not a whole --tp share per DP rank); each MoE layer "
        "all-gathers the ranks' tokens and reduce-scatters the experts' outputs back",
    )
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt whole (default: a prompt starts from the longest prefix an "
        "earlier request left in the cache)",
    )
    ap.add_argument(
        "--decode-window",
        type=_positive_int,
        help="decode steps run in one device program while every request decodes (default 1: "
        "every step alone: on an H200 windows did not shorten a step, the device bounds it)",
    )
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="print the memory plan (weights and cache bytes per device, requests that fit) of "
        "each layout of --plan-devices devices, from config.json alone, and exit",
    )
    ap.add_argument(
        "--plan-devices", type=_positive_int, default=8, help="devices of the memory plan"
    )
    ap.add_argument(
        "--request-tokens",
        type=_positive_int,
        default=4096,
        help="tokens of one request (prompt and output) in the memory plan",
    )
    ap.add_argument(
        "--headroom",
        type=_fraction,
        default=0.1,
        help="the memory plan's headroom: the fraction of each GPU's memory kept for "
        "activations, workspaces and XLA",
    )
    ap.add_argument("--output", help="write the result JSON here")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check the script on the CPU in seconds: the tiny model, two short prompts, "
        f"{SMOKE_NEW_TOKENS} new tokens, no compilation cache (flags given still win); "
        "needs --output",
    )
    return ap


def _smoke(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A smoke run's settings where the flags give none, on the CPU (before any array
    exists)."""
    if not args.output:
        ap.error("--smoke needs --output (the result JSON)")
    args.model = args.model or "tiny"
    if not args.prompt_ids and not args.prompt:
        args.prompt_ids = SMOKE_PROMPTS
    args.max_new_tokens = args.max_new_tokens or SMOKE_NEW_TOKENS
    args.no_compilation_cache = True
    jax.config.update("jax_platforms", "cpu")


def _check_output(ap: argparse.ArgumentParser, path: str) -> None:
    """Refuses an --output that could not be written now, rather than after loading and
    generating."""
    if os.path.isdir(path):
        ap.error(f"--output {path} is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        ap.error(f"--output {path}: {folder} is not an existing directory")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        ap.error(f"--output {path} is not writable")


def _compilation_cache(
    ap: argparse.ArgumentParser, args: argparse.Namespace, *, enable: bool
) -> None:
    """Checks the persistent compilation cache's folder (unless --no-compilation-cache):
    before anything is loaded, a file where it should be is refused; with ``enable``, it
    turns the cache on, refusing a folder that cannot be made."""
    if args.no_compilation_cache:
        return
    path = args.compilation_cache or compilation.default_program_dir()
    try:
        if not enable:
            compilation.check_folder(path)
            return
        compilation.enable_cache(path)
    except OSError as e:
        flag = f"--compilation-cache {path}"
        if args.compilation_cache is None:
            flag = f"the compilation cache {path} (default; see --compilation-cache)"
        ap.error(f"{flag}: {e}")
    print(f"compilation cache: {path}", file=sys.stderr)


def _check_max_model_len(
    ap: argparse.ArgumentParser, args: argparse.Namespace, model_dir: str
) -> int:
    """The model's ``max_position_embeddings`` (from config.json); refuses a --max-model-len
    beyond it before the weights load."""
    max_positions = load_config(model_dir).max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > max_positions:
        ap.error(
            f"--max-model-len {args.max_model_len} exceeds the model's "
            f"max_position_embeddings ({max_positions})"
        )
    return max_positions


def _tokenizer(ap: argparse.ArgumentParser, model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        ap.error(f"--prompt needs a tokenizer: {model_dir} has no tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        ap.error("--prompt needs the 'tokenizers' package (pip install tokenizers)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        ap.error(f"--prompt: {path} is not a tokenizer file the tokenizers package reads: {e}")


def _engine_config(
    ap: argparse.ArgumentParser, args: argparse.Namespace, prompts: list[list[int]]
) -> EngineConfig:
    """The engine's settings from the flags; by default a cache that holds every request."""
    if args.num_blocks is None and prompts:
        per_request = -(-(max(map(len, prompts)) + args.max_new_tokens) // args.block_size)
        # Each DP rank holds its share of the requests, and its scratch blocks (engine/batch.py).
        per_rank = per_request * -(-len(prompts) // args.dp)
        per_rank += scratch_blocks(args.block_size, args.dp)
        num_blocks = per_rank * args.dp
    else:  # given, or listing buckets: the engine's default cache
        num_blocks = args.num_blocks or EngineConfig.num_blocks
    try:
        return EngineConfig(
            block_size=args.block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            workspace_size=args.workspace_size,
            impl=args.impl,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel=args.tp,
            data_parallel=args.dp,
            expert_parallel=args.ep,
            enable_prefix_caching=not args.no_prefix_caching,
            decode_window=args.decode_window,
        )
    except ValueError as e:  # settings that conflict, e.g. a workspace smaller than a block
        ap.error(str(e))


def main(argv: list[str] | None = None) -> dict:
    """Parses ``argv`` and generates. Bad flags exit through argparse (status 2); a bad
    checkpoint or request raises its own error (``cli`` prints it as one line)."""
    allocator.prefer_cuda_async()  # before JAX starts its backend
    ap = _parser()
    args = ap.parse_args(argv)
    if args.output:
        _check_output(ap, args.output)
    if args.smoke:
        _smoke(ap, args)
    if args.model is None:
        ap.error("the following arguments are required: --model")
    if args.plan_only:
        return _plan(args)
    args.dtype = args.dtype or "float32"
    if args.list_buckets:
        return _list_buckets(ap, args)
    if not args.prompt_ids and not args.prompt:
        ap.error("give at least one --prompt-ids (or --prompt)")
    if args.max_new_tokens is None:
        ap.error("the following arguments are required: --max-new-tokens")
    _compilation_cache(ap, args, enable=False)

    model_dir = tiny_checkpoint() if args.model == "tiny" else args.model
    tokenizer = _tokenizer(ap, model_dir) if args.prompt else None
    prompts = list(args.prompt_ids)
    if tokenizer is not None:
        prompts += [tokenizer.encode(text).ids for text in args.prompt]
    cfg = _engine_config(ap, args, prompts)
    _check_max_model_len(ap, args, model_dir)
    placement = None
    if args.tp > 1 or args.dp > 1:  # refused before the weights load, which then go
        # straight to their shards
        flags = f"--tp {args.tp}" if args.dp == 1 else f"--dp {args.dp} --tp {args.tp}"
        flags += " --ep" if args.ep else ""
        try:
            model_cfg = load_config(model_dir)
            fp8_blocks = None
            if keeps_fp8(model_cfg, args.fp8_weights):
                fp8_blocks = model_cfg.quantization.weight_block_size
            sharding.check_divisible(model_cfg, args.tp, args.dp, args.ep, fp8_blocks)
            mesh = sharding.make_mesh(args.tp, args.dp)
            placement = sharding.placement(mesh, args.ep)
        except ValueError as e:
            ap.error(f"{flags}: {e}")
    _compilation_cache(ap, args, enable=True)
    print(f"loading {model_dir} ({args.dtype})", file=sys.stderr)
    _, model = load_model(
        model_dir,
        dtype=jnp.dtype(args.dtype),
        verbose=True,
        placement=placement,
        fp8_weights=args.fp8_weights,
    )
    engine = Engine(model, cfg, seed=args.seed)
    requests = [
        Request(p, args.max_new_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        for p in prompts
    ]
    engine.generate(requests)

    outputs = []
    for req in requests:
        out = {"prompt_ids": req.prompt_ids, "generated_ids": req.output_ids}
        if tokenizer is not None:
            out["generated_text"] = tokenizer.decode(req.output_ids)
        outputs.append(out)
        print(" ".join(map(str, req.prompt_ids)), "->", " ".join(map(str, req.output_ids)))
    result = {"outputs": outputs, "stats": engine.stats.as_dict()}
    print(_summary(result["stats"]), file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}", file=sys.stderr)
    return result


def _list_buckets(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Prints every program the engine would run for this model and these flags."""
    model_dir = tiny_checkpoint() if args.model == "tiny" else args.model
    cfg = _engine_config(ap, args, [])
    max_model_len = cfg.model_len(_check_max_model_len(ap, args, model_dir))
    shapes = cfg.fixed_buckets(max_model_len).step_shapes(cfg.workspace_size)
    print(f"{len(shapes)} programs (max_model_len {max_model_len}):")
    for shape in shapes:
        print(" ", shape)
    return {"buckets": [shape._asdict() for shape in shapes]}


def _plan(args: argparse.Namespace) -> dict:
    """Prints the memory plan of the model's config (``memory_plan.plan``) as a table."""
    model_cfg = TINY if args.model == "tiny" else load_config(args.model)
    settings = dict(
        dtype=jnp.dtype(args.dtype or "bfloat16"),
        request_tokens=args.request_tokens,
        block_size=args.block_size,
        headroom=args.headroom,
    )
    rows = memory_plan.plan(model_cfg, args.plan_devices, **settings)
    print(
        f"memory plan: {args.model} ({memory_plan.parameter_count(model_cfg) / 1e9:.2f} B "
        f"parameters) on {args.plan_devices} devices; weights in {settings['dtype'].name} or FP8 "
        f"with block scales (as --fp8-weights keep holds them); requests of "
        f"{args.request_tokens} tokens in blocks of {args.block_size}; headroom "
        f"{args.headroom:.0%} of each GPU's memory (activations, workspaces, XLA); dpMxtpN: "
        "--dp M --tp N, +ep: with --ep (the routed experts over all devices)"
    )
    print(memory_plan.format_plan(rows, request_tokens=args.request_tokens))
    result = {
        "plan": [
            {
                "layout": row.layout.name,
                "expert_parallel": row.layout.expert_parallel,
                "weights": row.weights,
                "weight_bytes_per_device": row.weight_bytes,
                "cache_bytes_per_token_per_device": row.token_bytes,
                "devices_holding_a_token": row.token_copies,
                "requests": [
                    {"node": node, "kv_cache_dtype": kv, "requests": count}
                    for (node, kv), count in row.requests.items()
                ],
                "refused": row.refused,
                "layer_runs": list(row.runs),
            }
            for row in rows
        ],
        "settings": {**settings, "dtype": settings["dtype"].name},
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}", file=sys.stderr)
    return result


def _summary(stats: dict) -> str:
    """The run's step statistics in one line."""
    first, hit_rate = stats["first_token_s"], stats["prefix_cache_hit_rate"]
    hits = "" if hit_rate is None else f", prefix cache hit rate {hit_rate:.1%}"
    return (
        f"{stats['steps']} steps, {stats['prompt_tokens']} prompt tokens computed + "
        f"{stats['cached_prompt_tokens']} cached{hits}, {stats['generated_tokens']} generated "
        f"tokens, {stats['tokens_per_s']} tok/s after "
        f"{stats['compile_s']} s on {stats['programs']} programs "
        f"({stats['programs_from_cache']} from the compilation cache); first token after "
        f"{first} s; decode step {stats['decode_step_ms']} ms (host working "
        f"{stats['decode_host_ms']} ms, waiting {stats['decode_wait_ms']} ms) over "
        f"{stats['decode_steps']} decode-only steps"
    )


def cli() -> None:
    """The command line: ``main``, with a user error printed as one ``error: ...`` line on
    stderr (exit status 1) instead of a traceback."""
    try:
        main()
    except _USER_ERRORS as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli()
