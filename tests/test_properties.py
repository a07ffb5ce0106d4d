"""Property tests: every public op against its reference over drawn mappings, lengths, page tables
and indices, hostile values included (INT32 extremes, negatives, duplicates, sentinels, zero-size
dims). Every hostile input is refused at trace time or reported through checkify, never a silent
change: bytes an op does not name are equal before and after.

Hypothesis runs derandomized with bounded examples (CI time). Shapes come from a few fixed choices
and each op is one jitted, checkified function, so most examples reuse a compiled executable;
tensor contents are fresh random bytes (helpers.random_array), drawn indices decide the case.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jaxkv

from helpers import DTYPES, as_bytes, assert_bytes_equal, random_array, ref

pytestmark = pytest.mark.long  # property sweeps (hypothesis): `pytest -m long`

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
HOSTILE = [INT32_MIN, INT32_MIN + 1, -(2**30), -2, -1, INT32_MAX - 1, INT32_MAX]


def examples(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def ints(lo, hi):
    """Mostly in [lo, hi], sometimes a hostile int32."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.sampled_from(HOSTILE))


def int_array(n, lo, hi):
    return st.lists(ints(lo, hi), min_size=n, max_size=n).map(lambda x: np.asarray(x, np.int32))


_compiled = {}


def checked(key, fn):
    """``fn`` under jit and checkify, made once per ``key`` (a new function object per example
    would compile anew every time): a function returning (message or None, result)."""
    if key not in _compiled:
        run = jax.jit(checkify.checkify(fn))

        def call(*args):
            err, out = run(*args)
            return err.get(), out

        _compiled[key] = call
    return _compiled[key]


def same_bytes(a, b) -> np.ndarray:
    """bool per element: bytes equal."""
    return np.all(as_bytes(a) == as_bytes(b), axis=-1)


dtypes = st.sampled_from(DTYPES)


# --- compaction ---------------------------------------------------------------------------


def has_duplicate_target(mapping, rows):
    valid = mapping[(mapping >= 0) & (mapping < rows)]
    return len(np.unique(valid)) != len(valid)


@examples(30)
@given(data=st.data(), rows=st.sampled_from([1, 5]), dtype=dtypes)
def test_compact_tensor_batch(data, rows, dtype):
    n = data.draw(st.integers(0, rows))
    mapping = data.draw(int_array(n, -1, rows))
    x = random_array((rows, 3), dtype)
    msg, out = checked("compact_tensor_batch", jaxkv.compact_tensor_batch)(x, jnp.asarray(mapping))
    duplicate = has_duplicate_target(mapping, rows)
    out_of_range = bool(np.any((mapping < -1) | (mapping >= rows)))
    assert (msg is not None) == (duplicate or out_of_range), (mapping, msg)
    targets = {int(t) for t in mapping if 0 <= t < rows}
    untouched = [r for r in range(rows) if r not in targets]
    assert_bytes_equal(np.asarray(out)[untouched], np.asarray(x)[untouched], "rows not named")
    if not duplicate:
        assert_bytes_equal(out, ref.compact_tensor_batch(x, jnp.asarray(mapping)), "x")


@examples(25)
@given(data=st.data(), dtype=dtypes, d=st.sampled_from([1, 8]))
def test_compact_kv_cache(data, dtype, d):
    rows, s = 4, 6
    mapping = data.draw(int_array(rows, -1, rows))
    lengths = data.draw(int_array(rows, 0, s))
    layers = [random_array((rows, 2, 2, s, d), dtype), random_array((rows, 2, 1, 3, 2 * d), dtype)]
    msg, (out, new_lengths) = checked("compact_kv_cache", jaxkv.compact_kv_cache)(
        layers, jnp.asarray(lengths), jnp.asarray(mapping))
    bad = np.any((lengths < 0) | (lengths > s)) or np.any((mapping < -1) | (mapping >= rows))
    duplicate = has_duplicate_target(mapping, rows)
    assert (msg is not None) == (duplicate or bad), (mapping, lengths, msg)
    if duplicate:
        return
    np.testing.assert_array_equal(new_lengths, ref.compact_lengths(jnp.asarray(lengths),
                                                                   jnp.asarray(mapping)))
    want, _ = ref.compact_kv_cache(layers, jnp.asarray(lengths), jnp.asarray(mapping))
    for layer, got, exp in zip(layers, out, want):
        cap = layer.shape[3]
        for r in range(rows):
            sources = [i for i in range(rows) if mapping[i] == r]
            if not sources:  # not written
                assert_bytes_equal(got[r], layer[r], f"row {r} not named")
            else:  # live tokens moved
                live = int(np.clip(lengths[sources[0]], 0, cap))
                assert_bytes_equal(got[r, :, :, :live], exp[r, :, :, :live], f"row {r}")


