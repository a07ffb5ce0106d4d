"""Sharded caches on 8 emulated CPU devices: every op per shard equals the unsharded op on that
shard's rows (a batch shard is a cache of its own rows; head sharding changes nothing), keeps every
leaf's sharding, and compiles to an in-place program with no collective of cache data."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from helpers import assert_bytes_equal, copies_of, random_array

L, B, H, S, D = 2, 4, 4, 16, 8  # B splits over dp=2, H over tp=4
PAGES, PAGE = 16, 4
F32 = jnp.float32
SPLITS = {"heads": dict(heads="tp"), "batch": dict(batch="dp"), "both": dict(heads="tp", batch="dp")}
_rng = np.random.default_rng()
# The 8 emulated CPU devices (conftest), also where the default backend is a GPU with fewer.
DEVICES = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")


@pytest.fixture(autouse=True)
def on_the_mesh_devices(request):
    """Arrays a test on the mesh makes live where the mesh is (the CPU devices on a 1- or 2-GPU
    machine); the other tests use the default backend's devices."""
    if "mesh" not in request.fixturenames:
        yield
        return
    with jax.default_device(DEVICES[0]):
        yield


@pytest.fixture(scope="module", params=["Auto", "Explicit"])
def mesh(request):
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(getattr(AxisType, request.param),) * 2,
                         devices=DEVICES[:8])


@pytest.fixture(params=list(SPLITS))
def sharding(mesh, request):
    return jaxkv.CacheSharding(mesh, **SPLITS[request.param])


# The contract's PartitionSpecs, written out, and where each leaf's batch axis is.
def leaf_specs(c, s):
    b, h = s.batch, s.heads
    rows = P(b)
    if isinstance(c, jaxkv.PagedKVCache):
        pool = P(None, h, b, None, None) if c.layout == "HND" else P(None, b, None, h, None)
        return dict(k_pages=pool, v_pages=pool, page_table=rows, lengths=rows, ref_counts=rows,
                    new_tokens=rows)
    out = dict(lengths=rows, active_batch_size=rows if b else P())
    if isinstance(c, jaxkv.LinearKVCache):
        out["buffer"] = P(None, b, None, h, None, None)
    else:
        out["layers"] = tuple(P(b, None, h, None, None) for _ in c.layers)
    return out


def batch_axis(c, name):
    if name == "buffer":
        return 1
    if name in ("k_pages", "v_pages"):
        return 2 if c.layout == "HND" else 1
    return 0


def assert_placed(c, s):
    for name, spec in leaf_specs(c, s).items():
        leaves, specs = getattr(c, name), spec
        if isinstance(leaves, tuple):
            pairs = zip(leaves, specs)
        else:
            pairs = [(leaves, specs)]
        for x, sp in pairs:
            assert x.sharding.is_equivalent_to(NamedSharding(s.mesh, sp), x.ndim), (
                name, x.sharding, sp)
    assert c.sharding == s


# The oracle: shard b of a sharded cache as an ordinary cache, and back.
def split(c, s):
    k = s.batch_shards
    subs = []
    for b in range(k):
        fields = {}
        for name in leaf_specs(c, s):
            x = getattr(c, name)
            if name == "active_batch_size":
                fields[name] = jnp.asarray(np.asarray(x)[b] if s.batch else np.asarray(x))
            elif isinstance(x, tuple):
                fields[name] = tuple(_part(y, 0, b, k) for y in x)
            else:
                fields[name] = _part(x, batch_axis(c, name), b, k)
        subs.append(dataclasses.replace(c, sharding=None, **fields))
    return subs


def _part(x, axis, b, k):
    x = np.asarray(x)
    n = x.shape[axis] // k
    return jnp.asarray(np.take(x, np.arange(b * n, (b + 1) * n), axis=axis))


def assert_joins(c, subs, s, what=""):
    """Shard b of every leaf of ``c`` equals ``subs[b]`` byte for byte."""
    assert_placed(c, s)
    k = s.batch_shards
    for name in leaf_specs(c, s):
        x = getattr(c, name)
        for b, sub in enumerate(subs):
            y = getattr(sub, name)
            if name == "active_batch_size":
                assert int(np.asarray(x)[b] if s.batch else x) == int(y), (what, name)
            elif isinstance(x, tuple):
                for i, (xi, yi) in enumerate(zip(x, y)):
                    assert_bytes_equal(_part(xi, 0, b, k), yi, f"{what} {name}[{i}] shard {b}")
            else:
                assert_bytes_equal(_part(x, batch_axis(c, name), b, k), y,
                                   f"{what} {name} shard {b}")


