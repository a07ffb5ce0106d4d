"""Automatic prefix caching: PagedKVCache.match_prefix / insert_prefix against a host oracle."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import AxisType

import jaxkv
from jaxkv import NO_PAGE, PagedKVCache, page_index

from helpers import assert_bytes_equal, copies_of, random_array


def make(num_pages=12, page_size=2, max_batch=4, max_pages_per_seq=4, **kw):
    kw = dict(dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype=jnp.float32), **kw)
    return PagedKVCache.create(num_pages=num_pages, page_size=page_size, max_batch=max_batch,
                               max_pages_per_seq=max_pages_per_seq, prefix_cache=True, **kw)


class Oracle:
    """The same cache, on the host: pages by reference count, the index as a dictionary from
    (namespace, the token tuple a page ends: the whole prefix through it) to that page,
    sequential rows."""

    def __init__(self, num_pages, page_size, max_batch, max_pages):
        self.P, self.S, self.B, self.K = num_pages, page_size, max_batch, max_pages
        self.ref = [0] * num_pages
        self.table = [[] for _ in range(max_batch)]
        self.length = [0] * max_batch
        self.index = {}  # (namespace, prefix tuple) -> page
        self.entry = {}  # page -> ((namespace, prefix tuple), used, depth)
        self.clock = 0

    def _unindex(self, pages):
        gone = [self.entry[p][0] for p in pages if p in self.entry]
        for (space, prefix), page in list(self.index.items()):
            if any(space == g and prefix[:len(t)] == t for g, t in gone):
                del self.index[space, prefix], self.entry[page]

    def _order(self):
        free = [p for p in range(self.P) if self.ref[p] == 0]
        never = [p for p in free if p not in self.entry]
        cached = sorted((p for p in free if p in self.entry),
                        key=lambda p: (self.entry[p][1], -self.entry[p][2], p))
        return never + cached

    def reserve(self, n):
        order = self._order()
        served, total, taken = [], 0, 0
        for b in range(self.B):
            room = self.K * self.S - self.length[b]
            fits = n[b] <= room
            end = self.length[b] + min(n[b], room)
            need = -(-end // self.S) - len(self.table[b]) if fits else 0
            need = max(need, 0)
            total += need if fits else 0
            ok = fits and (need == 0 or total <= len(order))
            served.append(ok)
            if ok and need:
                new = order[taken:taken + need]
                taken += need
                self._unindex(new)
                for p in new:
                    self.ref[p] = 1
                self.table[b] += new
        return served

    def commit(self, n):
        for b in range(self.B):
            self.length[b] = min(self.length[b] + n[b], len(self.table[b]) * self.S)

    def release(self, mask):
        for b in range(self.B):
            if mask[b]:
                for p in self.table[b]:
                    self.ref[p] -= 1
                self.table[b], self.length[b] = [], 0

    def match(self, tokens, n, spaces=None):
        spaces = spaces or [0] * self.B
        self.clock += 1
        matched = [0] * self.B
        for b in range(self.B):
            if not 0 < n[b] <= self.K * self.S or self.length[b] or self.table[b]:
                continue
            k = 0
            while k < min((n[b] - 1) // self.S, self.K):
                page = self.index.get((spaces[b], tuple(tokens[b][:(k + 1) * self.S])))
                if page is None:
                    break
                self.table[b].append(page)
                k += 1
            for p in self.table[b]:
                self.ref[p] += 1
                self.entry[p] = (self.entry[p][0], self.clock, self.entry[p][2])
            self.length[b] = matched[b] = k * self.S
        return matched

    def insert(self, tokens, n, spaces=None):
        spaces = spaces or [0] * self.B
        self.clock += 1
        for b in range(self.B):
            full = min(min(n[b], self.length[b]) // self.S, len(self.table[b]), self.K)
            for k in range(full):
                key = (spaces[b], tuple(tokens[b][:(k + 1) * self.S]))
                page = self.index.get(key)
                if page is None:
                    page = self.table[b][k]
                    if page in self.entry:
                        break
                    self.index[key], self.entry[page] = page, (key, 0, k)
                self.entry[page] = (key, self.clock, k)

    def assert_equal(self, cache):
        table = np.asarray(cache.page_table)
        for b in range(self.B):
            want = self.table[b] + [NO_PAGE] * (table.shape[1] - len(self.table[b]))
            assert table[b].tolist() == want, (b, table[b], want)
        assert np.asarray(cache.lengths).tolist() == self.length
        assert np.asarray(cache.ref_counts).tolist() == self.ref
        ix = cache.prefix_cache
        depth, tokens = np.asarray(ix.depth), np.asarray(ix.tokens)
        space = np.asarray(ix.namespace)
        assert {p for p in range(self.P) if depth[p] >= 0} == set(self.entry)
        for p, ((ns, prefix), _, k) in self.entry.items():
            assert depth[p] == k and tuple(tokens[p]) == prefix[-self.S:], p
            assert space[p] == ns, p
        assert page_index.cross_namespace_entries(ix) == 0


@pytest.mark.parametrize("seed,S,spaces", [(seed, 2, 1) for seed in range(6)] + [(6, 1, 1),
                                                                                (7, 3, 1)]
                         + [(8, 2, 3), (9, 1, 2), (10, 3, 3)])
def test_random_operations_agree_with_the_oracle(seed, S, spaces):
    """match / insert / reserve / release in any order: the same tables, counts and index, and
    every match as long as the oracle's best (tokens from 3 ids, so prefixes collide often).
    With ``spaces`` namespaces, each request in one of them: the oracle keys its index by
    (namespace, prefix), so a row finds only its own namespace's pages."""
    rng = np.random.default_rng(seed)
    P, B, K, T = 12, 4, 4, 8
    cache = make(P, S, B, K)
    oracle = Oracle(P, S, B, K)
    reserve, commit = jax.jit(PagedKVCache.reserve), jax.jit(PagedKVCache.commit)
    release = jax.jit(PagedKVCache.release)
    match, insert = jax.jit(PagedKVCache.match_prefix), jax.jit(PagedKVCache.insert_prefix)
    prompts = rng.integers(0, 3, (6, T)).astype(np.int32)
    rows = np.zeros((B, T), np.int32)  # each row's prompt, as the oracle knows it
    space = np.zeros((B,), np.int32)  # and its namespace
    # one namespace: called as before the namespaces (None: all 0)
    named = (lambda: {}) if spaces == 1 else (lambda: dict(namespace=jnp.asarray(space)))
    for step in range(60):
        op = rng.integers(4)
        if op == 0:  # new requests: rows that are empty ask for a prefix, then fill the rest
            pick = prompts[rng.integers(0, len(prompts), B)]
            n = np.where(np.asarray(cache.lengths) == 0, rng.integers(0, T + 1, B), 0)
            n = n * (np.asarray(cache.pages_held) == 0)
            rows = np.where((n > 0)[:, None], pick, rows)
            space = np.where(n > 0, rng.integers(0, spaces, B), space).astype(np.int32)
            cache, got = match(cache, jnp.asarray(rows), jnp.asarray(n, jnp.int32), **named())
            want = oracle.match(rows.tolist(), n.tolist(), space.tolist())
            assert np.asarray(got).tolist() == want, step
            rest = np.maximum(n - np.asarray(got), 0).astype(np.int32)
            cache, served = reserve(cache, jnp.asarray(rest))
            assert np.asarray(served).tolist() == oracle.reserve(rest.tolist()), step
            done = np.where(np.asarray(served), rest, 0).astype(np.int32)
            cache = commit(cache, jnp.asarray(done))
            oracle.commit(done.tolist())
        elif op == 1:
            n = rng.integers(0, T + 1, B).astype(np.int32)
            n = np.minimum(n, np.asarray(cache.lengths))
            cache = insert(cache, jnp.asarray(rows), jnp.asarray(n), **named())
            oracle.insert(rows.tolist(), n.tolist(), space.tolist())
        elif op == 2:
            mask = rng.random(B) < 0.4
            cache = release(cache, jnp.asarray(mask))
            oracle.release(mask.tolist())
        else:  # pressure: a row takes pages, evicting cached ones
            n = np.zeros(B, np.int32)
            n[rng.integers(B)] = rng.integers(1, 2 * S + 1)
            cache, served = reserve(cache, jnp.asarray(n))
            assert np.asarray(served).tolist() == oracle.reserve(n.tolist()), step
        oracle.assert_equal(cache)


