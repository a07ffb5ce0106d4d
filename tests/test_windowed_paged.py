"""PagedKVCache with sliding-window layers: window layers release the pages no query sees any
more, each row holds at most ceil((window + new tokens) / page_size) + 1 pages for them, and
attention over every layer equals jaxkv.reference over the whole history with each layer's
window."""

from __future__ import annotations

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jaxkv
from jaxkv import _windows, reference

from helpers import copies_of, mesh_of

_rng = np.random.default_rng()
H, D, PAGE = 2, 16, 4


def window_pages(cache) -> list[np.ndarray]:
    """Per group: (window, pages each row holds)."""
    out = []
    for table, w in zip(cache._tables(), cache._group_windows()):
        out.append((w, np.asarray(jnp.sum(table >= 0, axis=1))))
    return out


def assert_consistent(cache, n_new=None):
    """Reference counts equal table references; each window group within its bound."""
    refs = np.zeros(cache.num_pages, np.int64)
    for table in cache._tables():
        t = np.asarray(table)
        np.add.at(refs, t[t >= 0], 1)
    np.testing.assert_array_equal(refs, np.asarray(cache.ref_counts))
    for w, held in window_pages(cache):
        if w is not None:
            most = _windows.max_pages_held(w, 0 if n_new is None else n_new, PAGE)
            assert held.max(initial=0) <= most, (w, held, most)


@pytest.mark.parametrize("windows,layout,dtype", [
    ((5, None, 5, None), "NHD", jnp.float32),  # Gemma 2's alternation
    ((6, 6, 6), "HND", jnp.float32),  # Mistral: every layer windowed
    ((3, 3, None, 9, 9, None), "NHD", jnp.float8_e4m3fn),  # two windows and global, 8-bit
])
def test_attention_equals_the_reference_as_rows_advance(windows, layout, dtype):
    """Prefill chunks then decode steps over ragged rows (one idle, one forked midway): after
    every reserve, each layer's prefill and decode equal the reference with its window, while
    the window groups give back their old pages."""
    L, B = len(windows), 3
    eight = dtype == jnp.float8_e4m3fn
    c = jaxkv.PagedKVCache.create(L, 48, PAGE, H, D, B, 16, dtype, layout, windows=windows)
    hist = np.zeros((2, L, B, H, 64, D), np.float32)
    lengths = np.zeros(B, np.int32)
    steps = [[7, 3, 0], [1, 1, 0], [7, 1, 6], [1, 1, 1], [1, 7, 1]] + [[1, 1, 1]] * 4

    @jax.jit
    def attend(c, q, qd, n, i):
        return (jaxkv.attention.prefill(q, c, i, n),
                jaxkv.attention.decode(qd, c.commit(n), i))

    for step, n in enumerate(steps):
        n = np.asarray(n, np.int32)
        c, served = c.reserve(jnp.asarray(n))
        assert bool(served.all())
        assert_consistent(c, int(n.max()))
        t = int(n.max())
        kv = _rng.standard_normal((2, L, B, H, t, D)).astype(np.float32)
        c = c.append_layers(jnp.asarray(kv[0]), jnp.asarray(kv[1]), jnp.asarray(n))
        for b in range(B):
            new = kv[:, :, b, :, :n[b]]
            if eight:  # what the cache holds: the values quantized per token and head
                q8, s8 = reference.quantize(jnp.asarray(new), dtype)
                new = np.asarray(reference.dequantize(q8, s8))
            hist[:, :, b, :, lengths[b]:lengths[b] + n[b]] = new
        q = jnp.asarray(_rng.standard_normal((B, t, 2 * H, D)), jnp.bfloat16 if eight else jnp.float32)
        qd = jnp.asarray(_rng.standard_normal((B, 2 * H, D)), q.dtype)
        tol = 2e-2 if eight else 1e-4
        for i, w in enumerate(windows):
            out, dec = attend(c, q, qd, jnp.asarray(n), jnp.int32(i))
            want = reference.prefill_attention(q, hist[0, i], hist[1, i], jnp.asarray(lengths),
                                               jnp.asarray(n), window=w)
            np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=tol, atol=tol)
            want = reference.decode_attention(qd, hist[0, i], hist[1, i],
                                              jnp.asarray(lengths + n), window=w)
            np.testing.assert_allclose(np.asarray(dec, np.float32), want, rtol=tol, atol=tol)
        c = c.commit(jnp.asarray(n))
        lengths += n
        if step == 4:  # row 2 restarts as a copy of row 0 (shared full pages, its own last)
            c, forked = c.fork(0, jnp.array([2], jnp.int32))
            assert bool(forked.all())
            hist[:, :, 2] = hist[:, :, 0]
            lengths[2] = lengths[0]
            assert_consistent(c, 7)  # the rows hold what the last reserve (7 tokens) took
    # a window group's row holds its window's pages, not the context's
    held = dict((w, h) for w, h in window_pages(c))
    for w in set(windows) - {None}:
        assert held[w].max() <= _windows.max_pages_held(w, 1, PAGE) < lengths.max() // PAGE


