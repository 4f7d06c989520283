"""Paged absorbed MLA decode on Hopper (Pallas, Mosaic GPU lowering): wgmma, TMA, two
warpgroups, split-KV with the Triton kernel's plan and LSE combine.

Same contract as ``pallas_triton.mla_decode``. The design follows FlashMLA's Hopper kernel
(design notes and measurements in ``mla_jax/kernels/decode/MOSAIC_GPU.md``): a program owns 64
query-head rows (one wgmma M tile; heads are zero-padded to a multiple of 64) and runs its
items (``schedule_splits``) page by page with two warpgroups, each owning half of the
``[64, Lkv]`` float32 output (128 registers a thread instead of 256):

* each item's queries and each 64-token page (through the block table) are copied into
  shared memory by TMA, two page slots deep, the latent ``[64, Lkv]`` and rope ``[64, R]``
  parts apart; warpgroup 0 issues the copies, the next page's as soon as both warpgroups
  are done with its slot, so a page's copies fly while the one before it is computed;
* each page is two 32-token chunks, one a warpgroup: the owner of a chunk computes its
  scores ``[q_lat, q_pe] @ [kv_c, k_pe]^T`` and the online softmax, and hands the bf16
  probabilities (written over the chunk's rope rows, which nothing reads after its scores)
  and the new row maximum to the other through shared memory; both then add
  ``P @ kv_c[:, half]`` of both chunks. Warpgroup 1 issues its scores before waiting for
  warpgroup 0's probabilities and runs its softmax while the first product is in flight
  (FlashMLA's "seesaw"); 32-token chunks keep the scores, probabilities and masks at 16
  registers each beside the 128 of the accumulator;
* lazy rescaling (FlashAttention-4's): a row's maximum moves only when a score exceeds it
  by ``online_softmax.RESCALE_SLACK``, and a warp whose rows' maxima a chunk left where
  they were skips its rescale of the accumulator (``mosaic_gpu.rescale_rows``).

An item's first page may start before it (items start anywhere) and its last may end after
it: those keys are masked, and the value rows past the item's end are zeroed in shared
memory before any product reads them, so stale or NaN rows there change nothing; no
block-table entry past ``cdiv(seq_len, 64)`` is read.

Over an FP8 cache (``fp8.Fp8Cache``) the same kernel (a static variant) copies each page's
e4m3 latent and bf16 rope by TMA, two pages deep, and at the start of a page both
warpgroups dequantize it into one float16 page in shared memory, each the half of the
columns its products use: e4m3 -> float16 times the token's power-of-two scale (loaded from
global memory a page ahead), exact in float16's range, with the rows past the item's end
written as zeros. A warpgroup's scores start with the product over its own half and wait
for the other's half behind it. The latent wgmmas then run in float16, the queries scaled
per row into float16's range and the scores scaled back
(``MosaicDecodeConfig.float16_mma``; off, the page is bf16 through float32, as the
queries); the rope wgmma stays bf16 (wgmma has no 16-bit x fp8 form).

Runs on sm90 with page 64, bf16 (or an FP8 cache with bf16 rope), ``Lkv`` a multiple of 128
and ``R == 64``; ``mla_decode`` hands anything else to the Triton kernel (logged once per
reason).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import fp8, matmul_steps, mosaic_gpu, online_softmax
from . import pallas_triton

log = logging.getLogger(__name__)

BLOCK_H = 64  # query-head rows of a program: one wgmma M tile
PAGE = 64  # cache page
CHUNK = 32  # tokens per softmax step: half a page, the page's owner warpgroup's share
NUM_SLOTS = 2  # pages in shared memory: the next page's copies fly while one is computed
ROPE = 64  # k_pe width
SWIZZLE_COLUMNS = 32  # bf16 columns of a 64-byte swizzled shared-memory tile
# An FP8 page's staging tiles: 32 one-byte columns (a 32-byte swizzle), the width of the
# bf16 tiles they are dequantized into.
FP8_SWIZZLED = (plgpu.TilingTransform((8, SWIZZLE_COLUMNS)), plgpu.SwizzleTransform(32))
NUM_WARPGROUPS = 2  # each holds half of the output's columns
PAIR = "pair"  # the cluster axis of two head blocks that share each page's copy (multicast)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Compile options of the Mosaic GPU decode kernel.

    approx_math: exp2 through the special-function unit (``ex2.approx``), as FlashMLA.
    auto_barriers: let Pallas put a warpgroup barrier around every shared-memory store
      (off: the kernel orders its stores itself, through its mbarriers and commit_smem).
    lazy_rescale: rows keep their maximum until a score exceeds it by
      ``online_softmax.RESCALE_SLACK``, and a warp rescales its rows of the accumulator
      (128 registers a thread) only after a chunk that moved one of them (off: the exact
      online softmax, a rescale every chunk).
    float16_mma: over an FP8 cache, the latent wgmmas in float16 instead of bfloat16: the
      e4m3 pages convert in one instruction a pair (three into bf16) and take their
      power-of-two scales in float16; each query row is scaled by the power of two that
      puts it into float16's range (exact, ``matmul_steps.float16_rows``) and its scores are
      scaled back in the softmax; the probabilities are float16 (11 bits where bf16 has 8:
      out's error against float64 about 2.4x lower). The pages are exact for scales up to
      ``FLOAT16_MAX_SCALE`` (a group's largest magnitude up to ``FLOAT16_MAX_LATENT``)
      and down to 2^-15; smaller scales round e4m3's smallest values in float16's
      subnormals (an absolute error of at most 2^-25). ``mla_decode`` takes the bf16 MMA
      where concrete scales exceed the range; the engine refuses a model whose latent can
      (``float16_latent_bound``).
    float16_min_batch: float16_mma from this many requests up. The kernel itself is
      faster with it at every measured size, but the queries' preparation is four XLA
      fusions, more than the conversion saves on few requests. 128 heads, kernel / the
      preparation / whole call, bf16 wgmmas -> float16 (H200, ``decode_mgpu_fp8.json``'s
      runs of 2026-11-28 and the first of 2026-11-29): one 16384-token request 26.8 ->
      25.5 / 4.8 / 32.8 -> 36.6 us; 32 x 4096 129.1 -> 120.5 / 8.9 / 135.4 -> 136.0; 128 x
      4096 468.4 -> 434.0 / 20.4 / 478.5 -> 464.9.
    multicast: over a bf16 cache with an even number of 64-head blocks (128 heads), each
      pair of blocks runs as a cluster of two programs on the same items, and each page is
      copied from L2 once, by TMA multicast into both (each program issues half of it); a
      slot is refilled once both warpgroups of both programs are done with it (a cluster
      barrier). Both programs of a pair read the same pages, so this halves the kernel's L2
      reads (83% of L2 throughput at 128 heads, ncu, MOSAIC_GPU.md step 10). 128 heads,
      kernel time unpaired -> paired (H200, 2026-12-01, two runs each): 128 x 4096 313.4 ->
      305.2 us, 64 x 16384 578.6 -> 558.9 us.
    fp8_multicast: the same over the FP8 cache (its e4m3 staging and bf16 rope pages copied
      once for the pair). Off: it is slower there, 128 heads 128 x 4096 403.3 -> 415.9 us and
      64 x 16384 761.4 -> 789.0 us (same runs), where the kernel is bound by each program's
      dequantization rather than L2, and the shared release ties each program to its
      peer's slower page.
    """

    approx_math: bool = True
    auto_barriers: bool = False
    lazy_rescale: bool = True
    float16_mma: bool = True
    float16_min_batch: int = 64
    multicast: bool = True
    fp8_multicast: bool = False