@examples(30)
@given(lengths=int_array(3, 0, 50), inc=st.one_of(int_array(3, -5, 50), ints(-5, 50)))
def test_increment_lengths(lengths, inc):
    if isinstance(inc, np.ndarray):
        fn = checked("increment_lengths", jaxkv.increment_lengths)
        msg, out = fn(jnp.asarray(lengths), jnp.asarray(inc))
    else:  # a Python int is static: one compile per value
        fn = checked(("increment_lengths", int(inc)), lambda x: jaxkv.increment_lengths(x, int(inc)))
        msg, out = fn(jnp.asarray(lengths))
    exact = lengths.astype(np.int64) + np.asarray(inc, np.int64)
    wraps = np.any((exact > INT32_MAX) | (exact < INT32_MIN))
    assert (msg is not None) == wraps
    np.testing.assert_array_equal(out, exact.astype(np.int32))  # two's complement, like XLA


# --- prompt reuse -----------------------------------------------------------------------------


@examples(20)
@given(idx=ints(0, 3), seq_len=st.sampled_from([0, 2, 5]), dtype=dtypes)
def test_save_kv_cache(idx, seq_len, dtype):
    layers = [random_array((3, 2, 2, 5, 4), dtype), random_array((3, 2, 1, 6, 3), dtype)]
    save = checked(("save", seq_len), lambda x, i: jaxkv.save_kv_cache(x, i, seq_len))
    msg, out = save(layers, jnp.asarray(idx, jnp.int32))
    assert (msg is not None) == (not 0 <= idx < 3)
    for got, want in zip(out, ref.save_kv_cache(layers, jnp.asarray(idx, jnp.int32), seq_len)):
        assert_bytes_equal(got, want, "saved")


@examples(25)
@given(data=st.data(), dtype=dtypes, n=st.sampled_from([0, 1, 4]))
def test_instantiate_kv_cache(data, dtype, n):
    rows = 4
    slots = data.draw(int_array(n, 0, rows))  # duplicates and hostile rows included
    layers = [random_array((rows, 2, 2, 5, 4), dtype), random_array((rows, 2, 1, 3, 2), dtype)]
    saved = [random_array((2, 2, 3, 4), dtype), random_array((2, 1, 3, 2), dtype)]
    msg, out = checked("instantiate", jaxkv.instantiate_kv_cache)(layers, saved, jnp.asarray(slots))
    assert (msg is not None) == bool(np.any((slots < 0) | (slots >= rows)))
    for got, want, before in zip(out, ref.instantiate_kv_cache(layers, saved, jnp.asarray(slots)),
                                 layers):
        assert_bytes_equal(got, want, "layers")
        named = [r for r in range(rows) if r in set(slots.tolist())]
        others = [r for r in range(rows) if r not in named]
        assert_bytes_equal(np.asarray(got)[others], np.asarray(before)[others], "rows not named")


# --- paged ------------------------------------------------------------------------------------

LAYERS, HEADS, PAGES, SIZE, D = 2, 2, 6, 2, 4


def pool_shape(layout, pages=PAGES, size=SIZE):
    return (LAYERS, HEADS, pages, size, D) if layout == "HND" else (LAYERS, pages, size, HEADS, D)


