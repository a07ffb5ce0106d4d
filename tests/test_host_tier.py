"""The host tier: PagedKVCache.swap_out / swap_in against a host model, bytes, scales, in place."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxkv import NO_PAGE, CacheSharding, PagedKVCache, attention

from helpers import assert_bytes_equal, copies_of, mesh_of, random_array

pytestmark = pytest.mark.host_tier

L, H, D = 2, 2, 16


def make(num_pages=10, page_size=2, max_batch=4, max_pages_per_seq=4, host_pages=8, **kw):
    kw = dict(dict(num_layers=L, num_kv_heads=H, head_dim=D, dtype=jnp.float32), **kw)
    return PagedKVCache.create(num_pages=num_pages, page_size=page_size, max_batch=max_batch,
                               max_pages_per_seq=max_pages_per_seq, host_pages=host_pages, **kw)


swap_out = jax.jit(PagedKVCache.swap_out, static_argnums=2, donate_argnums=0)
swap_in = jax.jit(PagedKVCache.swap_in, static_argnums=2, donate_argnums=0)
swap_out_overlapped = jax.jit(functools.partial(PagedKVCache.swap_out, overlap=True),
                              static_argnums=2, donate_argnums=0)
swap_in_overlapped = jax.jit(functools.partial(PagedKVCache.swap_in, overlap=True),
                             static_argnums=2, donate_argnums=0)


@jax.jit
def fill(cache, n, k, v):
    """Reserves ``n`` tokens per row, appends ``k``, ``v`` ``[L, B, H, T, D]``, commits."""
    cache, served = cache.reserve(n)
    n = jnp.where(served, n, 0)
    return cache.append_layers(k, v, n).commit(n), served


def filled(cache, n, dtype=jnp.float32):
    n = jnp.asarray(n, jnp.int32)
    shape = (cache.num_layers, cache.max_batch, cache.num_kv_heads, int(jnp.max(n)),
             cache.head_dim)
    k, v = random_array(shape, dtype), random_array(shape, dtype)
    cache, served = fill(cache, n, k, v)
    assert bool(jnp.all(served))
    return cache


def row_bytes(cache, b):
    """Row ``b``'s pages in order, every leaf that holds token data (pools and scale pools)."""
    pages = [int(p) for p in np.asarray(cache.page_table[b]) if p >= 0]
    axis = 2 if cache.layout == "HND" else 1
    leaves = [cache.k_pages, cache.v_pages]
    if cache.scaling == "per_token_head":
        leaves += [cache.k_scales, cache.v_scales]
    return [np.take(np.asarray(x), pages, axis=axis) for x in leaves]


def host_row_bytes(cache, b):
    pages = [int(p) for p in np.asarray(cache.host.table[b]) if p >= 0]
    axis = 2 if cache.layout == "HND" else 1
    h = cache.host
    # The host pool is page-major [pages, K/V, *page]: laid out as the device pools to compare.
    leaves = [h.pages] + ([h.scales] if h.scales is not None else [])
    # Read through a device copy: numpy's view of a pinned host array is cached on the array
    # and holds its buffer, which can then no longer be donated (the next swap would fail).
    read = lambda x: np.asarray(jax.device_put(x, jax.memory.Space.Device))  # noqa: E731
    return [np.moveaxis(read(x)[pages][:, kv], 0, axis) for x in leaves for kv in (0, 1)]


CASES = [(jnp.float32, None, "HND"), (jnp.bfloat16, None, "NHD"), (jnp.float16, None, "HND"),
         (jnp.float8_e4m3fn, "per_token_head", "HND"), (jnp.float8_e4m3fn, "per_token_head", "NHD"),
         (jnp.int8, "per_token_head", "NHD"), (jnp.float8_e5m2, "per_tensor", "HND"),
         (jnp.int8, "per_tensor", "NHD")]


@pytest.mark.parametrize("dtype,scaling,layout", CASES)
def test_round_trip_keeps_every_byte(dtype, scaling, layout):
    """Swapped out, the row's pages (scales included) are on the host byte for byte; its device
    pages are reused by another row; swapped back in to other pages, every byte is back, and the
    other rows never changed."""
    cache = make(num_pages=14, layout=layout, dtype=dtype, scaling=scaling)
    src = jnp.bfloat16 if scaling else dtype
    cache = filled(cache, [5, 3, 7, 0], src)
    before = [row_bytes(cache, b) for b in range(4)]
    cache, swapped = swap_out(cache, jnp.array([True, False, True, False]), 8)
    assert np.asarray(swapped).tolist() == [True, False, True, False]
    assert np.asarray(cache.on_host).tolist() == [True, False, True, False]
    assert np.asarray(cache.lengths).tolist() == [5, 3, 7, 0]
    assert int(cache.num_free_pages) == 14 - 2 and int(cache.num_free_host_pages) == 8 - 7
    for b in (0, 2):
        for got, want in zip(host_row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"host copy of row {b}")
    # Row 3 takes freed pages (lowest ids first) and overwrites them.
    cache = filled(cache, [0, 0, 0, 8], src)
    cache, served = swap_in(cache, jnp.array([True, False, True, False]), 8)
    assert np.asarray(served).tolist() == [True, False, True, False]
    assert not bool(jnp.any(cache.on_host)) and int(cache.num_free_host_pages) == 8
    for b in range(3):
        for got, want in zip(row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"row {b}")
    assert set(np.asarray(cache.page_table[0])) - {NO_PAGE} != set(range(3))  # new pages


@pytest.mark.parametrize("pages", [16, 37])
def test_a_transfer_longer_than_one_loop_iteration(pages):
    """A transfer copies 16 pages per loop iteration, then the rest one by one: rows of 37 pages
    (two iterations and 5 more) and of 16 come back byte for byte, scales included, and the
    host pool holds them exactly (no page written twice or skipped)."""
    cache = make(num_pages=2 * pages + 4, max_pages_per_seq=pages, host_pages=pages + 3,
                 dtype=jnp.float8_e4m3fn, scaling="per_token_head", layout="NHD")
    cache = filled(cache, [2 * pages, 3, 0, 0], jnp.bfloat16)
    before = [row_bytes(cache, b) for b in range(2)]
    both = jnp.array([True, True, False, False])
    cache, swapped = swap_out(cache, both, pages + 2)
    assert np.asarray(swapped).tolist() == [True, True, False, False]
    for b in range(2):
        for got, want in zip(host_row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"host copy of row {b}")
    cache, served = swap_in(cache, both, pages + 2)
    assert np.asarray(served).tolist() == [True, True, False, False]
    for b in range(2):
        for got, want in zip(row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"row {b}")


def test_gather_and_attention_after_a_round_trip():
    cache = filled(make(num_pages=20, max_pages_per_seq=6), [9, 4, 11, 6])  # 16 pages
    q = random_array((4, 4, D), jnp.float32)
    want = [cache.gather(layer, 12) for layer in range(L)]
    want_out = attention.decode(q, cache, 1)
    mask = jnp.array([False, True, True, False])
    cache, _ = swap_out(cache, mask, 12)
    cache = filled(cache, [2, 0, 0, 2])  # rows 0, 3 grow into the freed pages
    cache, served = swap_in(cache, mask, 12)
    assert bool(jnp.all(served == mask))
    for layer in range(L):
        got = cache.gather(layer, 12)
        for b in (1, 2):
            assert_bytes_equal(got[b], want[layer][b], f"layer {layer} row {b}")
    out = attention.decode(q, cache, 1)
    np.testing.assert_allclose(out[1:3], want_out[1:3], rtol=1e-6, atol=1e-6)


