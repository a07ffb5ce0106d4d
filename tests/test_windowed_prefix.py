"""Prefix caching on a cache with sliding-window layers: group 0's pages form the exact chains,
every other group's pages are indexed as twins under them, and a match needs a window group's
pages only where its window still sees them (vLLM's rule)."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import _windows, page_index, reference

H, D = 2, 16


def kv_of(tokens, positions, num_layers):
    """K and V ``[L, B, H, T, D]`` that are a function of (token id, position, layer) alone:
    a row that starts on cached pages must read what it would have written."""
    t = np.asarray(tokens, np.float32)[None, :, None, :, None]
    p = np.asarray(positions, np.float32)[None, :, None, :, None]
    layer = np.arange(num_layers, dtype=np.float32)[:, None, None, None, None]
    k = t * 1000 + p * 10 + layer + np.zeros((1, 1, H, 1, D), np.float32)
    return jnp.asarray(k), jnp.asarray(-k)


@functools.partial(jax.jit, static_argnums=3)
def _write(cache, tokens, n, t):
    """Reserves, appends and commits ``n[b]`` tokens of ``tokens`` from each row's length."""
    cache, served = cache.reserve(n)
    cols = cache.lengths[:, None] + jnp.arange(t)[None, :]
    ids = jnp.take_along_axis(tokens, jnp.clip(cols, 0, tokens.shape[1] - 1), axis=1)
    f = (ids.astype(jnp.float32) * 1000 + cols.astype(jnp.float32) * 10)[None, :, None, :, None]
    k = f + jnp.arange(cache.num_layers, dtype=jnp.float32)[:, None, None, None, None]
    k = jnp.broadcast_to(k, (cache.num_layers, cache.max_batch, H, t, D))
    n = jnp.where(served, n, 0)
    return cache.append_layers(k, -k, n).commit(n), served


def make(windows, num_pages=40, page_size=2, max_batch=3, max_pages=8):
    return jaxkv.PagedKVCache.create(len(windows), num_pages, page_size, H, D, max_batch,
                                     max_pages, jnp.float32, "NHD", prefix_cache=True,
                                     windows=windows)


def assert_rows_read_their_tokens(cache, tokens):
    """Every position a row's layers still hold reads the K of its own token there."""
    lengths = np.asarray(cache.lengths)
    t = tokens.shape[1]
    for i, w in enumerate(cache.windows):
        k = np.asarray(cache.gather(i, t, split=True)[0])
        want = (tokens.astype(np.float32) * 1000 + np.arange(t, dtype=np.float32) * 10 + i)
        for b, n in enumerate(lengths):
            lo = 0 if w is None else max(int(n) - w + 1, 0)
            np.testing.assert_array_equal(
                k[b, :, lo:n], np.broadcast_to(want[b, None, lo:n, None], (H, n - lo, D)),
                err_msg=f"layer {i} row {b}")


def assert_consistent(cache):
    refs = np.zeros(cache.num_pages, np.int64)
    for table in cache._tables():
        t = np.asarray(table)
        np.add.at(refs, t[t >= 0], 1)
    np.testing.assert_array_equal(refs, np.asarray(cache.ref_counts))
    assert page_index.cross_namespace_entries(cache.prefix_cache) == 0


def test_a_hit_needs_only_the_pages_its_window_sees():
    """A prompt prefilled in two chunks releases its window pages of the first chunk before it
    is inserted: the whole prompt still matches (its last window's pages are cached), while a
    prompt sharing only the first chunk matches nothing (its window's pages are gone); a
    full-attention cache matches both."""
    windows = (None, 3, None, 3)
    tokens = np.arange(1, 17, dtype=np.int32)[None].repeat(3, 0)
    tokens[2, 7:] += 50  # row 2 shares the first 7 tokens only
    tokens = jnp.asarray(tokens)
    got = {}
    for name, w in (("windows", windows), ("full", (None,) * 4)):
        c = make(w)
        for n in ([8, 0, 0], [8, 0, 0]):  # row 0: 16 tokens in two chunks
            c, _ = _write(c, tokens, jnp.asarray(n, jnp.int32), 8)
        c = c.insert_prefix(tokens, jnp.array([16, 0, 0], jnp.int32))
        c = c.release(jnp.array([True, False, False]))
        c, matched = c.match_prefix(tokens, jnp.array([0, 16, 16], jnp.int32))
        got[name] = np.asarray(matched).tolist()
        assert_consistent(c)
        if name == "windows":
            for table, gw in zip(c._tables(), c._group_windows()):
                held = np.asarray(jnp.sum(table >= 0, axis=1))
                if gw is not None:
                    assert held[1] <= _windows.max_pages_held(gw, 0, 2), held
            c, _ = _write(c, tokens, jnp.array([0, 2, 16], jnp.int32), 16)
            assert_rows_read_their_tokens(c, np.asarray(tokens))
    assert got == {"windows": [0, 14, 0], "full": [0, 14, 6]}


@pytest.mark.parametrize("windows,page_size", [
    ((None, 3, None, 3), 2),
    pytest.param((5, 5), 2, marks=pytest.mark.long),  # every layer windowed: the anchor a window
    pytest.param((2, None, 7, 7), 3, marks=pytest.mark.long)])
