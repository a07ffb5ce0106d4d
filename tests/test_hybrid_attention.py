"""Hybrid attention: sliding windows, soft-capped scores and attention sinks, in decode and
prefill over every cache kind, against jaxkv.reference.

Every case poisons what its queries must not read: tokens before every query's window hold NaN
(a dense cache's positions, or a paged row's pages lying wholly before the window, pointed at a
NaN page), so a kernel that reads outside the window gives NaN. The reference reads the data
before poisoning. Tolerances as in test_attention.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from jaxkv import reference

_rng = np.random.default_rng()
ref = jax.jit(reference.attention, static_argnames=("scale", "soft_cap", "window"))
FULL = int(np.iinfo(np.int32).max)
KINDS = ["linear", "manager", "paged-HND", "paged-NHD"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3, jnp.float8_e4m3fn: 2e-2}
HKV = 2


def normal(shape, dtype):
    return jnp.asarray(_rng.standard_normal(shape, np.float32).astype(np.dtype(dtype)))


@dataclasses.dataclass
class Case:
    cache: object
    k: jax.Array  # [B, H, capacity, D] float32, as the reference reads them (before poisoning)
    v: jax.Array
    page: int


def build(kind, dtype, head_dim, page, lengths, capacity):
    """A cache of ``kind`` whose rows hold random tokens at every position of ``capacity``;
    ``lengths`` committed."""
    b = len(lengths)
    k = normal((b, HKV, capacity, head_dim), dtype)
    v = normal((b, HKV, capacity, head_dim), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    if kind == "linear":
        buf = jnp.stack([k, v], axis=1)[None]
        cache = jaxkv.LinearKVCache(buffer=buf, lengths=lengths,
                                    active_batch_size=jnp.asarray(b, jnp.int32))
    elif kind == "manager":
        cache = jaxkv.KVCacheManager(layers=(jnp.stack([k, v], axis=1),), lengths=lengths,
                                     active_batch_size=jnp.asarray(b, jnp.int32))
    else:
        layout = kind.split("-")[1]
        pages = capacity // page
        num = b * pages + 1  # the last page: poison
        cache = jaxkv.PagedKVCache.create(1, num, page, HKV, head_dim, b, pages, dtype, layout)
        table = _rng.permutation(b * pages).reshape(b, pages).astype(np.int32)
        tok = lambda x: x.reshape(b, HKV, pages, page, head_dim)  # noqa: E731
        def pool(x):
            x = tok(x)
            nan = jnp.full((1, HKV, page, head_dim), jnp.nan, dtype) if layout == "HND" else \
                jnp.full((1, page, HKV, head_dim), jnp.nan, dtype)
            order = np.argsort(table.reshape(-1))
            if layout == "HND":  # [H, P, S, D]
                p = x.transpose(0, 2, 1, 3, 4).reshape(b * pages, HKV, page, head_dim)[order]
                return jnp.concatenate([p, nan])[None].transpose(0, 2, 1, 3, 4)
            p = x.transpose(0, 2, 3, 1, 4).reshape(b * pages, page, HKV, head_dim)[order]
            return jnp.concatenate([p, nan])[None]
        cache = dataclasses.replace(cache, k_pages=pool(k), v_pages=pool(v),
                                    page_table=jnp.asarray(table), lengths=lengths,
                                    scaling=None, k_scales=None, v_scales=None)
    return Case(cache, k.astype(jnp.float32), v.astype(jnp.float32), page)


def poison_before(case: Case, first) -> object:
    """The cache with every token before ``first[b]`` of row b unreadable: NaN (dense kinds), or
    the row's pages lying wholly before it pointed at the NaN page."""
    c = case.cache
    first = np.asarray(first)
    if isinstance(c, jaxkv.PagedKVCache):
        cols = np.arange(c.max_pages_per_seq)[None]
        before = (cols + 1) * case.page <= first[:, None]
        table = np.where(before, c.num_pages - 1, np.asarray(c.page_table))
        return dataclasses.replace(c, page_table=jnp.asarray(table, jnp.int32))
    pos = np.arange(case.k.shape[2])
    mask = jnp.asarray(pos[None] < first[:, None])[:, None, None, :, None]  # [B, 1, 1, S, 1]
    if isinstance(c, jaxkv.LinearKVCache):
        return dataclasses.replace(c, buffer=jnp.where(mask[None], jnp.nan, c.buffer).astype(c.buffer.dtype))
    layer = c.layers[0]
    return dataclasses.replace(c, layers=(jnp.where(mask, jnp.nan, layer).astype(layer.dtype),))


