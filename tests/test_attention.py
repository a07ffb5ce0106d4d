"""jaxkv.attention: decode and prefill over every cache kind, against the dense float32 reference.

The caches hold fresh random data (std 1) and page tables that leave pages past each row's length
unassigned (NO_PAGE), so a kernel that reads past a length or through a missing page fails. The
reference computes at HIGHEST matmul precision, so TF32 cannot hide a bug on the GPU. Tolerances
are the output dtype's rounding on values of magnitude ~1: float32 2e-5, float16 4e-3, bfloat16
and fp8 caches (read under a bfloat16 q) 2e-2.
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

from helpers import XLA_FALLBACK, on_gpu

_rng = np.random.default_rng()
# Jitted once per shape: eager jnp would compile each of the reference's ops separately.
ref_decode = jax.jit(reference.decode_attention)
ref_prefill = jax.jit(reference.prefill_attention)
ref_gather = jax.jit(reference.paged_gather, static_argnums=(5, 6))

KINDS = ["linear", "manager", "paged-HND", "paged-NHD"]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16,
          "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
TOL = {"f32": 2e-5, "f16": 4e-3, "bf16": 2e-2, "e4m3": 2e-2, "e5m2": 2e-2}
# (GQA group, head_dim, page_size) per case, cycled so that every value meets every cache kind.
SHAPES = [(1, 64, 1), (4, 128, 16), (8, 256, 128), (4, 64, 128), (8, 128, 1), (1, 256, 16)]
B, HKV, L = 4, 2, 2


def normal(shape, dtype) -> jax.Array:
    return jnp.asarray(_rng.standard_normal(shape, np.float32).astype(np.dtype(dtype)))


def q_dtype(name):
    return jnp.bfloat16 if name in ("e4m3", "e5m2") else DTYPES[name]


@dataclasses.dataclass
class Case:
    cache: object
    kind: str
    capacity: int

    def dense(self, layer):
        """K, V [B, Hkv, capacity, D] of a layer (zeros where no page holds a token)."""
        c = self.cache
        if self.kind == "linear":
            return c.buffer[layer, :, 0], c.buffer[layer, :, 1]
        if self.kind == "manager":
            return c.layers[layer][:, 0], c.layers[layer][:, 1]
        full = jnp.full((c.max_batch,), self.capacity, jnp.int32)
        kv = ref_gather(c.k_pages, c.v_pages, c.page_table, full, layer,
                                    self.capacity, c.layout)
        return kv[:, 0], kv[:, 1]


def make_case(kind, dtype, head_dim, page_size, lengths) -> Case:
    """A cache of `kind` with random contents; rows hold pages for `lengths` tokens only."""
    lengths = np.asarray(lengths, np.int32)
    if kind.startswith("paged"):
        layout = kind.split("-")[1]
        max_pages = max(2, -(-48 // page_size))
        cap = max_pages * page_size
        num_pages = B * max_pages + 3
        cache = jaxkv.PagedKVCache.create(L, num_pages, page_size, HKV, head_dim, B, max_pages,
                                          dtype, layout)
        perm = _rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages)
        need = -(-np.minimum(lengths, cap) // page_size)
        table = np.where(np.arange(max_pages)[None] < need[:, None], perm, jaxkv.NO_PAGE)
        shape = cache.k_pages.shape
        # 8-bit pools of raw bytes read with the call's k_scale / v_scale (test_quantized.py
        # covers caches with scales of their own).
        cache = dataclasses.replace(cache, k_pages=normal(shape, dtype), v_pages=normal(shape, dtype),
                                    page_table=jnp.asarray(table, jnp.int32), scaling=None,
                                    k_scales=None, v_scales=None)
    elif kind == "linear":
        cap = 48
        cache = jaxkv.LinearKVCache(buffer=normal((L, B, 2, HKV, cap, head_dim), dtype),
                                    lengths=jnp.zeros((B,), jnp.int32),
                                    active_batch_size=jnp.asarray(B, jnp.int32))
    else:
        cap = 48
        layers = tuple(normal((B, 2, HKV, cap, head_dim), dtype) for _ in range(L))
        cache = jaxkv.KVCacheManager(layers=layers, lengths=jnp.zeros((B,), jnp.int32),
                                     active_batch_size=jnp.asarray(B, jnp.int32))
    return Case(dataclasses.replace(cache, lengths=jnp.asarray(lengths)), kind, cap)


def ragged(cap):
    """Lengths with 0 and full capacity among them."""
    return [0, cap, int(_rng.integers(1, cap)), int(_rng.integers(1, cap))]


def assert_close(out, want, name):
    tol = TOL[name]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=tol, atol=tol)


@functools.partial(jax.jit, static_argnames=("layer_static",))
def _decode(q, cache, layer, k_scale, v_scale, layer_static=None):
    # A traced layer index, except for the manager (its layers differ in shape).
    idx = layer if layer_static is None else layer_static
    return jaxkv.attention.decode(q, cache, idx, k_scale=k_scale, v_scale=v_scale)


@functools.partial(jax.jit, static_argnames=("layer_static",))
def _prefill(q, cache, layer, q_lengths, k_scale, v_scale, layer_static=None):
    idx = layer if layer_static is None else layer_static
    return jaxkv.attention.prefill(q, cache, idx, q_lengths, k_scale=k_scale, v_scale=v_scale)


def _scales(name):
    fp8 = name in ("e4m3", "e5m2")
    return (jnp.float32(0.5), jnp.float32(1.5)) if fp8 else (jnp.float32(1), jnp.float32(1))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_reference(kind, name):
    group, head_dim, page_size = SHAPES[(KINDS.index(kind) + list(DTYPES).index(name)) % len(SHAPES)]
    dtype = DTYPES[name]
    probe = make_case(kind, dtype, head_dim, page_size, [0] * B)
    case = make_case(kind, dtype, head_dim, page_size, ragged(probe.capacity))
    ks, vs = _scales(name)
    q = normal((B, HKV * group, head_dim), q_dtype(name))
    for layer in range(L):
        static = layer if kind == "manager" else None
        out = _decode(q, case.cache, jnp.int32(layer), ks, vs, layer_static=static)
        assert out.shape == q.shape and out.dtype == q.dtype
        k, v = case.dense(layer)
        want = ref_decode(q, k, v, case.cache.lengths, k_scale=ks, v_scale=vs)
        assert np.all(np.asarray(want[0]) == 0)  # row 0 has length 0: zeros
        assert_close(out, want, name)


@pytest.mark.parametrize("name", ["f32", "bf16", "e4m3"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_reference(kind, name):
    group, head_dim, page_size = SHAPES[(KINDS.index(kind) + 2 * list(DTYPES).index(name)) % 6]
    dtype = DTYPES[name]
    t = 8
    probe = make_case(kind, dtype, head_dim, page_size, [0] * B)
    cap = probe.capacity
    # Cached prefix + new tokens: none new, a chunk ending at capacity, a fresh row, a middle one.
    prefix = np.array([5, cap - t, 0, int(_rng.integers(1, cap - t))], np.int32)
    q_lengths = np.array([0, t, 3, int(_rng.integers(1, t + 1))], np.int32)
    case = make_case(kind, dtype, head_dim, page_size, prefix + q_lengths)
    case.cache = dataclasses.replace(case.cache, lengths=jnp.asarray(prefix))
    ks, vs = _scales(name)
    q = normal((B, t, HKV * group, head_dim), q_dtype(name))
    for layer in range(L):
        static = layer if kind == "manager" else None
        out = _prefill(q, case.cache, jnp.int32(layer), jnp.asarray(q_lengths), ks, vs,
                       layer_static=static)
        assert out.shape == q.shape and out.dtype == q.dtype
        k, v = case.dense(layer)
        want = ref_prefill(q, k, v, jnp.asarray(prefix), jnp.asarray(q_lengths),
                                           k_scale=ks, v_scale=vs)
        assert np.all(np.asarray(want[0]) == 0) and np.all(np.asarray(want[2, 3:]) == 0)
        assert_close(out, want, name)


@pytest.mark.parametrize("kind", ["linear", "paged-NHD"])
def test_long_rows_split_over_blocks(kind):
    """Rows long enough that the GPU kernel splits them over blocks and merges the parts: all
    splits live, some (777 keys), none (a row of length 0: zeros)."""
    dtype, head_dim, group, rows = jnp.bfloat16, 128, 4, 3
    if kind == "linear":
        cap = 1500
        cache = jaxkv.LinearKVCache(buffer=normal((1, rows, 2, HKV, cap, head_dim), dtype),
                                    lengths=jnp.array([cap, 777, 0], jnp.int32),
                                    active_batch_size=jnp.asarray(rows, jnp.int32))
        k, v = cache.buffer[0, :, 0], cache.buffer[0, :, 1]
    else:
        page, pages = 16, 94
        cap = page * pages
        cache = jaxkv.PagedKVCache.create(1, rows * pages, page, HKV, head_dim, rows, pages, dtype,
                                          "NHD")
        table = jnp.asarray(_rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
        shape = cache.k_pages.shape
        cache = dataclasses.replace(cache, k_pages=normal(shape, dtype), v_pages=normal(shape, dtype),
                                    page_table=table, lengths=jnp.array([cap, 777, 0], jnp.int32))
        kv = ref_gather(cache.k_pages, cache.v_pages, table, cache.lengths, 0, cap, "NHD")
        k, v = kv[:, 0], kv[:, 1]
    assert jaxkv.attention._splits(rows, jaxkv.attention._source("t", cache, 0), HKV * group) > 1
    q = normal((rows, HKV * group, head_dim), dtype)
    out = jax.jit(jaxkv.attention.decode)(q, cache, 0)
    assert not np.asarray(out[2]).any()  # no key: zeros, written although no split is live
    assert_close(out, ref_decode(q, k, v, cache.lengths), "bf16")


@pytest.mark.gpu_sized
@pytest.mark.parametrize("name", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_grid_past_one_wave(layout, head_dim, name):
    """More (row, KV head) pairs than one wave of the GPU's tensor-core decode holds at 3 blocks
    a multiprocessor, fewer than two at 2: a block a pair and the kernel's deeper ring
    (ffi/cuda/attention_decode.cu's TcDeep), over ragged rows of shuffled pages."""
    dtype, group, page, pages = DTYPES[name], 8, 16, 6
    rows = 3 * jaxkv.attention._multiprocessors() // HKV + 5
    cap = page * pages
    cache = jaxkv.PagedKVCache.create(1, rows * pages, page, HKV, head_dim, rows, pages, dtype,
                                      layout)
    lengths = _rng.integers(0, cap + 1, rows).astype(np.int32)
    lengths[:2] = 0, cap
    table = jnp.asarray(_rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    shape = cache.k_pages.shape
    cache = dataclasses.replace(cache, k_pages=normal(shape, dtype), v_pages=normal(shape, dtype),
                                page_table=table, lengths=jnp.asarray(lengths))
    src = jaxkv.attention._source("t", cache, 0)
    assert jaxkv.attention._splits(rows, src, HKV * group) == 1
    kv = ref_gather(cache.k_pages, cache.v_pages, table, cache.lengths, 0, cap, layout)
    q = normal((rows, HKV * group, head_dim), dtype)
    out = jax.jit(jaxkv.attention.decode, static_argnames="implementation")(
        q, cache, 0, implementation="jaxkv")
    assert not np.asarray(out[0]).any()
    assert_close(out, ref_decode(q, kv[:, 0], kv[:, 1], cache.lengths), name)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_chunk_spans_several_query_and_key_tiles(layout):
    """40 new tokens x 4 heads per KV head: several query tiles of the GPU's tensor-core prefill
    (32 tokens x 4 heads each), partial ones at the end, over several key tiles."""
    dtype, head_dim, group, t, page, pages = jnp.bfloat16, 128, 4, 40, 16, 20
    cap = page * pages
    prefix = np.array([250, 0, 100], np.int32)
    q_lengths = np.array([t, 17, 0], np.int32)
    cache = jaxkv.PagedKVCache.create(1, 3 * pages, page, HKV, head_dim, 3, pages, dtype, layout)
    table = jnp.asarray(_rng.permutation(3 * pages).reshape(3, pages), jnp.int32)
    shape = cache.k_pages.shape
    cache = dataclasses.replace(cache, k_pages=normal(shape, dtype), v_pages=normal(shape, dtype),
                                page_table=table, lengths=jnp.asarray(prefix))
    full = jnp.full((3,), cap, jnp.int32)
    kv = ref_gather(cache.k_pages, cache.v_pages, table, full, 0, cap, layout)
    q = normal((3, t, HKV * group, head_dim), dtype)
    out = jax.jit(jaxkv.attention.prefill)(q, cache, 0, jnp.asarray(q_lengths))
    want = ref_prefill(q, kv[:, 0], kv[:, 1], jnp.asarray(prefix), jnp.asarray(q_lengths))
    assert_close(out, want, "bf16")


@pytest.mark.gpu_sized
@pytest.mark.parametrize("group,dtype,kind,head_dim", [
    (1, jnp.bfloat16, "NHD", 128), (8, jnp.float16, "HND", 128), (4, jnp.bfloat16, "linear", 128),
    (2, jnp.bfloat16, "NHD", 256), (16, jnp.float16, "linear", 256)])
def test_prefill_over_long_prefixes(group, dtype, kind, head_dim):
    """Hundreds of new tokens on prefixes of up to 900 keys: on Hopper the wgmma prefill (rows of
    128 / group tokens; key tiles of 128, of 64 at head_dim 256) walks many key tiles past page
    and tile boundaries, the causal diagonal at every offset within a tile; one row's chunk is
    cut short by its count, one has no tokens; pages in random order."""
    t, page, pages = 300, 16, 76
    cap = page * pages
    prefix = np.array([cap - t, 0, 517], np.int32)
    q_lengths = np.array([t, 211, 0], np.int32)
    q = normal((3, t, HKV * group, head_dim), dtype)
    if kind == "linear":
        buffer = normal((1, 3, 2, HKV, cap, head_dim), dtype)
        cache = jaxkv.LinearKVCache(buffer=buffer, lengths=jnp.asarray(prefix),
                                    active_batch_size=jnp.asarray(3, jnp.int32))
        k, v = buffer[0, :, 0], buffer[0, :, 1]
    else:
        cache = jaxkv.PagedKVCache.create(1, 3 * pages, page, HKV, head_dim, 3, pages, dtype, kind)
        table = jnp.asarray(_rng.permutation(3 * pages).reshape(3, pages), jnp.int32)
        shape = cache.k_pages.shape
        cache = dataclasses.replace(cache, k_pages=normal(shape, dtype),
                                    v_pages=normal(shape, dtype), page_table=table,
                                    lengths=jnp.asarray(prefix))
        kv = ref_gather(cache.k_pages, cache.v_pages, table, jnp.full((3,), cap, jnp.int32), 0,
                        cap, kind)
        k, v = kv[:, 0], kv[:, 1]
    want = ref_prefill(q, k, v, jnp.asarray(prefix), jnp.asarray(q_lengths))
    prefill = jax.jit(functools.partial(jaxkv.attention.prefill, implementation="jaxkv"))
    out = prefill(q, cache, 0, jnp.asarray(q_lengths))
    assert_close(out, want, "bf16" if dtype == jnp.bfloat16 else "f16")
    assert not np.asarray(out[2]).any()  # no tokens: zeros


@pytest.mark.parametrize("head_dim,group,page,scale,dtype", [
    (64, 3, 12, None, jnp.bfloat16),  # a group that does not divide the row tile; pages of 12
    (128, 6, 16, -0.05, jnp.float16),  # a negative softmax scale
    (128, 4, 16, 0.0, jnp.bfloat16),  # scale 0: every visible key weighs the same
    (256, 2, 16, None, jnp.bfloat16),
])
def test_prefill_row_tiles_groups_and_scales(head_dim, group, page, scale, dtype):
    """The GPU's tensor-core prefill: row tiles of tokens x group heads (partial ones, groups
    that leave rows of a tile unused), key tiles ending mid-page, the sign of the scale. The
    default implementation too: cuDNN refuses pages of 12 (not a power of two), jaxkv reads them."""
    t, pages = 45, 12
    cap = page * pages
    prefix = np.array([cap - t, 0, 37], np.int32)
    q_lengths = np.array([t, 30, 8], np.int32)
    cache = jaxkv.PagedKVCache.create(1, 3 * pages, page, HKV, head_dim, 3, pages, dtype, "NHD")
    table = jnp.asarray(_rng.permutation(3 * pages).reshape(3, pages), jnp.int32)
    shape = cache.k_pages.shape
    cache = dataclasses.replace(cache, k_pages=normal(shape, dtype), v_pages=normal(shape, dtype),
                                page_table=table, lengths=jnp.asarray(prefix))
    full = jnp.full((3,), cap, jnp.int32)
    kv = ref_gather(cache.k_pages, cache.v_pages, table, full, 0, cap, "NHD")
    q = normal((3, t, HKV * group, head_dim), dtype)
    want = ref_prefill(q, kv[:, 0], kv[:, 1], jnp.asarray(prefix), jnp.asarray(q_lengths),
                       scale=scale)
    for implementation in (None, "jaxkv"):
        prefill = jax.jit(functools.partial(jaxkv.attention.prefill, scale=scale,
                                            implementation=implementation))
        out = prefill(q, cache, 0, jnp.asarray(q_lengths))
        assert_close(out, want, "bf16" if dtype == jnp.bfloat16 else "f16")


def test_decode_group_larger_than_one_block():
    """12 q heads per KV head: on the GPU two blocks per KV head (8 heads, then 4)."""
    case = make_case("linear", jnp.float16, 64, 16, [0, 48, 9, 30])
    q = normal((B, HKV * 12, 64), jnp.float16)
    out = jax.jit(jaxkv.attention.decode)(q, case.cache, 1)
    k, v = case.dense(1)
    assert_close(out, ref_decode(q, k, v, case.cache.lengths), "f16")


def test_scan_over_layers_with_donation_appends_and_attends():
    """A decode step as a model runs it: per layer (scan, traced index) append then attend."""
    case = make_case("paged-HND", jnp.float32, 64, 16, [7, 0, 20, 31])
    cache = case.cache
    q = normal((L, B, 2 * HKV, 64), jnp.float32)
    k_new, v_new = normal((L, B, HKV, 1, 64), jnp.float32), normal((L, B, HKV, 1, 64), jnp.float32)
    # Expected: the dense K/V with the new token written at each row's length.
    want = []
    for layer in range(L):
        k, v = case.dense(layer)
        pos = np.asarray(cache.lengths)
        k = k.at[jnp.arange(B), :, pos].set(k_new[layer, :, :, 0])
        v = v.at[jnp.arange(B), :, pos].set(v_new[layer, :, :, 0])
        want.append(ref_decode(q[layer], k, v, cache.lengths + 1))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, q, k_new, v_new):
        cache, _ = cache.reserve(jnp.ones((B,), jnp.int32))

        def layer(cache, xs):
            i, q, k, v = xs
            cache = cache.append(i, k, v)
            return cache, jaxkv.attention.prefill(q[:, None], cache, i, jnp.ones((B,), jnp.int32))

        cache, out = jax.lax.scan(layer, cache, (jnp.arange(L), q, k_new, v_new))
        return cache.commit(1), out[:, :, 0]

    # Pages for the new token are reserved inside the step; give rows room first.
    cache = dataclasses.replace(cache, ref_counts=jnp.asarray(
        np.bincount(np.asarray(cache.page_table).ravel()[np.asarray(cache.page_table).ravel() >= 0],
                    minlength=cache.num_pages), jnp.int32))
    cache, out = step(cache, q, k_new, v_new)
    for layer in range(L):
        assert_close(out[layer], want[layer], "f32")
    # Decode after commit reads the same tokens.
    again = jaxkv.attention.decode(q[1], cache, 1)
    assert_close(again, want[1], "f32")


_INSTR = re.compile(r"%([\w.-]+)\s*=\s*\w+(\[[\d,]*\])\S*\s+([\w-]+)\(([^)]*)\)")


def slices_and_copies_of(hlo: str, cache_array) -> list[str]:
    """copy / slice / dynamic-slice instructions (fused ones too) whose operand has the cache's
    shape, whatever its dtype (the CPU may convert before it slices)."""
    dims = "[" + ",".join(map(str, cache_array.shape)) + "]"
    shapes = {m.group(1): m.group(2) for m in _INSTR.finditer(hlo)}
    found = []
    for m in _INSTR.finditer(hlo):
        if m.group(3) in ("copy", "copy-start", "slice", "dynamic-slice"):
            operand = m.group(4).split(",")[0].strip().lstrip("%")
            if shapes.get(operand) == dims:
                found.append(m.group(0))
    return found


def _hlo_cases():
    lin = make_case("linear", jnp.bfloat16, 64, 16, [3, 0, 48, 9])
    nhd = make_case("paged-NHD", jnp.bfloat16, 64, 16, [3, 0, 48, 9])
    hnd = make_case("paged-HND", jnp.bfloat16, 64, 16, [3, 0, 48, 9])
    return [("linear", lin.cache, lin.cache.buffer), ("paged", nhd.cache, nhd.cache.k_pages),
            ("paged-HND", hnd.cache, hnd.cache.k_pages)]


_CUDNN = re.compile(r'custom_call_target="__cudnn\$fmha')


@pytest.mark.parametrize("which,implementation", [("linear", None), ("paged", "jaxkv"),
                                                  ("paged", None), ("paged-HND", None)])
def test_donated_decode_step_slices_and_copies_nothing(which, implementation):
    """The default paged decode is cuDNN's on a GPU (bfloat16, both layouts): in place as well."""
    name, cache, pool = next(c for c in _hlo_cases() if c[0] == which)
    cudnn = which.startswith("paged") and implementation is None and on_gpu()
    q = normal((L, B, 2 * HKV, 64), jnp.bfloat16)
    kv = normal((L, B, HKV, 1, 64), jnp.bfloat16)

    def step(cache, q, k, v):
        if isinstance(cache, jaxkv.PagedKVCache):
            cache, _ = cache.reserve(jnp.ones((B,), jnp.int32))

        def layer(cache, xs):
            i, q, k, v = xs
            cache = cache.append(i, k, v)
            return cache, jaxkv.attention.decode(q, cache, i, kv_lengths=cache.lengths + 1,
                                                 implementation=implementation)

        cache, out = jax.lax.scan(layer, cache, (jnp.arange(L), q, k, v))
        return cache.commit(1), out

    hlo = jax.jit(step, donate_argnums=0).lower(cache, q, kv, kv).compile().as_text()
    assert ("jaxkv_attention_decode" in hlo) == (not cudnn and not XLA_FALLBACK)
    assert bool(_CUDNN.search(hlo)) == cudnn
    assert slices_and_copies_of(hlo, pool) == []
    # cuDNN is handed the pool as pages ([L * P, S, H, D], or [L * H * P, S, 1, D]): no copy of
    # that either.
    pages = pool.reshape(-1, *pool.shape[2:]) if which == "paged" else pool.reshape(
        -1, pool.shape[3], 1, pool.shape[4])
    assert slices_and_copies_of(hlo, pages) == []

    # The detector is live: handing a slice of the stacked buffer to the kernel is a copy.
    def sliced(cache, q):
        if which == "linear":
            layer = jaxkv.KVCacheManager(layers=(cache.buffer[1],), lengths=cache.lengths,
                                         active_batch_size=cache.active_batch_size)
        else:
            layer = dataclasses.replace(cache, k_pages=cache.k_pages[1:], v_pages=cache.v_pages[1:])
        return jaxkv.attention.decode(q[0], layer, 0)

    control = jax.jit(sliced).lower(cache, q).compile().as_text()
    assert slices_and_copies_of(control, pool)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_is_jaxkvs_kernel_on_hopper_at_head_dim_128(head_dim, monkeypatch):
    """The default for a paged bf16 pool: on Hopper at head_dim 128 jaxkv's kernels (decode past
    the smallest grids, and prefill where the wgmma kernel is built), as fast as the cuDNN path or
    faster by a call's wall time; elsewhere cuDNN where it can serve the call."""
    A = jaxkv.attention
    nhd = make_case("paged-NHD", jnp.bfloat16, head_dim, 16, [3, 0, 48, 9]).cache
    src = A._source("t", nhd, 0)
    q = normal((B, 4, 2 * HKV, head_dim), jnp.bfloat16)

    def pick(op, q, implementation=None):
        return A._implementation(op, implementation, nhd, q, None, None, src)

    monkeypatch.setattr(A._cudnn, "unusable", lambda *args: None)  # as on a GPU with jax 0.11
    monkeypatch.setattr(A._ffi, "WITH_SM90A", True)
    monkeypatch.setattr(A, "_compute_capability", lambda: "9.0")
    monkeypatch.setattr(A, "_CUDNN_DECODE_MAX_PAIRS", B * HKV - 1)  # this grid is past it
    own = "jaxkv" if head_dim == 128 else "cudnn"
    assert pick("attention.prefill", q) == own
    assert pick("attention.prefill", q[:, :1]) == own
    assert pick("attention.decode", q[:, 0]) == own
    for op, x in (("attention.prefill", q), ("attention.decode", q[:, 0])):
        assert pick(op, x, "cudnn") == "cudnn"  # asked for: served
    monkeypatch.setattr(A, "_CUDNN_DECODE_MAX_PAIRS", B * HKV)  # a decode grid this small: cuDNN
    assert [pick("attention.prefill", q), pick("attention.prefill", q[:, :1]),
            pick("attention.decode", q[:, 0])] == [own, "cudnn", "cudnn"]
    monkeypatch.setattr(A, "_CUDNN_DECODE_MAX_PAIRS", 0)
    monkeypatch.setattr(A._ffi, "WITH_SM90A", False)  # no wgmma kernel: decode steps only
    assert [pick("attention.prefill", q), pick("attention.prefill", q[:, :1])] == ["cudnn", own]
    for capability in ("8.0", "10.0", None):
        monkeypatch.setattr(A._ffi, "WITH_SM90A", True)
        monkeypatch.setattr(A, "_compute_capability", lambda c=capability: c)
        assert pick("attention.prefill", q) == pick("attention.decode", q[:, 0]) == "cudnn"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("new_tokens", [1, 4])
def test_default_compiles_to_the_kernel_picked(head_dim, new_tokens, monkeypatch):
    """On this GPU a default call's HLO holds the kernel the rule above picks, only it; one new
    token a row is a decode step (the split-KV kernel), more take the prefill's."""
    A = jaxkv.attention
    monkeypatch.setattr(A, "_CUDNN_DECODE_MAX_PAIRS", 0)  # this test's grid is a small one
    nhd = make_case("paged-NHD", jnp.bfloat16, head_dim, 16, [3, 0, 48, 9]).cache
    q = normal((B, new_tokens, 2 * HKV, head_dim), jnp.bfloat16)
    new = jnp.array([1, 0, 1, 1], jnp.int32) * new_tokens
    src = A._source("t", nhd, 0)
    for op, x, call in (("attention.prefill", q, lambda c, q: A.prefill(q, c, 0, new)),
                        ("attention.decode", q[:, 0], lambda c, q: A.decode(q, c, 0))):
        own = A._implementation(op, None, nhd, x, None, None, src)
        hlo = jax.jit(call).lower(nhd, x).compile().as_text()
        target = "prefill" if op == "attention.prefill" and new_tokens > 1 else "decode"
        assert (f"jaxkv_attention_{target}" in hlo) == (own == "jaxkv"), op
        assert bool(_CUDNN.search(hlo)) == (own == "cudnn"), op
        hopper = head_dim == 128 and A._compute_capability() == "9.0"
        assert own == ("jaxkv" if hopper else "cudnn"), op


def test_checkify_reports_bad_layer_and_lengths():
    case = make_case("paged-HND", jnp.float32, 64, 16, [3, 0, 48, 9])
    q = normal((B, 2 * HKV, 64), jnp.float32)

    def run(fn, *args):
        err, out = checkify.checkify(jax.jit(fn))(*args)
        return err.get(), out

    msg, out = run(lambda c, i: jaxkv.attention.decode(q, c, i), case.cache, jnp.int32(L))
    assert msg and "attention.decode: layer_idx out of range" in msg
    assert np.all(np.asarray(out) == 0)  # a bad layer reads nothing
    too_long = jnp.array([3, 0, 49, 9], jnp.int32)  # row 2 holds 48 positions of pages
    msg, out = run(lambda c, n: jaxkv.attention.decode(q, c, 0, kv_lengths=n), case.cache, too_long)
    assert msg and "kv_lengths outside" in msg
    assert np.all(np.isfinite(np.asarray(out)))
    msg, _ = run(lambda c: jaxkv.attention.decode(q, c, 1), case.cache)
    assert msg is None
    qp = normal((B, 4, 2 * HKV, 64), jnp.float32)
    msg, _ = run(lambda c, n: jaxkv.attention.prefill(qp, c, 0, n), case.cache,
                 jnp.array([0, 2, 1, 0], jnp.int32))
    assert msg and "past the capacity" in msg  # row 2 is full
    msg, _ = run(lambda c, n: jaxkv.attention.prefill(qp, c, 0, n), case.cache,
                 jnp.array([0, 5, 0, 0], jnp.int32))
    assert msg and "q_lengths outside [0, T]" in msg


def test_bad_input_is_a_trace_time_error_naming_op_and_argument():
    lin = make_case("linear", jnp.bfloat16, 64, 16, [1, 2, 3, 4]).cache
    man = make_case("manager", jnp.bfloat16, 64, 16, [1, 2, 3, 4]).cache
    fp8 = make_case("linear", jnp.float8_e4m3fn, 64, 16, [1, 2, 3, 4]).cache
    q = normal((B, 4, 64), jnp.bfloat16)
    bad = [
        (lambda: jaxkv.attention.decode(q[None], lin, 0), ValueError, "attention.decode: q must have rank 3"),
        (lambda: jaxkv.attention.decode(q[:3], lin, 0), ValueError, "attention.decode: q has 3 rows"),
        (lambda: jaxkv.attention.decode(normal((B, 3, 64), jnp.bfloat16), lin, 0), ValueError,
         "num_q_heads (3) must be a multiple"),
        (lambda: jaxkv.attention.decode(q.astype(jnp.float32), lin, 0), TypeError, "q has dtype float32"),
        (lambda: jaxkv.attention.decode(q, fp8, 0), ValueError, "k_scale is required"),
        (lambda: jaxkv.attention.decode(q, lin, 0, kv_lengths=jnp.zeros((B,), jnp.float32)),
         TypeError, "kv_lengths must be int32"),
        (lambda: jaxkv.attention.prefill(q, lin, 0, jnp.ones((B,), jnp.int32)), ValueError,
         "attention.prefill: q must have rank 4"),
        (lambda: jaxkv.attention.decode(q, man, jnp.int32(0)), TypeError, "layer_idx must be a Python int"),
        (lambda: jaxkv.attention.decode(q, lin.buffer, 0), TypeError, "cache must be a LinearKVCache"),
    ]
    bad.append((lambda: jaxkv.attention.decode(q, lin, L), ValueError,
                "attention.decode: layer_idx must be in [0, 1], got 2"))
    odd = jaxkv.LinearKVCache.create(1, B, HKV, 8, 96, jnp.bfloat16)
    bad.append((lambda: jaxkv.attention.decode(normal((B, 4, 96), jnp.bfloat16), odd, 0), ValueError,
                "head_dim 96 is not supported"))
    for fn, exc, msg in bad:
        with pytest.raises(exc, match=re.escape(msg)):
            fn()


def test_implementation_is_checked_and_cudnn_says_when_it_cannot_serve():
    lin = make_case("linear", jnp.bfloat16, 64, 16, [1, 2, 3, 4]).cache
    nhd = make_case("paged-NHD", jnp.float32, 64, 16, [1, 2, 3, 4]).cache
    q = normal((B, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape("attention.decode: implementation must be one")):
        jaxkv.attention.decode(q, lin, 0, implementation="xla")
    why = "cuDNN needs a CUDA GPU" if not on_gpu() else "only a PagedKVCache"
    with pytest.raises(ValueError, match=f"implementation='cudnn' cannot serve this call: .*{why}"):
        jaxkv.attention.decode(q, lin, 0, implementation="cudnn")
    if on_gpu():
        with pytest.raises(ValueError, match="bfloat16 and float16 caches"):
            jaxkv.attention.decode(q.astype(jnp.float32), nhd, 0, implementation="cudnn")
    # "jaxkv" and the default serve every cache, and agree here (the default is jaxkv's kernel
    # except for bfloat16 / float16 paged pools on a GPU).
    ours = jaxkv.attention.decode(q, lin, 0, implementation="jaxkv")
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jaxkv.attention.decode(q, lin, 0)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_cudnn_and_jaxkv_decode_match_reference_on_paged_pools(name, layout):
    """Both GPU implementations over one paged pool: GQA 1, 4, 8; head_dim 64, 128; pages 1, 16,
    128; ragged lengths with 0 and full capacity; a traced layer index."""
    dtype, kind = DTYPES[name], f"paged-{layout}"
    for group, head_dim, page_size in [(1, 64, 1), (4, 128, 16), (8, 128, 128), (8, 64, 16)]:
        probe = make_case(kind, dtype, head_dim, page_size, [0] * B)
        case = make_case(kind, dtype, head_dim, page_size, ragged(probe.capacity))
        q = normal((B, HKV * group, head_dim), dtype)
        for layer in range(L):
            k, v = case.dense(layer)
            want = ref_decode(q, k, v, case.cache.lengths)
            for implementation in ("cudnn", "jaxkv"):
                out = _decode_with(q, case.cache, jnp.int32(layer), implementation)
                assert out.shape == q.shape and out.dtype == q.dtype
                assert np.all(np.asarray(out[0]) == 0)  # row 0 has length 0: zeros
                assert_close(out, want, name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_cudnn_and_jaxkv_prefill_match_reference_on_paged_pools(name, layout):
    """cuDNN's two calls (aligned prefix, causal rest) merged: prefixes on and off page
    boundaries, none, and up to capacity; chunks of 0, 1 (a decode step) and t tokens."""
    dtype, kind = DTYPES[name], f"paged-{layout}"
    for group, head_dim, page_size, t in [(1, 64, 1, 8), (4, 128, 16, 8), (8, 128, 16, 1),
                                          (8, 64, 128, 24)]:
        probe = make_case(kind, dtype, head_dim, page_size, [0] * B)
        cap = probe.capacity
        prefix = np.array([page_size, cap - t, 0, int(_rng.integers(1, cap - t))], np.int32)
        q_lengths = np.array([0, t, min(3, t), int(_rng.integers(1, t + 1))], np.int32)
        case = make_case(kind, dtype, head_dim, page_size, prefix + q_lengths)
        case.cache = dataclasses.replace(case.cache, lengths=jnp.asarray(prefix))
        q = normal((B, t, HKV * group, head_dim), dtype)
        for layer in range(L):
            k, v = case.dense(layer)
            want = ref_prefill(q, k, v, jnp.asarray(prefix), jnp.asarray(q_lengths))
            for implementation in ("cudnn", "jaxkv"):
                out = _prefill_with(q, case.cache, jnp.int32(layer), jnp.asarray(q_lengths),
                                    implementation)
                assert out.shape == q.shape and out.dtype == q.dtype
                assert np.all(np.asarray(out[0]) == 0)  # no new tokens: zeros
                assert_close(out, want, name)


@functools.partial(jax.jit, static_argnames=("implementation",))
def _prefill_with(q, cache, layer, q_lengths, implementation):
    return jaxkv.attention.prefill(q, cache, layer, q_lengths, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation",))
def _decode_with(q, cache, layer, implementation):
    return jaxkv.attention.decode(q, cache, layer, implementation=implementation)


def test_readme_decode_step_runs():
    """The README's attention snippet runs as written and attends to what it appended."""
    import pathlib

    readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
              if "jaxkv.attention" in b and "import jax" in b]  # the runnable one
    assert len(blocks) == 1
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.shape == (2, 4, 8, 64)
    np.testing.assert_array_equal(namespace["cache"].lengths, [1, 1, 1, 0])
    # One token of ones attended by itself: the output is that value token; the idle slot's zeros.
    np.testing.assert_array_equal(np.asarray(out[:, :3], np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(out[:, 3], np.float32), 0.0)
    # The step with an idle slot is clean under checkify, a second step too.
    step = checkify.checkify(namespace["decode_step"])
    for _ in range(2):
        err, (namespace["cache"], out) = step(namespace["cache"], *(namespace[x] for x in
                                                                    ("live", "q", "k", "v")))
        assert err.get() is None
    np.testing.assert_array_equal(namespace["cache"].lengths, [3, 3, 3, 0])