# The largest scale float16_mma's pages hold: e4m3's largest value 448 x 2^7 = 57344 is below
# float16's 65504 (x 2^8 would overflow), i.e. groups whose largest magnitude is at most
# FLOAT16_MAX_LATENT (``fp8.quantize`` takes the smallest power of two above amax / 448).
FLOAT16_MAX_SCALE = 2.0**7
FLOAT16_MAX_LATENT = fp8.E4M3_MAX * FLOAT16_MAX_SCALE


def float16_latent_bound(norm_weight_max: float, kv_lora_rank: int) -> float:
    """The largest magnitude an RMS-normalised latent can reach (DeepSeek's ``kv_c`` is
    ``kv_a_layernorm``'s output): ``|x_i| / rms(x) <= sqrt(kv_lora_rank)`` times the norm's
    largest weight, with two bf16 roundings (the normalised value and the product). At most
    ``FLOAT16_MAX_LATENT``: every scale of its FP8 cache is in float16_mma's range."""
    return norm_weight_max * math.sqrt(kv_lora_rank) * (1 + 2.0**-8) ** 2


def padded_heads(num_heads: int) -> int:
    """Heads the kernel runs: N rounded up to a multiple of 64 (padding heads get zero
    queries and are dropped)."""
    return -(-num_heads // BLOCK_H) * BLOCK_H


# Below 64 heads over an FP8 cache, the batch from which the padded kernel beats the Triton
# FP8 kernel (H200, 2026-11-27, 16 heads: 1.07x at 32 x 4096, 1.19x at 128 x 4096, 1.30x at
# 64 x 16384; 0.82x at 1 x 16384; ``decode_mgpu_fp8.json`` and ``--sweep few``).
FP8_MIN_BATCH = 32


def pays_off(num_heads: int, batch: int = 1, quantized: bool = False) -> bool:
    """Whether the kernel beats the Triton one for ``batch`` requests at ``num_heads`` heads
    (over an FP8 cache if ``quantized``): from 64 heads (one wgmma tile of rows) up. Fewer
    heads are padded to 64 rows, which at 16 heads is 4x the work of a bandwidth-bound
    decode: over bf16 1.16-1.82x the Triton kernel's time on an H200 (BENCHMARKS.md,
    ``decode_mgpu``); over FP8 the Triton kernel's dequantization costs more than the
    padding from ``FP8_MIN_BATCH`` requests up."""
    return num_heads >= BLOCK_H or (quantized and batch >= FP8_MIN_BATCH)


def num_programs(num_heads: int, num_sms: int = pallas_triton.DEFAULT_NUM_SMS) -> int:
    """Programs per block of 64 heads: one a multiprocessor (a program takes 225 KB of
    shared memory), the multiprocessors shared between the head blocks."""
    return max(1, num_sms // (padded_heads(num_heads) // BLOCK_H))


# What a program pays for each item it starts, in pages: the queries' copy, the first page's
# wait, the partial row's store and the merge of a split request. Measured (H200,
# 2026-11-29, 128 heads, kernel and merge): 64 requests of 16384 tokens on 66 programs (119
# items, 249 pages a program) took 590.6 us against 577.6 on 64 (64 items, 256 pages);
# 128 of 4096 on 66 (167 items) 320.7 against 316.8 on 64 (128 items, 128 pages). A fit of
# those figures puts an item at 3-9 pages of the kernel alone, plus the merge.
ITEM_COST = 8


def schedule(
    seq_lens: np.ndarray,
    num_heads: int,
    num_sms: int = pallas_triton.DEFAULT_NUM_SMS,
    num_items: int | None = None,
) -> pallas_triton.DecodeSchedule:
    """This kernel's split-KV plan for ``seq_lens [B]`` keys per request (host, NumPy int):
    ``schedule_splits`` over ``num_programs`` programs in pages, each item costed at
    ``ITEM_COST`` pages (equal requests run unsplit where splitting them gains less)."""
    return pallas_triton.schedule_splits(
        seq_lens,
        num_programs=num_programs(num_heads, num_sms),
        block_k=PAGE,
        num_items=num_items,
        item_cost=ITEM_COST,
    )


def unsupported(q_lat, q_pe, kv_cache) -> str | None:
    """Why the Mosaic GPU kernel cannot run these inputs here (None: it can). An
    ``fp8.Fp8Cache`` runs under the same conditions as a bf16 cache (its ``shape`` and
    ``dtype`` are those of the bf16 cache it stands for)."""
    if len(kv_cache.shape) != 3 or q_lat.ndim != 3 or q_pe.ndim != 3:
        return "inputs that are not 3-D"
    if kv_cache.shape[1] != PAGE:
        return f"page size {kv_cache.shape[1]} (runs {PAGE})"
    if q_lat.dtype != jnp.bfloat16:
        return f"dtype {q_lat.dtype} (runs bfloat16)"
    if q_lat.shape[-1] % (2 * 64) or q_pe.shape[-1] != ROPE:
        return f"Lkv {q_lat.shape[-1]} and R {q_pe.shape[-1]} (runs Lkv % 128 == 0, R == {ROPE})"
    return mosaic_gpu.device_unsupported()


def mla_decode(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array | fp8.Fp8Cache,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    schedule: pallas_triton.DecodeSchedule | None = None,
    config: MosaicDecodeConfig | None = None,
    combine_config: pallas_triton.DecodeConfig | None = None,
    interpret: bool | None = None,
    heads_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache (the contract of
    ``pallas_triton.mla_decode``).

    Args:
      q_lat: ``[B, N, Lkv]`` bf16 queries in the latent space (any N); ``[N, B, Lkv]``
        with ``heads_major``.
      q_pe: ``[B, N, R]`` bf16 rotated rope queries.
      kv_cache: ``[num_blocks, 64, Lkv + R]`` bf16 rows ``concat(kv_c, k_pe)``, or an
        ``fp8.Fp8Cache`` of pages of 64 (dequantized exactly into bf16 in shared memory).
        Other page sizes, dtypes and widths run the Triton kernel (logged once).
      block_table: ``[B, W]`` int32; only the first ``cdiv(seq_lens[b], 64)`` entries of
        row b are read.
      seq_lens: ``[B]`` int32 keys per request; 0 gives out 0 and lse -inf.
      scale: softmax scale.
      schedule: the split-KV plan (``schedule``, or ``pallas_triton.schedule_splits`` for
        any program count in whole pages), or one cut to shorter lengths by
        ``truncate_schedule``; None runs each request whole in a program of its own.
      config: compile options (default ``MosaicDecodeConfig()``).
      combine_config: its ``combine_*`` fields launch the merge of split requests (the
        Triton kernel's ``combine_splits``; default: ``DecodeConfig.for_shape(N, B)``'s).
      interpret: run in Mosaic GPU's interpret mode (default: off a GPU).
      heads_major: q_lat and out with heads leading, ``[N, B, Lkv]``
        (``pallas_triton.mla_decode``'s).

    Returns:
      ``out [B, N, Lkv]`` (``[N, B, Lkv]`` with ``heads_major``) in q's dtype and
      ``lse [B, N]`` float32 (natural log).
    """
    reason = unsupported(q_lat, q_pe, kv_cache)
    if reason is not None:
        mosaic_gpu.log_once(
            log, f"mla_decode: the Mosaic GPU kernel does not run {reason}; using Triton"
        )
        return pallas_triton.mla_decode(
            q_lat,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            scale=scale,
            schedule=schedule,
            interpret=interpret,
            heads_major=heads_major,
        )
    view = pallas_triton.batch_major_view(q_lat, heads_major)
    b, n, lkv = view.shape
    triton_config = pallas_triton.DecodeConfig.for_shape(n, b)
    # The same checks and the same one-line errors as the Triton kernel.
    pallas_triton._check(view, q_pe, kv_cache, block_table, seq_lens, triton_config.block_h)
    pallas_triton._check_values(kv_cache, block_table, seq_lens)
    if interpret is None:
        interpret = online_softmax.interpret_default()
    config = config or MosaicDecodeConfig()
    float16 = config.float16_mma and b >= config.float16_min_batch
    if float16 and _scales_past_float16(kv_cache):
        mosaic_gpu.log_once(
            log,
            f"mla_decode: FP8 cache scales above {FLOAT16_MAX_SCALE:g} (latents past "
            f"{FLOAT16_MAX_LATENT:g}) overflow float16: the latent wgmmas run in bf16",
        )
        float16 = False
    # _mla_decode compiles one variant: float16_mma says whether this call takes it.
    config = dataclasses.replace(config, float16_mma=float16, float16_min_batch=0)
    heads = padded_heads(n)
    combine_config = combine_config or triton_config
    combine_config = dataclasses.replace(
        combine_config,
        combine_block_h=min(combine_config.combine_block_h, heads),
        combine_block_d=min(combine_config.combine_block_d, lkv),
    )
    return _mla_decode(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        schedule,
        scale=scale,
        config=config,
        combine_config=combine_config,
        interpret=interpret,
        heads_major=heads_major,
    )


def _scales_past_float16(kv_cache) -> bool:
    """Whether a concrete FP8 cache holds a scale float16_mma's pages cannot hold (under a
    jit trace the values are unknown: the engine checks the model's bound instead)."""
    if not isinstance(kv_cache, fp8.Fp8Cache) or isinstance(kv_cache.scales, jax.core.Tracer):
        return False
    return bool(np.nanmax(np.asarray(kv_cache.scales), initial=0.0) > FLOAT16_MAX_SCALE)


@functools.partial(
    jax.jit, static_argnames=("scale", "config", "combine_config", "interpret", "heads_major")
)
def _mla_decode(
    q_lat,
    q_pe,
    kv_cache,
    block_table,
    seq_lens,
    schedule,
    *,
    scale,
    config,
    combine_config,
    interpret,
    heads_major,
):
    b, n, lkv = pallas_triton.batch_major_view(q_lat, heads_major).shape
    heads = padded_heads(n)
    q_lat = online_softmax.pad_to(q_lat, pallas_triton.head_shape(b, heads, lkv, heads_major))
    q_pe = online_softmax.pad_to(q_pe, (b, heads, ROPE))
    if schedule is None:
        schedule = pallas_triton._whole_requests(seq_lens)
    programs = schedule.prog_items.shape[0] - 1
    items = schedule.item_req.shape[0]
    row_factors = None
    if config.float16_mma and isinstance(kv_cache, fp8.Fp8Cache):
        # Each query row (and its rope part, which stays bf16) times the power of two that
        # puts the row into float16's range; the kernel scales its scores back.
        q_lat, row_factors = matmul_steps.float16_rows(q_lat.reshape(b * heads, lkv))
        q_lat = q_lat.reshape(pallas_triton.head_shape(b, heads, lkv, heads_major))
        row_factors = row_factors.reshape(q_lat.shape[:2])
        if heads_major:
            row_factors = row_factors.T
        q_pe = (q_pe.astype(jnp.float32) / row_factors[..., None]).astype(q_pe.dtype)
    out, lse, o_part, lse_part = _decode_call(
        q_lat,
        q_pe,
        kv_cache,
        row_factors,
        block_table,
        schedule,
        scale=scale,
        programs=programs,
        items=items,
        config=config,
        interpret=interpret,
        heads_major=heads_major,
    )
    out, lse = pallas_triton.combine_splits(
        schedule.req_items,
        o_part,
        lse_part,
        out,
        lse,
        config=combine_config,
        interpret=interpret,
        heads_major=heads_major,
    )
    return pallas_triton.unpad_out(out, n, lkv, heads_major), lse[:, :n]


def _decode_call(
    q_lat,
    q_pe,
    kv_cache,
    row_factors,
    block_table,
    schedule,
    *,
    scale,
    programs,
    items,
    config,
    interpret,
    heads_major,
):
    """The split-KV kernel: ``(out, lse)`` of the items that cover a request whole, the
    float32 partials ``(o_part, lse_part)`` of the others. ``row_factors [B, heads]``
    float32 (or None): what undoes the float16 queries' scaling (``float16_mma``)."""
    b, heads, lkv = pallas_triton.batch_major_view(q_lat, heads_major).shape
    quantized = isinstance(kv_cache, fp8.Fp8Cache)
    # The latent wgmmas' operands (queries, pages, probabilities): float16 under float16_mma.
    mma_dtype = q_lat.dtype
    # 64-byte swizzle everywhere: a wgmma's operands share one swizzle, and the product
    # of a chunk's probabilities [64, 32] with its values has a 64-byte (K = 32) A row.
    swizzled = (plgpu.TilingTransform((8, SWIZZLE_COLUMNS)), plgpu.SwizzleTransform(64))
    bf16 = jnp.bfloat16
    if quantized:
        # One bf16 page (the wgmmas' operand) and two FP8 pages in flight: the queries, two
        # bf16 slots and FP8 staging would not fit in shared memory.
        fp8_scratch = dict(
            fp8_smem=plgpu.SMEM((NUM_SLOTS, PAGE, lkv), fp8.FP8, transforms=FP8_SWIZZLED),
            dq_ready=plgpu.Barrier(num_arrivals=NUM_WARPGROUPS),
        )
    else:
        fp8_scratch = {}
    head_blocks = heads // BLOCK_H
    clustered = (config.fp8_multicast if quantized else config.multicast) and head_blocks % 2 == 0
    cluster = 2 if clustered else 1  # programs a cluster: the head blocks of a pair
    grid = dict(grid=(head_blocks // cluster, programs), grid_names=("h", "p"))
    if clustered:
        grid.update(cluster=(cluster,), cluster_names=(PAIR,))
        # Both warpgroups of both programs release a slot before either refills it (each
        # refill writes into both programs' shared memory).
        kv_free = plgpu.ClusterBarrier(
            collective_axes=(PAIR,), num_arrivals=NUM_WARPGROUPS, num_barriers=NUM_SLOTS
        )
    else:
        kv_free = plgpu.Barrier(num_arrivals=1, num_barriers=NUM_SLOTS)  # warpgroup 1 -> 0
    scratch = dict(
        q_lat_smem=plgpu.SMEM((BLOCK_H, lkv), mma_dtype, transforms=swizzled),
        q_pe_smem=plgpu.SMEM((BLOCK_H, ROPE), bf16, transforms=swizzled),
        kv_smem=plgpu.SMEM(
            (1 if quantized else NUM_SLOTS, PAGE, lkv), mma_dtype, transforms=swizzled
        ),
        # A chunk's probabilities [64, CHUNK] take the bytes of its rope rows [CHUNK, 64]:
        # those are read only by the chunk's own scores, which come first.
        pe_or_probs=plgpu.RefUnion(
            plgpu.SMEM((NUM_SLOTS, PAGE, ROPE), bf16, transforms=swizzled),
            plgpu.SMEM((NUM_SLOTS, NUM_WARPGROUPS, BLOCK_H, CHUNK), mma_dtype, transforms=swizzled),
        ),
        m_smem=plgpu.SMEM((NUM_WARPGROUPS, BLOCK_H), jnp.float32),
        l_smem=plgpu.SMEM((2, NUM_WARPGROUPS, BLOCK_H), jnp.float32),
        kv_ready=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),  # two copies a page
        kv_free=kv_free,
        p_ready=plgpu.Barrier(num_arrivals=1, num_barriers=NUM_WARPGROUPS),  # owner -> other
        q_ready=plgpu.Barrier(num_arrivals=2),
        q_free=plgpu.Barrier(num_arrivals=1),
        l_ready=plgpu.Barrier(num_arrivals=NUM_WARPGROUPS),
        **fp8_scratch,
    )
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            scale=scale,
            lazy_rescale=config.lazy_rescale,
            float16_scores=row_factors is not None,
            clustered=clustered,
            interpret=bool(interpret),
            heads_major=heads_major,
        ),
        out_type=(
            # (q_lat may be float16)
            jax.ShapeDtypeStruct(pallas_triton.head_shape(b, heads, lkv, heads_major), q_pe.dtype),
            jax.ShapeDtypeStruct((b, heads), jnp.float32),
            jax.ShapeDtypeStruct((items, heads, lkv), jnp.float32),
            jax.ShapeDtypeStruct((items, heads), jnp.float32),
        ),
        scratch_types=scratch,
        **grid,
        num_threads=NUM_WARPGROUPS,
        thread_name="wg",
        **mosaic_gpu.kernel_options(
            config, interpret, NUM_WARPGROUPS, programs_per_cluster=cluster
        ),
    )
    return kernel(
        schedule.prog_items,
        schedule.item_req,
        schedule.item_start,
        schedule.item_end,
        schedule.req_items,
        block_table,
        q_lat,
        q_pe,
        *jax.tree.leaves(kv_cache),
        *([] if row_factors is None else [row_factors]),
    )


def _kernel(
    prog_items_ref,
    item_req_ref,
    item_start_ref,
    item_end_ref,
    req_items_ref,
    block_table_ref,
    q_lat_ref,
    q_pe_ref,
    *cache_factors_and_out_refs,
    q_lat_smem,
    q_pe_smem,
    kv_smem,
    pe_or_probs,
    m_smem,
    l_smem,
    kv_ready,
    kv_free,
    p_ready,
    q_ready,
    q_free,
    l_ready,
    scale,
    lazy_rescale,
    float16_scores,
    clustered,
    interpret,
    heads_major,
    fp8_smem=None,
    dq_ready=None,
):
    """One program (a block of 64 heads x a share of the batch's tokens) on two warpgroups;
    the refs are the kernel's inputs, outputs and shared memory (see ``_decode_call``): the
    cache is one bf16 ref ``[blocks, 64, Lkv + R]`` or an FP8 cache's three (``kv_c``,
    ``k_pe``, ``scales``), which come with ``fp8_smem`` and ``dq_ready``; with
    ``float16_scores`` the queries' row factors ``[B, heads]`` follow the cache. ``q_lat``
    and ``out`` are ``[heads, B, Lkv]`` with ``heads_major``."""
    quantized = fp8_smem is not None
    *inputs, out_ref, lse_ref, o_part_ref, lse_part_ref = cache_factors_and_out_refs
    cache_refs = inputs[: 3 if quantized else 1]
    page_dtype = kv_smem.dtype
    # What an FP8 page is converted in before its scales multiply it: float16 is e4m3's
    # one-instruction conversion and exact for its products with power-of-two scales (in
    # range); bf16 pages go through float32.
    convert_dtype = jnp.float16 if page_dtype == jnp.float16 else jnp.float32
    lkv = q_lat_smem.shape[-1]
    pe_smem, p_smem = pe_or_probs
    half_width = lkv // NUM_WARPGROUPS
    wg = lax.axis_index("wg")
    p = lax.axis_index("p")
    head_block = lax.axis_index("h")
    if clustered:
        head_block = 2 * head_block + lax.axis_index(PAIR)
    heads = pl.ds(head_block * BLOCK_H, BLOCK_H)
    # A pair of programs copies each page once, into both (``MosaicDecodeConfig.multicast``,
    # ``fp8_multicast``).
    page_copy = dict(collective_axes=PAIR) if clustered else {}
    first_item, last_item = prog_items_ref[p], prog_items_ref[p + 1]
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    log2_scale = scale * math.log2(math.e)

    def accumulate(acc, alpha, a_ref, b_ref, during=lambda: None):
        """``acc * alpha[:, None] + a_ref @ b_ref`` with ``during()`` run while the wgmma is
        in flight; returns the sum and what ``during`` returned. Interpret mode cannot load
        a value into a wgmma accumulator, so there the product starts from zero and is added
        after (the same arithmetic in a different order)."""
        scaled = mosaic_gpu.rescale_rows(acc, alpha, lazy=lazy_rescale, interpret=interpret)

        def scope(acc_ref):
            if not interpret:
                acc_ref[...] = scaled
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            result = during()
            return acc_ref[...], result

        total, result = pl.run_scoped(scope, plgpu.ACC(acc.shape, jnp.float32))
        return (scaled + total if interpret else total), result

    def scores(w, slot, latent, c, during=lambda: None):
        """Warpgroup ``w``'s ``[64, CHUNK]`` raw scores of chunk ``c`` of the page in
        ``slot`` (its 16-bit latent ``[64, Lkv]`` in ``latent``), with ``during()`` run
        while the wgmma is in flight. A bf16 page: waits for its copy first. An FP8 page
        (whose copy ``dequantize`` waited for): issues the product over our own half of the
        columns, then waits for the other warpgroup's half, so that the wait overlaps that
        product."""

        def scope(s_ref):
            rows = pl.ds(c * CHUNK, CHUNK)
            if quantized:
                own = pl.ds(w * half_width, half_width)
                other = pl.ds((1 - w) * half_width, half_width)
                plgpu.wgmma(s_ref, q_lat_smem.at[:, own], latent.at[rows, own].T)
                plgpu.barrier_wait(dq_ready)
                plgpu.wgmma(s_ref, q_lat_smem.at[:, other], latent.at[rows, other].T)
            else:
                plgpu.barrier_wait(kv_ready.at[slot])
                plgpu.wgmma(s_ref, q_lat_smem, latent.at[rows].T)
            plgpu.wgmma(s_ref, q_pe_smem, pe_smem.at[slot, rows].T)
            result = during()
            return s_ref[...], result

        return pl.run_scoped(scope, plgpu.ACC((BLOCK_H, CHUNK), jnp.float32))

    def warpgroup(w):
        """Warpgroup ``w``'s part of the program's items: output columns ``half``, chunk
        ``w`` of each page (and, for warpgroup 0, every copy)."""
        half = pl.ds(w * half_width, half_width)

        def item(i, pages_done):
            req, start, end = item_req_ref[i], item_start_ref[i], item_end_ref[i]
            if float16_scores:
                # Undoes the float16 queries' power-of-two row scaling in the softmax.
                score_scale = log2_scale * plgpu.load(
                    inputs[-1].at[req, heads], layout=row_layout, optimized=False
                )
            else:
                score_scale = log2_scale
            first_page = start // PAGE
            last_page = jnp.maximum(end - 1, 0) // PAGE
            pages = jnp.where(end > start, last_page - first_page + 1, 0)

            def slot_of(k):
                return (pages_done + k) % NUM_SLOTS

            def bf16_page(k):
                """The bf16 latent ``[64, Lkv]`` of the item's page ``k``: its own slot, or
                the one page an FP8 cache is dequantized into. That one is indexed by a
                value the compiler cannot prove constant (0 below 2^30 pages): with a
                constant index every wgmma descriptor and store address of the page is
                loop-invariant, LLVM hoists them all out of the page loop (64 bits each)
                and ptxas spilled 1 KB a thread (H200: 759 -> 521 us at 128 x 4096, 128
                heads, ``decode_mgpu_fp8.json``)."""
                if quantized:
                    return kv_smem.at[(pages_done + k) // 2**30]
                return kv_smem.at[slot_of(k)]

            def load_page(k):
                """Starts the copies of the item's page ``k`` into its slot (warpgroup 0
                issues them, once the slot is free)."""
                slot = slot_of(k)
                block = block_table_ref[req, first_page + k]
                if quantized:
                    kv_c_ref, k_pe_ref, _ = cache_refs
                    latent, rope = kv_c_ref.at[block], k_pe_ref.at[block]
                    latent_smem = fp8_smem.at[slot]
                else:
                    (cache_ref,) = cache_refs
                    latent = cache_ref.at[block, :, pl.ds(0, lkv)]
                    rope = cache_ref.at[block, :, pl.ds(lkv, ROPE)]
                    latent_smem = kv_smem.at[slot]
                plgpu.copy_gmem_to_smem(latent, latent_smem, kv_ready.at[slot], **page_copy)
                plgpu.copy_gmem_to_smem(rope, pe_smem.at[slot], kv_ready.at[slot], **page_copy)

            if w == 0:
                # The item's queries once warpgroup 1 is done with the last item's, its
                # first pages into the slots (every earlier use of them was released).
                @pl.when(i > first_item)
                def _():
                    plgpu.barrier_wait(q_free)

                plgpu.copy_gmem_to_smem(
                    q_lat_ref.at[pallas_triton.head_rows(req, heads, heads_major)],
                    q_lat_smem,
                    q_ready,
                )
                plgpu.copy_gmem_to_smem(q_pe_ref.at[req, heads], q_pe_smem, q_ready)
                for k in range(NUM_SLOTS):
                    pl.when(k < pages)(functools.partial(load_page, k))

            plgpu.barrier_wait(q_ready)

            def last_page_cut(k):
                """Whether page ``k`` has rows past the item's end."""
                return (k == pages - 1) & (end % PAGE != 0)

            def before_end(k, layout=wgmma_layout):
                """``[64, SWIZZLE_COLUMNS]`` (in ``layout``): whether each row of page ``k``
                lies before the item's end."""
                row = plgpu.broadcasted_iota(jnp.int32, (PAGE, SWIZZLE_COLUMNS), 0, layout=layout)
                return row < end - (first_page + k) * PAGE

            def zero_past_end(slot, k):
                """Zeroes the value rows of page ``k`` past the item's end (stale or NaN rows
                of a page a request does not fill) before any product reads them."""
                valid = before_end(k)
                for column in range(lkv // SWIZZLE_COLUMNS):
                    tile = kv_smem.at[slot, :, pl.ds(column * SWIZZLE_COLUMNS, SWIZZLE_COLUMNS)]
                    values = tile[...]
                    tile[...] = jnp.where(valid, values, jnp.zeros_like(values))

            # The scale groups of our half of the latent columns (an FP8 cache).
            groups = sorted(
                {column // fp8.GROUP for column in range(w * half_width, (w + 1) * half_width)}
            )

            def page_scales(k):
                """The scales of page ``k`` of the item for our groups, one ``[64]`` row
                vector each in the dtype the page is converted in, loaded from global
                memory (a page ahead of their use)."""
                block = block_table_ref[req, first_page + k]
                return tuple(
                    plgpu.load(
                        cache_refs[2].at[block, :, g], layout=row_layout, optimized=False
                    ).astype(convert_dtype)
                    for g in groups
                )

            def dequantize(slot, k, scales, latent):
                """Our half of the latent columns of FP8 page ``k`` (in staging ``slot``)
                into its 16-bit page ``latent``, times their power-of-two scales (exact),
                rows past the item's end zeroed; ``dq_ready`` says when it is there (the
                other warpgroup's scores wait for it after their product over their own
                half)."""
                plgpu.barrier_wait(kv_ready.at[slot])

                def convert(past_end: bool):
                    # The zeroing's selects only where there are rows to zero: on every
                    # page they cost 7% of the kernel (128 x 4096 at 128 heads, H200).
                    if past_end:
                        valid = before_end(k, mosaic_gpu.FP8_CONVERT_LAYOUT)
                    for t in range(half_width // SWIZZLE_COLUMNS):
                        first = w * half_width + t * SWIZZLE_COLUMNS
                        columns = pl.ds(first, SWIZZLE_COLUMNS)
                        values = plgpu.load(
                            fp8_smem.at[slot, :, columns],
                            layout=mosaic_gpu.FP8_CONVERT_LAYOUT,
                            optimized=True,
                        ).astype(convert_dtype)
                        factor = scales[groups.index(first // fp8.GROUP)]
                        values = values * lax.broadcast_in_dim(factor, values.shape, [0])
                        if past_end:
                            values = jnp.where(valid, values, 0)
                        latent[:, columns] = values.astype(page_dtype)

                past_end = last_page_cut(k)
                pl.when(past_end)(functools.partial(convert, True))
                pl.when(jnp.logical_not(past_end))(functools.partial(convert, False))
                plgpu.commit_smem()
                plgpu.barrier_arrive(dq_ready)  # (``scores`` waits for it)

            def own_chunk(slot, k, s, m_prev, l):
                """The owner's part of chunk ``w`` of page ``k`` (raw scores ``s``): mask,
                online softmax, publish the probabilities and the new maximum. Returns
                (m_new, l_new, alpha)."""
                first_token = (first_page + k) * PAGE + w * CHUNK

                def mask(s):
                    col = plgpu.broadcasted_iota(
                        jnp.int32, (BLOCK_H, CHUNK), 1, layout=wgmma_layout
                    )
                    token = first_token + col
                    return jnp.where((token >= start) & (token < end), s, -jnp.inf)

                # Only an item's first and last pages have keys outside it: the mask's
                # registers are needed in that branch alone.
                boundary = (first_token < start) | (first_token + CHUNK > end)
                s = lax.cond(boundary, mask, lambda s: s, s)
                row_max = s.max(axis=1) * score_scale
                if lazy_rescale:
                    m_new = online_softmax.lazy_maximum(m_prev, row_max)
                else:
                    m_new = jnp.maximum(m_prev, row_max)
                subtracted = lax.broadcast_in_dim(online_softmax.finite(m_new), s.shape, [0])
                if float16_scores:
                    s = s * lax.broadcast_in_dim(score_scale, s.shape, [0])
                else:
                    s = s * log2_scale
                probs = jnp.exp2(s - subtracted)
                alpha = online_softmax.rescale_factor(m_prev, m_new)
                l = l * alpha + probs.sum(axis=1)
                p_smem[slot, w] = probs.astype(page_dtype)
                m_smem[w] = m_new
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[w])
                return m_new, l, alpha

            def values(latent, c):
                return latent.at[pl.ds(c * CHUNK, CHUNK), half]

            def other_probs(c):
                """Waits for chunk ``c``'s probabilities (from the other warpgroup) and
                returns its row maximum."""
                plgpu.barrier_wait(p_ready.at[c])
                return plgpu.layout_cast(m_smem[c], row_layout)

            # Where warpgroup 0 refills a slot: over an FP8 cache, while the next page's
            # scores are in flight (it would otherwise wait for warpgroup 1 between its last
            # product and the next page's dequantization: H200, 128 heads, 128 x 4096 526 ->
            # 502 us, 64 x 16384 994 -> 934); over a bf16 cache, right after its last
            # product (refilling later there cost 3-5%).
            refill_early = quantized

            def refill_previous(k):
                """Once warpgroup 1 releases page ``k - 1``'s slot, starts the copies of
                page ``k - 1 + NUM_SLOTS`` into it (warpgroup 0, while page ``k``'s scores
                are in flight)."""

                @pl.when(k > 0)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot_of(k - 1)])
                    pl.when(k - 1 + NUM_SLOTS < pages)(
                        functools.partial(load_page, k - 1 + NUM_SLOTS)
                    )

            def page(k, state):
                acc, m, l, scales = state
                slot, latent = slot_of(k), bf16_page(k)
                if quantized:
                    dequantize(slot, k, scales, latent)
                    scales = page_scales(jnp.minimum(k + 1, pages - 1))
                if w == 0:
                    # Chunk 0 is ours: scores, softmax, publish, then our half of both
                    # chunks' products (chunk 1's probabilities come from warpgroup 1). The
                    # slot is refilled with page k + NUM_SLOTS once warpgroup 1 releases it
                    # (with multicast: once both programs' warpgroups do).
                    if refill_early:
                        s, _ = scores(w, slot, latent, 0, functools.partial(refill_previous, k))
                    else:
                        s, _ = scores(w, slot, latent, 0)
                    if not quantized:  # (dequantize zeroes them)
                        pl.when(last_page_cut(k))(functools.partial(zero_past_end, slot, k))
                    m0, l, alpha0 = own_chunk(slot, k, s, m, l)
                    acc, m1 = accumulate(
                        acc, alpha0, p_smem.at[slot, 0], values(latent, 0), lambda: other_probs(1)
                    )
                    alpha1 = online_softmax.rescale_factor(m0, m1)
                    acc, _ = accumulate(acc, alpha1, p_smem.at[slot, 1], values(latent, 1))
                    if clustered:  # (alone, warpgroup 0's own order releases it)
                        plgpu.barrier_arrive(kv_free.at[slot])
                    if not refill_early:
                        plgpu.barrier_wait(kv_free.at[slot])
                        pl.when(k + NUM_SLOTS < pages)(functools.partial(load_page, k + NUM_SLOTS))
                    return acc, m1, l * alpha1, scales

                # Chunk 1 is ours: its scores run while chunk 0's softmax finishes on
                # warpgroup 0; our softmax runs while chunk 0's product is in flight.
                s, m0 = scores(w, slot, latent, 1, lambda: other_probs(0))
                alpha0 = online_softmax.rescale_factor(m, m0)
                acc, (m1, l, alpha1) = accumulate(
                    acc,
                    alpha0,
                    p_smem.at[slot, 0],
                    values(latent, 0),
                    lambda: own_chunk(slot, k, s, m0, l * alpha0),
                )
                acc, _ = accumulate(acc, alpha1, p_smem.at[slot, 1], values(latent, 1))
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc, m1, l, scales

            acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half_width), jnp.float32), wgmma_layout)
            m = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout)
            if quantized:
                # The first page's scales (no table entry is read for an empty item).
                zeros = tuple(
                    plgpu.layout_cast(jnp.zeros((BLOCK_H,), convert_dtype), row_layout)
                    for _ in groups
                )
                scales = lax.cond(pages > 0, lambda: page_scales(0), lambda: zeros)
            else:
                scales = ()
            acc, m, l, _ = lax.fori_loop(0, pages, page, (acc, m, l, scales))
            if w == 1:
                plgpu.barrier_arrive(q_free)
            elif refill_early:
                # The last page's release: every phase is observed, and the next item's
                # first copies go into slots warpgroup 1 is done with.
                pl.when(pages > 0)(lambda: plgpu.barrier_wait(kv_free.at[slot_of(pages - 1)]))

            # Each warpgroup summed the probabilities of its own chunks.
            # Two buffers by item parity: an empty next item must not overwrite a sum the
            # other warpgroup has yet to read (l_ready orders items two apart).
            sums = l_smem.at[i % 2]
            sums[w] = l
            plgpu.barrier_arrive(l_ready)
            plgpu.barrier_wait(l_ready)
            l = plgpu.layout_cast(sums[0], row_layout) + plgpu.layout_cast(sums[1], row_layout)
            nonempty = l > 0
            inv = 1.0 / jnp.where(nonempty, l, 1.0)
            out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            lse = jnp.where(
                nonempty, m * online_softmax.LN2 + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf
            )
            # A request of one item is whole (the combine kernel's rule): its output goes
            # straight to out.
            whole = req_items_ref[req + 1] - req_items_ref[req] == 1

            @pl.when(whole)
            def _():
                out_ref[(*pallas_triton.head_rows(req, heads, heads_major), half)] = out.astype(
                    out_ref.dtype
                )
                if w == 0:
                    lse_ref[req, heads] = lse

            @pl.when(jnp.logical_not(whole))
            def _():
                o_part_ref[i, heads, half] = out
                if w == 0:
                    lse_part_ref[i, heads] = lse

            return pages_done + pages

        lax.fori_loop(first_item, last_item, item, 0)
        if w == 0:
            # Observe warpgroup 1's last release of the queries: every mbarrier phase is
            # waited for.
            @pl.when(last_item > first_item)
            def _():
                plgpu.barrier_wait(q_free)

    for w in range(NUM_WARPGROUPS):
        pl.when(wg == w)(functools.partial(warpgroup, w))