def test_random_requests_read_their_own_tokens(windows, page_size):
    """Requests over a few shared prompts: match, prefill in chunks (inserting as they go),
    decode, release, under pressure that evicts cached pages. Every held position reads its own
    token's K/V, reference counts equal the tables, the index audit is clean, and matches are
    found (a window group's twins are found under their anchors)."""
    rng = np.random.default_rng(zlib.crc32(repr(windows).encode()))  # the same in every process
    B, T = 3, 16
    c = make(windows, num_pages=24, page_size=page_size, max_batch=B, max_pages=8)
    prompts = rng.integers(0, 3, (4, T)).astype(np.int32)
    rows = np.zeros((B, T), np.int32)
    insert = jax.jit(jaxkv.PagedKVCache.insert_prefix)
    hits = 0
    for step in range(40):
        idle = (np.asarray(c.lengths) == 0) & (np.asarray(c.pages_held) == 0)
        op = rng.integers(3)
        if op == 0 and idle.any():  # new requests on the idle rows
            n = np.where(idle, rng.integers(2, T + 1, B), 0).astype(np.int32)
            rows = np.where(idle[:, None], prompts[rng.integers(0, 4, B)], rows)
            c, matched = c.match_prefix(jnp.asarray(rows), jnp.asarray(n))
            hits += int(np.sum(matched))
            left = n - np.asarray(matched)
            while left.any():  # the rest in chunks of at most 5, inserted as they go
                chunk = np.minimum(left, 5).astype(np.int32)
                c, served = _write(c, jnp.asarray(rows), jnp.asarray(chunk), 5)
                chunk = np.where(np.asarray(served), chunk, 0)
                left = np.where(np.asarray(served), left - chunk, 0)
                c = insert(c, jnp.asarray(rows), c.lengths)
        elif op == 1:  # a decode step on busy rows (token ids past the prompts)
            busy = (np.asarray(c.lengths) > 0) & (np.asarray(c.lengths) < T)
            c, _ = _write(c, jnp.asarray(rows), jnp.asarray(busy.astype(np.int32)), 1)
        else:
            c = c.release(jnp.asarray(rng.random(B) < 0.5))
        assert_consistent(c)
        assert_rows_read_their_tokens(c, rows)
        for table, gw in zip(c._tables(), c._group_windows()):
            if gw is not None:
                held = np.asarray(jnp.sum(table >= 0, axis=1))
                assert held.max() <= _windows.max_pages_held(gw, 5, page_size), held
    assert hits > 0


@pytest.mark.long
def test_evicting_an_anchor_unindexes_its_twins():
    """Pressure that evicts the cached pages of group 0 takes the other groups' twins out of
    the index with them: nothing is found afterwards, and the audit stays clean."""
    windows = (None, 4)
    c = make(windows, num_pages=12, page_size=2, max_batch=2, max_pages=6)
    tokens = jnp.asarray(np.arange(1, 13, dtype=np.int32)[None].repeat(2, 0))
    c, _ = _write(c, tokens, jnp.array([6, 0], jnp.int32), 6)
    c = c.insert_prefix(tokens, jnp.array([6, 0], jnp.int32))
    assert int(jnp.sum((c.prefix_cache.group == 1) & c.prefix_cache.indexed)) == 3
    c = c.release(jnp.array([True, False]))
    c, served = c.reserve(jnp.array([0, 12], jnp.int32))  # every page of both groups
    assert bool(served[1])
    assert not bool(jnp.any(c.prefix_cache.indexed))
    c = c.release(jnp.array([False, True]))
    c, matched = c.match_prefix(tokens, jnp.array([6, 0], jnp.int32))
    assert np.asarray(matched).tolist() == [0, 0]
    assert_consistent(c)


def test_a_matched_row_attends_as_one_that_computed_its_prompt():
    """Attention of a row started on cached pages equals that of a row that computed the whole
    prompt (the same bytes: bit for bit) and the reference with each layer's window."""
    windows = (None, 3, None, 3)
    tokens = jnp.asarray(np.arange(1, 17, dtype=np.int32)[None].repeat(3, 0))
    c = make(windows)
    c, _ = _write(c, tokens, jnp.array([12, 0, 0], jnp.int32), 12)
    c = c.insert_prefix(tokens, jnp.array([12, 0, 0], jnp.int32))
    c, matched = c.match_prefix(tokens, jnp.array([0, 12, 0], jnp.int32))
    assert int(matched[1]) == 10
    c, _ = _write(c, tokens, jnp.array([0, 2, 12], jnp.int32), 12)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2 * H, D)), jnp.float32)
    q = jnp.repeat(q, 3, axis=0)  # one query for every row
    k, v = kv_of(tokens, np.broadcast_to(np.arange(16), (3, 16)), 4)
    for i, w in enumerate(windows):
        out = np.asarray(jaxkv.attention.decode(q, c, i, scale=1e-4))  # scores of order 1
        np.testing.assert_array_equal(out[1], out[2])
        want = reference.decode_attention(q, k[i], v[i], jnp.array([12, 12, 12]), scale=1e-4,
                                          window=w)
        # (row 0, done, released what a next query would not see: only rows 1 and 2 are read)
        np.testing.assert_allclose(out[1:], want[1:], rtol=1e-5, atol=1e-5)