def test_gemma3_shape_holds_the_pages_its_windows_need():
    """40 windowed layers (1024) and 8 global ones at 8k tokens: a row holds 8 layers' pages of
    the context and 40 layers' of one window, 3.7x fewer than a cache keeping every layer's
    tokens (at 32k: 5x)."""
    windows = ([1024] * 5 + [None]) * 8
    c = jaxkv.PagedKVCache.create(48, 4096, 16, 1, 16, 1, 512, jnp.bfloat16, windows=windows)
    assert c.k_pages.shape[0] == 8 and c.group_tables.shape[0] == 5  # slots, groups - 1
    for _ in range(8):  # 8 chunks of 1024
        c, served = c.reserve(jnp.array([1024], jnp.int32))
        c = c.commit(jnp.array([1024], jnp.int32))
    c, _ = c.reserve(jnp.array([1], jnp.int32))
    held = int(c.pages_held[0]) * c.k_pages.shape[0]  # layer-pages
    assert held <= 8 * (8192 // 16 + 1) + 40 * _windows.max_pages_held(1024, 1, 16)
    every_layer = 48 * (8192 // 16 + 1)
    assert every_layer / held > 3.6, (held, every_layer)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["step", "prefill", "fork", "release", "compact"]),
                          st.integers(0, 2), st.integers(1, 9)), min_size=4, max_size=14))
def test_page_bound_and_counts_hold_over_random_sequences(ops):
    """Random decode steps, prefill chunks, forks, releases and compactions: reference counts
    equal table references, no page serves two groups, window rows stay within their bound."""
    windows = (5, None, 2, None)
    c = _fresh(windows)
    for op, row, size in ops:
        if op in ("step", "prefill"):
            n = np.where(c.lengths > 0, 1, 0).astype(np.int32) if op == "step" else \
                np.eye(3, dtype=np.int32)[row] * size
            c, served = c.reserve(jnp.asarray(n))
            assert_consistent(c, int(n.max()))
            c = c.commit(jnp.where(served, jnp.asarray(n), 0))
        elif op == "fork":
            c, _ = c.fork(row, jnp.array([(row + 1) % 3], jnp.int32))
        elif op == "release":
            c = c.release(jnp.arange(3) == row)
        else:
            c = c.compact(jnp.array([2, -1, 0], jnp.int32) if row else jnp.array([1, 0, 2], jnp.int32))
        assert_consistent(c, 9)  # a row holds what its last reserve (9 tokens at most) took
        pages = np.concatenate([np.asarray(t).ravel() for t in c._tables()])
        held = pages[pages >= 0]
        shared_ok = np.asarray(c.ref_counts)[held] >= 1
        assert shared_ok.all()
        # a page id is in one group's tables only
        groups = [set(np.asarray(t)[np.asarray(t) >= 0].tolist()) for t in c._tables()]
        assert not (groups[0] & groups[1])
    c = c.release(jnp.ones((3,), bool))
    assert int(c.num_free_pages) == c.num_pages


@functools.cache
def _fresh(windows):
    return jaxkv.PagedKVCache.create(len(windows), 40, PAGE, H, D, 3, 8, jnp.float32,
                                     windows=windows)


def test_a_decode_step_runs_in_place_under_donation_and_scan():
    """reserve (releasing old pages) + a scan of append and attention over the layers (traced
    index) + commit: the compiled step copies no pool."""
    windows = (4, None, 4, None)
    c = jaxkv.PagedKVCache.create(4, 32, PAGE, H, D, 2, 8, jnp.float32, windows=windows)
    c, _ = c.reserve(jnp.array([6, 3], jnp.int32))
    c = c.commit(jnp.array([6, 3], jnp.int32))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(c, k, v, q):
        c, _ = c.reserve(jnp.ones((2,), jnp.int32))
        def layer(c, x):
            i, k, v, q = x
            c = c.append(i, k, v)
            return c, jaxkv.attention.prefill(q, c, i, jnp.ones((2,), jnp.int32))
        c, out = jax.lax.scan(layer, c, (jnp.arange(4), k, v, q))
        return c.commit(1), out

    args = (jnp.ones((4, 2, H, 1, D)), jnp.ones((4, 2, H, 1, D)), jnp.ones((4, 2, 1, 2 * H, D)))
    hlo = step.lower(c, *args).compile().as_text()
    assert not copies_of(hlo, c.k_pages), copies_of(hlo, c.k_pages)
    pool = c.k_pages.unsafe_buffer_pointer()
    c, _ = step(c, *args)
    assert c.k_pages.unsafe_buffer_pointer() == pool


