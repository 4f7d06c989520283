"""The MLA attention module (Flax NNX) over a paged latent cache.

One call runs a step of flattened tokens, packed in request order (``packing.py``: the module
lays them out) or in the bucket layout (decodes first, then prefills; see metadata.py):

    q_c = rmsnorm(x @ W_DQ);  q = q_c @ W_UQR  -> q_nope [T,N,P], q_pe [T,N,R]
    kv = x @ W_DKV_KR;  kv_c = rmsnorm(kv[:, :Lkv]);  k_pe = kv[:, Lkv:]
    q_pe, k_pe = rope(q_pe, k_pe);  cache[slot] = concat(kv_c, k_pe)

- decodes take the absorbed, data-movement-friendly path: ``q_lat = q_nope @ W_UK^T`` per
  head, MQA over the latent cache (keys ``[kv_c, k_pe]``, values ``kv_c``), ``o = o_lat @ W_UV``;
- prefills take the compute-friendly path: ``k_nope, v = kv_c @ W_UK, kv_c @ W_UV`` and causal
  MHA over the new tokens; cached context is gathered chunk by chunk into a bounded workspace,
  up-projected the same way, attended non-causally and LSE-merged with the new-token result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import kernels
from mla_jax.cache.latent_cache import as_stored, write_cache
from mla_jax.cache.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from mla_jax.cache.packing import PackedMetadata
from mla_jax.kernels.fp8 import Fp8Cache
from mla_jax.kernels.paged import gather_rows
from mla_jax.model.checks import check_hidden, check_packed, check_step
from mla_jax.model.config import MLAConfig
from mla_jax.model.layers import COLUMNS, ROWS, RMSNorm, linear, matmul_precision
from mla_jax.model.rope import apply_rope, rope_cos_sin

# HF's weight of which W_UK and W_UV are the parts (``kv_b_part``).
KV_B_PROJ = "kv_b_proj"
# HF's weights whose outputs ``fused_qkv_a_proj`` holds side by side (``fused_qkv_a_part``).
FUSED_QKV_A = ("q_a_proj", "kv_a_proj_with_mqa")


def kv_b_part(param: str, cfg: MLAConfig) -> tuple[tuple[int, ...], tuple, tuple] | None:
    """Where ``MLAAttention``'s parameter ``param`` ("W_UK" or "W_UV"; None for others) lies
    in HF's ``kv_b_proj.weight [N (P + V), Lkv]``: ``(shape, index, axes)`` such that the
    weight reshaped to ``shape`` ``[N, P + V, Lkv]``, indexed by ``index`` and transposed
    by ``axes`` is the parameter."""
    p, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    rows = {"W_UK": slice(0, p), "W_UV": slice(p, p + v)}.get(param)
    if rows is None:
        return None
    return (cfg.num_heads, p + v, cfg.kv_lora_rank), (slice(None), rows), (0, 2, 1)


def fused_qkv_a_part(param: str, cfg: MLAConfig) -> list[tuple[str, slice]]:
    """The HF weights ``MLAAttention``'s parameter ``param`` holds in ranges of its outputs:
    ``fused_qkv_a_proj`` holds ``q_a_proj``'s ``Lq`` outputs in ``[0, Lq)`` and
    ``kv_a_proj_with_mqa``'s ``Lkv + R`` after them (columns of its ``kernel [H, Lq + Lkv +
    R]``, or rows of its kept FP8 ``weight [Lq + Lkv + R, H]``); [] for other parameters."""
    if param != "fused_qkv_a_proj" or cfg.q_lora_rank is None:
        return []
    q_a, kv_a = FUSED_QKV_A
    lq = cfg.q_lora_rank
    return [(q_a, slice(0, lq)), (kv_a, slice(lq, lq + cfg.cache_width))]


class MLAAttention(nnx.Module):
    """DeepSeek MLA with HF parameter names; kernels are Linear ``[in, out]``.

    HF's ``kv_b_proj`` ``[N (P + V), Lkv]`` is held as its two per-head parts, ``W_UK``
    ``[N, Lkv, P]`` and ``W_UV`` ``[N, Lkv, V]`` (the loader splits it, ``kv_b_part``): the
    absorbed decode multiplies by them head by head, and XLA's batched matmuls take only a
    heads-first array in place (batch axes leading): slices of ``kv_b_proj`` are copied
    (on the CPU backend the optimized HLO shows the copy; at DeepSeek-V3's dims
    ``benchmarks/e2e_layer.json`` has a 16 us ``loop_slice_fusion`` a layer, the time of
    reading and writing both slices at the copy bandwidth).

    With a query LoRA, HF's ``q_a_proj`` and ``kv_a_proj_with_mqa`` (both of the hidden
    states, both whole on every tensor-parallel rank) are one ``fused_qkv_a_proj`` ``[H, Lq
    + Lkv + R]``, as vLLM holds them (``fused_qkv_a_part``): at decode one matmul streams
    both weights (DeepSeek-V3's pair at 16 rows, each split along K: 14.8 us as two
    matmuls, 10.9 us as one, in a trial on an H200, 2026-12-05; ``bench_fp8_matmul.py
    --sweep split_k`` times the fused shape).

    With ``fp8_blocks`` (a checkpoint's ``weight_block_size``) the projections of the hidden
    states and of the output (``q_proj`` and ``kv_a_proj_with_mqa``, or ``fused_qkv_a_proj``
    and ``q_b_proj``; ``o_proj``) are FP8 with block scales; the fused weight's block grid
    is its two weights' grids stacked on the outputs, so ``Lq`` must be whole blocks. ``W_UK`` and
    ``W_UV`` stay in ``param_dtype`` (the loader dequantizes ``kv_b_proj``): they are
    absorbed into the queries at decode and up-project latents at prefill, not linears of
    the hidden states, and they are small (V3: 17 M of the layer's 187 M weights, 2 GB over
    61 layers in bf16)."""

    def __init__(
        self,
        cfg: MLAConfig,
        *,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        fp8_blocks: tuple[int, int] | None = None,
    ):
        self.cfg = cfg
        n, qk, dt, fp8 = cfg.num_heads, cfg.qk_head_dim, param_dtype, fp8_blocks
        if cfg.q_lora_rank is None:
            self.q_proj = linear(cfg.hidden_size, n * qk, dt, rngs, fp8, COLUMNS)
            self.kv_a_proj_with_mqa = linear(cfg.hidden_size, cfg.cache_width, dt, rngs, fp8)
        else:
            lq = cfg.q_lora_rank
            if fp8 is not None and lq % fp8[0]:
                raise ValueError(
                    f"q_lora_rank {lq} is not a multiple of the FP8 weight_block_size's "
                    f"{fp8[0]} output columns: the fused q_a_proj / kv_a_proj_with_mqa "
                    "kernel needs whole blocks (load with fp8_weights='dequantize')"
                )
            self.fused_qkv_a_proj = linear(cfg.hidden_size, lq + cfg.cache_width, dt, rngs, fp8)
            self.q_a_layernorm = RMSNorm(lq, cfg.rms_norm_eps, param_dtype=dt)
            self.q_b_proj = linear(lq, n * qk, dt, rngs, fp8, COLUMNS)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, param_dtype=dt)
        # kv_c -> k_nope and kv_c -> v, per head (kv_b_proj's parts), initialised as its
        # kernel would be: fan-in Lkv.
        init = nnx.initializers.lecun_normal(batch_axis=(0,))
        lkv = cfg.kv_lora_rank
        self.W_UK = nnx.Param(init(rngs.params(), (n, lkv, cfg.qk_nope_head_dim), dt))
        self.W_UV = nnx.Param(init(rngs.params(), (n, lkv, cfg.v_head_dim), dt))
        self.o_proj = linear(n * cfg.v_head_dim, cfg.hidden_size, dt, rngs, fp8, ROWS)

    def __call__(
        self,
        x: jax.Array,
        cache: jax.Array | Fp8Cache,
        metadata: AttentionMetadata | PackedMetadata,
        *,
        layer: int | jax.Array | None = None,
        layer_in_run: int | jax.Array | None = None,
        impl: str = "auto",
    ) -> tuple[jax.Array, jax.Array | Fp8Cache]:
        """One step.

        Args:
          x: ``[T, H]`` hidden states. With ``PackedMetadata`` (``packing.packed_metadata``),
            the step's tokens packed in its requests' order, then up to its bucket of
            padding rows; with ``AttentionMetadata``, the bucket layout it describes
            (decodes first, ``T = metadata.num_tokens``), as the engine passes them.
          cache: ``[num_blocks, block_size, Lkv + R]`` this layer's latent cache, or with
            ``layer``, every layer's ``[L, num_blocks, block_size, Lkv + R]``; bfloat16 or
            float32, the geometry ``metadata`` was built for; or an ``Fp8Cache`` of the same
            leading axes (written quantized, read dequantized).
          metadata: the step's metadata (device arrays).
          layer: this layer's index into a stacked ``cache`` (may be traced, as in a scan
            over layers); the block ids of ``metadata`` are those of one layer.
          layer_in_run: where the FP8 projections hold a run of layers' stacked weights
            (``DeepseekModel``'s scan keeps them whole), this layer's index into them.
          impl: kernels to use (``kernels.select``); the Pallas kernels need metadata
            built with their schedules.

        Returns:
          ``[T, H]`` attention output (x's dtype, x's layout; padding rows 0) and the
          updated cache (its shape).
        """
        if isinstance(metadata, PackedMetadata):
            check_hidden(self.cfg, x)
            check_packed(x, metadata)
            y, cache = self(
                metadata.to_buckets(x),
                cache,
                metadata.attention,
                layer=layer,
                layer_in_run=layer_in_run,
                impl=impl,
            )
            return metadata.from_buckets(y, x.shape[0]), cache
        kernel_set = kernels.select(impl)
        check_step(self.cfg, x, cache, metadata, layer=layer, kernel_set=kernel_set)
        c = self.cfg
        t = x.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x, impl=kernel_set, layer_in_run=layer_in_run)
            kv = self.kv_a_proj_with_mqa(x, impl=kernel_set, layer_in_run=layer_in_run)
        else:
            qkv = self.fused_qkv_a_proj(x, impl=kernel_set, layer_in_run=layer_in_run)
            q_c = self.q_a_layernorm(qkv[:, : c.q_lora_rank])
            q = self.q_b_proj(q_c, impl=kernel_set, layer_in_run=layer_in_run)
            kv = qkv[:, c.q_lora_rank :]
        q = q.reshape(t, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        kv_c = self.kv_a_layernorm(kv[:, : c.kv_lora_rank])
        k_pe = kv[:, c.kv_lora_rank :]

        cos, sin = rope_cos_sin(c.rope, c.qk_rope_head_dim, metadata.positions)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=c.rope.interleaved)
        k_pe = apply_rope(k_pe, cos, sin, interleaved=c.rope.interleaved)
        cache = write_cache(cache, kv_c, k_pe, metadata.slot_mapping, layer=layer)
        kv_c, k_pe = as_stored(cache, kv_c, k_pe)  # what every later read of them sees
        layers = LayerView(cache, layer)

        num_decodes = metadata.num_decode_tokens
        outs = []
        if metadata.decode is not None:
            outs.append(
                self._decode(
                    kernel_set, q_nope[:num_decodes], q_pe[:num_decodes], layers, metadata.decode
                )
            )
        if metadata.prefill is not None:
            q = jnp.concatenate([q_nope[num_decodes:], q_pe[num_decodes:]], axis=-1)
            outs.append(
                self._prefill(
                    kernel_set,
                    q,
                    kv_c[num_decodes:],
                    k_pe[num_decodes:],
                    layers,
                    metadata.prefill,
                )
            )
        o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        o = o.reshape(t, c.num_heads * c.v_head_dim).astype(x.dtype)
        return self.o_proj(o, impl=kernel_set, layer_in_run=layer_in_run), cache

    def _decode(
        self,
        kernel_set: kernels.KernelSet,
        q_nope: jax.Array,
        q_pe: jax.Array,
        layers: LayerView,
        metadata: DecodeMetadata,
    ) -> jax.Array:
        """Absorbed path: ``[B, N, P]`` queries -> ``[B, N, V]`` (their dtype).

        The latent queries and outputs stay heads-leading, ``[N, B, Lkv]``, between the
        batched matmuls (one a head, heads as the batch axis, which a GPU's batched matmul
        wants leading) and the decode kernel (``heads_major``): batch-leading, each side
        transposed them, a pass over ``[B, N, Lkv]`` each way. q_lat's matmul writes the
        cache's dtype itself where the queries are in it (16-bit: the product accumulates
        in float32 and is rounded once, as a float32 result cast would be; a float32
        intermediate would be written and read again)."""
        cache = layers.blocks
        same_dtype = q_nope.dtype == cache.dtype
        q_lat = jnp.einsum(
            "bnp,nlp->nbl",
            q_nope,
            self.W_UK[...],
            preferred_element_type=cache.dtype if same_dtype else jnp.float32,
            precision=matmul_precision(q_nope.dtype),
        )
        o_lat, _ = kernel_set.mla_decode(
            q_lat.astype(cache.dtype),
            q_pe.astype(cache.dtype),
            cache,
            layers.block_ids(metadata.block_table),
            metadata.seq_lens,
            scale=self.cfg.softmax_scale,
            schedule=metadata.schedule,
            heads_major=True,
        )
        # The product in the queries' dtype where it is wider than the cache's (a float32
        # model over a bf16 or FP8 cache): with a bf16 result jax 0.12's CPU dot rounds its
        # sums (2% relative error where rounding the result costs 0.3%).
        o = jnp.einsum(
            "nbl,nlv->nbv",
            o_lat,
            self.W_UV[...].astype(o_lat.dtype),
            preferred_element_type=jnp.promote_types(q_nope.dtype, o_lat.dtype),
            precision=matmul_precision(o_lat.dtype),
        )
        return jnp.swapaxes(o, 0, 1).astype(q_nope.dtype)

    def _key_weight(self, dtype) -> jax.Array:
        """``[Lkv + R, N, P + R]``: latent rows ``concat(kv_c, k_pe)`` -> keys
        ``concat(kv_c @ W_UK, k_pe)`` in one matmul, W_UK beside an identity that copies
        k_pe into each head's last R columns (exact: k_pe times 1 plus zeros, accumulated in
        float32). Concatenating k_nope with k_pe broadcast over the heads after the matmul
        was a pass over all the keys: at DeepSeek-V3's 128 heads, 8192 context rows took 187
        us of matmul and 184 of concatenation, 280 us this way (H200)."""
        c = self.cfg
        lkv, r, p = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim
        rope = jnp.broadcast_to(jnp.eye(r, dtype=dtype)[:, None, :], (r, c.num_heads, r))
        w_uk = jnp.swapaxes(self.W_UK[...], 0, 1).astype(dtype)
        w_k = jnp.zeros((lkv + r, c.num_heads, p + r), dtype)
        return w_k.at[:lkv, :, :p].set(w_uk).at[lkv:, :, p:].set(rope)

    def _value_weight(self, dtype) -> jax.Array:
        """``[Lkv, N, V]``: kv_c -> values of every head in one matmul (W_UV, latent-major)."""
        return jnp.swapaxes(self.W_UV[...], 0, 1).astype(dtype)

    def _up_project(
        self, latent: jax.Array, w_k: jax.Array, w_v: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``latent [T, Lkv + R]`` rows ``concat(kv_c, k_pe)`` -> keys ``[T, N, P + R]`` and
        values ``[T, N, V]`` (``w_k``, ``w_v``: ``_key_weight``, ``_value_weight`` in
        latent's dtype)."""
        precision = matmul_precision(latent.dtype)
        lkv = self.cfg.kv_lora_rank
        k = jnp.einsum("tc,cnk->tnk", latent, w_k, precision=precision)
        v = jnp.einsum("tl,lnv->tnv", latent[:, :lkv], w_v, precision=precision)
        return k, v

    def _prefill(
        self,
        kernel_set: kernels.KernelSet,
        q: jax.Array,
        kv_c: jax.Array,
        k_pe: jax.Array,
        layers: LayerView,
        metadata: PrefillMetadata,
    ) -> jax.Array:
        """Compute-friendly path: ``q [Tp, N, P + R]`` -> ``[Tp, N, V]``."""
        latent = jnp.concatenate([kv_c, k_pe.astype(kv_c.dtype)], axis=-1)
        dt = latent.dtype
        k, v = self._up_project(latent, self._key_weight(dt), self._value_weight(dt))
        out, lse = kernel_set.flash_prefill(
            q,
            k,
            v,
            metadata.query_start_loc,
            metadata.query_start_loc,
            scale=self.cfg.softmax_scale,
            causal=True,
            schedule=metadata.schedule,
        )
        if metadata.chunks is None:
            return out
        context_out, context_lse = self._context(kernel_set, q, layers, metadata)
        out, _ = kernel_set.merge_attn_states(context_out, context_lse, out, lse, out_dtype=q.dtype)
        return out

    def _context(
        self,
        kernel_set: kernels.KernelSet,
        q: jax.Array,
        layers: LayerView,
        metadata: PrefillMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        """Attention of the prefill queries over their cached context, one workspace-sized
        chunk at a time (a scan, so peak memory is one chunk's keys and values). The
        running result is float32, so that many chunks add no bf16 rounding."""
        chunks = metadata.chunks
        block_table = layers.block_ids(metadata.block_table)
        # built once, outside the chunks' loop
        w_k, w_v = self._key_weight(q.dtype), self._value_weight(q.dtype)

        def attend(carry, cu_seq_lens, starts, total):
            workspace = _gather_workspace(
                layers.blocks,
                block_table,
                cu_seq_lens,
                starts,
                total,
                chunks.workspace_size,
            ).astype(q.dtype)
            k, v = self._up_project(workspace, w_k, w_v)
            out, lse = kernel_set.flash_prefill(
                q,
                k,
                v,
                metadata.query_start_loc,
                cu_seq_lens,
                scale=self.cfg.softmax_scale,
                causal=False,
                schedule=metadata.schedule,
            )
            return kernel_set.merge_attn_states(*carry, out, lse)

        def chunk(carry, plan):
            # The chunk count is fixed by the buckets: a chunk past the context is skipped.
            total = plan[2]
            carry = jax.lax.cond(total > 0, attend, lambda carry, *_: carry, carry, *plan)
            return carry, None

        tq, n = q.shape[:2]
        init = (
            jnp.zeros((tq, n, self.cfg.v_head_dim), jnp.float32),
            jnp.full((tq, n), -jnp.inf, jnp.float32),
        )
        (out, lse), _ = jax.lax.scan(
            chunk, init, (chunks.cu_seq_lens, chunks.starts, chunks.totals)
        )
        return out, lse


class LayerView:
    """One layer of a cache as the kernels take it: ``blocks``, every layer's blocks as one
    ``[L * num_blocks, block_size, Lkv + R]`` array (a free reshape, where slicing a layer
    out would copy it; each of an ``Fp8Cache``'s three arrays alike), and ``block_ids`` maps
    the layer's block ids into it."""

    def __init__(self, cache: jax.Array | Fp8Cache, layer: int | jax.Array | None):
        if layer is None:
            self.blocks, self.first_block = cache, 0
        else:
            num_layers, num_blocks = cache.shape[:2]
            self.blocks = jax.tree.map(
                lambda part: part.reshape(num_layers * num_blocks, *part.shape[2:]), cache
            )
            self.first_block = layer * num_blocks

    def block_ids(self, block_table: jax.Array) -> jax.Array:
        """``block_table [B, W]`` int32 of one layer -> ids into ``blocks``. Entries a
        request does not need may hold anything; they are never read."""
        return block_table + self.first_block


def _gather_workspace(
    cache: jax.Array,
    block_table: jax.Array,
    cu_seq_lens: jax.Array,
    starts: jax.Array,
    total: jax.Array,
    workspace_size: int,
) -> jax.Array:
    """``[workspace_size, Lkv + R]``: the chunk's context rows, prefill ``r``'s positions
    ``[starts[r], ...)`` at workspace rows ``[cu_seq_lens[r], cu_seq_lens[r + 1])``; rows
    past ``total`` are zero and read no cache row."""
    i = jnp.arange(workspace_size)
    request = jnp.clip(jnp.searchsorted(cu_seq_lens, i, side="right") - 1, 0, starts.shape[0] - 1)
    position = starts[request] + i - cu_seq_lens[request]
    return gather_rows(cache, block_table, request, position, i < total)