def close(out, want, dtype):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "a read outside the window (NaN)"
    np.testing.assert_allclose(out, np.asarray(want), rtol=TOL[dtype], atol=TOL[dtype])


@functools.partial(jax.jit, static_argnames=("window", "soft_cap", "static"))
def _decode(q, cache, lengths, sinks, window, soft_cap, static=True, traced_window=None):
    w = window if static else traced_window
    return jaxkv.attention.decode(q, cache, 0, kv_lengths=lengths, window=w, soft_cap=soft_cap,
                                  sinks=sinks)


@functools.partial(jax.jit, static_argnames=("window", "soft_cap"))
def _prefill(q, cache, q_lengths, sinks, window, soft_cap):
    return jaxkv.attention.prefill(q, cache, 0, q_lengths, window=window, soft_cap=soft_cap,
                                   sinks=sinks)


# (kind, dtype, head_dim, group, page): each kind meets each dtype of the kernels' paths.
DECODE_CASES = [("linear", jnp.bfloat16, 128, 4, 16), ("manager", jnp.float32, 64, 2, 16),
                ("paged-HND", jnp.float16, 256, 2, 16), ("paged-NHD", jnp.bfloat16, 128, 4, 16),
                ("paged-NHD", jnp.float32, 32, 1, 8)]


@pytest.mark.parametrize("kind,dtype,head_dim,group,page", DECODE_CASES)
def test_windowed_decode_matches_reference_at_window_edges(kind, dtype, head_dim, group, page):
    """Windows of 1, page - 1, page, page + 1, a few pages and wider than the rows, static and
    traced, with and without soft cap and sinks, over ragged rows (empty, one token, full)."""
    cap = 8 * page
    lengths = np.array([0, 1, cap, int(_rng.integers(page + 2, cap)), int(_rng.integers(2, page))],
                       np.int32)
    case = build(kind, dtype, head_dim, page, lengths, cap)
    q = normal((len(lengths), HKV * group, head_dim), dtype)
    sinks = jnp.asarray(_rng.standard_normal(HKV * group) * 2, jnp.float32)
    lens = jnp.asarray(lengths)
    for i, window in enumerate([1, page - 1, page, page + 1, 3 * page + 5, cap + 7]):
        cache = poison_before(case, np.maximum(lengths - window, 0))
        cap_, sk = [(None, None), (5.0, None), (None, sinks), (2.0, sinks)][i % 4]
        want = ref(q[:, None], case.k, case.v, lens - 1, (lens > 0).astype(jnp.int32),
                   window=window, soft_cap=cap_, sinks=sk)[:, 0]
        out = _decode(q, cache, lens, sk, window, cap_)
        assert not np.asarray(out[0]).any()  # no key: zeros, sink or not
        close(out, want, dtype)
        traced = _decode(q, cache, lens, sk, None, cap_, static=False,
                         traced_window=jnp.int32(window))
        close(traced, want, dtype)


@pytest.mark.parametrize("kind,dtype,head_dim,group,page", [
    ("paged-NHD", jnp.bfloat16, 128, 4, 16), ("paged-HND", jnp.float16, 64, 8, 16),
    ("linear", jnp.bfloat16, 256, 2, 16), ("manager", jnp.float32, 64, 1, 8),
    ("paged-NHD", jnp.float16, 128, 1, 16),
    # head_dim 256 on paged caches: Hopper's wgmma kernel at Gemma 3's head size
    pytest.param("paged-NHD", jnp.bfloat16, 256, 2, 16, marks=pytest.mark.gpu_sized),
    pytest.param("paged-HND", jnp.float16, 256, 8, 16, marks=pytest.mark.gpu_sized)])
