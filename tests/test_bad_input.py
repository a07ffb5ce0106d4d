"""Bad input at its edges: lengths near int32, page-table entries outside the pool, empty
batches, and the decisions on the ambiguous cases; and the handler errors: every error a handler can return is refused at trace
time by the Python validation first, so no op fails at run time after its input was donated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv

from helpers import assert_bytes_equal, random_array, ref

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
F32 = jnp.float32


def checked(fn, *args):
    """(error message or None, result) of ``fn`` under jit and checkify."""
    err, out = jax.jit(checkify.checkify(fn))(*args)
    return err.get(), out


# --- 1, 2: commit arithmetic saturates and reports -------------------------------------------


def linear_cache(max_seq_len=16):
    return jaxkv.LinearKVCache.create(1, 2, 1, max_seq_len, 4, F32)


def manager_cache(max_seq_len=16):
    return jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(1, 4)], 2, max_seq_len, F32)


@pytest.mark.parametrize("make", [linear_cache, manager_cache], ids=["linear", "manager"])
def test_commit_saturates_instead_of_wrapping(make):
    cache = make().reset(jnp.asarray([5, 3], jnp.int32))
    # Added naively in int32, the lengths would wrap negative, unreported.
    msg, out = checked(lambda c: c.commit(INT32_MAX), cache)
    np.testing.assert_array_equal(out.lengths, [16, 16])
    assert "passes the capacity" in msg
    msg, out = checked(lambda c, n: c.commit(n), cache, jnp.asarray([INT32_MAX, 2], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [16, 5])
    assert msg is not None


@pytest.mark.parametrize("make", [linear_cache, manager_cache], ids=["linear", "manager"])
def test_a_negative_commit_is_reported_and_ignored(make):
    cache = make().reset(jnp.asarray([5, 3], jnp.int32))
    for inc in (-1, INT32_MIN):
        msg, out = checked(lambda c: c.commit(inc), cache)
        np.testing.assert_array_equal(out.lengths, [5, 3])
        assert "negative" in msg
    msg, out = checked(lambda c, n: c.commit(n), cache, jnp.asarray([-4, 2], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [5, 5])  # the other row still advances
    assert msg is not None


def test_commit_refuses_a_python_int_past_int32():
    with pytest.raises(ValueError, match="LinearKVCache.commit: new_lengths"):
        linear_cache().commit(2**31)


def test_reset_clips_reuse_lengths_into_the_capacity():
    msg, out = checked(lambda c, r: c.reset(r), linear_cache(), jnp.asarray([-3, 99], jnp.int32))
    np.testing.assert_array_equal(out.lengths, [0, 16])
    assert "reuse_lengths outside" in msg


def paged_with_lengths_3_1():
    """Page size 2, lengths [3, 1] holding 2 and 1 pages (the issue's case)."""
    cache = jaxkv.PagedKVCache.create(1, 8, 2, 1, 4, 2, 4, F32)
    n = jnp.asarray([3, 1], jnp.int32)
    cache, served = cache.reserve(n)
    assert bool(jnp.all(served))
    return cache.commit(n)


def test_paged_commit_saturates_instead_of_wrapping():
    cache = paged_with_lengths_3_1()
    np.testing.assert_array_equal(cache.pages_held, [2, 1])
    # Lengths stop at the pages each row holds, and the rest is reported.
    msg, out = checked(lambda c, n: c.commit(n), cache, jnp.full((2,), INT32_MAX, jnp.int32))
    np.testing.assert_array_equal(out.lengths, [4, 2])
    assert "passes the capacity" in msg
    msg, out = checked(lambda c, n: c.commit(n), cache, jnp.full((2,), 1000, jnp.int32))
    np.testing.assert_array_equal(out.lengths, [4, 2])
    assert msg is not None
    msg, out = checked(lambda c: c.commit(INT32_MIN), cache)
    np.testing.assert_array_equal(out.lengths, [3, 1])
    assert msg is not None


def test_linear_append_reports_a_row_whose_length_is_past_int32_room():
    # Found by the property tests: the old check formed lengths + count, which wrapped negative
    # for a length near INT32_MAX and passed; the kernel (64-bit) dropped the token silently.
    cache = jaxkv.LinearKVCache(
        buffer=random_array((1, 2, 2, 1, 4, 2), F32),
        lengths=jnp.asarray([INT32_MAX, 1], jnp.int32), active_batch_size=jnp.asarray(2, jnp.int32))
    k = random_array((2, 1, 1, 2), F32)
    msg, out = checked(lambda c, k: c.append(0, k, k), cache, k)
    assert "past max_seq_len" in msg
    want = ref.append_layer(cache.buffer[0], k, k, cache.lengths, cache.active_batch_size)
    assert_bytes_equal(out.buffer[0], want, "buffer")


@pytest.mark.parametrize("kind", ["linear", "paged"])
def test_append_reports_new_lengths_outside_its_tokens_and_writes_within_them(kind):
    """A count below 0 writes nothing, one past T writes the T tokens there are; both are
    reported (the caller's commit would count tokens never written)."""
    if kind == "linear":
        cache = jaxkv.LinearKVCache.create(1, 2, 1, 8, 2, F32).reset(jnp.asarray([1, 1], jnp.int32))
    else:
        cache = jaxkv.PagedKVCache.create(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1,
                                          head_dim=2, max_batch=2, max_pages_per_seq=2, dtype=F32)
        cache, _ = cache.reserve(jnp.asarray([4, 4], jnp.int32))
    k = random_array((2, 1, 2, 2), F32)
    for n, clipped in (([-1, 2], [0, 2]), ([3, 1], [2, 1])):
        msg, out = checked(lambda c, k, n: c.append(0, k, k, n), cache, k, jnp.asarray(n, jnp.int32))
        assert "new_lengths outside [0, T]" in msg
        want = cache.append(0, k, k, jnp.asarray(clipped, jnp.int32))
        for got, exp in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            assert_bytes_equal(np.asarray(got).reshape(-1), np.asarray(exp).reshape(-1), kind)
    msg, _ = checked(lambda c, k, n: c.append(0, k, k, n), cache, k, jnp.asarray([0, 2], jnp.int32))
    assert msg is None


# --- 3: limits create accepts are limits every method supports -------------------------------


def test_create_refuses_what_compact_cannot_take():
    with pytest.raises(ValueError, match="LinearKVCache.create: num_layers must be in"):
        jaxkv.LinearKVCache.create(257, 1, 1, 1, 1, F32)
    with pytest.raises(ValueError, match="LinearKVCache.create: max_batch must be in"):
        jaxkv.LinearKVCache.create(1, 8193, 1, 1, 1, F32)
    with pytest.raises(ValueError, match="KVCacheManager.create: max_batch must be in"):
        jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(1, 1)], 8193, 1, F32)
    # The limits themselves work.
    jaxkv.LinearKVCache.create(256, 1, 1, 1, 1, F32)
    jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(1, 1)], 8192, 1, F32)


