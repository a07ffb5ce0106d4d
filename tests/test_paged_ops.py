"""The paged kernels (append, gather, copy_pages) against the pure-jnp reference, bit for bit.

Pools start as random bytes, so any byte a kernel writes outside its contract shows; page tables are
random permutations with ragged holdings, unassigned (NO_PAGE) and garbage entries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

from helpers import DTYPES, DTYPE_IDS, assert_bytes_equal, random_array, ref

LAYOUTS = ["HND", "NHD"]
PAGE_SIZES = [1, 16, 128]
L, H = 2, 3




def pool_shape(layout, pages, size, d):
    return (L, H, pages, size, d) if layout == "HND" else (L, pages, size, H, d)


def random_case(rng, size, batch=3, tokens=5, garbage=True):
    """lengths, counts and a page table holding the pages those tokens need (some rows hold an
    extra page, some a garbage entry in their write range)."""
    lengths = rng.integers(0, 3 * size + 2, batch).astype(np.int32)
    lengths[0] = 0  # an empty row
    counts = rng.integers(0, tokens + 1, batch).astype(np.int32)
    counts[-1] = tokens
    held = -(-(lengths + counts) // size) + rng.integers(0, 2, batch)
    held[-1] = max(held[-1], 1)
    max_pages = int(held.max()) + 1
    num_pages = int(held.sum()) + 3  # some pages no row holds
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((batch, max_pages), jaxkv.NO_PAGE, np.int32)
    start = 0
    for b in range(batch):
        table[b, : held[b]] = perm[start : start + held[b]]
        start += held[b]
    if garbage and held[1] > 0:  # row 1: a garbage entry; the last row always writes something
        table[1, held[1] - 1] = num_pages + 7 if rng.integers(2) else -5
    return jnp.asarray(lengths), jnp.asarray(counts), jnp.asarray(table), num_pages


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_append_matches_reference(layout, size, dtype):
    rng = np.random.default_rng()
    lengths, counts, table, pages = random_case(rng, size)
    d, tokens = 16, 5
    kp, vp = (random_array(pool_shape(layout, pages, size, d), dtype) for _ in range(2))
    k, v = (random_array((3, H, tokens, d), dtype) for _ in range(2))
    layer = jnp.asarray(1, jnp.int32)
    f = jax.jit(lambda *a: jaxkv.paged_append(*a, layout=layout))
    out = f(kp, vp, table, lengths, layer, k, v, counts)
    want = ref.paged_append(kp, vp, table, lengths, layer, k, v, counts, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")
    assert not np.array_equal(np.asarray(out[0]), np.asarray(kp)), "nothing was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [5, 64])
def test_append_every_dtype_and_head_dim(dtype, d):
    rng = np.random.default_rng()
    layout = LAYOUTS[rng.integers(2)]
    lengths, counts, table, pages = random_case(rng, 16, tokens=3)
    kp, vp = (random_array(pool_shape(layout, pages, 16, d), dtype) for _ in range(2))
    k, v = (random_array((3, H, 3, d), dtype) for _ in range(2))
    out = jaxkv.paged_append(kp, vp, table, lengths, 0, k, v, counts, layout=layout)
    want = ref.paged_append(kp, vp, table, lengths, 0, k, v, counts, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_all_layers_and_decode(layout):
    """k [L, B, H, T, D]: every layer in one call; T = 1 with no new_lengths is a decode step."""
    rng = np.random.default_rng()
    lengths, _, table, pages = random_case(rng, 16, tokens=1)
    kp, vp = (random_array(pool_shape(layout, pages, 16, 32), jnp.bfloat16) for _ in range(2))
    k, v = (random_array((L, 3, H, 1, 32), jnp.bfloat16) for _ in range(2))
    out = jaxkv.paged_append(kp, vp, table, lengths, 0, k, v, layout=layout)
    want = ref.paged_append(kp, vp, table, lengths, 0, k, v, None, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")


def test_append_traced_layer_in_scan_and_out_of_range():
    rng = np.random.default_rng()
    lengths, counts, table, pages = random_case(rng, 16)
    kp, vp = (random_array(pool_shape("HND", pages, 16, 8), jnp.float32) for _ in range(2))
    ks = random_array((L, 3, H, 5, 8), jnp.float32)

    def step(pools, kl):
        layer, k = kl
        return jaxkv.paged_append(*pools, table, lengths, layer, k, -k, counts), None

    layers = jnp.arange(L, dtype=jnp.int32)
    (ok_k, ok_v), _ = jax.jit(lambda p, x: jax.lax.scan(step, p, x))((kp, vp), (layers, ks))
    want_k, want_v = kp, vp
    for i in range(L):
        want_k, want_v = ref.paged_append(want_k, want_v, table, lengths, i, ks[i], -ks[i], counts)
    assert_bytes_equal(ok_k, want_k, "k_pages")
    assert_bytes_equal(ok_v, want_v, "v_pages")
    for bad in (-1, L):  # traced: the kernel writes nothing (a static one fails at trace time)
        bad_layer = jnp.asarray(bad, jnp.int32)
        out = jaxkv.paged_append(kp, vp, table, lengths, bad_layer, ks[0], ks[0], counts)
        assert_bytes_equal(out[0], kp, f"layer {bad} wrote")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e5m2], ids=["bf16", "fp8"])
def test_gather_matches_reference(layout, size, dtype):
    rng = np.random.default_rng()
    lengths, _, table, pages = random_case(rng, size)
    kp, vp = (random_array(pool_shape(layout, pages, size, 16), dtype) for _ in range(2))
    max_len = int(lengths.max()) + 5  # past every length: zeros
    want = ref.paged_gather(kp, vp, table, lengths, 1, max_len, layout)
    out = jax.jit(lambda *a: jaxkv.paged_gather(*a, max_len, layout=layout))(
        kp, vp, table, lengths, jnp.asarray(1, jnp.int32)
    )
    assert_bytes_equal(out, want, "gather")
    k, v = jaxkv.paged_gather(kp, vp, table, lengths, 1, max_len - 4, layout=layout, split=True)
    assert_bytes_equal(k, want[:, 0, :, : max_len - 4], "gather k (truncated)")
    assert_bytes_equal(v, want[:, 1, :, : max_len - 4], "gather v (truncated)")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_every_dtype(dtype):
    rng = np.random.default_rng()
    layout = LAYOUTS[rng.integers(2)]
    lengths, _, table, pages = random_case(rng, 4)
    kp, vp = (random_array(pool_shape(layout, pages, 4, 5), dtype) for _ in range(2))
    out = jaxkv.paged_gather(kp, vp, table, lengths, 0, 20, layout=layout)
    assert_bytes_equal(out, ref.paged_gather(kp, vp, table, lengths, 0, 20, layout), "gather")
    out = jaxkv.paged_gather(kp, vp, table, lengths, jnp.asarray(L, jnp.int32), 20, layout=layout)
    assert not np.asarray(out).view(np.uint8).any(), "an out-of-range layer gathers zeros"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_copy_pages_matches_reference(layout, size, dtype):
    pages = 12
    kp, vp = (random_array(pool_shape(layout, pages, size, 8), dtype) for _ in range(2))
    perm = np.random.default_rng().permutation(pages).astype(np.int32)
    src = jnp.asarray(np.concatenate([perm[:4], [3, -1]]).astype(np.int32))
    dst = jnp.asarray(np.concatenate([perm[4:8], [pages + 2, perm[9]]]).astype(np.int32))
    out = jax.jit(lambda *a: jaxkv.copy_pages(*a, layout=layout))(kp, vp, src, dst)
    want = ref.copy_pages(kp, vp, src, dst, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")
    assert not np.array_equal(np.asarray(out[0]), np.asarray(kp))


def test_validation_messages():
    kp = jnp.zeros((1, 2, 4, 4, 8), jnp.float32)
    table = jnp.zeros((2, 3), jnp.int32)
    lengths = jnp.zeros((2,), jnp.int32)
    k = jnp.zeros((2, 2, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="paged_append: layout"):
        jaxkv.paged_append(kp, kp, table, lengths, 0, k, k, layout="HDN")
    with pytest.raises(TypeError, match="paged_append: k has dtype bfloat16"):
        jaxkv.paged_append(kp, kp, table, lengths, 0, k.astype(jnp.bfloat16), k)
    with pytest.raises(ValueError, match=r"paged_append: v must have shape \(2, 2, 1, 8\)"):
        jaxkv.paged_append(kp, kp, table, lengths, 0, k, k[:, :1])
    with pytest.raises(ValueError, match="paged_gather: page_table has 2 rows, lengths 3"):
        jaxkv.paged_gather(kp, kp, table, jnp.zeros((3,), jnp.int32), 0, 4)
    with pytest.raises(TypeError, match="copy_pages: src_pages must be int32"):
        jaxkv.copy_pages(kp, kp, jnp.zeros((2,), jnp.float32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="paged_gather: max_len must be"):
        jaxkv.paged_gather(kp, kp, table, lengths, 0, 0)


@pytest.mark.gpu_sized
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size,d,dtype", [(16, 64, jnp.float32), (128, 7, jnp.bfloat16)])
def test_long_prefill_spans_many_chunks(layout, size, d, dtype):
    """Hundreds of tokens per row: the CUDA kernels split each span into several chunks."""
    rng = np.random.default_rng()
    tokens, batch = 300, 2
    lengths = jnp.asarray([0, int(rng.integers(1, 40))], jnp.int32)
    counts = jnp.asarray([tokens, int(rng.integers(200, tokens))], jnp.int32)
    held = -(-(np.asarray(lengths) + np.asarray(counts)) // size)
    pages = int(held.sum()) + 2
    perm = rng.permutation(pages).astype(np.int32)
    table = np.full((batch, int(held.max())), jaxkv.NO_PAGE, np.int32)
    table[0, : held[0]] = perm[: held[0]]
    table[1, : held[1]] = perm[held[0] : held[0] + held[1]]
    table = jnp.asarray(table)
    kp, vp = (random_array(pool_shape(layout, pages, size, d), dtype) for _ in range(2))
    k, v = (random_array((batch, H, tokens, d), dtype) for _ in range(2))
    out = jaxkv.paged_append(kp, vp, table, lengths, 1, k, v, counts, layout=layout)
    want = ref.paged_append(kp, vp, table, lengths, 1, k, v, counts, layout)
    assert_bytes_equal(out[0], want[0], "k_pages")
    assert_bytes_equal(out[1], want[1], "v_pages")
    total = lengths + counts
    got = jaxkv.paged_gather(*out, table, total, 1, tokens + 50, layout=layout)
    assert_bytes_equal(got, ref.paged_gather(*want, table, total, 1, tokens + 50, layout), "gather")
    assert_bytes_equal(got[0, 0, :, :tokens], k[0], "row 0 reads back its prefill")