def test_windowed_prefill_matches_reference(kind, dtype, head_dim, group, page):
    """A chunk over several query and key tiles of the GPU's prefill, on cached prefixes, the
    window's lower edge moving through the tiles; one row without new tokens, one cut short."""
    t, cap = 40, 12 * page
    prefix = np.array([cap - t, 0, 37, 100], np.int32)
    q_lengths = np.array([t, 30, 0, 17], np.int32)
    case = build(kind, dtype, head_dim, page, prefix + q_lengths, cap)
    case.cache = dataclasses.replace(case.cache, lengths=jnp.asarray(prefix))
    q = normal((4, t, HKV * group, head_dim), dtype)
    sinks = jnp.asarray(_rng.standard_normal(HKV * group), jnp.float32)
    for i, window in enumerate([1, page + 1, 50, cap]):
        cache = poison_before(case, np.maximum(prefix + 1 - window, 0))
        cap_, sk = [(None, None), (None, sinks), (30.0, None), (3.0, sinks)][i]
        want = ref(q, case.k, case.v, jnp.asarray(prefix), jnp.asarray(q_lengths), window=window,
                   soft_cap=cap_, sinks=sk)
        out = _prefill(q, cache, jnp.asarray(q_lengths), sk, window, cap_)
        assert not np.asarray(out[2]).any()
        close(out, want, dtype)


@pytest.mark.parametrize("kind", ["paged-NHD", "linear"])
@pytest.mark.parametrize("scaling", ["per_token_head", "per_tensor"])
def test_eight_bit_caches_with_window_soft_cap_and_sinks(kind, scaling):
    """fp8 e4m3 caches with their own scales: windowed decode and prefill, soft cap and sinks,
    against the reference over the dequantized values."""
    b, h, d, cap, page = 3, 2, 128, 256, 16
    kw = dict(scaling=scaling, **(dict(k_scale=0.05, v_scale=0.05) if scaling == "per_tensor"
                                  else {}))
    dtype = jnp.float8_e4m3fn
    if kind == "linear":
        c = jaxkv.LinearKVCache.create(1, b, h, cap, d, dtype, **kw).reset(jnp.zeros((b,), jnp.int32))
    else:
        c = jaxkv.PagedKVCache.create(1, b * cap // page, page, h, d, b, cap // page, dtype,
                                      "NHD", **kw)
    n = jnp.asarray([cap, 77, 0], jnp.int32)
    if kind != "linear":
        c, served = c.reserve(n)
        assert bool(jnp.all(served))
    k, v = normal((b, h, cap, d), jnp.float32), normal((b, h, cap, d), jnp.float32)
    c = c.append(0, k, v, n)
    scale = None if scaling == "per_token_head" else 0.05
    kq, ks = reference.quantize(k, dtype, scale)
    vq, vs = reference.quantize(v, dtype, scale)
    kd, vd = reference.dequantize(kq, ks), reference.dequantize(vq, vs)
    sinks = jnp.asarray(_rng.standard_normal(4 * h), jnp.float32)
    prefix = jnp.maximum(n - 20, 0)
    qp = normal((b, 20, 4 * h, d), jnp.bfloat16)
    out = jaxkv.attention.prefill(qp, dataclasses.replace(c, lengths=prefix), 0, n - prefix,
                                  window=33, soft_cap=20.0, sinks=sinks)
    want = reference.attention(qp, kd, vd, prefix, n - prefix, window=33, soft_cap=20.0,
                               sinks=sinks)
    close(out, want, jnp.float8_e4m3fn)
    c = c.commit(n)
    q = normal((b, 4 * h, d), jnp.bfloat16)
    for window, cap_, sk in [(100, None, None), (17, 10.0, sinks)]:
        out = jaxkv.attention.decode(q, c, 0, window=window, soft_cap=cap_, sinks=sk)
        want = reference.decode_attention(q, kd, vd, n, window=window, soft_cap=cap_, sinks=sk)
        close(out, want, jnp.float8_e4m3fn)


def test_long_rows_split_over_blocks_keep_the_window():
    """Rows long enough for the GPU's split-KV decode to split them: a traced window (splits
    sized by the capacity) and a static one (sized by the window), both over the window only."""
    b, d, page, pages = 3, 128, 16, 96
    cap = page * pages
    lengths = np.array([cap, 777, 0], np.int32)
    case = build("paged-NHD", jnp.bfloat16, d, page, lengths, cap)
    q = normal((b, HKV * 4, d), jnp.bfloat16)
    lens = jnp.asarray(lengths)
    sinks = jnp.asarray(_rng.standard_normal(HKV * 4), jnp.float32)
    for window in (600, 1000):
        cache = poison_before(case, np.maximum(lengths - window, 0))
        want = ref(q[:, None], case.k, case.v, lens - 1, (lens > 0).astype(jnp.int32),
                   window=window, sinks=sinks)[:, 0]
        close(_decode(q, cache, lens, sinks, window, None), want, jnp.bfloat16)
        close(_decode(q, cache, lens, sinks, None, None, static=False,
                      traced_window=jnp.int32(window)), want, jnp.bfloat16)


