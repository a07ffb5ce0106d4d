"""The host tier of a cache with sliding-window layers: a row's pages of every layer group go to
the host (only those it holds: a window group's released columns move nothing) and come back to
the same columns of the same groups' tables, byte for byte."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import NO_PAGE, PagedKVCache, attention

from helpers import assert_bytes_equal, copies_of, random_array
from test_host_tier import filled, swap_in, swap_in_overlapped, swap_out, swap_out_overlapped

pytestmark = pytest.mark.host_tier

H, D = 2, 16
# Prefill chunks then decode steps: the window groups release their first pages on the way.
STEPS = [[4, 3, 4, 2], [1, 2, 1, 4], [2, 1, 4, 1], [1, 1, 1, 1]]
OTHERS = [0, 4, 0, 4]  # rows 1 and 3 grow while 0 and 2 are on the host


fork = jax.jit(PagedKVCache.fork, donate_argnums=0)
reserve = jax.jit(PagedKVCache.reserve, donate_argnums=0)


def make(windows=(None, 3, None, 3), page_size=2, num_pages=80, max_batch=4,
         max_pages_per_seq=8, host_pages=32, **kw):
    kw = dict(dict(num_kv_heads=H, head_dim=D, dtype=jnp.float32), **kw)
    return PagedKVCache.create(num_layers=len(windows), num_pages=num_pages, page_size=page_size,
                               max_batch=max_batch, max_pages_per_seq=max_pages_per_seq,
                               host_pages=host_pages, windows=windows, **kw)


def grown(cache, steps=STEPS, dtype=jnp.float32):
    for n in steps:
        cache = filled(cache, n, dtype)
    return cache


def wide(cache) -> np.ndarray:
    """Every group's page table side by side: the host table's layout."""
    return np.concatenate([np.asarray(t) for t in cache._tables()], axis=1)


@functools.partial(jax.jit, static_argnums=1)
def gather_all(cache, max_len):
    """Every layer's tokens ``[L, B, 2, H, max_len, D]`` (released positions are zeros)."""
    return jnp.stack([cache.gather(i, max_len) for i in range(cache.num_layers)])


@jax.jit
def decode_all(q, cache):
    """Every layer's decode over the rows' tokens, each layer with its own window."""
    return jnp.stack([attention.decode(q, cache, i) for i in range(cache.num_layers)])


def snapshot(cache):
    q = random_array((cache.max_batch, 2 * H, D), jnp.bfloat16 if cache.scaling else jnp.float32)
    max_len = cache.max_pages_per_seq * cache.page_size
    return q, np.asarray(gather_all(cache, max_len)), np.asarray(decode_all(q, cache), np.float32)