def test_by_default_a_call_moves_every_selected_row_the_pools_have_room_for():
    """Without max_pages a call's transfer is the smaller pool's size: several rows go out and
    come back in one call, byte for byte, and only the pools' room refuses a row."""
    cache = filled(make(num_pages=12, max_pages_per_seq=4, host_pages=8), [7, 5, 6, 3])
    before = [row_bytes(cache, b) for b in range(4)]
    out = jax.jit(lambda c, r: c.swap_out(r), donate_argnums=0)
    back = jax.jit(lambda c, r: c.swap_in(r), donate_argnums=0)
    cache, swapped = out(cache, jnp.array([True, True, False, True]))  # 4 + 3 + 2 of 8 pages
    assert np.asarray(swapped).tolist() == [True, True, False, False]  # row 3: no room left
    cache, served = back(cache, jnp.array([True, True, False, False]))
    assert np.asarray(served).tolist() == [True, True, False, False]
    for b in range(4):
        for got, want in zip(row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"row {b}")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_step_over_a_new_host_tier_cache_compiles_once(sharded):
    """The host pools are committed to their device; every other leaf of a new cache is too, so
    the cache a jitted step returns has the signature of the one it took: no second compile on
    the second call (the 8B server's step takes tens of seconds to compile)."""
    kw = dict(sharding=CacheSharding(mesh_of((2,), ("batch",)), batch="batch")) if sharded else {}
    cache = make(prefix_cache=True, **kw)
    compiles = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache):
        cache, served = cache.reserve(jnp.ones((4,), jnp.int32))
        return cache.commit(jnp.where(served, 1, 0))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for _ in range(3):
            cache = step(cache)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1 and np.asarray(cache.lengths).tolist() == [3, 3, 3, 3]


def test_no_room_on_the_host_or_on_the_device():
    """swapped is false where the host pool lacks room, served false where the device pool
    does; such rows do not change, and neither do the rest."""
    cache = filled(make(num_pages=10, host_pages=4), [7, 3, 5, 0])  # pages 4, 2, 3
    cache, swapped = swap_out(cache, jnp.array([True, True, True, False]), 16)
    # Row 0 takes 4 host pages; row 1 does not fit, which stops row 2 (slot order).
    assert np.asarray(swapped).tolist() == [True, False, False, False]
    assert np.asarray(cache.on_host).tolist() == [True, False, False, False]
    assert int(cache.pages_held[1]) == 2 and int(cache.pages_held[2]) == 3
    cache = filled(cache, [0, 0, 0, 8])  # row 3 takes 4 of the 5 free pages
    assert int(cache.num_free_pages) == 1
    cache, served = swap_in(cache, jnp.array([True, False, False, False]), 16)
    assert not bool(served[0]) and bool(cache.on_host[0]) and int(cache.lengths[0]) == 7
    cache = cache.release(jnp.array([False, False, False, True]))
    cache, served = swap_in(cache, jnp.array([True, False, False, False]), 16)
    assert bool(served[0]) and int(cache.pages_held[0]) == 4


def test_max_pages_bounds_one_transfer():
    cache = filled(make(num_pages=12, host_pages=12), [3, 8, 2, 4])  # pages 2, 4, 1, 2
    cache, swapped = swap_out(cache, jnp.ones((4,), bool), 6)
    assert np.asarray(swapped).tolist() == [True, True, False, False]  # 2 + 4, then 7 > 6
    cache, swapped = swap_out(cache, jnp.array([False, False, True, True]), 3)
    assert np.asarray(swapped).tolist() == [False, False, True, True]
    cache, served = swap_in(cache, jnp.ones((4,), bool), 4)
    assert np.asarray(served).tolist() == [True, False, False, False]  # 2, then 2 + 4 > 4


def test_release_and_compact_carry_host_rows():
    cache = filled(make(), [3, 4, 5, 2])
    before = row_bytes(cache, 2)
    cache, _ = swap_out(cache, jnp.array([True, False, True, False]), 8)
    cache = cache.release(jnp.array([True, False, False, False]))
    assert int(cache.num_free_host_pages) == 8 - 3 and int(cache.lengths[0]) == 0
    assert not bool(cache.on_host[0])
    cache = cache.compact(jnp.array([-1, 2, 0, 1], jnp.int32))  # row 2 (on the host) -> 0
    assert np.asarray(cache.on_host).tolist() == [True, False, False, False]
    assert np.asarray(cache.lengths).tolist() == [5, 2, 4, 0]
    cache, served = swap_in(cache, jnp.array([True, False, False, False]), 8)
    assert bool(served[0])
    for got, want in zip(row_bytes(cache, 0), before):
        assert_bytes_equal(got, want, "the moved row")


def test_overlapped_swaps_hold_their_pages_until_settled():
    """Overlapped, a swap_out's device pages stay held and a swap_in's row stays on the host
    (reported like one) until settle_swaps; a row coming back moves with compact and, released,
    frees its new pages at the settle; the bytes come back."""
    cache = filled(make(num_pages=12), [3, 4, 5, 2])
    before = [row_bytes(cache, b) for b in range(4)]
    free = int(cache.num_free_pages)
    cache, swapped = swap_out_overlapped(cache, jnp.array([True, True, True, False]), 8)
    assert np.asarray(swapped).tolist() == [True, True, True, False]
    assert int(cache.num_free_pages) == free
    assert np.asarray(cache.on_host).tolist() == [True, True, True, False]
    cache = cache.settle_swaps()
    assert int(cache.num_free_pages) == free + 7
    cache, served = swap_in_overlapped(cache, jnp.array([True, True, True, False]), 8)
    assert np.asarray(served).tolist() == [True, True, True, False]
    assert np.asarray(cache.arriving).tolist() == [True, True, True, False]
    assert np.asarray(cache.on_host).tolist() == [True, True, True, False]
    assert int(cache.num_free_pages) == free and int(cache.num_free_host_pages) == 8 - 7
    err_of = lambda f, *a: checkify.checkify(f)(*a)[0].get()  # noqa: E731
    assert "already coming back" in err_of(lambda c: c.swap_in(c.on_host), cache)
    kv = random_array((4, H, 1, D), jnp.float32)
    appended = err_of(lambda c: c.append(0, kv, kv, jnp.ones(4, jnp.int32)), cache)
    assert "on the host" in appended and "settle_swaps" in appended  # the way out named
    cache = cache.release(jnp.array([True, False, False, False]))  # row 0's 2 pages: at settle
    assert int(cache.num_free_pages) == free
    cache = cache.compact(jnp.array([-1, 2, 0, 1], jnp.int32))  # row 2 -> 0, row 1 -> 2
    assert np.asarray(cache.arriving).tolist() == [True, False, True, False]
    cache = cache.settle_swaps()
    assert int(cache.num_free_pages) == free + 2 and int(cache.num_free_host_pages) == 8
    assert not bool(jnp.any(cache.on_host)) and not bool(jnp.any(cache.arriving))
    for row, old in ((0, 2), (2, 1), (1, 3)):
        for got, want in zip(row_bytes(cache, row), before[old]):
            assert_bytes_equal(got, want, f"row {row} (was {old})")


def test_copy_pages_never_races_an_overlapped_swap():
    """Until settle_swaps, a copy into a page a swap_out still reads or a swap_in still writes,
    or out of a page still arriving, is reported and skipped; the other pairs are copied, and the
    rows come back with their bytes."""
    cache = filled(make(num_pages=12), [3, 4, 0, 0])
    before = [row_bytes(cache, b) for b in range(2)]
    cache, _ = swap_out(cache, jnp.array([True, False, False, False]), 8)
    cache, _ = swap_in_overlapped(cache, jnp.array([True, False, False, False]), 8)
    writing = [int(p) for p in np.asarray(cache.host.incoming[0]) if p >= 0]
    cache, _ = swap_out_overlapped(cache, jnp.array([False, True, False, False]), 8)
    reading = [int(p) for p in np.flatnonzero(np.asarray(cache.host.outgoing))]
    free = [p for p in range(12) if int(cache.ref_counts[p]) == 0]
    assert len(writing) == 2 and len(reading) == 2 and len(free) >= 3
    # into a page read, into a page written, out of a page written
    src = jnp.array([free[0], free[0], writing[0]], jnp.int32)
    dst = jnp.array([reading[0], writing[1], free[1]], jnp.int32)
    err, _ = checkify.checkify(lambda c: c.copy_pages(src, dst))(cache)
    assert "overlapped swap" in err.get() and "settle_swaps" in err.get()
    legal = jnp.array([free[0]], jnp.int32), jnp.array([free[1]], jnp.int32)
    assert checkify.checkify(lambda c: c.copy_pages(*legal))(cache)[0].get() is None
    pools = np.asarray(cache.k_pages).copy()
    both = jnp.concatenate([src, legal[0]]), jnp.concatenate([dst, legal[1]])
    copied = jax.jit(PagedKVCache.copy_pages)(cache, *both)
    pools[:, :, free[1]] = pools[:, :, free[0]]  # HND [L, H, P, S, D]: the legal pair copied
    assert_bytes_equal(np.asarray(copied.k_pages), pools, "every racing pair skipped")
    cache = copied.settle_swaps()
    cache, _ = swap_in(cache, jnp.array([False, True, False, False]), 8)
    for row in range(2):
        for got, want in zip(row_bytes(cache, row), before[row]):
            assert_bytes_equal(got, want, f"row {row}")


