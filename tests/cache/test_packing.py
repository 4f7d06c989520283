"""Packed tokens in request order through ``MLAAttention``, metadata from ``packed_metadata``
and ``CacheManager``, and the errors at the module's boundary.

Outputs are compared with dense float64 NumPy MLA of each whole sequence (no cache, no
absorption, no packing); float32, tolerance 2e-5 as in test_attention.py (observed ~1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_ref as ref
import pytest
from conftest import mla_dims, mla_weights_np, randomize, rel_err, small_mla
from flax import nnx

from mla_jax import CacheManager, MLAAttention, build_metadata, init_cache, packed_metadata
from mla_jax.cache.latent_cache import CacheFullError
from mla_jax.cache.metadata import MetadataError
from mla_jax.kernels import KernelPlan

TOL = 2e-5


def _module(rng, cfg=None):
    cfg = cfg or small_mla()
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    randomize(attn, int(rng.integers(2**31)))
    return attn, mla_weights_np(attn), mla_dims(cfg)


@nnx.jit(static_argnames="impl")
def _run(attn, x, cache, metadata, impl):
    return attn(x, cache, metadata, impl=impl)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_packed_steps_in_any_order_match_dense_mla(rng, impl):
    """Step 1 prefills the contexts of five sequences, step 2 feeds decodes and prefills
    (one on cached context, one fresh) mixed in a random order; every packed output row is
    the dense MLA of its sequence at that position. The packed axis is padded to the bucket
    in step 1 and holds only the real tokens in step 2."""
    attn, p, dims = _module(rng)
    context, new = [0, 6, 3, 9, 0], [1, 1, 5, 1, 7]  # sequence 0: a one-token prompt
    xs = [
        rng.standard_normal((c + n, attn.cfg.hidden_size)).astype(np.float32)
        for c, n in zip(context, new, strict=True)
    ]
    want = [ref.mla(p, dims, x, np.arange(len(x))) for x in xs]
    plan = KernelPlan(attn.cfg.num_heads, num_sms=4) if impl == "pallas" else None
    manager = CacheManager(
        num_heads=attn.cfg.num_heads,
        num_blocks=24,
        block_size=4,
        workspace_size=8,
        impl=impl,
        kernel_plan=plan,
    )
    cache = jnp.full((24, 4, attn.cfg.cache_width), jnp.nan, jnp.float32)  # unwritten rows
    for step, (lo, hi) in enumerate([(0, context), (context, np.add(context, new))]):
        lo = np.broadcast_to(lo, len(xs))
        order = [int(i) for i in rng.permutation(len(xs)) if hi[i] > lo[i]]
        metadata = manager.step({i: int(hi[i] - lo[i]) for i in order})
        x = np.concatenate([xs[i][lo[i] : hi[i]] for i in order])
        num_real = len(x)
        if step == 0:
            x = np.concatenate([x, np.ones((metadata.num_tokens - num_real, x.shape[1]))])
        y, cache = _run(attn, jnp.asarray(x, jnp.float32), cache, metadata, impl)
        assert y.shape == x.shape and y.dtype == jnp.float32
        assert (np.asarray(y)[num_real:] == 0).all()  # padding rows
        rows = np.cumsum([0] + [hi[i] - lo[i] for i in order])
        for i, start, stop in zip(order, rows[:-1], rows[1:], strict=True):
            assert rel_err(y[start:stop], want[i][lo[i] : hi[i]]) < TOL, (step, i)


def test_packed_metadata_is_a_permutation_of_the_bucket_layout():
    """Requests in the caller's order; decodes go first inside, padding rows pair up."""
    metadata = packed_metadata(
        [4, 0, 7, 2], [3, 1, 1, 5], [[0, 1], [2], [3, 4], [5, 6]], num_heads=4,
        block_size=4, num_blocks=8, impl="reference",
    )  # fmt: skip
    index = np.asarray(metadata.packed_index)
    assert sorted(index) == list(range(metadata.num_tokens))
    positions = np.asarray(metadata.attention.positions)
    # Packed rows: request 0's positions 4-6, request 1's 0, request 2's 7, request 3's 2-6.
    want = {0: 4, 1: 5, 2: 6, 3: 0, 4: 7, 5: 2, 6: 3, 7: 4, 8: 5, 9: 6}
    got = {int(index[row]): int(positions[row]) for row in metadata.attention.token_rows()}
    assert got == want and metadata.num_real_tokens() == 10


def test_packed_metadata_names_requests_in_the_callers_order():
    kw = dict(num_heads=4, block_size=4, num_blocks=8)
    with pytest.raises(MetadataError, match=r"query_lens must be >= 1 \(request 1: 0\)"):
        packed_metadata([3, 0], [2, 0], [[0, 1], [2]], **kw)
    with pytest.raises(MetadataError, match=r"block_table\[1, 0\] = 9"):
        packed_metadata([3, 0], [2, 1], [[0, 1], [9]], **kw)