def table_entries(batch, max_pages, pages=PAGES):
    """A page table whose valid entries are distinct (no two tokens write one slot), with
    sentinels and garbage (out-of-pool and hostile entries) mixed in."""

    @st.composite
    def draw(draw):
        perm = draw(st.permutations(range(pages)))
        table = np.full((batch, max_pages), -1, np.int32)
        k = 0
        for b in range(batch):
            for j in range(max_pages):
                kind = draw(st.sampled_from(["page", "page", "page", "none", "garbage"]))
                if kind == "page" and k < pages:
                    table[b, j] = perm[k]
                    k += 1
                elif kind == "garbage":
                    table[b, j] = draw(st.sampled_from([pages, pages + 3, -5] + HOSTILE))
        return table

    return draw()


def np_skipped(table, lengths, counts, tokens, pages, size):
    """Tokens the kernel must skip (t < count), from the contract, in numpy int64."""
    skipped = np.zeros((table.shape[0], tokens), bool)
    for b in range(table.shape[0]):
        for t in range(min(max(int(counts[b]), 0), tokens)):
            pos = int(lengths[b]) + t
            ok = 0 <= pos < table.shape[1] * size and 0 <= table[b, pos // size] < pages
            skipped[b, t] = not ok
    return skipped


@examples(30)
@given(data=st.data(), layout=st.sampled_from(["HND", "NHD"]), dtype=dtypes,
       tokens=st.sampled_from([1, 3]), layer=ints(0, LAYERS - 1), ragged=st.booleans())
def test_paged_append(data, layout, dtype, tokens, layer, ragged):
    batch, max_pages = 3, 3
    table = data.draw(table_entries(batch, max_pages))
    lengths = data.draw(int_array(batch, 0, max_pages * SIZE))
    counts = data.draw(int_array(batch, 0, tokens)) if ragged else None
    kp, vp = (random_array(pool_shape(layout), dtype) for _ in range(2))
    k, v = (random_array((batch, HEADS, tokens, D), dtype) for _ in range(2))
    args = (kp, vp, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(layer, jnp.int32), k, v,
            None if counts is None else jnp.asarray(counts))
    append = checked(("paged_append", layout), functools.partial(jaxkv.paged_append, layout=layout))
    msg, out = append(*args)
    want = ref.paged_append(*args, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")
    n = np.full(batch, tokens) if counts is None else counts
    skipped = np_skipped(table, lengths, n, tokens, PAGES, SIZE)
    layer_bad = not 0 <= layer < LAYERS
    counts_bad = bool(np.any((n < 0) | (n > tokens)))  # written as clipped to [0, T]
    wrote = not (np.array_equal(as_bytes(out[0]), as_bytes(kp)))
    assert (msg is not None) == (bool(skipped.any()) or layer_bad or counts_bad), (
        table, lengths, n, msg)
    # Nothing skipped and something to write: it was written (no silent drop).
    if not skipped.any() and not layer_bad and np.any(np.minimum(n, tokens) > 0):
        assert wrote


@examples(25)
@given(data=st.data(), layout=st.sampled_from(["HND", "NHD"]), dtype=dtypes, layer=ints(0, 1),
       max_len=st.sampled_from([1, 7]))
def test_paged_gather(data, layout, dtype, layer, max_len):
    batch, max_pages = 3, 3
    table = data.draw(table_entries(batch, max_pages))
    lengths = data.draw(int_array(batch, 0, max_pages * SIZE))
    kp, vp = (random_array(pool_shape(layout), dtype) for _ in range(2))
    args = (kp, vp, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(layer, jnp.int32))
    gather = checked(("paged_gather", layout, max_len),
                     functools.partial(jaxkv.paged_gather, max_len=max_len, layout=layout))
    msg, out = gather(*args)
    assert_bytes_equal(out, ref.paged_gather(*args, max_len, layout), "gathered")
    assert (msg is not None) == (not 0 <= layer < LAYERS)


@examples(25)
@given(data=st.data(), layout=st.sampled_from(["HND", "NHD"]), dtype=dtypes,
       n=st.sampled_from([0, 1, 3]))
def test_copy_pages(data, layout, dtype, n):
    src = data.draw(int_array(n, 0, PAGES - 1))
    dst = data.draw(int_array(n, 0, PAGES - 1))
    kp, vp = (random_array(pool_shape(layout), dtype) for _ in range(2))
    copy = checked(("copy_pages", layout), functools.partial(jaxkv.copy_pages, layout=layout))
    msg, out = copy(kp, vp, jnp.asarray(src), jnp.asarray(dst))
    valid = (src >= 0) & (src < PAGES) & (dst >= 0) & (dst < PAGES) & (src != dst)
    d, s = dst[valid], src[valid]
    clash = len(np.unique(d)) != len(d) or bool(np.isin(d, s).any())
    assert (msg is not None) == clash, (src, dst, msg)
    page_axis = 2 if layout == "HND" else 1
    untouched = [p for p in range(PAGES) if p not in set(d.tolist())]
    for got, before in zip(out, (kp, vp)):
        assert_bytes_equal(np.take(np.asarray(got), untouched, page_axis),
                           np.take(np.asarray(before), untouched, page_axis), "pages not named")
    if not clash:
        want = ref.copy_pages(kp, vp, jnp.asarray(src), jnp.asarray(dst), layout)
        assert_bytes_equal(out[0], want[0], "k_pages")
        assert_bytes_equal(out[1], want[1], "v_pages")


# --- the linear caches: lifecycle arithmetic ------------------------------------------------


def linear_model(lengths, active, inc, cap):
    """The commit contract in int64: active rows advance by inc clipped to [0, cap - length]."""
    out = lengths.astype(np.int64).copy()
    bad = False
    for b in range(len(lengths)):
        if b < active:
            room = cap - lengths[b]
            bad |= inc[b] < 0 or inc[b] > room
            out[b] = lengths[b] + min(max(inc[b], 0), room)
    return out, bad


@examples(50)
@given(data=st.data(), kind=st.sampled_from(["linear", "manager"]))
def test_cache_reset_and_commit(data, kind):
    batch, cap = 4, 9
    if kind == "linear":
        cache = jaxkv.LinearKVCache.create(1, batch, 1, cap, 2, jnp.float32)
    else:
        cache = jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(1, 2)], batch, cap, jnp.float32)
    n = data.draw(st.integers(0, batch))
    reuse = data.draw(int_array(n, 0, cap))
    inc = data.draw(int_array(batch, -2, cap))
    msg, cache = checked(("reset", kind, n), lambda c, r: c.reset(r))(cache, jnp.asarray(reuse))
    assert (msg is not None) == bool(np.any((reuse < 0) | (reuse > cap)))
    start = np.zeros(batch, np.int64)
    start[:n] = np.clip(reuse, 0, cap)
    np.testing.assert_array_equal(cache.lengths, start)
    msg, out = checked(("commit", kind), lambda c, i: c.commit(i))(cache, jnp.asarray(inc))
    want, bad = linear_model(start, n, inc.astype(np.int64), cap)
    np.testing.assert_array_equal(out.lengths, want)
    assert (msg is not None) == bad
    assert np.all((np.asarray(out.lengths) >= 0) & (np.asarray(out.lengths) <= cap))