def assert_same_rows(cache, before, rows, what):
    """The rows' gathered tokens byte for byte (zeros included) and their attention as before."""
    q, tokens, out = before
    max_len = cache.max_pages_per_seq * cache.page_size
    got_tokens = np.asarray(gather_all(cache, max_len))
    got_out = np.asarray(decode_all(q, cache), np.float32)
    for b in rows:
        assert_bytes_equal(got_tokens[:, b], tokens[:, b], f"{what}: row {b}'s tokens")
        np.testing.assert_allclose(got_out[:, b], out[:, b], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{what}: row {b}'s attention")


def assert_counts_agree(cache):
    """Each device page's count is the table entries naming it; each host page's likewise."""
    table = wide(cache)
    named = np.bincount(table[table >= 0], minlength=cache.num_pages)
    np.testing.assert_array_equal(named, np.asarray(cache.ref_counts))
    host = np.asarray(cache.host.table)
    named = np.bincount(host[host >= 0], minlength=cache.host.num_pages)
    np.testing.assert_array_equal(named, np.asarray(cache.host.ref_counts))


def released_before_held(cache, b) -> bool:
    """Row ``b`` has, in some window group, a released column before a held one."""
    for table, w in zip(cache._tables(), cache._group_windows()):
        held = np.asarray(table[b]) >= 0
        if w is not None and held.any() and not held[:np.argmax(held)].all():
            return True
    return False


CASES = [((None, 3, None, 3), 2, jnp.float32, None, "NHD", False),
         ((3, None, 3, 3), 4, jnp.float32, None, "HND", False),  # 4 groups of one layer
         ((None, 3, None, 3), 2, jnp.float32, None, "HND", True),
         ((None, 3, None, 3), 2, jnp.float8_e4m3fn, "per_token_head", "NHD", False),
         ((3, None, 3, 3), 2, jnp.float8_e4m3fn, "per_token_head", "HND", True)]


@pytest.mark.parametrize("windows,page_size,dtype,scaling,layout,overlap", CASES)
def test_round_trip_moves_the_pages_held_and_brings_them_back(windows, page_size, dtype, scaling,
                                                             layout, overlap):
    """Rows 0 and 2 go out with exactly the pages they hold in every group (a window group's
    released columns move nothing), rows 1 and 3 grow into the freed pages, and back in, at
    the same columns of the same tables, every layer's tokens and attention are as before."""
    cache = make(windows, page_size, dtype=dtype, scaling=scaling, layout=layout)
    assert cache.host.table.shape == (4, 8 * len(cache._tables()))
    src = jnp.bfloat16 if scaling else dtype
    cache = grown(cache, dtype=src)
    mask = jnp.array([True, False, True, False])
    assert released_before_held(cache, 0) and released_before_held(cache, 2)
    before = snapshot(cache)
    table, held = wide(cache), np.asarray(cache.pages_held)
    free, free_host = int(cache.num_free_pages), int(cache.num_free_host_pages)
    moving = int(held[0] + held[2])

    cache, swapped = (swap_out_overlapped if overlap else swap_out)(cache, mask, 32)
    assert np.asarray(swapped).tolist() == [True, False, True, False]
    if overlap:  # the pages stay held until the transfer is settled
        assert int(cache.num_free_pages) == free
        cache = cache.settle_swaps()
    assert int(cache.num_free_pages) == free + moving
    assert int(cache.num_free_host_pages) == free_host - moving
    host = np.asarray(cache.host.table)
    for b in (0, 2):  # the host pages sit at the columns of the pages they hold
        np.testing.assert_array_equal(host[b] >= 0, table[b] >= 0, f"row {b}'s host columns")
        assert (wide(cache)[b] == NO_PAGE).all()
    assert_counts_agree(cache)

    freed = set(table[[0, 2]][table[[0, 2]] >= 0].tolist())
    cache = grown(cache, [OTHERS, OTHERS], src)
    assert freed & set(wide(cache)[[1, 3]].ravel().tolist()), "no freed page was reused"
    assert_counts_agree(cache)

    cache, served = (swap_in_overlapped if overlap else swap_in)(cache, mask, 32)
    assert np.asarray(served).tolist() == [True, False, True, False]
    if overlap:  # on the host until settled
        assert np.asarray(cache.arriving).tolist() == [True, False, True, False]
        cache = cache.settle_swaps()
    assert not bool(jnp.any(cache.on_host))
    assert int(cache.num_free_host_pages) == cache.host.num_pages
    for b in (0, 2):
        np.testing.assert_array_equal(wide(cache)[b] >= 0, table[b] >= 0, f"row {b}'s columns")
    assert_counts_agree(cache)
    assert_same_rows(cache, before, (0, 2), "back from the host")


def test_pages_shared_with_another_row_stay_in_every_group():
    """A forked row keeps its shared pages on the device in each group's table, the window
    group's after its released columns; only its own pages move, and they come back beside the
    shared ones: the pool uses no more pages than before."""
    cache = grown(make(), [[4, 0, 0, 0], [3, 0, 0, 0], [2, 0, 0, 0]])  # row 0: 9 tokens
    cache, forked = fork(cache, jnp.int32(0), jnp.array([1], jnp.int32))
    assert bool(forked[0])  # row 1: the full pages shared, its copy of the last one
    # Both rows let go of a shared window page; later reserves release nothing more (the
    # lengths stay), so the table row 1 comes back to is the one it left.
    cache, _ = reserve(cache, jnp.zeros((4,), jnp.int32))
    refs = np.asarray(cache.ref_counts)
    table = wide(cache)
    shared = (table[1] >= 0) & (refs[np.maximum(table[1], 0)] > 1)
    own = (table[1] >= 0) & ~shared
    w = cache.max_pages_per_seq
    assert shared[:w].any() and shared[w:].any() and own[:w].any() and own[w:].any()
    assert released_before_held(cache, 1)
    before = snapshot(cache)
    used = cache.num_pages - int(cache.num_free_pages)

    cache, swapped = swap_out(cache, jnp.array([False, True, False, False]), 32)
    assert bool(swapped[1])
    np.testing.assert_array_equal(wide(cache)[1], np.where(shared, table[1], NO_PAGE))
    np.testing.assert_array_equal(np.asarray(cache.host.table[1]) >= 0, own)
    assert cache.num_pages - int(cache.num_free_pages) == used - own.sum()
    assert_counts_agree(cache)
    cache = grown(cache, [[0, 0, 4, 0]])  # row 2 takes the freed pages
    cache = cache.release(jnp.array([False, False, True, False]))
    cache, served = swap_in(cache, jnp.array([False, True, False, False]), 32)
    assert bool(served[1])
    np.testing.assert_array_equal(wide(cache)[1] >= 0, table[1] >= 0)
    assert cache.num_pages - int(cache.num_free_pages) == used  # nothing unshared
    assert_counts_agree(cache)
    assert_same_rows(cache, before, (0, 1), "after the forked row's round trip")


def test_release_and_compact_carry_host_rows():
    """A row on the host moves with compact (its host row with it) and comes back whole; a row
    released on the host frees its host pages."""
    cache = grown(make())
    before = snapshot(cache)
    held = np.asarray(cache.pages_held)
    cache, _ = swap_out(cache, jnp.array([True, False, True, False]), 32)
    cache = cache.compact(jnp.array([2, 1, 0, 3], jnp.int32))  # rows 0 and 2 trade slots
    assert np.asarray(cache.host.held).tolist() == [held[2], 0, held[0], 0]
    cache = cache.release(jnp.array([True, False, False, False]))  # row 2, now slot 0
    assert int(cache.num_free_host_pages) == cache.host.num_pages - held[0]
    assert_counts_agree(cache)
    cache, served = swap_in(cache, jnp.array([False, False, True, False]), 32)
    assert bool(served[2]) and int(cache.num_free_host_pages) == cache.host.num_pages
    assert_counts_agree(cache)
    q, tokens, out = before
    slots = [2, 1, 0, 3]  # row 0's tokens (and query) are now row 2's
    moved = (q[jnp.array(slots)], tokens[:, slots], out[:, slots])
    assert_same_rows(cache, moved, (1, 2, 3), "after compact")


def test_swaps_copy_no_pool():
    """swap_out and swap_in of a windowed cache read and write the pools in place: the page
    tables' concatenation and split copy no cache data."""
    cache = grown(make())
    for fn, args in ((swap_out, (jnp.array([True, False, True, False]), 32)),
                     (swap_in, (jnp.array([True, False, True, False]), 32))):
        hlo = fn.lower(cache, *args).compile().as_text()
        for leaf in (cache.k_pages, cache.v_pages, cache.host.pages):
            assert copies_of(hlo, leaf) == [], (fn, leaf.shape)
        cache, done = fn(cache, *args)
        assert bool(done[0]) and bool(done[2])


def test_windows_refuse_prefix_cache_and_host_pages_together():
    with pytest.raises(ValueError, match=re.escape(
            "PagedKVCache.create: windows are not yet supported with prefix_cache and host_pages")):
        make(prefix_cache=True)