def test_pallas_metadata_carries_the_kernel_schedules():
    metadata = packed_metadata(
        [5, 0], [1, 6], [[0, 1], [2, 3]], num_heads=4, block_size=4, num_blocks=8,
        impl="pallas",
    )  # fmt: skip
    assert metadata.attention.decode.schedule is not None
    assert metadata.attention.prefill.schedule is not None
    plain = packed_metadata(
        [5, 0], [1, 6], [[0, 1], [2, 3]], num_heads=4, block_size=4, num_blocks=8,
        impl="reference",
    )  # fmt: skip
    assert plain.attention.decode.schedule is None


def test_cache_manager_allocates_as_tokens_arrive_and_frees():
    manager = CacheManager(num_heads=4, num_blocks=5, block_size=4, impl="reference")
    manager.step({"a": 6, "b": 3})
    assert (len(manager.blocks("a")), len(manager.blocks("b"))) == (2, 1)
    assert manager.cached_tokens("a") == 6 and manager.allocator.num_free == 2
    metadata = manager.step({"b": 2, "a": 1})  # b's fifth token needs a second block
    assert manager.cached_tokens("b") == 5 and manager.allocator.num_free == 1
    assert np.asarray(metadata.attention.positions)[metadata.attention.token_rows()].tolist() == [
        6,
        3,
        4,
    ]
    with pytest.raises(CacheFullError, match="needs 2 more cache blocks; 1 of 5 are free"):
        manager.step({"c": 8})
    assert manager.allocator.num_free == 1 and manager.cached_tokens("c") == 0
    with pytest.raises(ValueError, match=r"num_new_tokens\['a'\] must be an int >= 1, got 0"):
        manager.step({"a": 0})
    manager.free("a")
    assert manager.allocator.num_free == 3
    with pytest.raises(KeyError, match="'a' holds no cache blocks"):
        manager.free("a")


# -- errors at the module boundary ---------------------------------------------------------


@pytest.fixture(scope="module")
def boundary():
    """A module, a matching cache, a decode-and-prefill step's metadata both ways, and its
    packed tokens."""
    cfg = small_mla()
    attn = MLAAttention(cfg, rngs=nnx.Rngs(0))
    cache = init_cache(1, 8, 4, cfg.cache_width, jnp.float32)[0]
    args = ([5, 0], [1, 6], [[0, 1], [2, 3]])
    packed = packed_metadata(*args, num_heads=4, block_size=4, num_blocks=8, impl="reference")
    bucket = build_metadata(*map(np.asarray, args), block_size=4, num_blocks=8, workspace_size=64)
    x = jnp.zeros((7, cfg.hidden_size), jnp.float32)
    return attn, cache, packed, jax.device_put(bucket), x


def test_correct_arguments_run(boundary):
    attn, cache, packed, bucket, x = boundary
    # The metadata has no kernel schedules: the reference kernels (auto picks Pallas on GPUs).
    assert attn(x, cache, packed, impl="reference")[0].shape == x.shape
    rows = jnp.zeros((bucket.num_tokens, x.shape[1]))
    assert attn(rows, cache, bucket, impl="reference")[0].shape[0] == 24


@pytest.mark.parametrize(
    "case,match",
    [
        ("hidden", r"x must be \[tokens, hidden_size=48\], got shape \(7, 32\)"),
        ("rank", r"x must be \[tokens, hidden_size=48\], got shape \(1, 7, 48\)"),
        ("too_many_rows", "x has 25 packed rows, more than the 24 tokens of the metadata's"),
        ("too_few_rows", "x has 6 packed rows; the metadata's step has 7 tokens"),
        ("bucket_rows", "x has 7 rows but metadata lays out 24"),
        ("cache_width", r"cache rows are 41 wide; this module's are .* = 40"),
        ("cache_dtype", "cache dtype float16 is not supported"),
        ("cache_rank", r"cache must be \[num_blocks, block_size, width\], got shape"),
        ("stacked_cache", r"cache must be \[num_layers, num_blocks, block_size, width\]"),
        ("block_size", "metadata was built for block_size=4, num_blocks=8; the cache has 4 "),
        ("num_blocks", "metadata was built for block_size=4, num_blocks=8; the cache has 9 "),
        ("no_schedules", "metadata has no kernel schedules"),
    ],
)
def test_boundary_errors_name_the_argument(boundary, case, match):
    attn, cache, packed, bucket, x = boundary
    kwargs = {"impl": "reference"}
    metadata = packed
    if case == "hidden":
        x = x[:, :32]
    elif case == "rank":
        x = x[None]
    elif case == "too_many_rows":
        x = jnp.zeros((25, x.shape[1]))
    elif case == "too_few_rows":
        x = x[:6]
    elif case == "bucket_rows":
        metadata = bucket
    elif case == "cache_width":
        cache = jnp.zeros((8, 4, 41))
    elif case == "cache_dtype":
        cache = cache.astype(jnp.float16)
    elif case == "cache_rank":
        cache = cache[None]
    elif case == "stacked_cache":
        kwargs["layer"] = 0
    elif case == "block_size":
        cache = jnp.zeros((4, 8, cache.shape[-1]))
    elif case == "num_blocks":
        cache = jnp.zeros((9, 4, cache.shape[-1]))
    elif case == "no_schedules":
        kwargs["impl"] = "pallas"
    with pytest.raises(ValueError, match=match):
        attn(x, cache, metadata, **kwargs)