@examples(25)
@given(data=st.data(), dtype=dtypes, tokens=st.sampled_from([1, 4]), layer=ints(0, 1))
def test_linear_append(data, dtype, tokens, layer):
    batch, cap = 3, 6
    cache = jaxkv.LinearKVCache.create(2, batch, 2, cap, 4, dtype)
    cache = jaxkv.LinearKVCache(buffer=random_array(cache.buffer.shape, dtype),
                                lengths=jnp.asarray(data.draw(int_array(batch, 0, cap))),
                                active_batch_size=jnp.asarray(data.draw(ints(0, batch)), jnp.int32))
    counts = data.draw(int_array(batch, 0, tokens))
    k, v = (random_array((batch, 2, tokens, 4), dtype) for _ in range(2))
    append = checked("linear.append", lambda c, i, k, v, n: c.append(i, k, v, n))
    msg, out = append(cache, jnp.asarray(layer, jnp.int32), k, v, jnp.asarray(counts))
    lengths, active = np.asarray(cache.lengths), int(cache.active_batch_size)
    layer_ok = 0 <= layer < 2
    want = np.asarray(cache.buffer).copy()
    if layer_ok:
        want[layer] = ref.append_layer(cache.buffer[layer], k, v, cache.lengths,
                                       cache.active_batch_size, jnp.asarray(counts))
    assert_bytes_equal(out.buffer, want, "buffer")
    n = [min(max(int(c), 0), tokens) for c in counts]
    dropped = any(not 0 <= int(lengths[b]) <= cap - n[b]
                  for b in range(batch) if b < active and n[b] > 0)
    counts_bad = any(not 0 <= int(c) <= tokens for c in counts)  # written as clipped to [0, T]
    assert (msg is not None) == (dropped or not layer_ok or counts_bad), (lengths, counts, active,
                                                                          msg)


