"""The Mosaic GPU prefill kernel (``kernels/prefill/pallas_mosaic_gpu.py``) against float64
NumPy attention (``test_prefill_kernel``'s inputs and checks), with the padding rows past the
last sequence in q, k and v poisoned with NaN: a kernel that lets a stray row into a product
fails.

On the CPU the kernel runs in Mosaic GPU's interpret mode (jax >= 0.11), which simulates its
warpgroups, TMA copies, mbarriers and wgmmas, starts every output as NaN (an output row the
kernel does not write fails) and fails a kernel that leaves an mbarrier phase unobserved.
Two things differ there: the rescaled accumulation adds ``P V`` after a zero-started wgmma
(interpret mode cannot load a value into an accumulator), and ``P`` always goes through
shared memory (its wgmma reads refs only); the compiled paths are covered by the tests
marked ``gpu``.

Tolerances: out 3e-3 relative, lse 1e-5 absolute (the project's bf16 lse bound: compiled,
exp2 and log are approximate). Measured against float64 (interpret mode, CPU, 2026-11-25,
6 seeds x the five interpreted cases): out <= 2.3e-3 (bf16 probabilities and output) and
lse <= 5.1e-7. Lazy rescaling (the default since 2026-11-28; its probabilities reach 2^8)
against the exact online softmax, three cases at DeepSeek's widths, seeds 0-2 (interpret
mode): out 1.82-2.30e-3 against 1.81-2.16e-3.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_prefill_kernel as prefill_tests

from mla_jax.kernels import online_softmax, prefill
from mla_jax.kernels.prefill import pallas_mosaic_gpu as mosaic

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if jax.default_backend() != "gpu" and not hasattr(plgpu, "InterpretGPUParams"):
    pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11", allow_module_level=True)

BF16 = jnp.bfloat16
TOL = (3e-3, 1e-5)
SCALE = 192**-0.5


def _inputs(rng, lq, lk, *, n, dqk=192, dv=128):
    return prefill_tests._inputs(rng, lq, lk, n=n, dqk=dqk, dv=dv, dtype=BF16, poison=True)


def _check(inputs, *, causal, host=True, config=None, want=None):
    """Runs the kernel on ``inputs`` (``_inputs``) and checks it against float64 (``want``,
    or computed here)."""
    q, k, v, cu_q, cu_k = inputs
    schedule = prefill.schedule_query_tiles(cu_q, q.shape[0], mosaic.BLOCK_Q) if host else None
    args = [jnp.asarray(a, BF16) for a in (q, k, v)]
    assert mosaic.unsupported(*args, config) is None  # no silent fallback to Triton
    # Under a jit with the offsets and the schedule as arguments, as the model calls it.
    call = jax.jit(
        functools.partial(mosaic.flash_prefill, scale=SCALE, causal=causal, config=config)
    )
    got = call(*args, jnp.asarray(cu_q), jnp.asarray(cu_k), schedule=schedule)
    assert got[0].dtype == BF16 and got[0].shape == (q.shape[0], q.shape[1], v.shape[-1])
    assert got[1].shape == q.shape[:2]
    prefill_tests._check(got, q, k, v, cu_q, cu_k, causal=causal, scale=SCALE, tol=TOL, want=want)


def _run(rng, lq, lk, *, causal, n=1, dqk=192, dv=128, host=True, config=None):
    _check(_inputs(rng, lq, lk, n=n, dqk=dqk, dv=dv), causal=causal, host=host, config=config)


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_batch(rng, causal):
    """DeepSeek's widths (192 = three swizzled 64-column tiles, v 128), three heads: one
    key, a sequence of several tiles whose last is partial, an empty sequence, and queries
    on top of longer key runs (context)."""
    _run(rng, [5, 150, 0, 1], [9, 150, 3, 1], causal=causal, n=3)


def test_head_group_fits_the_l2_budget():
    """DeepSeek's 128 heads x 4096 keys (2.6 MB a head) run 8 heads side by side; few keys,
    every head; a head larger than the budget, one; a group always divides the heads."""
    per_token = 192 + 128
    assert mosaic.head_group(128, 4096, per_token) == 8
    assert mosaic.head_group(16, 4096, per_token) == 8
    assert mosaic.head_group(16, 256, per_token) == 16
    assert mosaic.head_group(12, 4096, per_token) == 6
    assert mosaic.head_group(128, 65536, per_token) == 1


def test_heads_in_groups(rng, monkeypatch):
    """Heads launched in two groups of two (a small L2 budget): each program finds its head
    from the group and the head within it."""
    monkeypatch.setattr(mosaic, "L2_BUDGET", 2 * 160 * (192 + 128) * 2)
    assert mosaic.head_group(4, 157, 192 + 128) == 2
    _run(rng, [150, 7], [150, 7], causal=True, n=4)


def test_context_longer_than_queries(rng):
    """Few queries on long key runs: whole blocks unmasked, then the diagonal; key boxes of
    the last sequence moved back inside k (its keys end near the poisoned rows)."""
    _run(rng, [3, 130], [300, 200], causal=True, dqk=64, dv=64)


def test_rows_without_keys(rng):
    """Causal with fewer keys than queries: the first rows of a sequence see no key (out 0,
    lse -inf), a tile of them visits no block."""
    _run(rng, [130, 7], [70, 7], causal=True, n=2, dqk=64, dv=64)


def test_device_side_schedule(rng):
    """No host schedule: 128-row tiles planned on the device up to a static bound (empty
    tiles past the real ones do nothing)."""
    _run(rng, [33, 1, 140], [33, 1, 140], causal=True, dqk=64, dv=64, host=False)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_consumers_issue_the_copies(rng, num_stages):
    """No producer warpgroup: consumer 0 issues the first stages, then refills each slot
    once both consumers released it (more blocks than stages, and fewer)."""
    config = mosaic.MosaicPrefillConfig(
        producer_warpgroup=False, schedule_barrier=False, num_stages=num_stages
    )
    _run(rng, [150, 2], [300, 70], causal=True, n=2, dqk=64, dv=64, config=config)


@pytest.mark.parametrize("lazy_rescale", [False, True])
def test_consumers_without_turns(rng, lazy_rescale):
    """Without FA3's ping-pong (the default takes turns through an mbarrier): a tile with
    blocks, one without; lazily rescaled too, which needs no turns."""
    config = mosaic.MosaicPrefillConfig(schedule_barrier=False, lazy_rescale=lazy_rescale)
    _run(rng, [150, 3], [200, 0], causal=True, n=2, dqk=64, dv=64, config=config)


@pytest.mark.parametrize("lazy_rescale", [True, False])
def test_row_maxima_jumping_mid_sequence(rng, lazy_rescale):
    """Keys from key 150 on scaled by 4, so that the row maxima jump past
    ``online_softmax.RESCALE_SLACK`` in the 64-key block holding it while the block before
    and some after move none: the lazily rescaled accumulator (and the exact one) against
    float64."""
    q, k, v, cu_q, cu_k = _inputs(rng, [448], [448], n=1)
    k[150:448] *= 4
    # The running row maxima (log2 units) of the last 64 query rows at each block's end.
    scores = q[384:448, 0] @ k[:448, 0].T * SCALE * np.log2(np.e)
    running = np.maximum.accumulate(scores, axis=1)[:, 63::64]
    jumps = np.diff(running, axis=1).max(axis=0) > online_softmax.RESCALE_SLACK
    assert jumps[1] and not jumps[0] and not jumps[2:].all(), jumps  # (block 2 against 1)
    config = mosaic.MosaicPrefillConfig(lazy_rescale=lazy_rescale)
    _check((q, k, v, cu_q, cu_k), causal=True, config=config)


def test_block_k_128(rng):
    """128-key blocks in two stages (the diagonal block masked in both halves)."""
    config = mosaic.MosaicPrefillConfig(block_k=128, num_stages=2, p_in_registers=False)
    _run(rng, [200, 20], [260, 20], causal=True, dqk=128, dv=64, config=config)


@pytest.mark.parametrize("causal", [True, False])
def test_mean_tile_keys(causal):
    """The keys a tile visits on average (what chooses 128-key blocks), against the count
    from the formulas: a tile of sequence s ending at row r1 reaches key
    ``min(r1 + len_k - len_q, len_k)`` of it (all its keys when not causal)."""
    lq, lk = [300, 0, 5, 129], [300, 4, 40, 129]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    schedule = prefill.schedule_query_tiles(cu_q, int(cu_q[-1]) + 7, mosaic.BLOCK_Q)
    reached = []
    for nq, nk in zip(lq, lk, strict=True):
        for end in range(mosaic.BLOCK_Q, nq + mosaic.BLOCK_Q, mosaic.BLOCK_Q):  # none if empty
            end = min(end, nq)
            reached.append(min(max(end + nk - nq, 0), nk) if causal else nk)
    got = mosaic.mean_tile_keys(
        jax.tree.map(jnp.asarray, schedule), jnp.asarray(cu_q), jnp.asarray(cu_k), causal=causal
    )
    np.testing.assert_allclose(float(got), np.mean(reached), rtol=1e-6)


def test_long_tiles_choose_128_key_blocks(rng, monkeypatch):
    """``block_k=None`` compiles a 64-key and a 128-key kernel where 128-key blocks fit,
    only the 64-key one where they do not (P staged at DeepSeek's widths); tiles past the
    threshold run the 128-key one: here every tile, the threshold at 0."""
    auto = mosaic.MosaicPrefillConfig()
    assert [(c.block_k, c.num_stages) for c in auto.compiled(192, 128, stage_p=False)] == [
        (64, 4),
        (128, 2),
    ]
    assert [c.block_k for c in auto.compiled(128, 64, stage_p=True)] == [64, 128]
    assert [c.block_k for c in auto.compiled(192, 128, stage_p=True)] == [64]
    monkeypatch.setattr(mosaic, "LONG_TILE_KEYS", 0)
    _run(rng, [190, 30], [250, 30], causal=True, dqk=128, dv=64)


@pytest.mark.parametrize(
    "config,causal,widths",
    [
        (mosaic.MosaicPrefillConfig(), True, (192, 128)),
        (mosaic.MosaicPrefillConfig(block_k=64), False, (192, 128)),
        (
            mosaic.MosaicPrefillConfig(block_k=64, p_in_registers=False, auto_barriers=True),
            True,
            (192, 128),
        ),
        (mosaic.MosaicPrefillConfig(block_k=128, num_stages=2), True, (128, 64)),
        (
            mosaic.MosaicPrefillConfig(
                block_k=64, num_stages=3, producer_warpgroup=False, schedule_barrier=False
            ),
            True,
            (192, 128),
        ),
        (mosaic.MosaicPrefillConfig(block_k=64, schedule_barrier=False), True, (192, 128)),
        (mosaic.MosaicPrefillConfig(lazy_rescale=False), True, (192, 128)),
    ],
    ids=[
        "default",
        "full",
        "p_staged_auto_barriers",
        "block_k_128",
        "no_producer",
        "no_turns",
        "exact_rescale",
    ],
)
def test_lowers_for_sm90(config, causal, widths):
    """The compiled kernel's Mosaic GPU lowering, run on any machine (the arch defaults to
    sm90 off a GPU): layout inference, TMA alignment and shared memory are checked there;
    only ptxas and the run itself need the GPU. The default lowers both block sizes (64-key
    blocks in four stages, 128 in two); the other configs one kernel each."""
    dqk, dv = widths
    cu = np.array([0, 5, 150, 150, 151], np.int32)
    tq = 156
    schedule = jax.tree.map(jnp.asarray, prefill.schedule_query_tiles(cu, tq, mosaic.BLOCK_Q))
    q = jax.ShapeDtypeStruct((tq, 4, dqk), BF16)
    v = jax.ShapeDtypeStruct((tq, 4, dv), BF16)
    f = jax.jit(
        lambda q, k, v, cu, schedule: mosaic._flash_prefill(
            q, k, v, cu, cu, schedule, scale=SCALE, causal=causal, config=config, interpret=False
        )
    )
    lowered = f.trace(q, q, v, jnp.asarray(cu), schedule).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_other_inputs_run_the_triton_kernel(rng, caplog):
    """float32, widths that are no multiple of 64 and tiles of other heights fall back to
    the Triton kernel, each reason logged once."""
    cu = jnp.array([0, 20], jnp.int32)
    args = [jnp.asarray(rng.standard_normal((20, 2, d)), jnp.float32) for d in (48, 48, 16)]
    with caplog.at_level(logging.WARNING, logger=mosaic.__name__):
        for _ in range(2):
            got = mosaic.flash_prefill(*args, cu, cu, scale=0.2, causal=True)
    want = prefill.flash_prefill(*args, cu, cu, scale=0.2, causal=True)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert sum("dtype float32" in r.message for r in caplog.records) == 1
    assert mosaic.unsupported(*(a.astype(BF16) for a in args)) is not None
    q = jnp.zeros((20, 2, 64), BF16)
    assert mosaic.unsupported(q, q, q) is None
    schedule = prefill.schedule_query_tiles(np.array([0, 20], np.int32), 20, 16)
    with caplog.at_level(logging.WARNING, logger=mosaic.__name__):
        mosaic.flash_prefill(q, q, q, cu, cu, scale=0.2, causal=True, schedule=schedule)
    assert any("tiles of 16 rows" in r.message for r in caplog.records)


def test_bad_inputs_are_refused_like_triton():
    q = jnp.zeros((10, 2, 64), BF16)
    cu = jnp.array([0, 10], jnp.int32)
    with pytest.raises(ValueError, match="int32"):
        mosaic.flash_prefill(q, q, q, cu.astype(jnp.float32), cu, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="at most 10"):
        mosaic.flash_prefill(q, q, q, jnp.array([0, 30], jnp.int32), cu, scale=1.0, causal=True)
    with pytest.raises(ValueError, match="block_k must be 64, 128 or None"):
        mosaic.MosaicPrefillConfig(block_k=32)
    with pytest.raises(ValueError, match="needs producer_warpgroup"):
        mosaic.MosaicPrefillConfig(schedule_barrier=True, producer_warpgroup=False)


GPU_CONFIGS = [
    mosaic.MosaicPrefillConfig(),
    mosaic.MosaicPrefillConfig(block_k=128),
    mosaic.MosaicPrefillConfig(p_in_registers=False),
    mosaic.MosaicPrefillConfig(num_stages=2),
    mosaic.MosaicPrefillConfig(auto_barriers=True),
    mosaic.MosaicPrefillConfig(producer_warpgroup=False, schedule_barrier=False),
    mosaic.MosaicPrefillConfig(schedule_barrier=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_deepseek_widths_compiled(rng, causal):
    """Compiled on sm90: 12 ragged sequences of 1..1500 tokens (an empty one, tile and block
    boundaries), context keys on some, four heads, DeepSeek's widths; each config (the
    default, 128-key blocks, P staged in shared memory, two stages, Pallas' own barriers, no
    producer warpgroup, no ping-pong between the consumers), with the host's schedule and
    the device's."""
    lq = [1, 1500, 0, 127, 128, 129, 64, 700, 3, 1000, 255, 513]
    extra = [0, 0, 5, 1, 0, 300, 64, 0, 1200, 17, 0, 2]
    lk = [a + b for a, b in zip(lq, extra, strict=True)]
    inputs = _inputs(rng, lq, lk, n=4)
    want = prefill_tests._expected(*inputs, causal=causal, scale=SCALE)
    for config in GPU_CONFIGS:
        for host in (True, False):
            _check(inputs, causal=causal, host=host, config=config, want=want)


@pytest.mark.gpu
def test_two_heads_long_sequence_compiled(rng):
    """One 1500-token sequence on 2 heads, causal and full."""
    for causal in (True, False):
        _run(rng, [1500], [1500], causal=causal, n=2)