def poisoned(c):
    """The cache with random bytes in its data buffers, placed as before."""
    def fill(x):
        return jax.device_put(random_array(x.shape, x.dtype), x.sharding)

    if isinstance(c, jaxkv.LinearKVCache):
        return dataclasses.replace(c, buffer=fill(c.buffer))
    if isinstance(c, jaxkv.KVCacheManager):
        return dataclasses.replace(c, layers=tuple(fill(x) for x in c.layers))
    return dataclasses.replace(c, k_pages=fill(c.k_pages), v_pages=fill(c.v_pages))


def rows_of(x, b, k, axis=0):
    return _part(x, axis, b, k)


def create(kind, s, dtype=F32):
    if kind == "linear":
        return jaxkv.LinearKVCache.create(L, B, H, S, D, dtype, sharding=s)
    cfg = [jaxkv.KVLayerConfig(H, D), jaxkv.KVLayerConfig(H, 2 * D, max_seq_len=S // 2)]
    return jaxkv.KVCacheManager.create(cfg, B, S, dtype, sharding=s)


def kv(c, tokens, dtype=F32, layer=0):
    heads, dim = (H, D) if isinstance(c, jaxkv.LinearKVCache) else c.layers[layer].shape[2::2]
    return (random_array((B, heads, tokens, dim), dtype) for _ in range(2))


def shard_preserving_mapping(k, local):
    """A random compaction inside each shard: survivors to the front of their own shard."""
    out = []
    for b in range(k):
        keep = _rng.permutation(local)[: _rng.integers(0, local + 1)]
        m = np.full(local, -1)
        m[keep] = np.arange(len(keep)) + b * local
        out.append(m)
    return np.concatenate(out).astype(np.int32)


def local_mapping(mapping, b, local):
    m = mapping[b * local:(b + 1) * local] - b * local
    return jnp.asarray(np.where((m >= 0) & (m < local), m, -1).astype(np.int32))


# Construction.
def test_cache_sharding_is_frozen_hashable_and_checked(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    assert s == jaxkv.CacheSharding(mesh, heads="tp", batch="dp") and len({s, s}) == 1
    assert (s.batch_shards, s.heads_shards) == (2, 4)
    with pytest.raises(Exception):
        s.heads = "dp"
    with pytest.raises(ValueError, match="heads='x' is not an axis"):
        jaxkv.CacheSharding(mesh, heads="x")
    with pytest.raises(ValueError, match="both name"):
        jaxkv.CacheSharding(mesh, heads="dp", batch="dp")
    with pytest.raises(TypeError, match="Mesh"):
        jaxkv.CacheSharding("mesh")


def test_create_names_the_dimension_an_axis_does_not_divide(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    with pytest.raises(ValueError, match="LinearKVCache.create: max_batch = 3 .* 'dp'"):
        jaxkv.LinearKVCache.create(L, 3, H, S, D, sharding=s)
    with pytest.raises(ValueError, match="num_kv_heads = 2 .* 4 devices of mesh axis 'tp'"):
        jaxkv.LinearKVCache.create(L, B, 2, S, D, sharding=s)
    with pytest.raises(ValueError, match=r"layer_configs\[1\].num_kv_heads = 6"):
        jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(4, 8), jaxkv.KVLayerConfig(6, 8)], B, S,
                                    sharding=s)
    with pytest.raises(ValueError, match="num_pages = 7"):
        jaxkv.PagedKVCache.create(L, 7, PAGE, H, D, B, 4, sharding=s)
    with pytest.raises(TypeError, match="CacheSharding"):
        jaxkv.LinearKVCache.create(L, B, H, S, D, sharding=mesh)


@pytest.mark.parametrize("kind", ["linear", "manager", "paged"])
def test_create_places_every_leaf(sharding, kind):
    if kind == "paged":
        c = jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, F32, sharding=sharding)
    else:
        c = create(kind, sharding)
    assert_placed(c, sharding)
    for x in jax.tree.leaves(c):  # every device holds only its shard
        assert len(x.addressable_shards) == 8


# Every op against the per-shard oracle: one jitted lifecycle, run on the sharded cache with
# global arguments and on each shard's rows as an ordinary cache with the arguments made local.
@functools.partial(jax.jit, static_argnums=2)
def dense_steps(c, a, static_layer=None):  # KVCacheManager takes a static layer index
    out = {}
    c = out["reset"] = c.reset(a["reuse"])
    c = out["ragged"] = c.append(0, a["k"], a["v"], a["new"]).commit(a["new"])
    layer = a["layer"] if static_layer is None else static_layer
    c = out["decode"] = c.append(layer, a["k1"], a["v1"]).commit(1)
    out["save"] = c.save(a["row"], 2)
    c = out["instantiate"] = c.instantiate(a["prompt"], a["targets"])
    c = out["compact"] = c.compact(a["mapping"])
    out["all_empty"] = c.all_empty
    out["set_active"] = c.set_active_batch_size(a["n"])
    return out


def dense_args(c, s, kind):
    k, local = s.batch_shards, B // s.batch_shards
    layer = jnp.int32(1)
    kk, vv = kv(c, 3)
    k1, v1 = kv(c, 1, layer=1)
    row = int(_rng.integers(0, B))
    prompt = c.save(0, 2)
    prompt = jax.tree.map(lambda x: random_array(x.shape, x.dtype), prompt)
    glob = dict(reuse=jnp.asarray(_rng.integers(0, S // 4, B), jnp.int32), k=kk, v=vv,
                new=jnp.asarray(_rng.integers(0, 4, B), jnp.int32), layer=layer, k1=k1, v1=v1,
                row=jnp.int32(row), prompt=prompt, targets=jnp.asarray([0, B - 1], jnp.int32),
                mapping=jnp.asarray(shard_preserving_mapping(k, local)), n=local)
    per_shard = []
    for b in range(k):
        t = np.asarray([0, B - 1])
        per_shard.append(dict(
            glob, reuse=rows_of(glob["reuse"], b, k), k=rows_of(kk, b, k), v=rows_of(vv, b, k),
            new=rows_of(glob["new"], b, k), k1=rows_of(k1, b, k), v1=rows_of(v1, b, k),
            row=jnp.int32(row % local),
            targets=jnp.asarray(np.where(t // local == b, t % local, local), jnp.int32),
            mapping=local_mapping(np.asarray(glob["mapping"]), b, local)))
    return glob, per_shard, row // local


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_dense_lifecycle_equals_unsharded_per_shard(sharding, kind):
    check_dense_lifecycle(sharding, kind)


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_save_of_a_row_of_no_shard_answers_as_unsharded(sharding, kind):
    """A traced row outside [0, max_batch) is reported, and the SavedKV is the unsharded op's
    (zeros of seq_len tokens), not zeros from every shard (length 0)."""
    c = poisoned(create(kind, sharding))
    data = "buffer" if kind == "linear" else "layers"
    plain = dataclasses.replace(create(kind, None), **{data: jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x)), getattr(c, data))})
    c, plain = (x.reset(jnp.full((B,), 3, jnp.int32)) for x in (c, plain))
    for row in (B, -1):
        save = jax.jit(checkify.checkify(lambda c, r: c.save(r, 2)))
        (err, got), (want_err, want) = save(c, jnp.int32(row)), save(plain, jnp.int32(row))
        assert "outside" in err.get() and "outside" in want_err.get()
        assert got.length == want.length == 2
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_bytes_equal(np.asarray(x).reshape(-1), np.asarray(y).reshape(-1), f"row {row}")


def check_dense_lifecycle(s, kind):
    c = poisoned(create(kind, s))
    glob, local_args, owner = dense_args(c, s, kind)
    static = 1 if kind == "manager" else None
    got = dense_steps(c, glob, static)
    want = [dense_steps(sub, a, static) for sub, a in zip(split(c, s), local_args)]
    for name in ("reset", "ragged", "decode", "instantiate", "compact", "set_active"):
        assert_joins(got[name], [w[name] for w in want], s, name)
    for x, y in zip(got["save"].layers, want[owner]["save"].layers):
        assert x.sharding.is_equivalent_to(NamedSharding(s.mesh, P(None, s.heads)), 4)
        assert_bytes_equal(x, y, "save")
    assert bool(got["all_empty"]) == all(bool(w["all_empty"]) for w in want)


@jax.jit
def paged_steps(c, a):
    out = {}
    c, out["served"] = c.reserve(a["n"])
    c = out["append"] = c.append(jnp.int32(1), a["k"], a["v"], a["n"]).commit(a["n"])
    c, _ = c.reserve(jnp.ones_like(a["n"]))
    c = out["append_layers"] = c.append_layers(a["kl"], a["vl"]).commit(1)
    out["queries"] = (c.num_free_pages, c.max_context_length, c.max_prompt_length, c.empty)
    out["row_lengths"] = (c.cache_length(c.max_batch - 1), c.cache_length(jnp.int32(0)))
    out["gather"] = c.gather(jnp.int32(1), 12)
    out["gather_split"] = c.gather(jnp.int32(1), 12, split=True)
    c, out["forked"] = c.fork(a["src"], a["dst"])
    out["fork"] = c
    c = out["copy_pages"] = c.copy_pages(a["copy_src"], a["copy_dst"])
    c = out["release"] = c.release(a["mask"])
    c = out["compact"] = c.compact(a["mapping"])
    return out


def paged_args(s):
    k, local, share = s.batch_shards, B // s.batch_shards, PAGES // s.batch_shards
    n = jnp.asarray(_rng.integers(1, 7, B), jnp.int32)
    kk, vv = (random_array((B, H, 6, D), F32) for _ in range(2))
    kl, vl = (random_array((L, B, H, 1, D), F32) for _ in range(2))
    src = B - 1
    owner = src // local
    pairs = np.asarray([[b * share + 1, b * share + share - 1] for b in range(k)], np.int32)
    glob = dict(n=n, k=kk, v=vv, kl=kl, vl=vl, src=jnp.int32(src),
                dst=jnp.asarray([owner * local], jnp.int32),
                copy_src=jnp.asarray(pairs[:, 0]), copy_dst=jnp.asarray(pairs[:, 1]),
                mask=jnp.asarray(_rng.integers(0, 2, B).astype(bool)),
                mapping=jnp.asarray(shard_preserving_mapping(k, local)))
    per_shard = []
    for b in range(k):
        mine = np.arange(k) == b
        per_shard.append(dict(
            n=rows_of(n, b, k), k=rows_of(kk, b, k), v=rows_of(vv, b, k),
            kl=rows_of(kl, b, k, 1), vl=rows_of(vl, b, k, 1), src=jnp.int32(src % local),
            dst=jnp.asarray([0 if b == owner else -1], jnp.int32),
            copy_src=jnp.asarray(np.where(mine, pairs[:, 0] % share, -1).astype(np.int32)),
            copy_dst=jnp.asarray(np.where(mine, pairs[:, 1] % share, -1).astype(np.int32)),
            mask=rows_of(glob["mask"], b, k),
            mapping=local_mapping(np.asarray(glob["mapping"]), b, local)))
    return glob, per_shard, owner


def test_paged_lifecycle_equals_unsharded_per_shard(sharding):
    check_paged_lifecycle(sharding)


def check_paged_lifecycle(s):
    c = poisoned(jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, F32, sharding=s))
    glob, local_args, owner = paged_args(s)
    got = paged_steps(c, glob)
    want = [paged_steps(sub, a) for sub, a in zip(split(c, s), local_args)]
    for name in ("append", "append_layers", "fork", "copy_pages", "release", "compact"):
        assert_joins(got[name], [w[name] for w in want], s, name)
    assert_bytes_equal(got["served"], np.concatenate([w["served"] for w in want]), "served")
    assert got["served"].sharding.is_equivalent_to(NamedSharding(s.mesh, P(s.batch)), 1)
    free, longest, prompt, empty = (np.asarray(x) for x in got["queries"])
    assert free == sum(int(w["queries"][0]) for w in want)
    assert longest == max(int(w["queries"][1]) for w in want)
    assert prompt == max(int(w["queries"][2]) for w in want)
    assert empty == all(bool(w["queries"][3]) for w in want)
    last, first = (int(x) for x in got["row_lengths"])  # the last shard's last row, the first's
    assert (last, first) == (int(want[-1]["row_lengths"][0]), int(want[0]["row_lengths"][1]))
    assert_bytes_equal(got["gather"], np.concatenate([w["gather"] for w in want]), "gather")
    for i in range(2):
        assert_bytes_equal(got["gather_split"][i],
                           np.concatenate([w["gather_split"][i] for w in want]), "gather split")
    assert_bytes_equal(got["forked"], want[owner]["forked"], "forked")
    assert bool(want[owner]["forked"][0])  # the fork ran: the comparison above says something


# The functional ops' sharding= argument.
def test_functional_ops_equal_unsharded(sharding):
    s = sharding
    k, local = s.batch_shards, B // s.batch_shards
    named = lambda *spec: NamedSharding(s.mesh, P(*spec))  # noqa: E731
    layers = [jax.device_put(random_array((B, 2, H, S, d), F32), named(s.batch, None, s.heads))
              for d in (D, 2 * D)]
    lengths = jax.device_put(jnp.asarray(_rng.integers(0, S, B), jnp.int32), named(s.batch))
    mapping = jnp.asarray(shard_preserving_mapping(k, local))
    out, new_lengths = jaxkv.compact_kv_cache(layers, lengths, mapping, sharding=s)
    # the oracles: the same ops on unsharded copies of every argument
    want, want_lengths = jaxkv.compact_kv_cache([np.asarray(x) for x in layers], np.asarray(lengths),
                                                mapping)
    assert_bytes_equal(new_lengths, want_lengths, "compact lengths")
    for x, w, l in zip(out, want, layers):
        assert x.sharding.is_equivalent_to(l.sharding, 5), (x.sharding, l.sharding)
        live = np.arange(S)[None, :] < np.asarray(want_lengths)[:, None]  # live tokens only
        assert_bytes_equal(np.asarray(x).transpose(0, 3, 1, 2, 4)[live],
                           np.asarray(w).transpose(0, 3, 1, 2, 4)[live], "compact")

    x = jax.device_put(random_array((B, 3), F32), named(s.batch))
    got = jaxkv.compact_tensor_batch(x, mapping, sharding=s)
    kept = np.asarray(mapping)[np.asarray(mapping) >= 0]
    assert_bytes_equal(np.asarray(got)[kept],
                       np.asarray(jaxkv.compact_tensor_batch(np.asarray(x), mapping))[kept])

    saved = jaxkv.save_kv_cache(layers, 3, 4, sharding=s)
    for a, w in zip(saved, jaxkv.save_kv_cache([np.asarray(x) for x in layers], 3, 4)):
        assert_bytes_equal(a, w, "save_kv_cache")
    rows = jnp.asarray([0, B - 1], jnp.int32)
    got = jaxkv.instantiate_kv_cache(layers, saved, rows, sharding=s)
    want = jaxkv.instantiate_kv_cache([np.asarray(x) for x in layers], [np.asarray(x) for x in saved],
                                      rows)
    for a, w in zip(got, want):
        assert_bytes_equal(a, w, "instantiate_kv_cache")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_functional_ops_equal_unsharded_per_shard(mesh, layout):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    k, local, share = 2, B // 2, PAGES // 2
    c = poisoned(jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, F32, layout, sharding=s))
    c, _ = c.reserve(jnp.full((B,), 5, jnp.int32))
    subs = split(c, s)
    kk, vv = (random_array((B, H, 5, D), F32) for _ in range(2))
    kp, vp = jaxkv.paged_append(c.k_pages, c.v_pages, c.page_table, c.lengths, 1, kk, vv,
                                layout=layout, sharding=s)
    assert kp.sharding.is_equivalent_to(c.k_pages.sharding, 5)
    axis = 2 if layout == "HND" else 1
    for b, x in enumerate(subs):
        wk, wv = jaxkv.paged_append(x.k_pages, x.v_pages, x.page_table, x.lengths, 1,
                                    rows_of(kk, b, k), rows_of(vv, b, k), layout=layout)
        assert_bytes_equal(rows_of(kp, b, k, axis), wk, "paged_append k")
        assert_bytes_equal(rows_of(vp, b, k, axis), wv, "paged_append v")
        subs[b] = x.__class__(wk, wv, x.page_table, x.lengths + 5, x.ref_counts, x.new_tokens,
                              layout)
    lengths = c.lengths + 5
    got = jaxkv.paged_gather(kp, vp, c.page_table, lengths, 1, 8, layout=layout, sharding=s)
    want = np.concatenate([x.gather(1, 8) for x in subs])
    assert_bytes_equal(got, want, "paged_gather")
    src, dst = jnp.asarray([1, share + 2], jnp.int32), jnp.asarray([3, share + 5], jnp.int32)
    kp2, vp2 = jaxkv.copy_pages(kp, vp, src, dst, layout=layout, sharding=s)
    for b, x in enumerate(subs):
        wk, wv = jaxkv.copy_pages(x.k_pages, x.v_pages, src[b:b + 1] % share, dst[b:b + 1] % share,
                                  layout=layout)
        assert_bytes_equal(rows_of(kp2, b, k, axis), wk, "copy_pages")


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_reset_to_no_rows_under_jit(mesh, kind):
    """``reset`` with zero rows (every row emptied): under jax 0.11 a zero-size operand of a
    shard_map crashed XLA's compiler (a segfault, CPU and GPU); the reset passes none."""
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    c = create(kind, s).reset(jnp.full((B,), 3, jnp.int32))
    out = jax.jit(lambda c: c.reset(jnp.zeros((0,), jnp.int32)), donate_argnums=0)(c)
    np.testing.assert_array_equal(out.lengths, np.zeros(B))
    np.testing.assert_array_equal(out.active_batch_size, [0, 0])
    assert out.lengths.sharding.spec == c.lengths.sharding.spec