@pytest.mark.parametrize("shape", [(257, 2, 2, 1, 2, 1), (1, 8193, 2, 1, 2, 1)], ids=["layers", "rows"])
def test_an_oversized_cache_is_refused_at_trace_time_and_keeps_its_buffer(shape):
    # A cache built around create (e.g. a pytree from elsewhere) still fails before donation.
    cache = jaxkv.LinearKVCache(
        buffer=jnp.ones(shape, F32), lengths=jnp.ones((shape[1],), jnp.int32),
        active_batch_size=jnp.asarray(shape[1], jnp.int32),
    )
    mapping = jnp.full((shape[1],), -1, jnp.int32)
    step = jax.jit(lambda c, m: c.compact(m), donate_argnums=0)
    with pytest.raises(ValueError, match="LinearKVCache.compact: at most"):
        step(cache, mapping)
    assert not cache.buffer.is_deleted()
    assert float(cache.buffer[0, 0, 0, 0, 0, 0]) == 1.0


# --- 4: paged_append's skipped-position check asks the kernel's question ---------------------


def one_row_append(entries, length, page_size=2, num_pages=2):
    """Appends one token to a 1-row table through the public op; (report, pools, reference)."""
    kp, vp = (random_array((1, 1, num_pages, page_size, 4), F32) for _ in range(2))
    k, v = (random_array((1, 1, 1, 4), F32) for _ in range(2))
    table = jnp.asarray([entries], jnp.int32)
    lengths = jnp.asarray([length], jnp.int32)
    msg, out = checked(lambda *a: jaxkv.paged_append(*a), kp, vp, table, lengths, 0, k, v)
    want = ref.paged_append(kp, vp, table, lengths, 0, k, v)
    return msg, out, want, kp


@pytest.mark.parametrize("entry", [99, 2, -5, INT32_MIN, INT32_MAX])
def test_paged_append_reports_an_entry_outside_the_pool(entry):
    # Any entry outside [0, num_pages) is no page, not only NO_PAGE.
    msg, out, want, kp = one_row_append([0, entry], length=2)
    assert "no page of this pool" in msg
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[0], kp, "k_pages untouched")  # the token was skipped


