"""PagedKVCache: lifecycle against a dense model, pool pressure, fork, compact, in-place updates."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxkv import NO_PAGE, PagedKVCache, reference

from helpers import assert_bytes_equal, copies_of, random_array, ref


LAYOUTS = ["HND", "NHD"]


def make(layout="HND", poison=True, **kw):
    cfg = dict(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8, max_batch=4,
               max_pages_per_seq=6, dtype=jnp.float32, layout=layout)
    cfg.update(kw)
    cache = PagedKVCache.create(**cfg)
    if poison:  # random pools: bytes nobody wrote show up in comparisons
        shape, dtype = cache.k_pages.shape, cache.dtype
        cache = dataclasses.replace(cache, k_pages=random_array(shape, dtype),
                                    v_pages=random_array(shape, dtype))
    return cache


def check_allocator(cache):
    """Reference counts equal table references; held pages are a prefix; lengths fit the pages."""
    table = np.asarray(cache.page_table)
    counts = np.bincount(table[table >= 0], minlength=cache.num_pages)
    np.testing.assert_array_equal(counts, np.asarray(cache.ref_counts), "ref_counts")
    held = table != NO_PAGE
    assert not np.any(~held[:, :-1] & held[:, 1:]), "held pages are not a prefix"
    assert np.all(np.asarray(cache.lengths) <= held.sum(1) * cache.page_size)


class Dense:
    """What every sequence should hold: per layer, per row, a list of [H, D] tokens of K and V."""

    def __init__(self, cache):
        self.k = [[[] for _ in range(cache.max_batch)] for _ in range(cache.num_layers)]
        self.v = [[[] for _ in range(cache.max_batch)] for _ in range(cache.num_layers)]

    def add(self, layer, k, v, counts):
        for b, n in enumerate(np.asarray(counts)):
            self.k[layer][b] += list(np.asarray(k[b, :, :n]).transpose(1, 0, 2))
            self.v[layer][b] += list(np.asarray(v[b, :, :n]).transpose(1, 0, 2))

    def expected(self, layer, max_len, cache):
        out = np.zeros((cache.max_batch, 2, cache.num_kv_heads, max_len, cache.head_dim),
                       np.dtype(cache.dtype))
        for b in range(cache.max_batch):
            for t, (kt, vt) in enumerate(zip(self.k[layer][b], self.v[layer][b])):
                out[b, 0, :, t], out[b, 1, :, t] = kt, vt
        return out

    def check(self, cache, max_len=24):
        for layer in range(cache.num_layers):
            got = cache.gather(layer, max_len)
            assert_bytes_equal(got, self.expected(layer, max_len, cache), f"layer {layer}")


@functools.partial(jax.jit, donate_argnums=0)
def step(cache, k, v, n):
    """reserve, append every layer, commit: one jitted step with the cache donated."""
    cache, served = cache.reserve(n)
    n = jnp.where(served, n, 0)
    for layer in range(cache.num_layers):
        cache = cache.append(layer, k[layer], v[layer], n)
    return cache.commit(n), served


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_then_decode_reads_back(layout, page_size):
    cache = make(layout, page_size=page_size, num_pages=40, max_pages_per_seq=24 // page_size + 1)
    dense = Dense(cache)
    shape = (cache.num_layers, cache.max_batch, cache.num_kv_heads)
    prompt = jnp.array([5, 0, 9, 3], jnp.int32)  # ragged, one idle slot
    for n, tokens in [(prompt, 9), (jnp.array([1, 0, 1, 1], jnp.int32), 1),
                      (jnp.array([1, 2, 1, 0], jnp.int32), 2), (jnp.array([1, 1, 1, 1], jnp.int32), 1)]:
        k, v = random_array(shape + (tokens, 8), jnp.float32), random_array(shape + (tokens, 8), jnp.float32)
        cache, served = step(cache, k, v, n)
        assert np.all(served)
        for layer in range(cache.num_layers):
            dense.add(layer, k[layer], v[layer], n)
        check_allocator(cache)
    np.testing.assert_array_equal(cache.lengths, [8, 3, 12, 5])
    dense.check(cache)
    # A decode step of every layer in one launch.
    k, v = random_array(shape + (1, 8), jnp.float32), random_array(shape + (1, 8), jnp.float32)
    cache, _ = cache.reserve(jnp.ones((4,), jnp.int32))
    cache = cache.append_layers(k, v).commit(1)
    for layer in range(cache.num_layers):
        dense.add(layer, k[layer], v[layer], jnp.ones((4,), jnp.int32))
    dense.check(cache)
    assert int(cache.max_context_length) == 13 and int(cache.max_prompt_length) == 1
    assert int(cache.cache_length(1)) == 4 and not bool(cache.empty)
    k, v = cache.gather(1, 16, split=True)
    assert_bytes_equal(k, dense.expected(1, 16, cache)[:, 0], "split k")


def test_pool_pressure_reports_and_overwrites_nothing():
    cache = make(num_pages=6, page_size=4, max_batch=4, max_pages_per_seq=4)
    n = jnp.array([8, 9, 4, 4], jnp.int32)  # pages 2 + 3 + 1 + 1 = 7 > 6
    err, (cache2, served) = checkify.checkify(PagedKVCache.reserve)(cache, n)
    assert "out of pages" in str(err.get())
    np.testing.assert_array_equal(served, [True, True, True, False])
    np.testing.assert_array_equal(cache2.page_table[3], [NO_PAGE] * 4)
    assert int(cache2.num_free_pages) == 0
    check_allocator(cache2)
    # Every row appends; the unserved row has no page, so it writes nothing anywhere.
    k = random_array((4, 2, 9, 8), jnp.float32)
    err, out = checkify.checkify(lambda c: c.append(1, k, -k, n))(cache2)
    assert "past a row's reserved pages" in str(err.get())
    want = ref.paged_append(cache2.k_pages, cache2.v_pages, cache2.page_table, cache2.lengths, 1,
                            k, -k, n)
    assert_bytes_equal(out.k_pages, want[0], "k_pages")
    assert_bytes_equal(out.v_pages, want[1], "v_pages")
    # Commit stops at the reserved pages: the unserved row does not advance.
    out = out.commit(jnp.where(served, n, 0))
    np.testing.assert_array_equal(out.lengths, [8, 9, 4, 0])
    # Releasing row 1 makes room for row 3; releasing everything empties the pool.
    out = out.release(jnp.array([False, True, False, False]))
    out, served = out.reserve(jnp.array([0, 0, 0, 4], jnp.int32))
    assert bool(served[3])
    check_allocator(out)
    out = out.release(jnp.ones((4,), bool))
    assert int(out.num_free_pages) == 6 and bool(out.empty)
    assert np.all(np.asarray(out.ref_counts) == 0) and np.all(np.asarray(out.page_table) == NO_PAGE)


def test_reserve_past_the_page_table():
    cache = make(page_size=4, max_pages_per_seq=2)
    err, (out, served) = checkify.checkify(PagedKVCache.reserve)(
        cache, jnp.array([9, 8, 0, 1], jnp.int32)
    )
    assert "max_pages_per_seq" in str(err.get())
    np.testing.assert_array_equal(served, [False, True, True, True])
    np.testing.assert_array_equal(out.pages_held, [0, 2, 0, 1])
    # Reserving again for tokens that already have pages takes nothing new.
    again, served = out.reserve(jnp.array([0, 8, 0, 3], jnp.int32))
    assert np.all(served)
    np.testing.assert_array_equal(again.page_table, out.page_table)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_shares_full_pages_and_copies_the_last(layout):
    cache = make(layout, num_pages=12, page_size=4, max_batch=4, max_pages_per_seq=4)
    dense = Dense(cache)
    prompt = jnp.array([10, 0, 0, 0], jnp.int32)  # 2 full pages + 2 tokens
    k, v = (random_array((2, 4, 2, 10, 8), jnp.float32) for _ in range(2))
    cache, _ = step(cache, k, v, prompt)
    for layer in range(2):
        dense.add(layer, k[layer], v[layer], prompt)
    cache, forked = jax.jit(PagedKVCache.fork)(cache, 0, jnp.array([2, 1], jnp.int32))
    assert np.all(forked)
    check_allocator(cache)
    table = np.asarray(cache.page_table)
    np.testing.assert_array_equal(table[1, :2], table[0, :2])  # shared, stored once
    np.testing.assert_array_equal(table[2, :2], table[0, :2])
    np.testing.assert_array_equal(np.asarray(cache.ref_counts)[table[0, :2]], [3, 3])
    assert len({table[0, 2], table[1, 2], table[2, 2]}) == 3  # private last pages
    for layer in range(2):
        for b in (1, 2):
            dense.k[layer][b], dense.v[layer][b] = list(dense.k[layer][0]), list(dense.v[layer][0])
    dense.check(cache)
    # They diverge: each appends its own tokens into its own last page.
    n = jnp.array([3, 1, 2, 0], jnp.int32)
    k, v = (random_array((2, 4, 2, 3, 8), jnp.float32) for _ in range(2))
    cache, served = step(cache, k, v, n)
    assert np.all(served)
    for layer in range(2):
        dense.add(layer, k[layer], v[layer], n)
    dense.check(cache)
    check_allocator(cache)
    # A page-aligned source shares every page and copies nothing.
    cache = cache.release(jnp.array([False, True, True, True]))
    aligned, _ = cache.reserve(jnp.array([3, 0, 0, 0], jnp.int32))
    aligned = aligned.commit(jnp.array([3, 0, 0, 0], jnp.int32))  # 16 tokens: 4 full pages
    free = int(aligned.num_free_pages)
    aligned, forked = aligned.fork(0, jnp.array([3], jnp.int32))
    assert bool(forked[0]) and int(aligned.num_free_pages) == free
    np.testing.assert_array_equal(aligned.page_table[3], aligned.page_table[0])
    assert_bytes_equal(aligned.k_pages, cache.k_pages, "an aligned fork copies nothing")
    # Ending every sequence returns every page.
    aligned = aligned.release(jnp.ones((4,), bool))
    assert int(aligned.num_free_pages) == aligned.num_pages


def test_fork_out_of_pages_and_bad_slots():
    cache = make(num_pages=4, page_size=4, max_batch=4, max_pages_per_seq=4)
    k = random_array((2, 4, 2, 6, 8), jnp.float32)
    cache, _ = step(cache, k, k, jnp.array([0, 6, 0, 0], jnp.int32))  # 2 pages, 2 free
    err, (out, forked) = checkify.checkify(PagedKVCache.fork)(
        cache, 1, jnp.array([0, 2, 3, 1], jnp.int32)
    )
    assert err.get() is not None
    np.testing.assert_array_equal(forked, [True, True, False, False])
    np.testing.assert_array_equal(out.page_table[3], [NO_PAGE] * 4)
    check_allocator(out)


def test_compact_moves_rows_not_data():
    cache = make(num_pages=16, page_size=4)
    n = jnp.array([5, 7, 2, 9], jnp.int32)
    k = random_array((2, 4, 2, 9, 8), jnp.float32)
    cache, _ = step(cache, k, k, n)
    before = cache.gather(1, 12)
    mapping = jnp.array([-1, 3, 0, 1], jnp.int32)
    out = jax.jit(PagedKVCache.compact)(cache, mapping)
    assert_bytes_equal(out.k_pages, cache.k_pages, "compact moved KV data")
    np.testing.assert_array_equal(out.lengths, reference.compact_lengths(cache.lengths, mapping))
    np.testing.assert_array_equal(out.page_table[3], cache.page_table[1])
    np.testing.assert_array_equal(out.page_table[2], [NO_PAGE] * 6)
    after = out.gather(1, 12)
    for old, new in [(1, 3), (2, 0), (3, 1)]:
        assert_bytes_equal(after[new], before[old], f"row {old} -> {new}")
    check_allocator(out)
    assert int(out.num_free_pages) == 16 - (2 + 1 + 3)  # row 0 (2 pages) released
    # Two rows sent to one slot: reported, and the loser's pages are released, not leaked.
    err, out = checkify.checkify(PagedKVCache.compact)(cache, jnp.array([0, 0, -1, 1], jnp.int32))
    assert "same new row" in str(err.get())
    check_allocator(out)


def test_in_place_under_donation():
    cache = make(num_pages=32, page_size=4, max_pages_per_seq=8, dtype=jnp.bfloat16)
    k = random_array((4, 2, 1, 8), jnp.bfloat16)
    n = jnp.ones((4,), jnp.int32)

    def decode(c, k):
        c, served = c.reserve(n)
        c = c.append(jnp.asarray(1, jnp.int32), k, k, jnp.where(served, n, 0))
        c, _ = c.fork(0, jnp.array([3], jnp.int32))
        c = c.copy_pages(jnp.array([0], jnp.int32), jnp.array([31], jnp.int32))
        return c.commit(jnp.where(served, n, 0))

    f = jax.jit(decode, donate_argnums=0)
    hlo = f.lower(cache, k).compile().as_text()
    assert copies_of(hlo, cache.k_pages) == [], "the pools are copied"
    ptr = cache.k_pages.unsafe_buffer_pointer(), cache.v_pages.unsafe_buffer_pointer()
    out = f(cache, k)
    assert (out.k_pages.unsafe_buffer_pointer(), out.v_pages.unsafe_buffer_pointer()) == ptr


def test_random_operations_keep_the_allocator_consistent():
    rng = np.random.default_rng()
    cache = make(num_pages=20, page_size=2, max_batch=4, max_pages_per_seq=6, poison=False)
    reserve = jax.jit(PagedKVCache.reserve)
    commit = jax.jit(PagedKVCache.commit)
    release = jax.jit(PagedKVCache.release)
    fork = jax.jit(PagedKVCache.fork)
    for _ in range(40):
        op = rng.integers(3)
        if op == 0:
            n = jnp.asarray(rng.integers(0, 4, 4).astype(np.int32))
            cache, served = reserve(cache, n)
            cache = commit(cache, jnp.where(served, n, 0))
        elif op == 1:
            cache = release(cache, jnp.asarray(rng.random(4) < 0.3))
        else:
            src = int(rng.integers(4))
            cache, _ = fork(cache, src, jnp.asarray([(src + 1 + int(rng.integers(3))) % 4], jnp.int32))
        check_allocator(cache)
    cache = release(cache, jnp.ones((4,), bool))
    assert int(cache.num_free_pages) == 20


def test_create_and_argument_errors():
    with pytest.raises(ValueError, match="PagedKVCache.create: layout"):
        PagedKVCache.create(1, 4, 4, 1, 8, 2, 2, layout="BHSD")
    with pytest.raises(ValueError, match="PagedKVCache.create: page_size must be"):
        PagedKVCache.create(1, 4, 0, 1, 8, 2, 2)
    with pytest.raises(TypeError, match="PagedKVCache.create: unsupported dtype"):
        PagedKVCache.create(1, 4, 4, 1, 8, 2, 2, dtype=jnp.int64)
    with pytest.raises(TypeError, match="PagedKVCache.create: unsupported dtype 'foo'; supported"):
        PagedKVCache.create(1, 4, 4, 1, 8, 2, 2, dtype="foo")
    cache = make()
    with pytest.raises(ValueError, match=r"PagedKVCache.reserve: num_new_tokens must have shape \(4,\)"):
        cache.reserve(jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="PagedKVCache.release: mask must be bool"):
        cache.release(jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="PagedKVCache.fork: dst_slots must be int32"):
        cache.fork(0, jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match="PagedKVCache.fork: src_slot must be"):
        cache.fork(9, jnp.array([1], jnp.int32))  # a Python int: refused before anything runs
    k = jnp.zeros((2, 4, 2, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="PagedKVCache.append: k must have rank 4"):
        cache.append(0, k, k)
    with pytest.raises(ValueError, match="PagedKVCache.append_layers: v must have rank 5"):
        cache.append_layers(k, k[0])
    assert make(layout="HND").k_pages[1].shape == (2, 16, 4, 8)  # [H, P, S, D] per layer
    assert make(layout="NHD").k_pages[1].shape == (16, 4, 2, 8)  # [P, S, H, D] per layer