def test_settle_is_ordered_after_the_transfer_in_one_jit():
    """swap_out(overlap) -> settle -> reserve + append into the freed pages, all in one jit: the
    fence reads the transfer's output (so no schedule runs it first), and the host pages hold
    the row swapped out, not the data appended after. Sized on a GPU so that a fence that did not
    wait would lose the race (the race was seen there: 255 of 256 pages overwritten)."""
    gpu = jax.default_backend() == "gpu"
    layers, heads, dim, size, pages = (32, 8, 128, 16, 512) if gpu else (2, 2, 8, 2, 16)
    per_row = pages // 2
    cache = PagedKVCache.create(num_layers=layers, num_kv_heads=heads, head_dim=dim,
                                num_pages=pages, page_size=size, max_batch=2,
                                max_pages_per_seq=per_row, dtype=jnp.bfloat16, layout="HND",
                                host_pages=per_row)
    shape = (layers, 2, heads, per_row * size, dim)  # [L, B, H, T, D]: row 0's, then row 1's
    k0, v0, k1, v1 = (random_array(shape, jnp.bfloat16) for _ in range(4))

    def put(c, row, k, v):
        n = jnp.array([per_row * size if r == row else 0 for r in range(2)], jnp.int32)
        c, _ = c.reserve(n)
        return c.append_layers(k, v, n).commit(n)

    def swap_settle_and_reuse(c, k, v):
        c, _ = c.swap_out(jnp.array([True, False]), per_row, overlap=True)
        return put(c.settle_swaps(), 1, k, v)

    cache = jax.jit(lambda c, k, v: put(c, 0, k, v), donate_argnums=0)(cache, k0, v0)
    step = jax.jit(swap_settle_and_reuse, donate_argnums=0)
    hlo = step.lower(cache, k1, v1).compile().as_text()
    out = re.search(r"(%\S+) = .*custom_call_target=\"jaxkv_pages_to_host\"", hlo).group(1)
    fence = re.search(r"= .*custom-call\(([^)]*)\).*custom_call_target=\"jaxkv_host_fence\"", hlo)
    operands = fence.group(1)  # "%a, %b" (or with types before the names)
    assert re.search(re.escape(out) + r"(?![\w.])", operands), \
        "the fence does not read the transfer's output"
    cache = jax.jit(PagedKVCache.settle_swaps, donate_argnums=0)(step(cache, k1, v1))
    # Host page table[0, j] holds row 0's page j: K then V, [L, H, page_size, D] each (HND).
    host = np.asarray(jax.device_put(cache.host.pages, jax.memory.Space.Device))
    table = np.asarray(cache.host.table[0])
    assert sorted(table.tolist()) == list(range(per_row))
    want = np.stack([np.asarray(x[:, 0]) for x in (k0, v0)])  # [2, L, H, T, D]
    want = want.reshape(2, layers, heads, per_row, size, dim).transpose(3, 0, 1, 2, 4, 5)
    bad = [j for j in range(per_row) if not np.array_equal(host[table[j]].view(np.uint16),
                                                          want[j].view(np.uint16))]
    assert not bad, f"{len(bad)} of {per_row} host pages do not hold row 0's page (first {bad[0]})"
    assert bool(jnp.all(cache.page_table[1] >= 0))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("implementation", ["jaxkv", pytest.param("cudnn", marks=pytest.mark.gpu)])
def test_attention_beside_a_row_on_the_host_reads_only_the_other_rows(implementation, layout):
    """A row on the host keeps its length but holds no device page: decode and prefill give it
    zeros, and the rows beside it the outputs they had before, though its freed pages now hold
    another row's tokens (the poison a read of stale entries would show)."""
    cache = make(num_pages=12, page_size=16, max_pages_per_seq=4, host_pages=4,
                 head_dim=64, dtype=jnp.bfloat16, layout=layout)
    cache = filled(cache, [40, 20, 33, 0], jnp.bfloat16)  # 3 + 2 + 3 pages
    q = random_array((4, 8, 64), jnp.bfloat16)
    t = 5
    qs = random_array((4, t, 8, 64), jnp.bfloat16)
    q_lengths = jnp.array([t, 0, 3, 0], jnp.int32)
    decode = jax.jit(lambda c: attention.decode(q, c, 1, implementation=implementation))
    prefill = jax.jit(lambda c: attention.prefill(qs, c, 1, q_lengths,
                                                  implementation=implementation))
    before = jax.jit(lambda c: c.reserve(q_lengths)[0])  # room for the prefill's queries
    want_decode, want_prefill = decode(cache), prefill(before(cache))
    cache, swapped = swap_out(cache, jnp.array([False, True, False, False]), 4)
    assert np.asarray(swapped).tolist() == [False, True, False, False]
    cache = filled(cache, [0, 0, 0, 32], jnp.bfloat16)  # row 3 takes the freed pages
    got_decode, got_prefill = decode(cache), prefill(before(cache))
    assert not np.any(np.asarray(got_decode[1], np.float32)), "the host row read device pages"
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(got_decode[b], np.float32),
                                      np.asarray(want_decode[b], np.float32), f"decode row {b}")
        np.testing.assert_array_equal(np.asarray(got_prefill[b], np.float32),
                                      np.asarray(want_prefill[b], np.float32), f"prefill row {b}")
    assert not np.any(np.asarray(got_prefill[1], np.float32))


@pytest.mark.long
def test_rows_on_the_host_are_reported_and_never_touched():
    """Appending, reserving, committing, forking from or attending over a row on the host is
    reported; its length stays and nothing reads or writes device pages for it."""
    cache = filled(make(), [3, 4, 0, 0])
    cache, _ = swap_out(cache, jnp.array([True, False, False, False]), 8)
    err_of = lambda f, *a: checkify.checkify(f)(*a)[0].get()  # noqa: E731
    n = jnp.array([1, 0, 0, 0], jnp.int32)
    kv = random_array((4, H, 1, D), jnp.float32)
    assert "on the host" in err_of(lambda c: c.append(0, kv, kv, n), cache)
    assert "on the host" in err_of(lambda c: c.reserve(n), cache)
    assert "on the host" in err_of(lambda c: c.commit(n), cache)
    assert "negative" in err_of(lambda c: c.commit(-n), cache)  # as at home, not "swap_in first"
    assert int(cache.commit(-n).lengths[0]) == 3
    assert "on the host" in err_of(lambda c: c.fork(0, jnp.array([2], jnp.int32)), cache)
    q = random_array((4, 2, D), jnp.float32)
    assert "decode: a row is on the host" in err_of(lambda c: attention.decode(q, c, 0), cache)
    qs = random_array((4, 2, 2, D), jnp.float32)
    assert "prefill: a row is on the host" in err_of(
        lambda c: attention.prefill(qs, c, 0, jnp.array([1, 0, 0, 0], jnp.int32)), cache)
    assert err_of(lambda c: attention.prefill(qs, c, 0, jnp.array([0, 0, 0, 0], jnp.int32)),
                  cache) is None  # the row takes no part: nothing to report
    assert "already on the host" in err_of(lambda c: c.swap_out(c.on_host), cache)
    assert "no pages" in err_of(lambda c: c.swap_out(jnp.array([0, 0, 1, 0], bool)), cache)
    assert "not on the host" in err_of(lambda c: c.swap_in(jnp.array([0, 1, 0, 0], bool)), cache)
    # What the reported calls did: nothing to row 0.
    c2, served = cache.reserve(n)
    assert not bool(served[0]) and int(c2.pages_held[0]) == 0
    c2 = cache.commit(n)
    assert int(c2.lengths[0]) == 3
    c2, forked = cache.fork(0, jnp.array([2], jnp.int32))
    assert not bool(forked[0]) and int(c2.lengths[2]) == 0
    c2 = cache.commit(0)  # an increment of 0 keeps a swapped row's length
    assert np.asarray(c2.lengths).tolist() == [3, 4, 0, 0]
    assert err_of(lambda c: c.commit(0), cache) is None