# Reports through checkify.
def test_cross_shard_compaction_is_reported_and_moves_nothing_across(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    c = poisoned(create("linear", s)).reset(jnp.full((B,), 3, jnp.int32))
    before = np.asarray(c.buffer)
    mapping = jnp.asarray([2, 0, -1, -1], jnp.int32)  # row 0 -> shard 1's row 2
    err, out = jax.jit(checkify.checkify(lambda c, m: c.compact(m)))(c, mapping)
    assert "another batch shard" in err.get()
    after = np.asarray(out.buffer)
    assert_bytes_equal(after[:, 2:], before[:, 2:], "shard 1 untouched")
    assert_bytes_equal(after[:, 0, :, :, :3], before[:, 1, :, :, :3], "row 1 -> 0 inside shard 0")
    np.testing.assert_array_equal(out.lengths, [3, 0, 0, 0])
    np.testing.assert_array_equal(out.active_batch_size, [1, 0])


@pytest.mark.parametrize("kind", ["linear", "manager", "paged"])
@pytest.mark.parametrize("bad", [B, 2**31 - 1, -5])
def test_a_mapping_entry_out_of_range_is_reported_on_a_sharded_cache(mesh, kind, bad):
    """As unsharded: an entry outside [-1, rows) is reported, and counts as an eviction."""
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    c = jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, F32, sharding=s) \
        if kind == "paged" else create(kind, s)
    mapping = jnp.asarray([1, bad, -1, -1], jnp.int32)
    err, out = jax.jit(checkify.checkify(lambda c, m: c.compact(m)))(c, mapping)
    assert "outside [-1" in (err.get() or ""), err.get()
    err, _ = jax.jit(checkify.checkify(lambda c, m: c.compact(m)))(
        c, jnp.asarray([1, 0, -1, -1], jnp.int32))
    assert err.get() is None


