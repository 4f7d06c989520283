"""Generate tokens with a DeepSeek checkpoint (or the built-in tiny model) through mla_jax.

    python scripts/generate.py --model tiny --prompt-ids 3,14,15 --prompt-ids 9,2,6 \
        --max-new-tokens 16 --output result.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax.numpy as jnp

from mla_jax.engine import Engine, EngineConfig, Request
from mla_jax.tiny import tiny_checkpoint
from mla_jax.weights import load_model


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        msg = f"--prompt-ids wants comma-separated integers: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"--prompt needs a tokenizer: {model_dir} has no tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("--prompt needs the 'tokenizers' package (pip install tokenizers)")
    return Tokenizer.from_file(path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint folder, or 'tiny'")
    ap.add_argument("--prompt-ids", type=_token_ids, action="append", default=[])
    ap.add_argument("--prompt", action="append", default=[], help="text (needs tokenizer.json)")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, help="cache blocks (default: all requests at once)")
    ap.add_argument("--workspace-size", type=int, default=8192)
    ap.add_argument("--impl", default="auto", help="kernels: auto, pallas or reference")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--output", help="write the result JSON here")
    args = ap.parse_args(argv)

    model_dir = tiny_checkpoint() if args.model == "tiny" else args.model
    tokenizer = _tokenizer(model_dir) if args.prompt else None
    prompts = list(args.prompt_ids)
    if tokenizer is not None:
        prompts += [tokenizer.encode(text).ids for text in args.prompt]
    if not prompts:
        ap.error("give at least one --prompt-ids (or --prompt)")

    print(f"loading {model_dir} ({args.dtype})", file=sys.stderr)
    _, model = load_model(model_dir, dtype=jnp.dtype(args.dtype), verbose=True)
    per_request = -(-(max(map(len, prompts)) + args.max_new_tokens) // args.block_size)
    cfg = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks or per_request * len(prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
        workspace_size=args.workspace_size,
        impl=args.impl,
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
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