def test_sinks_larger_than_every_score_and_scores_past_the_cap():
    """A sink far above the scores (its weight near 1: no overflow) and scores far past a small
    cap (softmax over values near +-cap)."""
    case = build("linear", jnp.float32, 64, 16, [5, 40], 48)
    q = normal((2, 4, 64), jnp.float32) * 30
    lens = case.cache.lengths
    for sinks, cap_ in ((jnp.full((4,), 200.0, jnp.float32), None), (None, 0.5)):
        out = _decode(q, case.cache, lens, sinks, None, cap_)
        want = ref(q[:, None], case.k, case.v, lens - 1, jnp.ones((2,), jnp.int32),
                   soft_cap=cap_, sinks=sinks)[:, 0]
        close(out, want, jnp.float32)


@pytest.mark.parametrize("dtype,group,head_dim", [
    (jnp.bfloat16, 4, 128), (jnp.float16, 1, 128),
    pytest.param(jnp.bfloat16, 2, 256, marks=pytest.mark.gpu_sized)])
def test_soft_capped_prefill_over_long_prefixes(dtype, group, head_dim):
    """Soft-capped prefill, no window, over prefixes of several key tiles (the GPU's tiles
    without masks among them): Gemma 2's cap of 50 with scores far past it (weights below
    2^-126), a small cap with sinks, and a cap so large that it is as good as none."""
    page, cap = 16, 640
    prefix = np.array([cap - 64, 300, 0], np.int32)
    q_lengths = np.array([64, 45, 64], np.int32)
    case = build("paged-NHD", dtype, head_dim, page, prefix + q_lengths, cap)
    case.cache = dataclasses.replace(case.cache, lengths=jnp.asarray(prefix))
    sinks = jnp.asarray(_rng.standard_normal(HKV * group), jnp.float32)
    # Scores near +-50: the GPU's tanh (relative error 2^-11) moves a logit by up to 0.025, and
    # a softmax that sharp moves the output by up to about 0.04.
    for q_mul, cap_, sk, tol in [(40.0, 50.0, None, 6e-2), (1.0, 2.0, sinks, TOL[dtype]),
                                 (3.0, 1e30, None, TOL[dtype])]:
        q = normal((3, 64, HKV * group, head_dim), dtype) * q_mul
        want = ref(q, case.k, case.v, jnp.asarray(prefix), jnp.asarray(q_lengths),
                   soft_cap=cap_, sinks=sk)
        out = np.asarray(_prefill(q, case.cache, jnp.asarray(q_lengths), sk, None, cap_), np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, np.asarray(want), rtol=tol, atol=tol)


def test_traced_windows_mix_window_and_global_layers_in_a_scan():
    """A scan over layers whose window is a traced value (a window layer, then a global one as
    a window past the capacity), appending each layer's token then attending, cache donated."""
    layers, b, h, d, cap = 2, 2, 2, 64, 40
    windows = jnp.asarray([5, FULL], jnp.int32)
    cache = jaxkv.LinearKVCache.create(layers, b, h, cap, d, jnp.float32).reset(
        jnp.zeros((b,), jnp.int32))
    k, v = normal((layers, b, h, 30, d), jnp.float32), normal((layers, b, h, 30, d), jnp.float32)
    n = jnp.asarray([30, 12], jnp.int32)
    for i in range(layers):
        cache = cache.append(i, k[i], v[i], n)
    cache = cache.commit(n)
    q = normal((layers, b, 2 * h, d), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, q):
        def layer(c, x):
            i, w, qi = x
            return c, jaxkv.attention.decode(qi, c, i, window=w)
        return jax.lax.scan(layer, cache, (jnp.arange(layers), windows, q))

    _, outs = step(cache, q)
    for i in range(layers):
        want = reference.decode_attention(q[i], k[i], v[i], n, window=[5, None][i])
        close(outs[i], want, jnp.float32)