# --- shapes vary (a few examples: each is a new compile) ----------------------------------------


@examples(3)
@given(rows=st.integers(0, 3), heads=st.integers(0, 2), d=st.integers(0, 3),
       pages=st.integers(0, 3), size=st.integers(0, 3), max_pages=st.integers(0, 2),
       dtype=dtypes)
def test_zero_size_dims_never_fail(rows, heads, d, pages, size, max_pages, dtype):
    kp = random_array((1, heads, pages, size, d), dtype)
    table = jnp.zeros((rows, max_pages), jnp.int32)
    lengths = jnp.zeros((rows,), jnp.int32)
    k = random_array((rows, heads, 2, d), dtype)
    out = jaxkv.paged_append(kp, kp, table, lengths, 0, k, k)
    want = jax.jit(ref.paged_append)(kp, kp, table, lengths, 0, k, k)
    assert_bytes_equal(out[0], want[0], "k_pages")
    got = jaxkv.paged_gather(kp, kp, table, lengths, 0, 2)
    want = jax.jit(ref.paged_gather, static_argnums=5)(kp, kp, table, lengths, 0, 2)
    assert_bytes_equal(got, want, "gathered")
    if rows:
        x = random_array((rows, heads, d), dtype)
        mapping = jnp.arange(rows, dtype=jnp.int32)[::-1]
        assert_bytes_equal(jaxkv.compact_tensor_batch(x, mapping),
                           ref.compact_tensor_batch(x, mapping), "x")
        layer = random_array((rows, 2, heads, size, d), dtype)
        saved = jaxkv.save_kv_cache(layer, 0, size)
        assert_bytes_equal(saved, ref.save_kv_cache(layer, jnp.int32(0), size), "saved")
        slots = jnp.arange(rows, dtype=jnp.int32)
        out = jaxkv.instantiate_kv_cache(layer, saved, slots)
        assert_bytes_equal(out, jax.jit(ref.instantiate_kv_cache)(layer, saved, slots), "inst.")


@pytest.mark.parametrize("bad", [jnp.float32, jnp.int64 if jax.config.x64_enabled else jnp.int16])
def test_index_arrays_of_another_dtype_are_refused(bad):
    x = jnp.zeros((2, 3), jnp.float32)
    with pytest.raises(TypeError, match="compact_tensor_batch: batch_mapping must be int32"):
        jaxkv.compact_tensor_batch(x, jnp.zeros((2,), bad))


# --- the prefix cache's namespaces ----------------------------------------------------------------
# A paged cache with a prefix index and a host tier, under random sequences of requests (match,
# reserve, append, commit, insert: one jitted step), releases, pool pressure, spills, forks and
# copies, each request in one of several namespaces (sometimes a hostile one). Every token a
# request writes is a function of its namespace, its id and its position, so reading back a
# row's tokens shows whose pages it holds.

NS_PAGES, NS_HOST, NS_SIZE, NS_ROWS, NS_MAX = 8, 4, 2, 3, 4
NS_T = NS_SIZE * NS_MAX
# three prompts over two ids: the first two share their first two pages
NS_PROMPTS = np.array([[0, 1, 0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 1, 1, 0, 0],
                       [1, 1, 0, 0, 1, 0, 1, 1]], np.int32)


def ns_value(space, token, position):
    """What a request of namespace ``space`` writes for ``token`` at ``position`` (K; V is this
    + 0.5): distinct for every (namespace, token, position) drawn."""
    return (np.maximum(space, -1) * 100 + token * 10 + position).astype(np.float32)