def test_in_place_under_donation_and_scan():
    """The compiled swaps copy neither pool (device or host); the outputs are the inputs'
    buffers; a scan of swaps carries the cache in place."""
    cache = filled(make(num_pages=16, host_pages=16), [5, 3, 7, 2])
    rows = jnp.array([True, False, True, False])
    for fn in (swap_out, swap_in):
        hlo = fn.lower(cache, rows, 8).compile().as_text()
        for leaf in (cache.k_pages, cache.host.pages):
            assert copies_of(hlo, leaf) == [], (fn, leaf.shape)
        ptrs = [cache.k_pages.unsafe_buffer_pointer(), cache.host.pages.unsafe_buffer_pointer()]
        cache, _ = fn(cache, rows, 8)
        assert [cache.k_pages.unsafe_buffer_pointer(),
                cache.host.pages.unsafe_buffer_pointer()] == ptrs
        assert cache.host.pages.sharding.memory_kind == "pinned_host"

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(cache):
        def body(c, _):
            c, _ = c.swap_out(rows, 8)
            c, _ = c.swap_in(rows, 8)
            return c, None
        return jax.lax.scan(body, cache, None, length=3)[0]

    before = [row_bytes(cache, b) for b in range(4)]
    hlo = loop.lower(cache).compile().as_text()
    assert copies_of(hlo, cache.k_pages) == [] and copies_of(hlo, cache.host.pages) == []
    cache = loop(cache)
    for b in range(4):
        for got, want in zip(row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"row {b} after the scan")