def test_bad_window_soft_cap_and_sinks_are_trace_time_errors_naming_the_op():
    case = build("linear", jnp.bfloat16, 64, 16, [3, 4], 16)
    c, q = case.cache, normal((2, 4, 64), jnp.bfloat16)
    qp = normal((2, 3, 4, 64), jnp.bfloat16)
    ql = jnp.ones((2,), jnp.int32)
    bad = [
        (dict(window=0), ValueError, "attention.decode: window must be >= 1"),
        (dict(window=-3), ValueError, "window must be >= 1"),
        (dict(window=True), TypeError, "window must be None, a Python int or an int32 scalar"),
        (dict(window=2.5), TypeError, "window must be None, a Python int"),
        (dict(window=jnp.ones((2,), jnp.int32)), ValueError, "window must have rank 0"),
        (dict(window=jnp.float32(4)), TypeError, "window must be an int32 scalar"),
        (dict(soft_cap=0.0), ValueError, "attention.decode: soft_cap must be a finite float > 0"),
        (dict(soft_cap=-50.0), ValueError, "soft_cap must be a finite float > 0"),
        (dict(soft_cap=float("inf")), ValueError, "soft_cap must be a finite float > 0"),
        (dict(soft_cap=float("nan")), ValueError, "soft_cap must be a finite float > 0"),
        (dict(soft_cap=jnp.float32(5)), TypeError, "soft_cap must be None or a Python float"),
        (dict(sinks=jnp.zeros((3,), jnp.float32)), ValueError, "attention.decode: sinks"),
        (dict(sinks=jnp.zeros((4,), jnp.bfloat16)), TypeError, "sinks must be float32"),
        (dict(sinks=[0.0] * 4), TypeError, "attention.decode: sinks"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=re.escape(msg)):
            jaxkv.attention.decode(q, c, 0, **kw)
    with pytest.raises(ValueError, match=re.escape("attention.prefill: window must be >= 1")):
        jaxkv.attention.prefill(qp, c, 0, ql, window=0)
    with pytest.raises(ValueError, match="implementation='cudnn' cannot serve this call"):
        jaxkv.attention.decode(q, c, 0, window=4, implementation="cudnn")


def test_a_traced_window_below_one_is_reported_and_sees_no_key():
    case = build("paged-NHD", jnp.float32, 64, 16, [3, 20], 32)
    q = normal((2, 2, 64), jnp.float32)
    fn = checkify.checkify(jax.jit(lambda c, w: jaxkv.attention.decode(q, c, 0, window=w)))
    err, out = fn(case.cache, jnp.int32(0))
    assert "attention.decode: window < 1" in (err.get() or "")
    assert not np.asarray(out).any()
    err, _ = fn(case.cache, jnp.int32(1))
    assert err.get() is None


def test_sharded_sinks_split_with_their_heads():
    """Over a mesh splitting heads (tp) and rows (dp), each shard takes its q heads' sinks: equal
    to the unsharded result."""
    from jax.sharding import AxisType

    devices = jax.devices() if jax.device_count() >= 4 else jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=devices[:4])
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    b, h, hq, cap, d = 4, 2, 8, 16, 16
    k, v = normal((b, h, cap, d), jnp.float32), normal((b, h, cap, d), jnp.float32)
    n = jnp.asarray([5, 0, 16, 9], jnp.int32)
    with jax.default_device(devices[0]):
        def filled(sharding):
            c = jaxkv.LinearKVCache.create(1, b, h, cap, d, jnp.float32, sharding=sharding)
            c = c.reset(jnp.zeros((b,), jnp.int32))
            return c.append(0, k, v, n).commit(n)
        q = normal((b, hq, d), jnp.float32)
        sinks = jnp.asarray(_rng.standard_normal(hq), jnp.float32)
        fn = jax.jit(lambda c, q, s: jaxkv.attention.decode(q, c, 0, window=6, soft_cap=3.0,
                                                            sinks=s))
        got = fn(filled(s), q, sinks)
        want = reference.decode_attention(q, k, v, n, window=6, soft_cap=3.0, sinks=sinks)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_a_hybrid_call_never_goes_to_cudnn():
    case = build("paged-NHD", jnp.bfloat16, 64, 16, [3, 4], 32)
    q = normal((2, 4, 64), jnp.bfloat16)
    hlo = jax.jit(lambda c: jaxkv.attention.decode(q, c, 0, window=8)).lower(case.cache).as_text()
    assert "jaxkv_attention_decode" in hlo