def _ns_request(cache, tokens, n, space):
    cache = cache.release(n > 0)  # a row asking ends what it held: a new request in its place
    cache, matched = cache.match_prefix(tokens, n, space)
    rest = jnp.maximum(n - matched, 0)
    cache, served = cache.reserve(rest)
    rest = jnp.where(served, rest, 0)
    pos = matched[:, None] + jnp.arange(NS_T, dtype=jnp.int32)[None, :]
    tok = jnp.take_along_axis(tokens, jnp.clip(pos, 0, NS_T - 1), axis=1)
    val = (jnp.maximum(space, -1)[:, None] * 100 + tok * 10 + pos).astype(jnp.float32)
    k = jnp.broadcast_to(val[:, None, :, None], (NS_ROWS, 1, NS_T, 2))
    cache = cache.append(0, k, k + 0.5, rest).commit(rest)
    cache = cache.insert_prefix(tokens, jnp.where(n > 0, cache.lengths, 0), space)
    return cache, matched


def _ns_pressure(cache, n):
    cache, served = cache.reserve(n)
    n = jnp.where(served, n, 0)
    junk = jnp.full((NS_ROWS, 1, NS_T, 2), -7.0, jnp.float32)
    return cache.append(0, junk, junk, n).commit(n)


def _ns_fork(cache, src, dst, tokens, space):
    cache, forked = cache.fork(src, dst[None])
    n = jnp.zeros((NS_ROWS,), jnp.int32).at[dst].set(jnp.where(forked[0], cache.lengths[dst], 0))
    return cache.insert_prefix(tokens, n, space), forked


def _rows_of(strategy):
    return st.lists(strategy, min_size=NS_ROWS, max_size=NS_ROWS)


_NS_OPS = {
    "request": st.tuples(
        st.just("request"), _rows_of(st.sampled_from([True, True, False])),
        _rows_of(st.sampled_from([0, 0, 1, 1, 2, 2, -1, INT32_MIN])), _rows_of(st.integers(0, 2)),
        _rows_of(st.sampled_from([NS_T, NS_T, NS_T - 1, 5, 3, 1]))),
    "release": st.tuples(st.just("release"), _rows_of(st.booleans())),
    "pressure": st.tuples(st.just("pressure"), st.integers(0, NS_ROWS - 1), st.integers(1, NS_T)),
    "spill": st.tuples(st.just("spill"), st.integers(1, NS_HOST)),
    "fork": st.tuples(st.just("fork"), st.integers(0, NS_ROWS - 1), st.integers(0, NS_ROWS - 1)),
    "copy": st.tuples(st.just("copy"), st.integers(0, NS_PAGES - 1),
                      st.integers(0, NS_PAGES - 1)),
}
# requests most often (each ends its row's request before: the index fills, pages go free and
# stay cached), then the rest: releases, pool pressure evicting cached pages, spills to the host
# (found there by later requests), forks and copies onto free pages
ns_ops = st.lists(st.sampled_from(["request"] * 5 + ["release", "pressure", "spill", "spill",
                                                     "fork", "copy"]).flatmap(_NS_OPS.get),
                  min_size=10, max_size=18)