def test_a_query_reaching_released_pages_is_reported():
    from jax.experimental import checkify

    c = jaxkv.PagedKVCache.create(2, 32, PAGE, H, D, 1, 8, jnp.float32, windows=(4, None))
    c, _ = c.reserve(jnp.array([20], jnp.int32))
    c = c.commit(jnp.array([20], jnp.int32))
    c, _ = c.reserve(jnp.array([1], jnp.int32))  # releases window pages below 17
    q = jnp.ones((1, 2 * H, D))
    run = checkify.checkify(jax.jit(lambda c, w: jaxkv.attention.decode(q, c, 0, window=w)))
    assert run(c, jnp.int32(4))[0].get() is None
    assert "reaches pages its layer released" in run(c, jnp.int32(12))[0].get()
    assert "reaches pages its layer released" in checkify.checkify(
        lambda c: jaxkv.attention.decode(q, c, 0, window=None, kv_lengths=jnp.array([8])))(c)[0].get()


def test_per_tensor_scales_stay_with_their_layer():
    """An 8-bit cache with one scale per layer: a window layer's slot in its group is not its
    layer index, yet each layer writes and reads with its own scale: the windowed cache equals
    one without windows read with the same windows."""
    windows, scales = (3, None, 3, None), jnp.array([0.5, 1.0, 2.0, 4.0], jnp.float32)
    make = functools.partial(jaxkv.PagedKVCache.create, 4, 48, PAGE, H, D, 2, 8, jnp.int8, "NHD",
                             scaling="per_tensor", k_scale=scales, v_scale=scales / 2)
    hybrid, plain = make(windows=windows), make()
    qd = jnp.asarray(_rng.standard_normal((2, 2 * H, D)), jnp.bfloat16)
    for n in ([6, 2], [1, 1], [1, 3]):
        n = jnp.asarray(n, jnp.int32)
        kv = jnp.asarray(_rng.standard_normal((2, 4, 2, H, 3, D)) * 4, jnp.float32)
        caches = []
        for c in (hybrid, plain):
            c, _ = c.reserve(n)
            c = c.append_layers(kv[0], kv[1], n)
            c = c.append(1, kv[0, 1], kv[1, 1], n)  # one layer again: the same values
            caches.append(c.commit(n))
        hybrid, plain = caches
        for i, w in enumerate(windows):
            np.testing.assert_array_equal(
                jaxkv.attention.decode(qd, hybrid, i), jaxkv.attention.decode(qd, plain, i,
                                                                              window=w))
            for b, length in enumerate(np.asarray(plain.lengths)):
                lo = 0 if w is None else max(int(length) - w, 0)  # the positions still held
                np.testing.assert_array_equal(hybrid.gather(i, 16, dtype=jnp.float32)[b, ..., lo:, :],
                                              plain.gather(i, 16, dtype=jnp.float32)[b, ..., lo:, :])


def test_bad_windows_are_trace_time_errors_naming_the_argument():
    make = functools.partial(jaxkv.PagedKVCache.create, 2, 16, PAGE, H, D, 2, 4, jnp.float32)
    bad = [
        (dict(windows=(4,)), ValueError, "windows has 1 entries, num_layers is 2"),
        (dict(windows=(4, 0)), ValueError, "windows[1] must be >= 1"),
        (dict(windows=(4, 2.0)), TypeError, "windows[1] must be None or a Python int"),
        (dict(windows=4), TypeError, "windows must be a sequence"),
        (dict(windows=(4, None), prefix_cache=True, host_pages=4), ValueError,
         "windows are not yet supported with prefix_cache and host_pages together"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=re.escape("PagedKVCache.create: " + msg)):
            make(**kw)
    assert make(windows=(None, None)).windows is None  # no window: today's cache


def test_sharded_windowed_cache_equals_one_device_and_moves_no_cache_data():
    """Rows over dp, heads over tp: each shard's groups reserve, release, append and attend on
    their own rows; equal to the unsharded cache, and the compiled step has no collective."""
    mesh = mesh_of((2, 2), ("dp", "tp"))
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    windows = (5, None, 5, None)
    make = functools.partial(jaxkv.PagedKVCache.create, 4, 32, PAGE, H, D, 4, 8, jnp.float32,
                             "NHD", windows=windows)

    @jax.jit
    def step(c, k, q, n):
        c, _ = c.reserve(n)
        for i in range(4):
            c = c.append(i, k[i], 2 * k[i], n)
        c = c.commit(n)
        return c, jnp.stack([jaxkv.attention.decode(q, c, i) for i in range(4)])

    caches = [make(), make(sharding=s)]
    for n in ([7, 3, 0, 5], [1, 1, 0, 1], [1, 6, 2, 1]):
        n = jnp.asarray(n, jnp.int32)
        k = jnp.asarray(_rng.standard_normal((4, 4, H, 6, D)), jnp.float32)
        q = jnp.asarray(_rng.standard_normal((4, 2 * H, D)), jnp.float32)
        results = [step(c, k, q, n) for c in caches]
        caches = [r[0] for r in results]
        np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(caches[1].pages_held, caches[0].pages_held)
    hlo = step.lower(caches[1], k, q, n).compile().as_text()
    moves = re.findall(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", hlo)
    assert not moves, moves