def test_checks_inside_a_shard_are_reported(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    c = create("linear", s).reset(jnp.asarray([0, S - 1, 0, 0], jnp.int32))
    kk, vv = kv(c, 2)
    err, _ = jax.jit(checkify.checkify(lambda c: c.append(0, kk, vv).commit(2)))(c)
    assert "past max_seq_len" in err.get()
    err, _ = jax.jit(checkify.checkify(lambda c: c.append(0, kk[:, :, :1], vv[:, :, :1])))(c)
    assert err.get() is None
    saved = c.save(0, 2)
    err, _ = jax.jit(checkify.checkify(lambda c, i: c.instantiate(saved, i)))(c, jnp.int32(B))
    assert "batch_idx outside" in err.get()
    err, _ = jax.jit(checkify.checkify(lambda c, i: c.instantiate(saved, i)))(c, jnp.int32(B - 1))
    assert err.get() is None  # a row of another shard is not an error


def test_trace_time_errors_name_global_shapes(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    c = create("linear", s)
    with pytest.raises(ValueError, match=r"LinearKVCache.append: k must have shape \(4, 4, T, 8\)"):
        c.append(0, jnp.ones((2, 4, 1, 8), F32), jnp.ones((2, 4, 1, 8), F32))
    with pytest.raises(ValueError, match="reuse_lengths' length = 3 is not divisible"):
        c.reset(jnp.zeros((3,), jnp.int32))


def test_wrong_out_spec_fails_instead_of_returning_shard_0(mesh):
    from jaxkv.sharding import run_per_shard

    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    layer = jax.device_put(random_array((B, 2, H, S, D), F32),
                           NamedSharding(mesh, P("dp", None, "tp")))
    lengths = jnp.zeros((B,), jnp.int32)
    mapping = jnp.asarray([1, 0, 1, 0], jnp.int32)  # a swap inside each shard
    body = functools.partial(jaxkv.compact_kv_cache)
    specs = (P("dp", None, "tp"), P("dp"), P("dp"))
    with pytest.raises(Exception, match="tp"):  # the layer varies over tp: P('dp') is wrong
        run_per_shard(s, body, (layer, lengths, mapping), specs, (P("dp"), P("dp")))


# Compiled programs: in place, no collective of cache data.
COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
ALL_REDUCE = re.compile(r"=\s*(\S+)\s+all-reduce(-start)?\(")


def local_type(x):
    return jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)


def assert_in_place(fn, c, *args, saved_bytes=0):
    """``fn(c, *args)`` jitted with ``c`` donated: no collective but small all-reduces, no copy
    of a cache buffer, the donated buffers consumed and reused."""
    big = [x for x in jax.tree.leaves(c) if x.size >= 64 * 8]
    step = jax.jit(fn, donate_argnums=0)
    hlo = step.lower(c, *args).compile().as_text()
    assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
    for t, _ in ALL_REDUCE.findall(hlo):  # metadata (ints, flags) or one saved row
        elems = np.prod([int(n) for n in re.findall(r"\d+", t.split("[")[1])] or [1])
        assert elems <= max(saved_bytes, 16), t
    for x in big:
        assert not copies_of(hlo, local_type(x)), copies_of(hlo, local_type(x))
    pointers = [[sh.data.unsafe_buffer_pointer() for sh in x.addressable_shards] for x in big]
    out = step(c, *args)
    assert all(x.is_deleted() for x in big)
    out_cache = out[0] if isinstance(out, tuple) else out
    new_big = [x for x in jax.tree.leaves(out_cache) if x.size >= 64 * 8]
    assert [[sh.data.unsafe_buffer_pointer() for sh in x.addressable_shards]
            for x in new_big] == pointers
    return out


@pytest.mark.parametrize("kind", ["linear", "manager"])
def test_dense_ops_compile_in_place_without_collectives(mesh, kind):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    fresh = lambda: create(kind, s).reset(jnp.full((B,), 2, jnp.int32))  # noqa: E731
    kk, vv = kv(fresh(), 1)
    mapping = jnp.asarray([1, -1, 2, 3], jnp.int32)
    saved = fresh().save(0, 2)
    ops = {
        "append": (lambda c, k, v: c.append(0, k, v), kk, vv),
        "commit": (lambda c: c.commit(1),),
        "reset": (lambda c, r: c.reset(r), jnp.ones((B,), jnp.int32)),
        "compact": (lambda c, m: c.compact(m), mapping),
        "instantiate": (lambda c, i: c.instantiate(saved, i), jnp.asarray([1, 2], jnp.int32)),
    }
    for name, (fn, *args) in ops.items():
        assert_in_place(fn, fresh(), *args)
    hlo = jax.jit(lambda c: (c, c.save(jnp.int32(1), 2))).lower(fresh()).compile().as_text()
    assert not COLLECTIVES.findall(hlo)


def test_functional_ops_compile_in_place_without_collectives(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    named = NamedSharding(mesh, P("dp", None, "tp"))
    layer = lambda: jax.device_put(random_array((B, 2, H, S, D), F32), named)  # noqa: E731
    lengths = jax.device_put(jnp.full((B,), 2, jnp.int32), NamedSharding(mesh, P("dp")))
    mapping = jnp.asarray([1, -1, 2, 3], jnp.int32)
    assert_in_place(lambda x, l, m: jaxkv.compact_kv_cache(x, l, m, sharding=s), layer(),
                    lengths, mapping)
    saved = jaxkv.save_kv_cache(layer(), 0, 2, sharding=s)
    assert_in_place(lambda x, v, i: jaxkv.instantiate_kv_cache(x, v, i, sharding=s), layer(),
                    saved, jnp.int32(3))


@pytest.mark.parametrize("mesh", ["Auto"], indirect=True)  # Explicit: in the lifecycle tests
def test_paged_ops_compile_in_place_without_collectives(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")

    def fresh():
        c = jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, F32, sharding=s)
        c, _ = c.reserve(jnp.full((B,), 5, jnp.int32))
        return c.commit(5)

    kk, vv = (random_array((B, H, 1, D), F32) for _ in range(2))
    ops = {
        "reserve": (lambda c, n: c.reserve(n), jnp.ones((B,), jnp.int32)),
        "append": (lambda c, k, v: c.append(0, k, v, jnp.zeros((B,), jnp.int32)), kk, vv),
        "commit": (lambda c: c.commit(jnp.zeros((B,), jnp.int32)),),
        "release": (lambda c, m: c.release(m), jnp.asarray([True, False, False, True])),
        "compact": (lambda c, m: c.compact(m), jnp.asarray([1, 0, -1, 2], jnp.int32)),
        "fork": (lambda c, d: c.fork(0, d), jnp.asarray([1], jnp.int32)),
        "copy_pages": (lambda c, a, b: c.copy_pages(a, b), jnp.asarray([0], jnp.int32),
                       jnp.asarray([7], jnp.int32)),
    }
    for name, (fn, *args) in ops.items():
        assert_in_place(fn, fresh(), *args)
    hlo = jax.jit(lambda c: c.gather(0, 8)).lower(fresh()).compile().as_text()
    assert not COLLECTIVES.findall(hlo)


def test_scan_decode_loop_stays_sharded_and_in_place(mesh):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    steps, cap = 64, 72

    def make(sharding):  # every row active: the same cache with or without a batch split
        c = jaxkv.LinearKVCache.create(L, B, H, cap, D, F32, sharding=sharding)
        return c.reset(jnp.asarray([3, 0, 5, 1], jnp.int32))

    tokens = random_array((steps, L, B, H, 1, D), F32)

    def decode(c, t):
        def layer(c, i):
            return c.append(i, t[i], t[i]), None
        c, _ = jax.lax.scan(layer, c, jnp.arange(L, dtype=jnp.int32))
        return c.commit(1), None

    run = lambda c, t: jax.lax.scan(decode, c, t)[0]  # noqa: E731
    out = assert_in_place(run, make(s), tokens)
    assert_placed(out, s)
    want = jax.jit(run)(make(None), tokens)
    assert_bytes_equal(out.buffer, want.buffer, "64 steps")
    assert_bytes_equal(out.lengths, want.lengths, "lengths")


def test_readme_sharding_example_runs(capsys):
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Sharding", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    cache = namespace["cache"]
    assert cache.buffer.sharding.spec == P(None, None, None, "tp", None, None)
    assert len(cache.buffer.sharding.device_set) == jax.device_count()
    np.testing.assert_array_equal(cache.lengths, [1, 1, 1, 1])
    assert "'tp'" in capsys.readouterr().out


@pytest.mark.long
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices of the default backend")
def test_bench_devices_measures_sharded_ops_in_place():
    from jaxkv._bench import sharded

    rows = sharded.run(2, "cpu", reps=1)
    assert [(r["op"], r["split"]) for r in rows] == [
        (op, split) for op in ("compact", "append", "paged_append") for split in sharded.SPLITS]
    for r in rows:
        assert r["gbps_1"] > 0 and r["gbps_2"] > 0 and r["ratio"] > 0
        assert r["big_copies_1"] == r["big_copies_2"] == 0, r  # in place
        assert r["collectives_1"] == r["collectives_2"] == 0, r  # local shards only
    z = sharded.SIZES["cpu"]  # the appends: T tokens per row, per device as on one device
    appended = 2 * 2 * z["B"] * z["H"] * z["T"] * z["D"] * 4
    assert [r["bytes_per_device"] for r in rows[2:]] == [appended] * 4
    assert "ratio" in sharded.table(rows) and "kernel" in sharded.table(rows)


def test_bench_devices_sizes_make_every_op_bandwidth_sized():
    """On a GPU a loop iteration costs ~8 us whatever it runs: an op must move far more than
    that many microseconds of bytes (>= 40 MB at 4 TB/s) to measure bandwidth, not dispatch."""
    from jaxkv._bench import sharded

    z = sharded.SIZES["gpu"]
    item = jnp.dtype(z["dtype"]).itemsize
    appended = 2 * 2 * z["B"] * z["H"] * z["T"] * z["D"] * item
    assert appended >= 64 << 20 and z["T"] <= z["S"] // 2


# The demo's stream: more requests than rows, so every batch shard admits and evicts repeatedly.
DEMO = ["--requests", "8", "--max-batch", "4", "--system-len", "4", "--max-prompt-len", "4",
        "--max-new-tokens", "5", "--page-size", "4"]


@functools.lru_cache(maxsize=None)
def demo_run(kind, axes=None):
    """(engine, stats, each request's tokens) of the demo's stream, on a mesh of ``axes``."""
    from jaxkv.demo import cli

    args = cli.parse_args(["--cache", kind, *DEMO] + (["--mesh", axes] if axes else []))
    stream = cli.Stream(args)
    engine = stream.engine("jaxkv")
    requests = stream.requests()
    with jax.default_matmul_precision("highest"):
        stats = engine.run(requests)
    return engine, stats, tuple(tuple(r.output) for r in requests)


@pytest.mark.parametrize("kind, axes", [
    ("paged", "tp=2"),  # KV heads split (the paged kind goes through every sharded path)
    *((kind, axes) for kind in ("linear", "manager", "paged") for axes in ("dp=2,tp=2", "dp=4")),
])
@pytest.mark.long
def test_demo_with_a_mesh_generates_the_unsharded_tokens(kind, axes):
    from jaxkv.demo import cli

    sizes = cli.parse_mesh(axes)
    if jax.device_count() < np.prod(list(sizes.values())):
        pytest.skip(f"needs {np.prod(list(sizes.values()))} devices of the default backend")
    _, _, unsharded = demo_run(kind)
    engine, stats, tokens = demo_run(kind, axes)
    assert tokens == unsharded and all(tokens)
    s = engine.kind.sharding
    assert (s.batch_shards, s.heads_shards) == (sizes.get("dp", 1), sizes.get("tp", 1))
    assert engine.cache_copies() == 0
    # Continuous batching in every shard: admissions after evictions, every request evicted.
    assert stats.admit_steps > 1 and stats.evictions == 8


@pytest.mark.long
@pytest.mark.parametrize("kind", ["linear", "paged"])
def test_demo_command_with_batch_shards_matches_the_xla_baseline(kind, capsys):
    """The XLA baseline on the same sharded cache (its plain scatters on the sharded leaves; the
    paged one reads the pool through page ids of the whole pool)."""
    from jaxkv.demo import cli

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices of the default backend")
    assert cli.main(["--cache", kind, *DEMO, "--mesh", "dp=2,tp=2", "--baseline", "xla"]) == 0
    out = capsys.readouterr().out
    assert "8/8 requests" in out and "xla baseline generated the same tokens" in out


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["heads", "batch"])
def test_lifecycles_on_every_gpu(split):
    """The CUDA kernels per shard: every op on a mesh of all the GPUs (1, 2, ...); the batch over
    at most B / 2 of them, since a fork takes two rows of one shard."""
    gpus = jax.devices("gpu")
    if split == "batch":
        gpus = gpus[:max(1, min(len(gpus), B // 2))]
    if B % len(gpus) or H % len(gpus) or PAGES % len(gpus):
        pytest.skip(f"{len(gpus)} GPUs do not divide the test shapes")
    mesh = jax.make_mesh((len(gpus),), ("d",), devices=gpus)
    s = jaxkv.CacheSharding(mesh, **{split: "d"})
    with jax.default_device(gpus[0]):
        for kind in ("linear", "manager"):
            check_dense_lifecycle(s, kind)
        check_paged_lifecycle(s)