@examples(24)
@given(ops=ns_ops)
def test_prefix_namespaces_never_share_a_page(ops):
    """After every step: no page is found by a row of another namespace (the data each row
    reads back is its own namespace's, and every page a match mapped is of the row's
    namespace), reference counts equal the table entries naming each page, the index's chains
    are whole and each of one namespace, and a hostile namespace is reported (checkify) while
    its row matches and indexes nothing."""
    cache = jaxkv.PagedKVCache.create(
        num_layers=1, num_pages=NS_PAGES, page_size=NS_SIZE, num_kv_heads=1, head_dim=2,
        max_batch=NS_ROWS, max_pages_per_seq=NS_MAX, dtype=jnp.float32, prefix_cache=True,
        host_pages=NS_HOST)
    kind = [None] * NS_ROWS  # "request", "pressure" or None (empty)
    space = np.zeros(NS_ROWS, np.int32)
    tokens = np.zeros((NS_ROWS, NS_T), np.int32)
    for op in ops:
        empty = (np.asarray(cache.lengths) == 0) & (np.asarray(cache.pages_held) == 0)
        msg = None
        if op[0] == "request":
            _, ask, spaces, prompts, counts = op
            n = np.where(ask, counts, 0).astype(np.int32)
            space = np.where(n > 0, spaces, space).astype(np.int32)
            tokens = np.where((n > 0)[:, None], NS_PROMPTS[prompts], tokens)
            msg, (cache, matched) = checked("ns_request", _ns_request)(
                cache, jnp.asarray(tokens), jnp.asarray(n), jnp.asarray(space))
            hostile = bool(np.any((n > 0) & (space < 0)))
            assert (msg is not None and "namespace must be >= 0" in msg) == hostile, msg
            matched = np.asarray(matched)
            assert np.all(matched[space < 0] == 0)
            ix = cache.prefix_cache
            for b in np.flatnonzero(matched):  # the pages a match mapped: the row's namespace
                pages = np.asarray(cache.page_table[b, :matched[b] // NS_SIZE])
                assert np.all(np.asarray(ix.namespace)[pages] == space[b]), (b, pages)
            for b in np.flatnonzero(n):  # (its old request ended)
                kind[b] = "request" if int(cache.lengths[b]) else None
        elif op[0] == "release":
            mask = np.asarray(op[1])
            cache = checked("ns_release", jaxkv.PagedKVCache.release)(cache, jnp.asarray(mask))[1]
            kind = [None if m else k for m, k in zip(mask, kind)]
        elif op[0] == "pressure":
            _, b, count = op
            if not empty[b]:
                continue
            n = np.zeros(NS_ROWS, np.int32)
            n[b] = count
            cache = checked("ns_pressure", _ns_pressure)(cache, jnp.asarray(n))[1]
            kind[b] = "pressure" if int(cache.lengths[b]) else None
        elif op[0] == "spill":
            msg, (cache, _) = checked("ns_spill", lambda c, k: c.spill_prefix(NS_HOST, k))(
                cache, jnp.int32(op[1]))
            assert msg is None, msg
        elif op[0] == "fork":
            _, src, dst = op
            if kind[src] != "request" or dst == src:
                continue
            space[dst], tokens[dst] = space[src], tokens[src]  # a fork stays with its tenant
            msg, (cache, forked) = checked("ns_fork", _ns_fork)(
                cache, jnp.int32(src), jnp.int32(dst), jnp.asarray(tokens), jnp.asarray(space))
            assert (msg is not None and "namespace must be >= 0" in msg) == (
                bool(forked[0]) and space[dst] < 0 and int(cache.lengths[dst]) > 0), msg
            kind[dst] = "request" if bool(forked[0]) else None
        else:  # copy a page onto a free one (cached or not): it leaves the index
            _, src, pick = op
            free = np.flatnonzero(np.asarray(cache.ref_counts) == 0)
            if not len(free) or free[pick % len(free)] == src:
                continue
            pair = jnp.array([src], jnp.int32), jnp.array([free[pick % len(free)]], jnp.int32)
            msg, cache = checked("ns_copy", jaxkv.PagedKVCache.copy_pages)(cache, *pair)
            assert msg is None, msg
        # Reference counts equal the table entries naming each page (device and host pools).
        table = np.asarray(cache.page_table)
        named = np.bincount(table[table >= 0], minlength=NS_PAGES)
        np.testing.assert_array_equal(np.asarray(cache.ref_counts), named)
        assert not np.any(np.asarray(cache.host.ref_counts))
        # The index: every chain whole and of one namespace.
        assert jaxkv.page_index.cross_namespace_entries(cache.prefix_cache) == 0
        # The data each request's row reads back: its own namespace's, for its own tokens.
        got = np.asarray(checked("ns_gather", lambda c: c.gather(0, NS_T))(cache)[1])
        lengths = np.asarray(cache.lengths)
        for b in range(NS_ROWS):
            if kind[b] != "request":
                continue
            pos = np.arange(lengths[b])
            want = ns_value(space[b], tokens[b, :lengths[b]], pos)
            np.testing.assert_array_equal(got[b, 0, 0, :lengths[b], 0], want, f"row {b} K")
            np.testing.assert_array_equal(got[b, 1, 0, :lengths[b], 1], want + 0.5, f"row {b} V")
