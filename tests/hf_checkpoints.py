"""Small random DeepseekV2 / DeepseekV3 checkpoints written by transformers (float32), in the
config.json schemas the published checkpoints use: the test models of test_hf.py,
test_sharding.py and the engine tests."""

from __future__ import annotations

import json
import os

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    kv_lora_rank=32,
    qk_nope_head_dim=24,
    v_head_dim=16,
    max_position_embeddings=512,
    first_k_dense_replace=2,  # dense layers (the MoE checkpoints below override it)
    eos_token_id=None,
    bos_token_id=None,
)
YARN = dict(
    factor=8.0,
    original_max_position_embeddings=16,
    beta_fast=32,
    beta_slow=1,
)


def v3_current_schema():
    cfg = transformers.DeepseekV3Config(
        **COMMON,
        num_attention_heads=8,
        qk_rope_head_dim=16,
        q_lora_rank=32,  # whole 16-wide FP8 blocks (test_hf's): fused_qkv_a_proj keeps FP8
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, mscale=1.0, mscale_all_dim=1.0, **YARN
        ),
    )
    return transformers.DeepseekV3ForCausalLM, cfg, None


def v2_lite_legacy_schema():
    cfg = transformers.DeepseekV2Config(
        **COMMON,
        num_attention_heads=4,
        qk_rope_head_dim=8,
        q_lora_rank=None,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, mscale=0.707, mscale_all_dim=0.707, **YARN
        ),
    )

    def to_legacy(d):
        rope = d.pop("rope_parameters")
        d["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_type")
        d["rope_scaling"] = {"type": "yarn", **rope}
        return d

    return transformers.DeepseekV2ForCausalLM, cfg, to_legacy


# Layer 0 dense, layers 1-2 mixture-of-experts (one stacked run of two, so that each must
# find its own experts in the run's stack): 8 routed experts in 4 groups, 2 groups kept, top
# 2, a shared expert, routed_scaling_factor not 1.
MOE = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=24,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
)


def v3_moe():
    cls, cfg, _ = v3_current_schema()
    cfg = transformers.DeepseekV3Config(**{**cfg.to_dict(), **MOE, "norm_topk_prob": True})
    return cls, cfg, None


def v2_moe():
    cfg = transformers.DeepseekV2Config(
        **{**COMMON, **MOE},
        num_attention_heads=4,
        qk_rope_head_dim=8,
        q_lora_rank=None,
        topk_method="group_limited_greedy",
    )
    return transformers.DeepseekV2ForCausalLM, cfg, None


CHECKPOINTS = {
    "v3": v3_current_schema,
    "v2-lite-legacy": v2_lite_legacy_schema,
    "v3-moe": v3_moe,
    "v2-moe": v2_moe,
}


def write_checkpoint(name: str, path, seed: int):
    """Writes checkpoint ``name`` of ``CHECKPOINTS`` with random weights (from ``seed``) to
    ``path``; returns the transformers model, float32, in eval mode."""
    cls, cfg, rewrite = CHECKPOINTS[name]()
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    if rewrite is not None:
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            d = rewrite(json.load(f))
        with open(config_path, "w") as f:
            json.dump(d, f)
        model = cls.from_pretrained(path).float().eval()
    return model


def greedy_tokens(hf, prompt, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``new_tokens`` of them, EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()