def test_paged_append_does_not_report_a_token_it_writes():
    # Old code: a false report for [[-1, 0]] at length 2, where the token is written to page 0.
    msg, out, want, kp = one_row_append([-1, 0], length=2)
    assert msg is None
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert not np.array_equal(np.asarray(out[0]), np.asarray(kp))


@pytest.mark.parametrize("length", [-1, INT32_MIN, 4, INT32_MAX])
def test_paged_append_reports_a_position_outside_the_table(length):
    msg, out, want, kp = one_row_append([0, 1], length=length)
    assert msg is not None
    assert_bytes_equal(out[0], kp, "k_pages untouched")


# --- 5: paged_append with zero rows ----------------------------------------------------------


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_append_and_gather_with_zero_rows(layout):
    shape = (2, 1, 3, 2, 4) if layout == "HND" else (2, 3, 2, 1, 4)
    kp, vp = (random_array(shape, F32) for _ in range(2))
    table = jnp.zeros((0, 2), jnp.int32)
    lengths = jnp.zeros((0,), jnp.int32)
    k = random_array((0, 1, 1, 4), F32)
    # An empty batch: nothing to write, and no run-time error after donation.
    out = jax.jit(lambda *a: jaxkv.paged_append(*a, layout=layout))(kp, vp, table, lengths, 1, k, k)
    assert_bytes_equal(out[0], kp, "k_pages")
    assert_bytes_equal(out[1], vp, "v_pages")
    all_layers = random_array((2, 0, 1, 3, 4), F32)
    out = jaxkv.paged_append(kp, vp, table, lengths, 0, all_layers, all_layers, layout=layout)
    assert_bytes_equal(out[0], kp, "k_pages")
    got = jaxkv.paged_gather(kp, vp, table, lengths, 0, 4, layout=layout)
    assert got.shape == (0, 2, 1, 4, 4)


def test_paged_append_with_head_dim_zero():
    # The handler used to divide by head_dim to find the element size; XLA skips the call for
    # zero-size pools, so this only guards the shape path, but the division is gone too.
    kp = jnp.zeros((1, 1, 2, 2, 0), F32)
    k = jnp.zeros((1, 1, 1, 0), F32)
    table, lengths = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([1], jnp.int32)
    out = jaxkv.paged_append(kp, kp, table, lengths, 0, k, k)
    assert out[0].shape == kp.shape


@pytest.mark.parametrize("kind", ["linear", "paged"])
def test_a_prefill_of_no_query_gives_an_empty_result(kind):
    # A chunk of T = 0 once divided by zero choosing the kernel's split count.
    cache = (jaxkv.LinearKVCache.create(2, 4, 2, 16, 16, F32) if kind == "linear" else
             jaxkv.PagedKVCache.create(2, 8, 4, 2, 16, 4, 3, dtype=F32))
    q = jnp.zeros((4, 0, 4, 16), F32)
    err, out = checked(lambda q: jaxkv.attention.prefill(q, cache, 0, jnp.zeros(4, jnp.int32)), q)
    assert err is None and out.shape == (4, 0, 4, 16) and out.dtype == F32


# --- the ambiguous ones, decided ---------------------------------------------------------------


def test_reserve_past_a_rows_own_room_holds_back_no_one():
    # 4 pages of 2 tokens, 2 pages per sequence at most (4 tokens).
    cache = jaxkv.PagedKVCache.create(1, 4, 2, 1, 4, 3, 2, F32)
    msg, (out, served) = checked(lambda c, n: c.reserve(n), cache, jnp.asarray([5, 3, 1], jnp.int32))
    np.testing.assert_array_equal(served, [False, True, True])
    np.testing.assert_array_equal(out.pages_held, [0, 2, 1])
    assert "max_pages_per_seq" in msg
    np.testing.assert_array_equal(out.ref_counts, [1, 1, 1, 0])


def test_reserve_short_of_pages_holds_back_later_rows():
    cache = jaxkv.PagedKVCache.create(1, 3, 2, 1, 4, 3, 4, F32)
    msg, (out, served) = checked(lambda c, n: c.reserve(n), cache, jnp.asarray([2, 6, 1], jnp.int32))
    # Row 1 needs 3 pages, 2 are left: it waits, and row 2 waits behind it (first come, first served).
    np.testing.assert_array_equal(served, [True, False, False])
    np.testing.assert_array_equal(out.pages_held, [1, 0, 0])
    assert "out of pages" in msg