class Model:
    """The cache's allocators and rows on the host: pages lowest id first on both tiers."""

    def __init__(self, P, N, B, K, S):
        self.P, self.N, self.B, self.K, self.S = P, N, B, K, S
        self.dev_free, self.host_free = set(range(P)), set(range(N))
        self.table = [[] for _ in range(B)]
        self.host = [[] for _ in range(B)]
        self.length = [0] * B
        # overlapped swaps until settle: device pages held, and each row's pages coming back
        self.outgoing: set = set()
        self.incoming = [[] for _ in range(B)]

    def _take(self, free, needs, eligible, budget=None):
        served, total, spent = [], 0, 0
        for need, ok in zip(needs, eligible):
            spent += need if ok else 0
            total += need if ok else 0
            fits = ok and (need == 0 or ((budget is None or spent <= budget)
                                         and total <= len(free)))
            served.append(fits)
        order, pages = sorted(free), []
        for need, ok in zip(needs, served):
            pages.append(order[:need] if ok else [])
            if ok:
                order = order[need:]
        for got in pages:
            free -= set(got)
        return served, pages

    def reserve(self, n):
        needs, eligible = [], []
        for b in range(self.B):
            end = self.length[b] + n[b]
            parked = bool(self.host[b])
            fits = end <= self.K * self.S and not (parked and n[b] > 0)
            needs.append(max(-(-end // self.S) - len(self.table[b]), 0)
                         if fits and not parked else 0)
            eligible.append(fits)
        served, pages = self._take(self.dev_free, needs, eligible)
        for b in range(self.B):
            self.table[b] += pages[b]
        return served

    def commit(self, n):
        for b in range(self.B):
            if not self.host[b]:
                self.length[b] = min(self.length[b] + n[b], len(self.table[b]) * self.S)

    def release(self, mask):
        for b in np.flatnonzero(mask):
            self.dev_free |= set(self.table[b])
            self.host_free |= set(self.host[b])
            self.outgoing |= set(self.incoming[b])
            self.table[b], self.host[b], self.length[b], self.incoming[b] = [], [], 0, []

    def settle(self):
        self.dev_free |= self.outgoing
        self.outgoing = set()
        for b in range(self.B):
            if self.incoming[b]:
                self.host_free |= set(self.host[b])
                self.table[b], self.host[b], self.incoming[b] = self.incoming[b], [], []

    def swap_out(self, mask, budget, overlap=False):
        eligible = [bool(m) and not self.host[b] and bool(self.table[b])
                    for b, m in enumerate(mask)]
        needs = [len(t) for t in self.table]
        swapped, pages = self._take(self.host_free, needs, eligible, budget)
        for b in range(self.B):
            if swapped[b]:
                (self.outgoing if overlap else self.dev_free).update(self.table[b])
                self.table[b], self.host[b] = [], pages[b]
        return swapped

    def swap_in(self, mask, budget, overlap=False):
        eligible = [bool(m) and bool(self.host[b]) and not self.incoming[b]
                    for b, m in enumerate(mask)]
        needs = [len(h) for h in self.host]
        served, pages = self._take(self.dev_free, needs, eligible, budget)
        for b in range(self.B):
            if served[b] and overlap:
                self.incoming[b] = pages[b]
            elif served[b]:
                self.host_free |= set(self.host[b])
                self.table[b], self.host[b] = pages[b], []
        return served


@pytest.mark.parametrize("seed,overlapped", [(s, False) for s in range(5)] +
                         [(s, True) for s in range(5, 10)])
def test_random_operations_agree_with_the_model(seed, overlapped):
    """reserve + append, release, swap_out, swap_in in any order (overlapped: either form of
    each swap, and settle_swaps): the same results, tables, host tables, pages in flight and
    lengths as the model, and every row on the device reads its own tokens."""
    rng = np.random.default_rng(seed)
    P, N, B, K, S, T = 10, 7, 4, 4, 2, 5
    cache, model = make(P, S, B, K, host_pages=N), Model(P, N, B, K, S)
    data = [np.zeros((L, 2, H, 0, D), np.float32) for _ in range(B)]
    release = jax.jit(PagedKVCache.release)
    settle = jax.jit(PagedKVCache.settle_swaps, donate_argnums=0)
    for step in range(40):
        op = rng.integers(5 if overlapped else 4)
        overlap = overlapped and bool(rng.integers(2))
        if op == 0:
            n = rng.integers(0, T + 1, B).astype(np.int32)
            n = np.where([bool(h) for h in model.host], 0, n).astype(np.int32)
            k = random_array((L, B, H, T, D), jnp.float32)
            v = random_array((L, B, H, T, D), jnp.float32)
            cache, served = fill(cache, jnp.asarray(n), k, v)
            assert np.asarray(served).tolist() == model.reserve(n.tolist()), step
            kv = np.stack([np.asarray(k), np.asarray(v)], 2)  # [L, B, 2, H, T, D]
            for b in range(B):
                if served[b]:
                    data[b] = np.concatenate([data[b], kv[:, b, :, :, :n[b]]], axis=3)
            model.commit(np.where(np.asarray(served), n, 0).tolist())
        elif op == 1:
            mask = rng.random(B) < 0.3
            cache = release(cache, jnp.asarray(mask))
            model.release(mask)
            for b in np.flatnonzero(mask):
                data[b] = data[b][:, :, :, :0]
        elif op == 2:
            mask, budget = rng.random(B) < 0.5, int(rng.integers(1, 9))
            cache, swapped = (swap_out_overlapped if overlap else swap_out)(
                cache, jnp.asarray(mask), budget)
            assert np.asarray(swapped).tolist() == model.swap_out(mask, budget, overlap), step
        elif op == 3:
            mask, budget = rng.random(B) < 0.6, int(rng.integers(1, 9))
            cache, served = (swap_in_overlapped if overlap else swap_in)(
                cache, jnp.asarray(mask), budget)
            assert np.asarray(served).tolist() == model.swap_in(mask, budget, overlap), step
        else:
            cache = settle(cache)
            model.settle()
        pad = lambda rows: [r + [NO_PAGE] * (K - len(r)) for r in rows]  # noqa: E731
        assert np.asarray(cache.page_table).tolist() == pad(model.table), step
        assert np.asarray(cache.host.table).tolist() == pad(model.host), step
        assert np.asarray(cache.host.incoming).tolist() == pad(model.incoming), step
        assert set(np.flatnonzero(np.asarray(cache.host.outgoing))) == model.outgoing, step
        assert np.asarray(cache.lengths).tolist() == model.length, step
        assert int(cache.num_free_pages) == len(model.dev_free), step
        assert int(cache.num_free_host_pages) == len(model.host_free), step
        for layer in range(L):
            got = np.asarray(cache.gather(layer, K * S))
            for b in range(B):
                if not model.host[b]:
                    n = model.length[b]
                    assert_bytes_equal(got[b, :, :, :n], data[b][layer, :, :, :n],
                                       f"step {step} layer {layer} row {b}")


@pytest.mark.long
@pytest.mark.parametrize("host_pages", [8, 3])
def test_prefix_cache_pages_evicted_by_swap_in_spill_to_the_host_while_it_has_room(host_pages):
    """swap_in takes device pages as reserve does: never-cached free pages first, then cached
    ones least recently used, which spill to free host pages first and stay findable there (8
    host pages: room for them beside the row's 3); where the host has no room (3: the row's own)
    they leave the index."""
    cache = make(num_pages=6, page_size=2, max_batch=2, prefix_cache=True, host_pages=host_pages)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    k, v = kv_of_at(tokens, jnp.arange(8, dtype=jnp.float32)[None, :])
    cache, served = fill(cache, jnp.array([6, 0], jnp.int32), k, v)
    cache = cache.insert_prefix(tokens, jnp.array([6, 0], jnp.int32))
    cache, _ = swap_out(cache, jnp.array([True, False]), 8)  # 3 cached pages, still findable
    cache = filled(cache, [0, 6])  # row 1 takes the 3 pages never cached
    assert int(cache.num_free_pages) == 3
    cache, served = swap_in(cache, jnp.array([True, False]), 8)
    assert bool(served[0])
    spilled = host_pages == 8
    assert bool(jnp.any(cache.prefix_cache.indexed[6:])) == spilled
    probe = cache.release(jnp.array([True, True]))
    probe, matched = probe.match_prefix(tokens, jnp.array([7, 0], jnp.int32))
    assert int(matched[0]) == (6 if spilled else 0)
    if spilled:
        assert_rows_hold_their_tokens(probe, tokens, "the spilled chain, brought back")


@pytest.mark.parametrize("layout,dtype,scaling", [("HND", jnp.float32, None),
                                                  ("NHD", jnp.float8_e4m3fn, "per_token_head")])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_sharded_cache_swaps_each_shard_to_its_own_host_pages(layout, dtype, scaling, overlap):
    """Batch over 2 devices, KV heads over 2: each batch shard moves its rows to its share of the
    host pages and back; flags, counts and every gathered value equal the unsharded cache's, and
    the host pool stays in host memory, split like the pools."""
    mesh = mesh_of((2, 2), ("dp", "tp"))
    src = jnp.bfloat16 if scaling else dtype
    shape = (L, 4, H, 7, D)
    k, v = random_array(shape, src), random_array(shape, src)
    n, rows = jnp.array([5, 3, 7, 0], jnp.int32), jnp.array([True, False, True, False])
    results = []
    for sharding in (None, CacheSharding(mesh, heads="tp", batch="dp")):
        cache = make(num_pages=16, host_pages=8, layout=layout, dtype=dtype, scaling=scaling,
                     sharding=sharding)
        cache, served = fill(cache, n, k, v)
        assert bool(jnp.all(served))
        cache, swapped = (swap_out_overlapped if overlap else swap_out)(cache, rows, 8)
        cache = cache.settle_swaps()
        assert cache.host.pages.sharding.memory_kind == "pinned_host"
        out = [swapped, cache.on_host, cache.num_free_pages, cache.num_free_host_pages]
        cache, back = (swap_in_overlapped if overlap else swap_in)(cache, rows, 8)
        cache = cache.settle_swaps()
        got = [np.asarray(x, np.float32) for x in cache.gather(0, 8, split=True)]
        results.append([np.asarray(x) for x in out + [back, cache.on_host]] + got)
        if sharding is not None:
            assert cache.host.pages.sharding.spec == sharding.spec(*cache.leaf_roles()["host"]
                                                                     ["pages"])
    want, sharded = results
    assert want[0].tolist() == [True, False, True, False] and int(want[3]) == 8 - 7
    for got, expected in zip(sharded, want):
        np.testing.assert_array_equal(got, expected)


def test_bad_arguments_are_refused_at_trace_time():
    with pytest.raises(ValueError, match="host_pages must be"):
        make(host_pages=-1)
    with pytest.raises(TypeError, match="host_pages must be a Python int"):
        make(host_pages=2.0)
    cache = make()
    with pytest.raises(ValueError, match="PagedKVCache.swap_out: the cache has no host tier"):
        make(host_pages=0).swap_out(jnp.zeros((4,), bool))
    with pytest.raises(TypeError, match="swap_in: rows must be bool"):
        cache.swap_in(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="swap_out: rows must have shape"):
        cache.swap_out(jnp.zeros((3,), bool))
    with pytest.raises(ValueError, match="max_pages must be"):
        cache.swap_out(jnp.zeros((4,), bool), 0)
    with pytest.raises(TypeError, match="swap_in: overlap must be a bool"):
        cache.swap_in(jnp.zeros((4,), bool), overlap=1)
    with pytest.raises(ValueError, match="settle_swaps: the cache has no host tier"):
        make(host_pages=0).settle_swaps()


# --- the prefix cache's host tier ----------------------------------------------------------------
@jax.jit
def fill_tokens(cache, tokens, n):
    """Reserves and appends ``tokens[b, lengths[b]:lengths[b] + n[b]]`` (``kv_of_at`` them)."""
    cache, served = cache.reserve(n)
    n = jnp.where(served, n, 0)
    t = tokens.shape[1]
    pick = jnp.clip(cache.lengths[:, None] + jnp.arange(t)[None, :], 0, t - 1)
    chunk = jnp.take_along_axis(tokens, pick, axis=1)
    pos = (cache.lengths[:, None] + jnp.arange(t)[None, :]).astype(jnp.float32)
    k, v = kv_of_at(chunk, pos)
    return cache.append_layers(k, v, n).commit(n), served


def kv_of_at(tokens, pos):
    """K and V ``[L, B, H, T, D]``, a function of each token id and its position, so that any
    page can be checked against the tokens it claims to hold. Integers below 2^24 times a power
    of two: exact however XLA computes them (a sine differs by an ulp between a sharded and an
    unsharded program under XLA:CPU's older emitters)."""
    base = (jnp.asarray(tokens, jnp.float32) * 64 + pos)[None, :, None, :, None] * (L * H * D)
    grid = jnp.arange(L * H * D, dtype=jnp.float32).reshape(L, 1, H, 1, D)
    k = (base + grid) * 2.0**-16
    return k, -k - 2.0**-17


def assert_rows_hold_their_tokens(cache, tokens, what=""):
    """Every row on the device reads K/V equal to ``kv_of_at`` its tokens."""
    t = tokens.shape[1]
    want_k, want_v = kv_of_at(tokens, jnp.arange(t, dtype=jnp.float32)[None, :])
    lengths, on_host = np.asarray(cache.lengths), np.asarray(cache.on_host)  # sharded too
    for layer in range(L):
        k, v = (np.asarray(x) for x in cache.gather(layer, t, split=True))
        for b in range(cache.max_batch):
            n = int(lengths[b])
            if on_host[b] or n == 0:
                continue
            np.testing.assert_array_equal(k[b, :, :n], want_k[layer, b, :, :n], f"{what} row {b}")
            np.testing.assert_array_equal(v[b, :, :n], want_v[layer, b, :, :n], f"{what} row {b}")


def prefix_cache(num_pages=8, host_pages=8, page_size=2, max_batch=2, max_pages_per_seq=4, **kw):
    return make(num_pages=num_pages, host_pages=host_pages, page_size=page_size,
                max_batch=max_batch, max_pages_per_seq=max_pages_per_seq, prefix_cache=True,
                **kw)


@pytest.mark.long
@pytest.mark.parametrize("how", ["ahead", "on eviction", "no room"])
def test_spilled_prefix_survives_device_pressure_and_comes_back(how):
    """A cached chain spilled to the host, ahead (spill_prefix) or by reserve's own eviction, is
    found there after another row used up the device pool, and comes back byte for byte; with
    one free host page the chain's first page spills and comes back alone (its deepest page,
    spilled, would have left the index with the eviction of the pages above it: matching walks
    the chain from its first page)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 8)), jnp.int32)
    cache = prefix_cache(num_pages=4, host_pages=1 if how == "no room" else 8)
    cache, _ = fill_tokens(cache, tokens, jnp.array([6, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([6, 0], jnp.int32))
    cache = cache.release(jnp.array([True, False]))
    if how == "ahead":
        cache, spilled = cache.spill_prefix()
        assert int(spilled) == 3 and int(cache.num_free_pages) == 4
    # Row 1 takes the whole pool: every cached page left on the device is evicted.
    cache, served = fill_tokens(cache, tokens.at[1].add(100), jnp.array([0, 8], jnp.int32))
    assert bool(served[1])
    pages = 1 if how == "no room" else 3
    assert int(jnp.sum(cache.prefix_cache.indexed[4:])) == pages
    cache = cache.release(jnp.array([False, True]))
    cache, matched = cache.match_prefix(tokens, jnp.array([8, 0], jnp.int32))
    assert int(matched[0]) == 2 * pages
    assert_rows_hold_their_tokens(cache, tokens, "brought back")
    # The chain is on the device again, held once: released, it is found without the host.
    assert int(cache.ref_counts.sum()) == pages
    assert not bool(jnp.any(cache.prefix_cache.indexed[cache.num_pages:]))


def test_host_pages_must_split_evenly_over_the_batch_shards():
    mesh = mesh_of((2,), ("batch",))
    with pytest.raises(ValueError, match="host_pages = 7 is not divisible by the 2 devices"):
        make(host_pages=7, sharding=CacheSharding(mesh, batch="batch"))


@pytest.mark.long
def test_each_batch_shard_spills_and_finds_its_own_prefix_on_the_host():
    """The previous test on a cache split over 2 batch shards (and 2 head shards): each shard
    spills its cached chain to its own host pages, loses its device pool to another row, and
    finds the chain on the host again."""
    mesh = mesh_of((2, 2), ("dp", "tp"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (4, 8)), jnp.int32)
    first, second = jnp.array([6, 0, 6, 0], jnp.int32), jnp.array([0, 8, 0, 8], jnp.int32)
    cache = prefix_cache(num_pages=8, max_batch=4,
                         sharding=CacheSharding(mesh, heads="tp", batch="dp"))
    cache, _ = fill_tokens(cache, tokens, first)
    cache = cache.insert_prefix(tokens, first)
    cache = cache.release(first > 0)
    cache, spilled = cache.spill_prefix()
    assert int(spilled) == 6 and int(cache.num_free_pages) == 8
    cache, served = fill_tokens(cache, tokens.at[1::2].add(100), second)
    assert np.asarray(served)[1::2].all()
    cache = cache.release(second > 0)
    cache, matched = cache.match_prefix(tokens, jnp.where(first > 0, 8, 0))
    assert np.asarray(matched).tolist() == [6, 0, 6, 0]
    assert_rows_hold_their_tokens(cache, tokens, "brought back")


@pytest.mark.parametrize("dtype,scaling,layout", [(jnp.float8_e4m3fn, "per_token_head", "NHD"),
                                                  (jnp.int8, "per_tensor", "HND")])
def test_spill_and_bring_back_keep_bytes_and_scales(dtype, scaling, layout):
    cache = prefix_cache(num_pages=8, dtype=dtype, scaling=scaling, layout=layout)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    cache = filled(cache, [8, 0], jnp.bfloat16)
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32))
    before = row_bytes(cache, 0)
    cache = cache.release(jnp.array([True, False]))
    cache, spilled = cache.spill_prefix(8)
    assert int(spilled) == 4
    cache = filled(cache, [0, 8], jnp.bfloat16)  # the spilled device pages are written over
    cache, matched = cache.match_prefix(tokens, jnp.array([8, 0], jnp.int32))
    assert int(matched[0]) == 6  # one token at least is left to compute
    for got, want in zip(row_bytes(cache, 0), before):
        assert_bytes_equal(got, want[(slice(None),) * (2 if layout == "HND" else 1) + (
            slice(0, 3),)], "three pages back")


@pytest.mark.long
def test_a_traced_count_spills_what_a_transfer_of_that_size_spills():
    """spill_prefix(max_pages, count): one compiled spill moves min(count, what could move)
    pages, the same pages and bytes as a transfer of size count; a negative count is reported
    and moves none."""
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    cache = prefix_cache(num_pages=8, max_batch=2)
    cache, _ = fill_tokens(cache, tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32)).release(
        jnp.array([True, False]))
    spill = jax.jit(lambda c, n: c.spill_prefix(8, n))
    for count in range(6):
        got, n = spill(cache, count)
        assert int(n) == min(count, 4)
        if count:
            want, _ = cache.spill_prefix(count)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert_bytes_equal(np.asarray(a), np.asarray(b), f"count {count}")
    err, (_, n) = checkify.checkify(spill)(cache, jnp.int32(-1))
    assert "count must be >= 0" in err.get() and int(n) == 0
    with pytest.raises(TypeError, match="spill_prefix: count"):
        cache.spill_prefix(8, jnp.float32(2))
    with pytest.raises(ValueError, match=r"spill_prefix: count must be in \[-2147483648, "):
        cache.spill_prefix(8, 2**31)  # past int32: named, not numpy's OverflowError


@pytest.mark.long
def test_host_pages_come_back_within_the_budget_and_the_pool():
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))  # both rows: the same prompt
    cache = prefix_cache(num_pages=8, max_batch=2)
    cache, _ = fill_tokens(cache, tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.release(jnp.array([True, False]))
    cache, _ = cache.spill_prefix(2)  # the two least recently used: the chain's deepest pages
    assert np.asarray(cache.prefix_cache.indexed[:8]).sum() == 2
    ask = jnp.array([8, 0], jnp.int32)
    _, matched = cache.match_prefix(tokens, ask, max_host_pages=0)
    assert int(matched[0]) == 4  # up to its first page on the host
    got, matched = cache.match_prefix(tokens, ask, max_host_pages=1)
    assert int(matched[0]) == 6  # three of the four pages (one token is left to compute)
    assert_rows_hold_their_tokens(got, tokens)
    # Both rows ask for the same pages: the first brings each host page back (once), and both
    # share every page, each held by the two rows.
    got, matched = cache.match_prefix(tokens, jnp.array([8, 8], jnp.int32), max_host_pages=2)
    assert np.asarray(matched).tolist() == [6, 6]
    table = np.asarray(got.page_table)
    assert table[1, :3].tolist() == table[0, :3].tolist() and len(set(table[0, :3])) == 3
    np.testing.assert_array_equal(np.asarray(got.ref_counts)[table[0, :3]], [2, 2, 2])
    assert int(got.ref_counts.sum()) == 6 and int(got.num_free_pages) == 8 - 3
    assert_rows_hold_their_tokens(got, tokens, "shared")
    # No transfer: both rows stop before the host page, and share the device ones.
    got, matched = cache.match_prefix(tokens, jnp.array([8, 8], jnp.int32), max_host_pages=0)
    assert np.asarray(matched).tolist() == [4, 4]
    assert int(got.ref_counts.sum()) == 4
    # Two chains on the host, a transfer of one page: the second row stops before its host page.
    two = jnp.stack([jnp.arange(8), jnp.arange(8) + 20]).astype(jnp.int32)
    both = prefix_cache(num_pages=8, max_batch=2)
    both, _ = fill_tokens(both, two, jnp.array([6, 6], jnp.int32))
    both = both.insert_prefix(two, jnp.array([6, 6], jnp.int32)).release(jnp.ones((2,), bool))
    both, spilled = both.spill_prefix(2)  # the deepest page of each chain
    assert int(spilled) == 2
    got, matched = both.match_prefix(two, jnp.array([7, 7], jnp.int32), max_host_pages=1)
    assert np.asarray(matched).tolist() == [6, 4]
    assert_rows_hold_their_tokens(got, two)
    # Three rows, two chains with a page on the host each; rows 1 and 2 ask for the same one.
    # A transfer of one page: row 0 brings its own back, row 1's does not fit, and row 2, whose
    # page row 1 owns, stops before it too. A transfer of two: row 2 shares row 1's page.
    three = jnp.stack([jnp.arange(8), jnp.arange(8) + 20, jnp.arange(8) + 20]).astype(jnp.int32)
    chains = prefix_cache(num_pages=8, max_batch=3)
    chains, _ = fill_tokens(chains, three, jnp.array([6, 6, 0], jnp.int32))
    chains = chains.insert_prefix(three, jnp.array([6, 6, 0], jnp.int32)).release(
        jnp.ones((3,), bool))
    chains, spilled = chains.spill_prefix(2)
    assert int(spilled) == 2
    ask = jnp.array([7, 7, 7], jnp.int32)
    got, matched = chains.match_prefix(three, ask, max_host_pages=1)
    assert np.asarray(matched).tolist() == [6, 4, 4]
    assert_rows_hold_their_tokens(got, three, "one page back")
    got, matched = chains.match_prefix(three, ask, max_host_pages=2)
    assert np.asarray(matched).tolist() == [6, 6, 6]
    table = np.asarray(got.page_table)
    assert table[2, :3].tolist() == table[1, :3].tolist()
    np.testing.assert_array_equal(np.asarray(got.ref_counts)[table[1, :3]], [2, 2, 2])
    assert_rows_hold_their_tokens(got, three, "two pages back")
    assert not bool(jnp.any(got.prefix_cache.indexed[8:]))  # both chains whole on the device
    # The device pool is short: no host page comes back, the device part is still matched.
    full = prefix_cache(num_pages=3, max_batch=2)
    full, _ = fill_tokens(full, tokens, jnp.array([6, 0], jnp.int32))
    full = full.insert_prefix(tokens, jnp.array([6, 0], jnp.int32)).release(
        jnp.array([True, False]))
    full, _ = full.spill_prefix(1)
    full, _ = fill_tokens(full, tokens.at[1].add(50), jnp.array([0, 2], jnp.int32))  # 1 page
    assert int(full.num_free_pages) == 2  # the two cached pages left on the device, held by no one
    got, matched = full.match_prefix(tokens, jnp.array([7, 0], jnp.int32))
    assert int(matched[0]) == 4 and int(got.num_free_pages) == 0
    assert bool(jnp.any(got.prefix_cache.indexed[3:]))  # the page stays cached on the host


@pytest.mark.long
def test_swap_out_evicts_cached_host_pages_least_recently_used():
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    cache = prefix_cache(num_pages=8, host_pages=4)
    cache, _ = fill_tokens(cache, tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.release(jnp.array([True, False]))
    cache, spilled = cache.spill_prefix(4)
    assert int(spilled) == 4 and int(cache.num_free_host_pages) == 4
    cache, _ = fill_tokens(cache, tokens, jnp.array([0, 6], jnp.int32))  # row 1: 3 pages
    cache, swapped = cache.swap_out(jnp.array([False, True]))
    assert bool(swapped[1])
    # The three least recently used cached host pages (the chain's deepest) were evicted, and
    # with them everything below them: only the chain's first page is still findable.
    assert int(cache.prefix_cache.indexed.sum()) == 1
    probe, matched = cache.match_prefix(tokens, jnp.array([8, 0], jnp.int32))
    assert int(matched[0]) == 2
    cache, served = cache.swap_in(jnp.array([False, True]))
    assert bool(served[1])
    assert_rows_hold_their_tokens(cache, tokens)


@pytest.mark.long
def test_random_tiered_prefix_operations_keep_every_invariant():
    """match / insert / spill / reserve+append / release / swap in any order: every row on the
    device reads its own tokens (matched pages included), every indexed entry hangs under an
    indexed parent one level up, and reference counts equal the page-table references."""
    rng = np.random.default_rng(7)
    P, N, B, K, S, T = 10, 6, 3, 4, 2, 8
    cache = prefix_cache(num_pages=P, host_pages=N, page_size=S, max_batch=B,
                         max_pages_per_seq=K)
    prompts = rng.integers(0, 3, (4, T)).astype(np.int32)
    rows = np.zeros((B, T), np.int32)
    match = jax.jit(PagedKVCache.match_prefix, static_argnames="max_host_pages")
    spill = jax.jit(PagedKVCache.spill_prefix, static_argnums=1)
    for step in range(50):
        op = rng.integers(6)
        if op == 0:
            n = np.where(np.asarray(cache.lengths) == 0, rng.integers(0, T + 1, B), 0)
            n = (n * (np.asarray(cache.pages_held) == 0)).astype(np.int32)  # rows on the host
            # with nothing committed ask too: they must be refused
            pick = prompts[rng.integers(0, len(prompts), B)]
            rows = np.where((n > 0)[:, None], pick, rows)
            cache, got = match(cache, jnp.asarray(rows), jnp.asarray(n),
                               max_host_pages=int(rng.integers(0, 4)))
            rest = np.where(np.asarray(cache.on_host), 0, np.maximum(n - np.asarray(got), 0))
            cache, _ = fill_tokens(cache, jnp.asarray(rows), jnp.asarray(rest, jnp.int32))
        elif op == 1:
            n = np.minimum(rng.integers(0, T + 1, B), np.asarray(cache.lengths)).astype(np.int32)
            cache = cache.insert_prefix(jnp.asarray(rows), jnp.asarray(n))
        elif op == 2:
            cache, _ = spill(cache, int(rng.integers(1, 5)))
        elif op == 3:
            cache = cache.release(jnp.asarray(rng.random(B) < 0.4))
        elif op == 4:
            cache, _ = swap_out(cache, jnp.asarray(rng.random(B) < 0.5), 8)
        else:
            cache, _ = swap_in(cache, jnp.asarray(rng.random(B) < 0.6), 8)
        assert_rows_hold_their_tokens(cache, jnp.asarray(rows), f"step {step}")
        idx = cache.prefix_cache
        depth, parent = np.asarray(idx.depth), np.asarray(idx.parent)
        for e in np.flatnonzero(depth >= 0):
            if depth[e] == 0:
                assert parent[e] == -1, (step, e)
            else:
                assert depth[parent[e]] == depth[e] - 1, (step, e)
        table = np.asarray(cache.page_table)
        refs = np.bincount(table[table >= 0], minlength=P)
        assert np.array_equal(refs, np.asarray(cache.ref_counts)), step
        host_table = np.asarray(cache.host.table)
        host_refs = np.bincount(host_table[host_table >= 0], minlength=N)
        assert np.array_equal(host_refs, np.asarray(cache.host.ref_counts)), step
        # a host page holds a row's pages or a cached page, never both
        assert not np.any((host_refs > 0) & (depth[P:] >= 0)), step


@pytest.mark.parametrize("dtype,scaling", [(jnp.float32, None),
                                           (jnp.int8, "per_token_head")])
def test_a_step_that_reads_pages_to_the_host_then_appends_runs_in_place(dtype, scaling):
    """Reads of the device pools by a transfer to the host (a swap_out; a reserve whose evictions
    spill) followed, in the same jit, by appends that write those pools in place: no copy of
    any pool, and the outputs are the inputs' buffers."""
    cache = prefix_cache(num_pages=16, max_batch=4, dtype=dtype, scaling=scaling)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(4, 8)
    k = random_array((L, 4, H, 8, D), jnp.float32)
    n = jnp.array([3, 5, 0, 0], jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache):
        cache, _ = cache.swap_out(jnp.array([False, False, True, False]))
        cache, served = cache.reserve(n)
        n_served = jnp.where(served, n, 0)
        cache = cache.append_layers(k, k, n_served).commit(n_served)
        return cache.insert_prefix(tokens, cache.lengths)

    device = lambda c: [c.k_pages, c.v_pages] + ([c.k_scales, c.v_scales] if scaling else [])  # noqa: E731
    host = [cache.host.pages] + ([cache.host.scales] if scaling else [])
    hlo = step.lower(cache).compile().as_text()
    for leaf in device(cache) + host:
        assert copies_of(hlo, leaf) == [], leaf.shape
    # (The host pools' buffers are not compared: jax's CPU runtime sometimes hands back a
    # donated pinned_host buffer at a new address even where a step only passes it through.)
    ptrs = [x.unsafe_buffer_pointer() for x in device(cache)]
    cache = step(cache)
    assert [x.unsafe_buffer_pointer() for x in device(cache)] == ptrs


@pytest.mark.long
def test_a_page_in_flight_matched_and_swapped_out_again_is_freed_once_per_hold():
    """A page an overlapped swap_out still reads can be matched into another row (its data is
    intact) and go out again with that row before settle_swaps: each swap holds it, and after
    settle, swap_in and release every page is free (a flag per page freed it once: a leak)."""
    cache = prefix_cache(num_pages=8, max_batch=3)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    count = lambda r, n: jnp.zeros((3,), jnp.int32).at[r].set(n)  # noqa: E731
    only = lambda *rows: jnp.zeros((3,), bool).at[jnp.array(rows)].set(True)  # noqa: E731
    cache, _ = fill_tokens(cache, tokens, count(0, 4))  # row 0: pages a0, a1, indexed
    cache = cache.insert_prefix(tokens, count(0, 4))
    cache, _ = cache.match_prefix(tokens, count(1, 3))  # row 1 shares a0
    out = jax.jit(functools.partial(PagedKVCache.swap_out, overlap=True), donate_argnums=0)
    cache, swapped = out(cache, only(0))  # a0 stays (shared), a1 in flight
    assert bool(swapped[0])
    cache = cache.release(only(0, 1))
    cache, matched = cache.match_prefix(tokens, count(2, 5))  # row 2 on a0 and a1 (in flight)
    assert int(matched[2]) == 4
    cache, swapped = out(cache, only(2))  # both go out; a1 held twice
    assert bool(swapped[2]) and int(cache.host.outgoing.sum()) == 3
    cache = cache.settle_swaps()
    cache, served = cache.swap_in(only(2))
    assert bool(served[2])
    assert_rows_hold_their_tokens(cache, tokens, "row 2 back")
    cache = cache.release(only(0, 1, 2))
    assert int(cache.ref_counts.sum()) == 0 and int(cache.num_free_pages) == 8


def test_a_page_held_only_by_a_swap_in_flight_is_not_kept_on_the_device():
    """swap_out keeps on the device the leading pages another row holds; the hold of an
    overlapped swap_out still reading a page is not a row: a row that matched that page alone
    moves it to the host, and after settle_swaps the page is free."""
    cache = prefix_cache(num_pages=8)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    only = lambda *rows: jnp.zeros((2,), bool).at[jnp.array(rows)].set(True)  # noqa: E731
    cache, _ = fill_tokens(cache, tokens, jnp.array([4, 0], jnp.int32))  # row 0: a0 a1, indexed
    cache = cache.insert_prefix(tokens, jnp.array([4, 0], jnp.int32))
    cache, _ = cache.swap_out(only(0), overlap=True)  # a0, a1 in flight
    cache, matched = cache.match_prefix(tokens, jnp.array([0, 3], jnp.int32))  # row 1 on a0
    assert int(matched[1]) == 2
    cache, _ = fill_tokens(cache, tokens, jnp.array([0, 1], jnp.int32))  # a page of its own
    cache, swapped = cache.swap_out(only(1))
    assert bool(swapped[1]) and int(cache.host.held[1]) == 2  # a0 moved too
    cache = cache.settle_swaps()
    assert int(cache.num_free_pages) == 8
    cache, served = cache.swap_in(only(0, 1))
    assert np.asarray(served).tolist() == [True, True]
    assert_rows_hold_their_tokens(cache, tokens, "both rows back")


def test_spill_and_match_run_in_place():
    """spill_prefix and a match that brings pages back copy neither pool, device or host."""
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    cache = prefix_cache(num_pages=8)
    cache, _ = fill_tokens(cache, tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.release(jnp.array([True, False]))
    spill = jax.jit(PagedKVCache.spill_prefix, static_argnums=1, donate_argnums=0)
    match = jax.jit(PagedKVCache.match_prefix, donate_argnums=0)
    ask = jnp.array([8, 0], jnp.int32)
    for fn, args in ((spill, (4,)), (match, (tokens, ask))):
        hlo = fn.lower(cache, *args).compile().as_text()
        for leaf in (cache.k_pages, cache.host.pages, cache.prefix_cache.tokens):
            assert copies_of(hlo, leaf) == [], (fn, leaf.shape)
        ptrs = [cache.v_pages.unsafe_buffer_pointer(), cache.host.pages.unsafe_buffer_pointer()]
        cache, _ = fn(cache, *args)
        assert [cache.v_pages.unsafe_buffer_pointer(),
                cache.host.pages.unsafe_buffer_pointer()] == ptrs
    assert int(cache.lengths[0]) == 6
    assert_rows_hold_their_tokens(cache, tokens)


@pytest.mark.long
def test_a_shared_prefix_stays_on_the_device_and_stays_shared():
    """A forked row's shared pages stay on the device (held by it) when it swaps out; only its
    own pages move, and they come back behind the shared ones: the pool uses no more pages after
    a round trip than before, and both rows read what they wrote."""
    cache = filled(make(num_pages=12, max_batch=3), [5, 0, 0])  # 3 pages, the last partial
    cache, forked = cache.fork(0, jnp.array([1], jnp.int32))
    assert bool(forked[0])
    cache = filled(cache, [0, 3, 0])  # row 1: the 2 shared full pages, its copy, one more page
    before = [row_bytes(cache, b) for b in (0, 1)]
    used = int(cache.num_pages - cache.num_free_pages)
    shared = np.asarray(cache.page_table[1, :2]).tolist()
    cache, swapped = swap_out(cache, jnp.array([False, True, False]), 8)
    assert bool(swapped[1]) and bool(cache.on_host[1])
    assert np.asarray(cache.page_table[1]).tolist() == shared + [NO_PAGE, NO_PAGE]
    assert int(cache.host.held[1]) == 2 and int(cache.lengths[1]) == 8
    cache = filled(cache, [0, 0, 8])  # row 2 takes the freed pages and writes over them
    cache = cache.release(jnp.array([False, False, True]))
    cache, served = swap_in(cache, jnp.array([False, True, False]), 8)
    assert bool(served[1]) and np.asarray(cache.page_table[1, :2]).tolist() == shared
    assert int(cache.num_pages - cache.num_free_pages) == used  # nothing unshared
    for b in (0, 1):
        for got, want in zip(row_bytes(cache, b), before[b]):
            assert_bytes_equal(got, want, f"row {b}")
    # A row holding only shared pages has nothing of its own to move: a reported no-op.
    only = filled(make(num_pages=12, max_batch=3), [4, 0, 0])
    only, _ = only.fork(0, jnp.array([2], jnp.int32))
    err, (_, swapped) = checkify.checkify(lambda c: c.swap_out(jnp.array([0, 0, 1], bool)))(only)
    assert "no pages of its own" in err.get() and not bool(swapped[2])


@pytest.mark.long
def test_a_row_on_the_host_with_nothing_committed_is_not_empty_for_match():
    """Reserved but not committed, then swapped: length 0, no device page, yet on the host.
    match_prefix must not map cached pages into it (they would leak when it comes back)."""
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    cache = prefix_cache(num_pages=8, max_batch=2)
    cache, _ = fill_tokens(cache, tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.insert_prefix(tokens, jnp.array([8, 0], jnp.int32))
    cache = cache.release(jnp.array([True, False]))
    cache, _ = cache.reserve(jnp.array([0, 3], jnp.int32))
    cache, swapped = swap_out(cache, jnp.array([False, True]), 8)
    assert bool(swapped[1]) and int(cache.lengths[1]) == 0
    ask = jnp.array([0, 8], jnp.int32)
    err, (out, matched) = checkify.checkify(lambda c: c.match_prefix(tokens, ask))(cache)
    assert "must be empty" in err.get() and int(matched[1]) == 0
    out, served = swap_in(out, jnp.array([False, True]), 8)
    assert bool(served[1])
    table = np.asarray(out.page_table)
    refs = np.bincount(table[table >= 0], minlength=8)
    assert np.array_equal(refs, np.asarray(out.ref_counts))


def test_host_pages_may_be_a_numpy_int():
    cache = prefix_cache(host_pages=np.int64(4))
    assert cache.host.num_pages == 4 and cache.prefix_cache.entries == cache.num_pages + 4
    cache, spilled = cache.spill_prefix()
    assert int(spilled) == 0


@pytest.mark.parametrize("scaling", [None, "per_token_head"])
def test_the_host_pool_is_page_major_in_host_memory(scaling):
    """``pages`` ``[N, 2, *page]`` (K then V of every layer) and ``scales`` likewise, in
    ``pinned_host`` memory from the start; under ``eval_shape`` the same shapes."""
    dtype = jnp.float8_e4m3fn if scaling else jnp.bfloat16
    for layout in ("HND", "NHD"):
        cache = make(layout=layout, dtype=dtype, scaling=scaling, host_pages=6)
        axis = 2 if layout == "HND" else 1
        page = cache.k_pages.shape[:axis] + cache.k_pages.shape[axis + 1:]
        assert cache.host.pages.shape == (6, 2) + page
        assert cache.host.pages.dtype == dtype
        assert cache.host.pages.sharding.memory_kind == "pinned_host"
        if scaling:
            assert cache.host.scales.shape == (6, 2) + page[:3]
            assert cache.host.scales.sharding.memory_kind == "pinned_host"
        else:
            assert cache.host.scales is None
        shapes = jax.eval_shape(lambda: make(layout=layout, dtype=dtype, scaling=scaling,
                                             host_pages=6))
        assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, cache)
        made = jax.jit(lambda: make(layout=layout, dtype=dtype, scaling=scaling, host_pages=6))()
        assert made.host.pages.sharding.memory_kind == "pinned_host"
        assert not np.any(np.asarray(made.host.pages.astype(jnp.float32)))