@pytest.mark.long
def test_matched_pages_hold_the_first_rows_data():
    """A second request with the same prompt starts on the first one's pages: gather reads the
    same values, and only the last partial page is new."""
    P, S, B, K, T = 16, 4, 2, 4, 16
    cache = make(P, S, B, K)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 1000, (B, T)), jnp.int32)
    tokens = tokens.at[1].set(tokens[0])
    n = jnp.array([13, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    for layer in range(2):
        k, v = random_array((B, 2, T, 8), jnp.float32), random_array((B, 2, T, 8), jnp.float32)
        cache = cache.append(layer, k, v, n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    cache, matched = cache.match_prefix(tokens, jnp.array([0, 16], jnp.int32))
    assert matched.tolist() == [0, 12]  # three full pages (page 4 of row 0 is partial)
    assert cache.page_table[1, :3].tolist() == cache.page_table[0, :3].tolist()
    assert cache.page_table[1, 3] == NO_PAGE
    for layer in range(2):
        g = cache.gather(layer, 12)
        assert_bytes_equal(g[1, :, :, :12], g[0, :, :, :12])


@pytest.mark.long
def test_at_least_one_token_is_left_to_compute():
    cache = make(16, 4, 2, 4)
    tokens = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    n = jnp.array([16, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    _, matched = cache.match_prefix(tokens, jnp.array([0, 16], jnp.int32))
    assert matched.tolist() == [0, 12]
    _, matched = cache.match_prefix(tokens, jnp.array([0, 13], jnp.int32))
    assert matched.tolist() == [0, 12]
    _, matched = cache.match_prefix(tokens, jnp.array([0, 12], jnp.int32))
    assert matched.tolist() == [0, 8]


def test_one_token_differs_one_page_earlier():
    """Equality is of the ids: a prompt differing in its fifth token matches one page only."""
    cache = make(16, 4, 2, 4)
    tokens = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    n = jnp.array([16, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    _, matched = cache.match_prefix(tokens.at[1, 4].set(99), jnp.array([0, 16], jnp.int32))
    assert matched.tolist() == [0, 4]


def test_same_page_under_another_parent_is_not_shared():
    """Page 2's ids equal, page 1's not: the chain stops at page 1 (no hash-only sharing)."""
    cache = make(16, 2, 2, 4)
    a = jnp.array([[1, 2, 3, 4, 5, 6, 0, 0], [0] * 8], jnp.int32)
    n = jnp.array([6, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(a, n)
    b = a.at[1].set(jnp.array([1, 2, 9, 9, 5, 6, 7, 0], jnp.int32))
    _, matched = cache.match_prefix(b, jnp.array([0, 7], jnp.int32))
    assert matched.tolist() == [0, 2]


def test_cached_free_pages_count_as_free_and_are_evicted_last():
    cache = make(8, 2, 2, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    n = jnp.array([8, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n).release(jnp.array([True, False]))
    assert int(cache.num_free_pages) == 8
    cache, served = cache.reserve(jnp.array([0, 8], jnp.int32))  # never-cached pages first
    assert bool(served[1])
    assert sorted(cache.page_table[1].tolist()) == [4, 5, 6, 7]
    cache = cache.release(jnp.array([False, True]))
    _, matched = cache.match_prefix(tokens, jnp.array([0, 8], jnp.int32))
    assert matched.tolist() == [0, 6]
    # Now evict: 5 pages needed, 4 never-cached: the deepest cached page (page 3) goes.
    cache, _ = cache.reserve(jnp.array([0, 8], jnp.int32))
    cache2, _ = cache.reserve(jnp.array([2, 0], jnp.int32))
    assert cache2.page_table[0, 0] == 3
    assert cache2.prefix_cache.depth.tolist()[:4] == [0, 1, 2, -1]


def test_evicting_a_page_unindexes_the_pages_below_it():
    cache = make(8, 2, 2, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    n = jnp.array([8, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    # copy_pages into page 1 (depth 1) takes pages 1, 2, 3 out; page 0 stays findable
    skipped = cache.copy_pages(jnp.array([-1, 1, 9], jnp.int32), jnp.array([1, 1, 2], jnp.int32))
    assert skipped.prefix_cache.depth.tolist()[:4] == [0, 1, 2, 3]  # no pair copied: none out
    cache = cache.copy_pages(jnp.array([5], jnp.int32), jnp.array([1], jnp.int32))
    assert cache.prefix_cache.depth.tolist()[:4] == [0, -1, -1, -1]
    _, matched = cache.release(jnp.array([True, False])).match_prefix(
        tokens, jnp.array([0, 8], jnp.int32))
    assert matched.tolist() == [0, 2]


@pytest.mark.long
def test_rows_adding_one_chain_together_index_it_once():
    cache = make(16, 2, 3, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    tokens = tokens.at[2, 6:].set(jnp.array([7, 9], jnp.int32))  # row 2 differs in page 3
    n = jnp.array([8, 8, 8], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    depth = np.asarray(cache.prefix_cache.depth)
    table = np.asarray(cache.page_table)
    assert depth[table[0]].tolist() == [0, 1, 2, 3]
    assert (depth[table[1]] == -1).all()  # all duplicates of row 0
    assert depth[table[2]].tolist() == [-1, -1, -1, 3]  # only its own last page
    assert int(cache.prefix_cache.parent[table[2, 3]]) == table[0, 2]
    again = cache.insert_prefix(tokens, n)  # idempotent
    assert np.asarray(again.prefix_cache.depth).tolist() == depth.tolist()


@pytest.mark.long
def test_bad_rows_are_reported_and_change_nothing():
    cache = make(16, 2, 3, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    n = jnp.array([8, 0, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    match = checkify.checkify(PagedKVCache.match_prefix)
    # row 0 is not empty
    err, (out, matched) = match(cache, tokens, jnp.array([8, 8, 0], jnp.int32))
    assert "must be empty" in str(err.get())
    assert matched.tolist() == [0, 6, 0] and out.lengths.tolist() == [8, 6, 0]
    # negative ids, counts past T
    bad = tokens.at[2, 3].set(-5)
    err, (out, matched) = match(cache, bad, jnp.array([0, 9, 8], jnp.int32))
    assert "num_tokens" in str(err.get())
    assert matched.tolist() == [0, 0, 0]
    err, (out, matched) = match(cache, bad, jnp.array([0, 0, 8], jnp.int32))
    assert "token ids must be >= 0" in str(err.get()) and matched.tolist() == [0, 0, 0]
    assert out.ref_counts.tolist() == cache.ref_counts.tolist()
    err, _ = checkify.checkify(PagedKVCache.insert_prefix)(cache, tokens, jnp.array([9, 0, 0],
                                                                                   jnp.int32))
    assert "num_tokens" in str(err.get())
    err, _ = checkify.checkify(PagedKVCache.insert_prefix)(cache, tokens, jnp.array([0, 4, 0],
                                                                                   jnp.int32))
    assert "past a row's length" in str(err.get())
    # A row committed to 4 tokens asked to index 6: reported, and nothing of it is indexed
    # (not even the 2 full pages it has).
    two = make(16, 2, 3, 4)
    n = jnp.array([0, 4, 0], jnp.int32)
    two, _ = two.reserve(n)
    two = two.commit(n)
    err, out = checkify.checkify(PagedKVCache.insert_prefix)(two, tokens.at[1].add(100),
                                                             jnp.array([0, 6, 0], jnp.int32))
    assert "past a row's length" in str(err.get())
    assert not bool(jnp.any(out.prefix_cache.indexed))


def test_trace_time_errors_name_the_op_and_argument():
    cache = make()
    t, n = jnp.zeros((4, 8), jnp.int32), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="match_prefix: the cache has no prefix index"):
        PagedKVCache.create(1, 4, 2, 1, 8, 4, 2).match_prefix(t, n)
    with pytest.raises(TypeError, match="insert_prefix.*tokens"):
        cache.insert_prefix(t.astype(jnp.float32), n)
    with pytest.raises(ValueError, match=r"match_prefix: tokens must be \[max_batch, T\]"):
        cache.match_prefix(jnp.zeros((3, 8), jnp.int32), n)
    with pytest.raises(ValueError, match="match_prefix.*num_tokens"):
        cache.match_prefix(t, jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="prefix_cache must be a bool"):
        PagedKVCache.create(1, 4, 2, 1, 8, 4, 2, prefix_cache=1)


def test_in_place_under_donation_and_scan():
    cache = make(32, 4, 4, 8, dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 5, (4, 32)), jnp.int32)
    k = random_array((4, 2, 32, 8), jnp.bfloat16)

    def step(c, _):
        c = c.release(jnp.ones((4,), bool))
        c, matched = c.match_prefix(tokens, jnp.full((4,), 32, jnp.int32))
        rest = 32 - matched
        c, served = c.reserve(rest)
        c = c.append(0, k, k, jnp.where(served, rest, 0)).commit(jnp.where(served, rest, 0))
        return c.insert_prefix(tokens, c.lengths), None

    f = jax.jit(lambda c: jax.lax.scan(step, c, length=3)[0], donate_argnums=0)
    hlo = f.lower(cache).compile().as_text()
    assert copies_of(hlo, cache.k_pages) == [], "the pools are copied"
    ptr = cache.k_pages.unsafe_buffer_pointer()
    out = f(cache)
    assert out.k_pages.unsafe_buffer_pointer() == ptr


def test_an_8bit_cache_shares_bytes_and_scales():
    cache = make(16, 4, 2, 4, dtype=jnp.float8_e4m3fn)
    tokens = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    n = jnp.array([16, 0], jnp.int32)
    cache, _ = cache.reserve(n)
    for layer in range(2):
        k, v = random_array((2, 2, 16, 8), jnp.float32), random_array((2, 2, 16, 8), jnp.float32)
        cache = cache.append(layer, k, v, n)
    cache = cache.commit(n).insert_prefix(tokens, n)
    cache, matched = cache.match_prefix(tokens, jnp.array([0, 16], jnp.int32))
    assert matched.tolist() == [0, 12]
    for layer in range(2):
        g = cache.gather(layer, 12)
        assert_bytes_equal(g[1, :, :, :12], g[0, :, :, :12])


@pytest.fixture
def mesh():
    """8 devices: the emulated CPU ones (conftest) where the default backend has fewer, with the
    test's arrays made there too."""
    devices = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")
    with jax.default_device(devices[0]):
        yield jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2,
                            devices=devices[:8])


# A prefix-indexed cache of 4 rows over a (dp=2, tp=4) mesh.
SHARDED_KW = dict(num_layers=1, num_pages=16, page_size=2, num_kv_heads=4, head_dim=8,
                  max_batch=4, max_pages_per_seq=4, dtype=jnp.float32, prefix_cache=True)


def test_sharded_each_batch_shard_has_its_own_index(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    sharded = PagedKVCache.create(**SHARDED_KW, sharding=s)
    assert sharded.prefix_cache.tokens.sharding.spec[0] == "dp"
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (4, 1))
    n = jnp.array([8, 0, 0, 0], jnp.int32)

    @jax.jit
    def run(c):
        c, _ = c.reserve(n)
        c = c.commit(n).insert_prefix(tokens, n)
        return c.match_prefix(tokens, jnp.array([0, 8, 8, 0], jnp.int32))

    out, matched = run(sharded)
    # row 1 shares row 0's batch shard and finds its pages; row 2 is on the other shard
    assert matched.tolist() == [0, 6, 0, 0]
    plain, want = run(PagedKVCache.create(**SHARDED_KW))
    assert want.tolist() == [0, 6, 6, 0]
    hlo = jax.jit(run).lower(sharded).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


# --- namespaces: cached pages shared only within a tenant -----------------------------------------


def prefilled(cache, tokens, n, namespace=None, data=None):
    """Rows of ``n`` tokens reserved, written (``data``: K = V = [B, H, T, D], default random),
    committed and inserted under ``namespace``."""
    b, t = tokens.shape
    k = random_array((b, 2, t, 8), jnp.float32) if data is None else data
    cache, served = _prefilled(cache, tokens, n, namespace, k)
    assert bool(jnp.all(served))
    return cache


match = jax.jit(PagedKVCache.match_prefix)  # one compile per test, not one per jnp op
insert = jax.jit(PagedKVCache.insert_prefix)


@jax.jit
def _prefilled(cache, tokens, n, namespace, k):
    cache, served = cache.reserve(n)
    for layer in range(2):
        cache = cache.append(layer, k, k, n)
    return cache.commit(n).insert_prefix(tokens, n, namespace=namespace), served


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "one namespace"])
def test_another_tenant_sending_the_same_tokens_matches_nothing(namespaces):
    """The side channel, closed: tenant A's prompt is cached; tenant B sends the same tokens
    and matches 0 of them (it computes every token, so its time to first token tells it
    nothing), while A's next request finds them. Without namespaces (all 0) B finds them all."""
    cache = make(16, 4, 3, 4)
    tokens = jnp.tile(jnp.arange(16, dtype=jnp.int32), (3, 1))
    space = jnp.array([1, 2, 1], jnp.int32) if namespaces else None  # tenants A, B, A
    cache = prefilled(cache, tokens, jnp.array([16, 0, 0], jnp.int32), space)
    counts = cache.ref_counts
    out, matched = match(cache, tokens, jnp.array([0, 16, 0], jnp.int32), namespace=space)
    if namespaces:
        assert matched.tolist() == [0, 0, 0]  # B: nothing, its prefill computes all 16 tokens
        assert out.ref_counts.tolist() == counts.tolist()
        assert out.page_table[1].tolist() == [NO_PAGE] * 4
    else:
        assert matched.tolist() == [0, 12, 0]  # every full page but the last token's
    _, matched = match(cache, tokens, jnp.array([0, 0, 16], jnp.int32), namespace=space)
    assert matched.tolist() == [0, 0, 12]  # A finds its own


def test_equal_tokens_under_two_namespaces_are_two_chains():
    """Two tenants prefill one prompt together: each indexes its own pages (one chain each),
    each next request of a tenant maps that tenant's pages, with that tenant's bytes."""
    cache = make(24, 4, 4, 4)
    tokens = jnp.tile(jnp.arange(16, dtype=jnp.int32), (4, 1))
    space = jnp.array([3, 5, 3, 5], jnp.int32)
    data = jnp.broadcast_to(space.astype(jnp.float32)[:, None, None, None], (4, 2, 16, 8))
    n = jnp.array([16, 16, 0, 0], jnp.int32)
    cache = prefilled(cache, tokens, n, space, data)
    ix = cache.prefix_cache
    table = np.asarray(cache.page_table)
    assert np.asarray(ix.depth)[table[0]].tolist() == [0, 1, 2, 3]
    assert np.asarray(ix.depth)[table[1]].tolist() == [0, 1, 2, 3]  # not a duplicate of row 0's
    assert np.asarray(ix.namespace)[table[:2]].tolist() == [[3] * 4, [5] * 4]
    assert int(jnp.sum(ix.indexed)) == 8
    assert page_index.cross_namespace_entries(ix) == 0
    again = insert(cache, tokens, n, namespace=space)  # idempotent per namespace
    assert np.asarray(again.prefix_cache.depth).tolist() == np.asarray(ix.depth).tolist()
    cache, matched = match(cache, tokens, jnp.array([0, 0, 16, 16], jnp.int32),
                                        namespace=space)
    assert matched.tolist() == [0, 0, 12, 12]
    assert cache.page_table[2, :3].tolist() == table[0, :3].tolist()
    assert cache.page_table[3, :3].tolist() == table[1, :3].tolist()
    g = cache.gather(0, 12)
    assert bool(jnp.all(g[2] == 3)) and bool(jnp.all(g[3] == 5))


def test_a_chain_continues_only_in_its_namespace():
    """Tenant B extends a prompt whose first pages only tenant A has cached: B indexes its own
    whole chain (from its first page), never a page under A's."""
    cache = make(24, 2, 3, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    cache = prefilled(cache, tokens, jnp.array([4, 0, 0], jnp.int32),
                      jnp.array([1, 0, 0], jnp.int32))
    space = jnp.array([1, 2, 0], jnp.int32)
    cache = prefilled(cache, tokens, jnp.array([0, 8, 0], jnp.int32), space)
    ix = cache.prefix_cache
    row = np.asarray(cache.page_table[1])
    assert np.asarray(ix.depth)[row].tolist() == [0, 1, 2, 3]
    assert np.asarray(ix.parent)[row].tolist() == [-1, *row[:3]]
    assert np.asarray(ix.namespace)[row].tolist() == [2] * 4
    _, matched = match(cache, tokens, jnp.array([0, 0, 8], jnp.int32),
                                    namespace=jnp.array([0, 0, 1], jnp.int32))
    assert matched.tolist() == [0, 0, 4]  # A: its two pages only


def test_a_negative_namespace_is_reported_and_the_row_changes_nothing():
    cache = make(16, 2, 3, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    n = jnp.array([8, 0, 0], jnp.int32)
    cache = jax.jit(lambda c: c.reserve(n)[0].commit(n))(cache)
    checked = jax.jit(checkify.checkify(PagedKVCache.insert_prefix))
    err, out = checked(cache, tokens, n, jnp.array([-1, 0, 0], jnp.int32))
    assert "namespace must be >= 0" in str(err.get())
    assert not bool(jnp.any(out.prefix_cache.indexed))
    err, cache = checked(cache, tokens, n, jnp.array([0, -3, 0], jnp.int32))
    assert err.get() is None  # row 1 asks nothing: its namespace is not read
    assert int(jnp.sum(cache.prefix_cache.indexed)) == 4
    checked = jax.jit(checkify.checkify(PagedKVCache.match_prefix))
    ask = jnp.array([0, 8, 8], jnp.int32)
    err, (out, matched) = checked(cache, tokens, ask, jnp.array([0, 0, -(2**31)], jnp.int32))
    assert "namespace must be >= 0" in str(err.get())
    assert matched.tolist() == [0, 6, 0]
    assert out.page_table[2].tolist() == [NO_PAGE] * 4 and int(out.lengths[2]) == 0
    err, _ = checked(cache, tokens, ask, jnp.zeros((3,), jnp.int32))
    assert err.get() is None


def test_namespace_errors_at_trace_time_name_the_op_and_argument():
    cache = make()
    t, n = jnp.zeros((4, 8), jnp.int32), jnp.zeros((4,), jnp.int32)
    with pytest.raises(TypeError, match="match_prefix: namespace must be int32"):
        cache.match_prefix(t, n, namespace=n.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"insert_prefix: namespace must have shape \(4,\)"):
        cache.insert_prefix(t, n, namespace=jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="insert_prefix: namespace must be an array"):
        cache.insert_prefix(t, n, namespace=1)


def test_a_fork_into_another_tenant_indexes_none_of_the_sources_pages():
    """Rows forked from tenant A's request hold A's pages: under tenant B their insert indexes
    none of them (a page belongs to one chain), so B's next request finds nothing; under A it
    is the same chain, indexed once."""
    cache = make(24, 2, 4, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (4, 1))
    space = jnp.array([1, 2, 1, 2], jnp.int32)
    cache = prefilled(cache, tokens, jnp.array([7, 0, 0, 0], jnp.int32), space)
    before = np.asarray(cache.prefix_cache.depth)
    cache, forked = jax.jit(PagedKVCache.fork)(cache, 0, jnp.array([1, 2], jnp.int32))
    assert forked.tolist() == [True, True]
    n = jnp.array([0, 7, 7, 0], jnp.int32)
    cache = insert(cache, tokens, n, namespace=space)
    assert np.asarray(cache.prefix_cache.depth).tolist() == before.tolist()
    assert page_index.cross_namespace_entries(cache.prefix_cache) == 0
    _, matched = match(cache, tokens, jnp.array([0, 0, 0, 8], jnp.int32), namespace=space)
    assert matched.tolist() == [0, 0, 0, 0]


def test_eviction_takes_any_tenants_pages_and_their_chains_with_them():
    """The pool is shared: least recently used goes first whatever its namespace, and a
    page's descendants leave with it (in its namespace only: the other chain stays whole)."""
    cache = make(8, 2, 3, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    space = jnp.array([1, 2, 0], jnp.int32)
    cache = prefilled(cache, tokens, jnp.array([8, 0, 0], jnp.int32), space)
    cache = prefilled(cache, tokens, jnp.array([0, 8, 0], jnp.int32), space)
    cache = cache.release(jnp.array([True, True, False]))
    assert int(cache.num_free_pages) == 8 and int(jnp.sum(cache.prefix_cache.indexed)) == 8
    cache, _ = cache.reserve(jnp.array([0, 0, 2], jnp.int32))  # 1 page: tenant 1's deepest
    ix = cache.prefix_cache
    assert sorted(np.asarray(ix.namespace)[np.asarray(ix.indexed)].tolist()) == [1] * 3 + [2] * 4
    cache = cache.release(jnp.array([False, False, True]))
    _, matched = match(cache, tokens, jnp.array([8, 8, 0], jnp.int32), namespace=space)
    assert matched.tolist() == [6, 6, 0]
    cache, _ = cache.reserve(jnp.array([0, 0, 8], jnp.int32))  # 4: tenant 1's chain goes
    ix = cache.prefix_cache
    assert np.asarray(ix.namespace)[np.asarray(ix.indexed)].tolist() == [2] * 4
    assert page_index.cross_namespace_entries(ix) == 0


@pytest.mark.host_tier
def test_spilled_pages_come_back_only_for_their_namespace():
    """Tenant A's chain spilled to the host tier: tenant B's request does not find it there (no
    page comes back for it); A's brings it back, with its bytes."""
    cache = make(8, 2, 3, 4, host_pages=8)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (3, 1))
    space = jnp.array([4, 6, 4], jnp.int32)
    data = jnp.broadcast_to(jnp.arange(8, dtype=jnp.float32)[None, None, :, None], (3, 2, 8, 8))
    cache = prefilled(cache, tokens, jnp.array([8, 0, 0], jnp.int32), space, data)
    cache, spilled = jax.jit(lambda c: c.release(jnp.array([True, False, False])).spill_prefix())(
        cache)
    assert int(spilled) == 4
    host = np.asarray(cache.prefix_cache.namespace)[8:][np.asarray(cache.prefix_cache.indexed)[8:]]
    assert host.tolist() == [4] * 4
    out, matched = match(cache, tokens, jnp.array([0, 8, 0], jnp.int32), space)
    assert matched.tolist() == [0, 0, 0]
    assert int(jnp.sum(out.prefix_cache.indexed[8:])) == 4  # nothing came back
    cache, matched = match(cache, tokens, jnp.array([0, 0, 8], jnp.int32), space)
    assert matched.tolist() == [0, 0, 6]
    ix = cache.prefix_cache
    assert np.asarray(ix.namespace)[np.asarray(cache.page_table[2, :3])].tolist() == [4] * 3
    assert page_index.cross_namespace_entries(ix) == 0
    assert bool(jnp.all(cache.gather(0, 6)[2, :, :, :6] == data[2, None, :, :6]))


def test_sharded_namespaces_each_shard_keeps_the_rule(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    sharded = PagedKVCache.create(**SHARDED_KW, sharding=s)
    assert sharded.prefix_cache.namespace.sharding.spec[0] == "dp"
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (4, 1))
    n = jnp.array([8, 0, 8, 0], jnp.int32)
    space = jnp.array([1, 2, 1, 1], jnp.int32)

    @jax.jit
    def run(c):
        c, _ = c.reserve(n)
        c = c.commit(n).insert_prefix(tokens, n, namespace=space)
        return c.match_prefix(tokens, jnp.array([0, 8, 0, 8], jnp.int32), namespace=space)

    out, matched = run(sharded)
    # row 1 (tenant 2) shares row 0's shard but not its tenant; row 3 shares row 2's
    assert matched.tolist() == [0, 0, 0, 6]
    assert page_index.cross_namespace_entries(out.prefix_cache, shards=2) == 0
    hlo = jax.jit(run).lower(sharded).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_the_audit_counts_entries_whose_chain_crosses_namespaces():
    """``cross_namespace_entries`` is an audit independent of the index's code: an index with a
    chain edited to cross namespaces (or hanging under an unindexed parent) counts every entry
    below the bad edge."""
    cache = make(16, 2, 2, 4)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    cache = prefilled(cache, tokens, jnp.array([8, 0], jnp.int32))
    ix = cache.prefix_cache
    row = np.asarray(cache.page_table[0])
    assert page_index.cross_namespace_entries(ix) == 0
    crossed = dataclasses.replace(ix, namespace=ix.namespace.at[row[1]].set(7))
    assert page_index.cross_namespace_entries(crossed) == 3  # pages 1, 2, 3 of the chain
    orphan = dataclasses.replace(ix, depth=ix.depth.at[row[2]].set(-1))
    assert page_index.cross_namespace_entries(orphan) == 1  # page 3 under an unindexed page


def test_namespaced_match_and_insert_stay_in_place_under_donation_and_scan():
    cache = make(32, 4, 4, 8, dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 5, (4, 32)), jnp.int32)
    space = {"namespace": jnp.array([0, 1, 0, 1], jnp.int32)}
    k = random_array((4, 2, 32, 8), jnp.bfloat16)

    def step(c, _):
        c = c.release(jnp.ones((4,), bool))
        c, matched = c.match_prefix(tokens, jnp.full((4,), 32, jnp.int32), **space)
        rest = 32 - matched
        c, served = c.reserve(rest)
        c = c.append(0, k, k, jnp.where(served, rest, 0)).commit(jnp.where(served, rest, 0))
        return c.insert_prefix(tokens, c.lengths, **space), None

    f = jax.jit(lambda c: jax.lax.scan(step, c, length=3)[0], donate_argnums=0)
    hlo = f.lower(cache).compile().as_text()
    assert copies_of(hlo, cache.k_pages) == [], "the pools are copied"
    out = f(cache)
    assert page_index.cross_namespace_entries(out.prefix_cache) == 0