def test_fork_to_a_repeated_destination_forks_once_and_says_so():
    cache = jaxkv.PagedKVCache.create(1, 8, 2, 1, 4, 4, 4, F32)
    cache, _ = cache.reserve(jnp.asarray([3, 0, 0, 0], jnp.int32))
    cache = cache.commit(jnp.asarray([3, 0, 0, 0], jnp.int32))
    dst = jnp.asarray([2, 2, 3], jnp.int32)
    msg, (out, forked) = checked(lambda c, d: c.fork(0, d), cache, dst)
    # The old code said [True, True, True] for two new sequences.
    np.testing.assert_array_equal(forked, [True, False, True])
    assert "distinct" in msg
    np.testing.assert_array_equal(out.lengths, [3, 0, 3, 3])
    # Pool whole: page 0 (full) shared by 3 rows; each row its own last page.
    table = np.asarray(out.page_table)
    counts = np.bincount(table[table >= 0], minlength=8)
    np.testing.assert_array_equal(out.ref_counts, counts)


# --- every handler error is refused at trace time ---------------------------------------------
#
# Each case is an input that, if it reached the handler, would make it return the named
# ffi::Error (docs/api/checks.md lists them all). Traced with eval_shape (abstract values, so huge
# shapes cost nothing): the Python validation must refuse it before any FFI call is built.

S = jax.ShapeDtypeStruct
i32 = jnp.int32


def kv(rows=2, h=1, s=4, d=4, dtype=F32, lead=()):
    return S(lead + (rows, 2, h, s, d), dtype)


def pools(layers=1, h=1, pages=4, size=2, d=4, dtype=F32):
    return S((layers, h, pages, size, d), dtype)


