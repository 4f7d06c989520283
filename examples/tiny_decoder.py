"""A decoder of a model author's own around ``MLAAttention``, generating greedily over a paged
latent cache (the README's module section is the marked region of this file; a test checks
both the copy and the tokens, against a dense float64 NumPy computation).

    python examples/tiny_decoder.py
"""

# --- README begin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import CacheManager, MLAAttention, MLAConfig, init_cache


class Block(nnx.Module):
    """Pre-norm residual block: MLA, then a GELU MLP."""

    def __init__(self, cfg: MLAConfig, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.attn_norm = nnx.RMSNorm(h, rngs=rngs)
        self.attn = MLAAttention(cfg, rngs=rngs)  # float32 parameters
        self.mlp_norm = nnx.RMSNorm(h, rngs=rngs)
        self.up = nnx.Linear(h, 4 * h, rngs=rngs)
        self.down = nnx.Linear(4 * h, h, rngs=rngs)

    def __call__(self, x, cache, metadata, layer):
        h, cache = self.attn(self.attn_norm(x), cache, metadata, layer=layer)
        x = x + h
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x)))), cache


class Decoder(nnx.Module):
    def __init__(self, cfg: MLAConfig, num_layers: int, vocab_size: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, cfg.hidden_size, rngs=rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def blocks(rngs):  # parameters stacked on a leading [num_layers] axis
            return Block(cfg, rngs)

        self.blocks = blocks(rngs)
        self.num_layers = num_layers
        self.norm = nnx.RMSNorm(cfg.hidden_size, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden_size, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, ids, cache, metadata):
        """ids ``[T]`` int32 (packed in request order, then padding) and the stacked cache
        ``[num_layers, num_blocks, block_size, width]`` -> logits ``[T, vocab]`` float32 and
        the updated cache."""

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def layers(carry, block, layer):  # one traced layer, whatever num_layers is
            x, cache = carry
            return block(x, cache, metadata, layer)

        x, cache = layers((self.embed(ids), cache), self.blocks, jnp.arange(self.num_layers))
        return self.head(self.norm(x)), cache


@nnx.jit(donate_argnums=2)  # the cache is updated in place
def forward(model, ids, cache, metadata):
    return model(ids, cache, metadata)


def generate(model, cache, manager, prompts, *, chunk, steps):
    """Greedy decoding: each step feeds every sequence up to ``chunk`` prompt tokens (a
    chunked prefill over what it has cached) or, once its prompt is in, its last sampled
    token. ``prompts``: ``{name: [token ids]}``. Returns ``{name: sampled ids}``, each
    sampled token's logits ``{name: [vocab] float32 rows}`` and the cache."""
    pending = {name: list(tokens) for name, tokens in prompts.items()}  # not in the cache
    sampled = {name: [] for name in prompts}
    logits_of = {name: [] for name in prompts}
    for _ in range(steps):
        new = {name: tokens[:chunk] for name, tokens in pending.items()}
        # Block ids, positions, kernel schedules: all from the per-sequence counts.
        metadata = manager.step({name: len(tokens) for name, tokens in new.items()})
        packed = np.concatenate(list(new.values()))  # request order, as the mapping's
        ids = np.zeros(metadata.num_tokens, np.int32)  # padded to the bucket: few programs
        ids[: len(packed)] = packed
        logits, cache = forward(model, ids, cache, metadata)  # [num_tokens, vocab] float32
        last_rows = np.cumsum([len(tokens) for tokens in new.values()]) - 1
        for name, row in zip(new, last_rows, strict=True):
            pending[name] = pending[name][len(new[name]) :]
            if not pending[name]:  # the prompt is in: sample, and feed the token next step
                token = int(jnp.argmax(logits[row]))
                sampled[name].append(token)
                logits_of[name].append(np.asarray(logits[row]))
                pending[name] = [token]
    return sampled, logits_of, cache


cfg = MLAConfig(  # DeepSeek-V3-like (a q LoRA), tiny; preset("deepseek-v3") is the real one
    hidden_size=64,
    num_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
num_layers, num_blocks, block_size, vocab = 2, 16, 4, 97
model = Decoder(cfg, num_layers, vocab, rngs=nnx.Rngs(0))
# [2, 16, 4, 40] float32: rows concat(kv_c [32], k_pe [8]) of each token, per layer
cache = init_cache(num_layers, num_blocks, block_size, cfg.cache_width, jnp.float32)
# Owns the block allocator; picks the kernel schedules for this backend (Pallas on a GPU).
# workspace_size=4: the cached context is gathered 4 rows at a time, so in several chunks.
manager = CacheManager(
    num_heads=cfg.num_heads, num_blocks=num_blocks, block_size=block_size, workspace_size=4
)
prompts = {"long": [5, 17, 42, 8, 8, 90, 3, 61, 27, 14, 2], "short": [7, 7, 31]}
# Step 1 prefills "long"[:6] and all of "short"; step 2 runs "long"[6:] on its 6 cached
# tokens beside the decode of "short" (prefill first: any order); then both decode.
sampled, logits_of, cache = generate(model, cache, manager, prompts, chunk=6, steps=5)
# --- README end

if __name__ == "__main__":
    for name, ids in sampled.items():
        print(name, prompts[name], "->", ids)
