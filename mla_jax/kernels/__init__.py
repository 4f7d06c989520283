"""MLA attention kernels, the MoE grouped matmul and the FP8 matmuls (weight-only, and w8a8
on Hopper): Pallas (Triton lowering on GPU, interpret mode elsewhere) and their pure-jnp
references, behind one selector, plus the host-side plan the Pallas kernels' schedules are
built with.

Each kernel can be called on its own: the README's Kernels section gives their shapes,
dtypes, the LSE layout and the block-table contract, with a snippet for each that runs as it
is (``tests/test_readme.py``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    decode,
    fp8,
    fp8_blocks,
    fp8_matmul,
    grouped_matmul,
    merge,
    mosaic_gpu,
    prefill,
    tiling,
    w8a8_matmul,
)
from .decode import pallas_mosaic_gpu

log = logging.getLogger(__name__)


class KernelSet(NamedTuple):
    """The kernels a model step calls, all Pallas or all references (``select``), or wrapped
    (``mla_jax.parallel.sharding.sharded_kernels``); each entry is called as the model calls
    ``decode.mla_decode``, ``prefill.flash_prefill``, ``merge.merge_attn_states``,
    ``grouped_matmul.grouped_matmul`` and ``fp8_matmul.fp8_matmul`` in turn (arrays, scale,
    causal, schedule, the decode's ``heads_major``, FP8 weights' scales, blocks and the layer
    of a stacked weight); the FP8 matmul also takes ``tensor_split``, how tensor parallelism
    splits its weight (``on_whole_weights``). ``backend`` names the set
    (``"reference"``, ``"triton"`` or ``"mosaic_gpu"``): the host plans the Pallas kernels'
    schedules for it (``KernelPlan``)."""

    mla_decode: Callable
    flash_prefill: Callable
    merge_attn_states: Callable
    grouped_matmul: Callable
    fp8_matmul: Callable
    backend: str = "triton"


def on_whole_weights(matmul: Callable) -> Callable:
    """An FP8 matmul (``fp8_matmul.fp8_matmul``'s signature) as a kernel set calls it: with
    ``tensor_split`` (``layers.Linear.tensor_split``: None, ``"columns"`` or ``"rows"``),
    which a set whose kernels run split over devices acts on
    (``mla_jax.parallel.sharding.sharded_kernels``); here one device holds the whole weight."""

    def on_one_device(x, weight, scale_inv, *, blocks, layer=None, tensor_split=None):
        del tensor_split  # the weight is whole here
        return matmul(x, weight, scale_inv, blocks=blocks, layer=layer)

    return on_one_device


REFERENCE = KernelSet(
    decode.reference.mla_decode,
    prefill.reference.flash_prefill,
    merge.reference.merge_attn_states,
    grouped_matmul.reference.grouped_matmul,
    on_whole_weights(fp8_matmul.reference.fp8_matmul),
    backend="reference",
)
# The portable Pallas kernels: Triton lowering on any CUDA GPU and every jax in the range,
# interpret mode elsewhere.
TRITON = KernelSet(
    decode.mla_decode,
    prefill.flash_prefill,
    merge.merge_attn_states,
    grouped_matmul.grouped_matmul,
    on_whole_weights(fp8_matmul.fastest),
    backend="triton",
)


def _hopper_decode(
    q_lat, q_pe, kv_cache, block_table, seq_lens, *, scale, schedule=None, heads_major=False
):
    """The Mosaic GPU decode where it beats the Triton one (64 heads and more, or an FP8
    cache and enough requests: ``pallas_mosaic_gpu.pays_off``), the Triton decode elsewhere
    (logged once); ``KernelPlan`` plans the schedule for the same kernel (any schedule is
    correct for either kernel; a plan for the other one only balances the work worse)."""
    batch, heads = decode.pallas_triton.batch_major_view(q_lat, heads_major).shape[:2]
    quantized = isinstance(kv_cache, fp8.Fp8Cache)
    if pallas_mosaic_gpu.pays_off(heads, batch, quantized):
        kernel = pallas_mosaic_gpu.mla_decode
        if heads < pallas_mosaic_gpu.BLOCK_H:
            mosaic_gpu.log_once(
                log,
                f"mla_decode: the Mosaic GPU kernel for {heads} heads over the FP8 cache from "
                f"{pallas_mosaic_gpu.FP8_MIN_BATCH} requests (heads padded to "
                f"{pallas_mosaic_gpu.BLOCK_H} rows), the Triton kernel for fewer",
            )
    else:
        mosaic_gpu.log_once(
            log,
            f"mla_decode: the Triton kernel for {heads} heads (the Mosaic GPU kernel pads heads "
            f"to {pallas_mosaic_gpu.BLOCK_H} rows and is slower below that, except over the FP8 "
            f"cache from {pallas_mosaic_gpu.FP8_MIN_BATCH} requests)",
        )
        kernel = decode.mla_decode
    return kernel(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        scale=scale,
        schedule=schedule,
        heads_major=heads_major,
    )


def _hopper_grouped_matmul(
    lhs, rhs, group_sizes, *, group_offset=0, rhs_scale_inv=None, blocks=None
):
    """FP8 experts with bf16 rows on w8a8's grouped form (e4m3 wgmmas, the rows quantized
    per token and 128 columns) where it takes them, the Triton kernel elsewhere and for
    bf16 experts; either choice for FP8 experts said once. V3's MoE layer over FP8 experts
    took 0.52x the bf16 layer's time at 64 tokens and 0.75x at 8192 with w8a8, 0.53x and
    1.41x with the Triton kernel (H100, 2026-12-06, ``benchmarks/fp8_matmul.json``)."""
    if blocks is not None and lhs.dtype == jnp.bfloat16:
        reason = (
            "its weight blocks are not 128 x 128"
            if (blocks.block_out, blocks.block_in) != (w8a8_matmul.BLOCK, w8a8_matmul.BLOCK)
            else w8a8_matmul.grouped_unsupported(lhs, rhs, rhs_scale_inv, group_sizes, group_offset)
        )
        shape = list(rhs.shape[-2:])
        if reason is None:
            mosaic_gpu.log_once(
                log,
                f"grouped_matmul: w8a8 (rows quantized to e4m3 per token and 128 columns, FP8 "
                f"tensor cores) for experts {shape}",
            )
            return w8a8_matmul.grouped_w8a8_matmul(
                lhs, rhs, rhs_scale_inv, group_sizes, group_offset=group_offset
            )
        mosaic_gpu.log_once(log, f"grouped_matmul: experts {shape} not on w8a8 ({reason})")
    return grouped_matmul.grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        rhs_scale_inv=rhs_scale_inv,
        blocks=blocks,
    )


def _hopper_fp8_matmul(x, weight, scale_inv, *, blocks, layer=None):
    """bf16 rows over an FP8 projection on w8a8 (e4m3 wgmmas, x quantized per token and 128
    columns) where it pays off (``w8a8_matmul.pays_off``) and the kernel takes the weight,
    ``fp8_matmul.fastest`` (weight-only) elsewhere; either choice for bf16 rows said once."""
    if x.dtype == jnp.bfloat16:
        shape = list(weight.shape[-2:])
        if blocks != fp8_blocks.Fp8Blocks(w8a8_matmul.BLOCK, w8a8_matmul.BLOCK):
            reason = "its weight blocks are not 128 x 128"
        else:
            reason = w8a8_matmul.unsupported(x, weight, scale_inv, layer)
        if reason is None and not w8a8_matmul.pays_off(x):
            reason = (
                f"{x.shape[0]} rows of depth {x.shape[1]}: up to {w8a8_matmul.FEW_ROWS} of "
                f"depth up to {w8a8_matmul.SHALLOW_DEPTH} the weight-only kernel is faster"
            )
        if reason is None:
            mosaic_gpu.log_once(
                log,
                f"fp8_matmul: w8a8 (x quantized to e4m3 per token and 128 columns, FP8 tensor "
                f"cores) for {shape}",
            )
            return w8a8_matmul.w8a8_matmul(x, weight, scale_inv, layer=layer)
        mosaic_gpu.log_once(log, f"fp8_matmul: {shape} not on w8a8 ({reason})")
    return fp8_matmul.fastest(x, weight, scale_inv, blocks=blocks, layer=layer)


# Hopper (sm90): decode, prefill, FP8 experts and FP8 projections of bf16 rows on Mosaic GPU
# (wgmma, TMA, warpgroups with their own roles); the merge and the other matmuls are
# Triton's.
MOSAIC_GPU = TRITON._replace(
    mla_decode=_hopper_decode,
    grouped_matmul=_hopper_grouped_matmul,
    fp8_matmul=on_whole_weights(_hopper_fp8_matmul),
    flash_prefill=prefill.pallas_mosaic_gpu.flash_prefill,
    backend="mosaic_gpu",
)


def select(impl: str | KernelSet = "auto") -> KernelSet:
    """The kernels for ``impl``:

    * ``"auto"``: ``"pallas"`` on GPUs, the references elsewhere (interpret mode is for
      tests, not speed);
    * ``"pallas"``: the Mosaic GPU set on an sm90 GPU whose jax compiles it, the Triton set
      on other GPUs and older jax (interpreted off a GPU); the choice is logged once;
    * ``"mosaic_gpu"`` / ``"triton"``: that set, forced (Mosaic GPU where it cannot run is
      a one-line error; off a GPU both run in their interpret modes);
    * ``"reference"``: the pure-jnp references;
    * a ``KernelSet`` (e.g. ``mla_jax.parallel.sharding.sharded_kernels``) as it is."""
    if isinstance(impl, KernelSet):
        return impl
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl == "pallas":
        reason = mosaic_gpu.device_unsupported()
        if reason is None and jax.default_backend() == "gpu":
            mosaic_gpu.log_once(
                log,
                "kernels: the Hopper set (sm90): Mosaic GPU kernels where they win, Triton "
                "elsewhere",
            )
            return MOSAIC_GPU
        if jax.default_backend() == "gpu":
            mosaic_gpu.log_once(
                log, f"kernels: Triton (the Mosaic GPU kernels do not run {reason})"
            )
        return TRITON
    if impl == "triton":
        return TRITON
    if impl == "mosaic_gpu":
        reason = mosaic_gpu.device_unsupported()
        if reason is not None:
            raise ValueError(f"impl='mosaic_gpu': the Mosaic GPU kernels do not run {reason}")
        return MOSAIC_GPU
    if impl == "reference":
        return REFERENCE
    raise ValueError(
        f"unknown kernel implementation {impl!r} (auto, pallas, mosaic_gpu, triton or reference)"
    )


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What the host needs to schedule the Pallas kernels of a model with ``num_heads``
    heads on a GPU with ``num_sms`` multiprocessors, for the kernels of ``backend``
    (``"triton"`` or ``"mosaic_gpu"``: each decode kernel has its own program count and
    step) over a cache of ``page_size``-row pages."""

    num_heads: int
    num_sms: int = decode.DEFAULT_NUM_SMS
    prefill_block_q: int = prefill.PrefillConfig().block_q
    backend: str = "triton"
    quantized_cache: bool = False  # an FP8 cache (``fp8.Fp8Cache``): the decode kernel may differ
    page_size: int = pallas_mosaic_gpu.PAGE  # the Mosaic GPU decode runs this size only

    def __post_init__(self):
        if self.backend not in ("triton", "mosaic_gpu"):
            raise ValueError(f"KernelPlan backend {self.backend!r} (triton or mosaic_gpu)")

    def decode_config(self, batch: int) -> decode.DecodeConfig:
        """The launch parameters the Triton ``mla_decode`` picks for a batch of ``batch``
        decodes over the plan's cache."""
        return decode.DecodeConfig.for_shape(self.num_heads, batch, self.quantized_cache)

    def mosaic_decode(self, batch: int) -> bool:
        """Whether ``mla_decode`` runs the Mosaic GPU kernel for a batch of ``batch`` decodes
        (else the Triton one)."""
        return (
            self.backend == "mosaic_gpu"
            and self.page_size == pallas_mosaic_gpu.PAGE
            and pallas_mosaic_gpu.pays_off(self.num_heads, batch, self.quantized_cache)
        )

    def decode_programs(self, batch: int) -> int:
        """Decode programs per block of heads for a batch of ``batch`` decodes."""
        if self.mosaic_decode(batch):
            return pallas_mosaic_gpu.num_programs(self.num_heads, self.num_sms)
        return decode.num_programs(self.decode_config(batch), self.num_heads, self.num_sms)

    def decode_schedule(self, seq_lens: np.ndarray) -> decode.DecodeSchedule:
        """The split-KV schedule of ``mla_decode`` for a batch of decodes with ``seq_lens
        [B]`` keys each (host, NumPy int; padding rows 0). Its arrays have sizes fixed by B
        alone, so that a padded batch size compiles once."""
        batch = seq_lens.shape[0]
        num_items = decode.max_items(batch, self.decode_programs(batch))
        if self.mosaic_decode(batch):
            return pallas_mosaic_gpu.schedule(seq_lens, self.num_heads, self.num_sms, num_items)
        return decode.schedule_splits(
            seq_lens,
            num_programs=self.decode_programs(batch),
            block_k=self.decode_config(batch).block_k,
            num_items=num_items,
        )

    def prefill_schedule(self, query_start: np.ndarray, num_rows: int) -> tiling.TileSchedule:
        """The query tiles of ``flash_prefill`` for prompt chunks at offsets ``query_start
        [S + 1]`` (host, NumPy int) in a query region of ``num_rows`` rows (padding after
        them). Its arrays have sizes fixed by S and ``num_rows`` alone, so that padded sizes
        compile once."""
        num_tiles = tiling.max_tiles(num_rows, query_start.shape[0] - 1, self.prefill_block_q)
        return prefill.schedule_query_tiles(
            query_start, num_rows, self.prefill_block_q, num_tiles=num_tiles
        )

    @classmethod
    def for_device(
        cls,
        num_heads: int,
        device: jax.Device | None = None,
        backend: str = "triton",
        quantized_cache: bool = False,
        page_size: int = pallas_mosaic_gpu.PAGE,
    ) -> KernelPlan:
        """The plan for ``device`` (default: the first one): its multiprocessor count, or an
        H100's / H200's where it reports none (a CPU running the kernels interpreted)."""
        return cls(
            num_heads,
            decode.device_num_sms(device),
            backend=backend,
            quantized_cache=quantized_cache,
            page_size=page_size,
        )

    @classmethod
    def for_impl(
        cls,
        impl: str | KernelSet,
        num_heads: int,
        quantized_cache: bool = False,
        page_size: int = pallas_mosaic_gpu.PAGE,
    ) -> KernelPlan | None:
        """The plan for this device and the kernels ``impl`` selects (they need the
        schedules) over a bf16 cache, or an FP8 one with ``quantized_cache``, of
        ``page_size``-row pages; None for the references, which take none."""
        kernel_set = select(impl)
        if kernel_set.backend == "reference":
            return None
        return cls.for_device(
            num_heads,
            backend=kernel_set.backend,
            quantized_cache=quantized_cache,
            page_size=page_size,
        )