HANDLER_ERRORS = {
    # common.h element_bytes
    "unsupported dtype": (jaxkv.compact_tensor_batch, S((2, 3), jnp.bool_), S((2,), i32)),
    # layers.h describe_layers
    "a KV layer must have rank 5 or 6": (jaxkv.compact_kv_cache, S((2, 2, 4, 4), F32),
                                         S((2,), i32), S((2,), i32)),
    "KV layer shape mismatch (K/V axis)": (jaxkv.compact_kv_cache, S((2, 3, 1, 4, 4), F32),
                                           S((2,), i32), S((2,), i32)),
    "KV layer shape mismatch (rows)": (jaxkv.compact_kv_cache, kv(rows=3), S((2,), i32),
                                       S((2,), i32)),
    "too many layers for one launch": (jaxkv.compact_kv_cache, [kv()] * 257, S((2,), i32),
                                       S((2,), i32)),
    "too many layers (save)": (lambda x: jaxkv.save_kv_cache(x, 0, 1), [kv()] * 257),
    # compact.h check_compact
    "too many rows": (jaxkv.compact_tensor_batch, S((8193, 1), F32), S((8193,), i32)),
    "batch_mapping is longer than the batch": (jaxkv.compact_tensor_batch, S((2, 1), F32),
                                               S((3,), i32)),
    "lengths must have one entry per row (compact)": (jaxkv.compact_kv_cache, kv(),
                                                      S((3,), i32), S((2,), i32)),
    # paged.h make_view / make_append / make_copy
    "pools must have rank 5": (lambda kp: jaxkv.paged_append(
        kp, kp, jnp.zeros((1, 1), i32), jnp.zeros((1,), i32), 0, jnp.zeros((1, 1, 1, 4)),
        jnp.zeros((1, 1, 1, 4))), S((1, 4, 2, 4), F32)),
    "K and V pools differ": (lambda kp, vp: jaxkv.copy_pages(
        kp, vp, jnp.zeros((1,), i32), jnp.ones((1,), i32)), pools(), pools(pages=5)),
    "page_table must be [max_batch, max_pages_per_seq]": (
        lambda kp, t: jaxkv.paged_gather(kp, kp, t, jnp.zeros((2,), i32), 0, 4), pools(),
        S((3, 2), i32)),
    "k/v do not match the pools (dtype)": (lambda kp, k: jaxkv.paged_append(
        kp, kp, jnp.zeros((1, 1), i32), jnp.zeros((1,), i32), 0, k, k), pools(),
        S((1, 1, 1, 4), jnp.bfloat16)),
    "k/v shape does not match the cache (paged)": (lambda kp, k: jaxkv.paged_append(
        kp, kp, jnp.zeros((1, 1), i32), jnp.zeros((1,), i32), 0, k, k), pools(),
        S((1, 2, 1, 4), F32)),
    "counts must have one entry per row": (lambda kp, k, n: jaxkv.paged_append(
        kp, kp, jnp.zeros((1, 1), i32), jnp.zeros((1,), i32), 0, k, k, n), pools(),
        S((1, 1, 1, 4), F32), S((2,), i32)),
    "src_pages and dst_pages differ in length": (lambda kp, s, d: jaxkv.copy_pages(
        kp, kp, s, d), pools(), S((2,), i32), S((3,), i32)),
    # append.h make_append_params
    "bad ranks": (lambda c, k: c.append(0, k, k), jaxkv.LinearKVCache.create(1, 2, 1, 4, 4, F32),
                  S((2, 1, 4), F32)),
    "k/v dtype differs from the cache": (lambda c, k: c.append(0, k, k),
                                         jaxkv.LinearKVCache.create(1, 2, 1, 4, 4, F32),
                                         S((2, 1, 1, 4), jnp.bfloat16)),
    "k/v shape does not match the cache": (lambda c, k: c.append(0, k, k),
                                           jaxkv.LinearKVCache.create(1, 2, 1, 4, 4, F32),
                                           S((2, 1, 1, 8), F32)),
    "lengths must have one entry per row (append)": (
        lambda c, k, n: c.append(0, k, k, n), jaxkv.LinearKVCache.create(1, 2, 1, 4, 4, F32),
        S((2, 1, 1, 4), F32), S((3,), i32)),
    # prefix.h describe_prefix
    "one saved tensor per layer expected": (lambda x, s: jaxkv.instantiate_kv_cache(x, s, 0),
                                            [kv(), kv()], [S((2, 1, 2, 4), F32)]),
    "saved tensor does not fit its layer (heads)": (
        lambda x, s: jaxkv.instantiate_kv_cache(x, s, 0), kv(), S((2, 2, 2, 4), F32)),
    "saved tensor does not fit its layer (tokens)": (
        lambda x, s: jaxkv.instantiate_kv_cache(x, s, 0), kv(s=4), S((2, 1, 5, 4), F32)),
    # cuda/paged.cu launch_move and paged_copy_cuda: one launch's grid.x
    "too many (layer, row, head) spans for one launch": (lambda kp, t, n, k: jaxkv.paged_append(
        kp, kp, t, n, 0, k, k), pools(layers=2**16, h=2**16, pages=1, size=1, d=1),
        S((1, 1), i32), S((1,), i32), S((2**16, 1, 2**16, 1, 1), F32)),
    "too many pages for one launch": (lambda kp, s: jaxkv.copy_pages(kp, kp, s, s),
                                      pools(layers=2**16, h=2**8, pages=1, size=1, d=1),
                                      S((2**8,), i32)),
    # the int32 fields of LayerSpan / PagedView / AppendParams
    "a token past int32 bytes": (lambda kp, t, n: jaxkv.paged_gather(kp, kp, t, n, 0, 1),
                                 pools(d=2**29, dtype=F32), S((1, 1), i32), S((1,), i32)),
    "a compacted row past int32 bytes": (jaxkv.compact_tensor_batch, S((2, 2**29 + 1), F32),
                                         S((2,), i32)),
    "a dimension past int32": (lambda kp, t, n: jaxkv.paged_gather(kp, kp, t, n, 0, 1),
                               pools(pages=2**31), S((1, 1), i32), S((1,), i32)),
}


@pytest.mark.parametrize("name", HANDLER_ERRORS)
def test_the_python_validation_refuses_it_before_the_handler(name):
    fn, *args = HANDLER_ERRORS[name]
    # jaxkv's own validation ("<op>: <argument> ..."), not an error from elsewhere
    with pytest.raises((ValueError, TypeError), match=r"^[\w.]+: \S"):
        jax.eval_shape(fn, *args)


def test_the_append_kernel_takes_any_number_of_spans():
    # "too many spans" (cuda/append.cu) is gone: the kernel strides over its grid. 8192 rows x
    # 32 heads x K/V is 65536 groups of 8 spans, one past grid.y; the CPU handler checks the same
    # bytes land where the reference puts them.
    cache = jaxkv.LinearKVCache.create(1, 8192, 32, 2, 1, jnp.uint8).reset(
        jnp.ones((8192,), jnp.int32))
    k, v = (random_array((8192, 32, 1, 1), jnp.uint8) for _ in range(2))
    out = jax.jit(lambda c, k, v: c.append(0, k, v))(cache, k, v)
    want = ref.append_layer(cache.buffer[0], k, v, cache.lengths, cache.active_batch_size)
    assert_bytes_equal(out.buffer[0], want, "buffer")
