"""The sharded path of the cache methods and functional ops.

Each runs the ordinary unsharded method (or op) once per device on its local shards through
``sharding.per_shard``; this module only says how each argument is split and turns global row
ids and counts into local ones. The arguments are first validated at their global shapes (the
unsharded method under ``jax.eval_shape``), so trace-time messages name global shapes.

Under batch sharding a shard is a cache of its own rows: ``active_batch_size`` is int32
``[batch_shards]`` (shard ``s`` has live local rows ``[0, active_batch_size[s])``), and a paged
shard owns pages ``[s * P/k, (s + 1) * P/k)`` of the pools, addressed by local page ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _validate as validate
from . import reuse
from ._checks import check
from .sharding import (KV, KV_LAYERS, LAYER, LINEAR_BUFFER, POOL, REPLICATED, ROWS, SAVED,
                       CacheSharding, abstract, per_shard)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


# The cache pytrees, per shard.
def cache_specs(cache):
    """The cache with a ``PartitionSpec`` in place of each leaf."""
    s = cache.sharding
    rows = s.spec(*ROWS)
    if hasattr(cache, "k_pages"):
        pool = s.spec(*POOL[cache.layout])
        return dataclasses.replace(cache, k_pages=pool, v_pages=pool, page_table=rows,
                                   lengths=rows, ref_counts=rows, new_tokens=rows)
    if hasattr(cache, "buffer"):
        fields = dict(buffer=s.spec(*LINEAR_BUFFER))
    else:
        fields = dict(layers=tuple(s.spec(*LAYER) for _ in cache.layers))
    active = rows if s.batch else P()
    return dataclasses.replace(cache, lengths=rows, active_batch_size=active, **fields)


def _local(cache):
    """A shard's cache as an ordinary unsharded cache (its active count a scalar)."""
    if hasattr(cache, "active_batch_size") and cache.sharding.batch:
        return dataclasses.replace(cache, sharding=None,
                                   active_batch_size=cache.active_batch_size.reshape(()))
    return dataclasses.replace(cache, sharding=None)


def _global(result, s: CacheSharding):
    """Results of a local method, caches typed back as shards of the sharded cache."""
    if isinstance(result, tuple):
        return tuple(_global(r, s) for r in result)
    if not hasattr(result, "sharding") or not dataclasses.is_dataclass(result) or isinstance(
            result, type):
        return result
    if hasattr(result, "active_batch_size") and s.batch:
        return dataclasses.replace(result, sharding=s,
                                   active_batch_size=result.active_batch_size.reshape((1,)))
    return dataclasses.replace(result, sharding=s)


def _unsharded(cache):
    """The cache as one unsharded cache of the global shapes, abstract (for validation)."""
    out = dataclasses.replace(cache, sharding=None)
    if hasattr(cache, "active_batch_size"):
        out = dataclasses.replace(out, active_batch_size=jnp.zeros((), jnp.int32))
    return abstract(out)


def _eval_shape(fn, *args):
    """``fn(*args)`` traced abstractly with only the arrays of ``args`` as tracers (Python ints
    stay static), to run its trace-time checks at global shapes."""
    leaves, treedef = jax.tree.flatten(args)
    is_arr = [_is_array(x) for x in leaves]

    def call(*arrays):
        it = iter(arrays)
        full = [next(it) if a else x for x, a in zip(leaves, is_arr)]
        return fn(*jax.tree.unflatten(treedef, full))

    return jax.eval_shape(call, *[jax.ShapeDtypeStruct(x.shape, x.dtype)
                                  for x, a in zip(leaves, is_arr) if a])


def validate_method(cache, name: str, *args):
    _eval_shape(lambda c, *a: getattr(c, name)(*a), _unsharded(cache), *args)


def method(cache, name: str, args: tuple, roles: tuple, out_specs=None):
    """``cache.name(*args)`` per shard; ``roles[i]`` splits array argument ``i`` (other
    arguments are static). ``out_specs``: of the result, the cache's own by default."""
    validate_method(cache, name, *args)
    s = cache.sharding
    dynamic = [i for i, a in enumerate(args) if _is_array(a)]

    def body(c, *values):
        full = list(args)
        for i, x in zip(dynamic, values):
            full[i] = x
        return _global(getattr(_local(c), name)(*full), s)

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, *[args[i] for i in dynamic]),
                     (specs, *[s.spec(*roles[i]) for i in dynamic]),
                     specs if out_specs is None else out_specs)


def localize_mapping(op: str, s: CacheSharding, mapping: jax.Array, rows: int) -> jax.Array:
    """A shard's slice of a global ``batch_mapping`` in local rows. A survivor sent to another
    shard's row is reported and evicted: compaction never moves data across shards."""
    local_rows = rows // s.batch_shards
    local = mapping - s.shard_index() * local_rows
    here = (local >= 0) & (local < local_rows)
    survivor = (mapping >= 0) & (mapping < rows)
    check(~survivor | here,
          f"{op}: batch_mapping sends a row to another batch shard: it is evicted "
          "(compaction never moves data across shards)")
    return jnp.where(here, local, -1)


# Dense caches (LinearKVCache, KVCacheManager).
def _kv_buffers(cache):
    if hasattr(cache, "buffer"):
        return [cache.buffer], ["buffer"]
    return list(cache.layers), [f"layers[{i}]" for i in range(len(cache.layers))]


def _with_kv_buffers(cache, out):
    if hasattr(cache, "buffer"):
        return dataclasses.replace(cache, buffer=out[0])
    return dataclasses.replace(cache, layers=tuple(out))


def reset(cache, reuse_lengths):
    s = cache.sharding
    validate_method(cache, "reset", reuse_lengths)
    s.require_divides(f"{type(cache).__name__}.reset", "reuse_lengths' length",
                      reuse_lengths.shape[0], "batch")
    if reuse_lengths.shape[0] == 0:
        # No row kept: no operand. A zero-size operand of a shard_map crashes the XLA compiler of
        # jax 0.11 (a segfault, on CPU and on the H200s).
        def body(c):
            return _global(_local(c).reset(jnp.zeros((0,), jnp.int32)), s)

        specs = cache_specs(cache)
        return per_shard(s, body, (cache,), (specs,), specs)
    return method(cache, "reset", (reuse_lengths,), (ROWS,))


def set_active_batch_size(cache, n):
    """``n``: each shard's count (an int or an int32 scalar), or int32 ``[batch_shards]``."""
    op = f"{type(cache).__name__}.set_active_batch_size"
    s = cache.sharding
    local_batch = cache.max_batch // s.batch_shards
    if s.batch is None:
        return method(cache, "set_active_batch_size", (n,), (REPLICATED,))
    if isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)):
        validate.static_int(op, "n", n, 0, local_batch)
    if not _is_array(n) or n.ndim == 0:
        n = jnp.full((s.batch_shards,), validate.int_scalar(op, "n", n), jnp.int32)
    validate.array(op, "n", n)
    validate.int32(op, "n", n)
    validate.shape(op, "n", n, (s.batch_shards,), "[batch_shards]")

    def body(c, count):
        return _global(_local(c).set_active_batch_size(count.reshape(())), s)

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, n), (specs, s.spec(*ROWS)), specs)


def append(cache, layer_idx, k, v, new_lengths):
    return method(cache, "append", (layer_idx, k, v, new_lengths),
                  (REPLICATED, KV, KV, ROWS))


def commit(cache, new_lengths):
    return method(cache, "commit", (new_lengths,), (ROWS,))


def compact(cache, batch_mapping):
    """Dense and paged: every shard compacts its own rows."""
    op = f"{type(cache).__name__}.compact"
    validate_method(cache, "compact", batch_mapping)
    s = cache.sharding

    def body(c, mapping):
        return _global(_local(c).compact(localize_mapping(op, s, mapping, cache.max_batch)), s)

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, batch_mapping), (specs, s.spec(*ROWS)), specs)


def all_empty(cache):
    """One psum of an int32 over the batch shards."""
    s = cache.sharding

    def body(c):
        busy = jnp.logical_not(_local(c).all_empty).astype(jnp.int32)
        return s.psum_batch(busy) == 0

    return per_shard(s, body, (cache,), (cache_specs(cache),), P())


def _saved_specs(s: CacheSharding, num_layers: int):
    """A ``SavedKV`` whose leaves are PartitionSpecs (a spec prefix for ``shard_map``)."""
    specs: Any = tuple(s.spec(*SAVED) for _ in range(num_layers))
    return reuse.SavedKV(layers=specs, length=cast(Any, P()))


def _row_ids(op: str, batch_idx):
    if _is_array(batch_idx):
        return batch_idx
    validate.int_scalar(op, "batch_idx", batch_idx)  # type errors at trace time
    return jnp.asarray(batch_idx, jnp.int32)


def save(cache, batch_idx, seq_len: int):
    """The owner shard reads the row; one all-reduce of the saved row's size (not the cache's)
    hands it to the other batch shards."""
    op = f"{type(cache).__name__}.save"
    validate_method(cache, "save", batch_idx, seq_len)
    s = cache.sharding
    rows = cache.max_batch // s.batch_shards
    idx = _row_ids(op, batch_idx)

    def body(c, idx):
        local, owned = s.local_rows(idx, rows)
        foreign = (idx >= 0) & (idx < cache.max_batch) & ~owned
        buffers, names = _kv_buffers(_local(c))
        out = reuse.save_buffers(op, buffers, names, local, seq_len, foreign=foreign)
        return reuse.SavedKV(layers=tuple(s.from_owner(x, owned) for x in out),
                             length=jnp.asarray(seq_len, jnp.int32))

    return per_shard(s, body, (cache, idx), (cache_specs(cache), P()),
                     _saved_specs(s, cache.num_layers))


def instantiate(cache, saved, batch_idx):
    op = f"{type(cache).__name__}.instantiate"
    validate_method(cache, "instantiate", saved, batch_idx)
    s = cache.sharding
    rows = cache.max_batch // s.batch_shards
    idx = _row_ids(op, batch_idx)

    def body(c, saved, idx):
        local, owned = s.local_rows(idx, rows)
        foreign = (idx >= 0) & (idx < cache.max_batch) & ~owned
        lc = _local(c)
        buffers, names = _kv_buffers(lc)
        out = reuse.instantiate_saved_kv(op, buffers, names, saved, local, foreign=foreign)
        return _global(_with_kv_buffers(lc, out), s)

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, saved, idx),
                     (specs, _saved_specs(s, saved.num_layers), P()), specs)


def create(cls, op: str, s, fields: dict, max_batch: int, heads: dict):
    """A cache with every leaf created already placed. ``fields``: name -> (shape, dtype,
    roles), or a list of them for a tuple field; ``heads``: dimension name -> head count."""
    if not isinstance(s, CacheSharding):
        raise TypeError(f"{op}: sharding must be a jaxkv.CacheSharding, got {type(s).__name__}")
    s.require_divides(op, "max_batch", max_batch, "batch")
    for name, count in heads.items():
        s.require_divides(op, name, count, "heads")

    def place(spec):
        if isinstance(spec, list):
            return tuple(place(x) for x in spec)
        shape, dtype, roles = spec
        return s.full(shape, 0, dtype, roles)

    placed = {name: place(spec) for name, spec in fields.items()}
    rows = s.full((max_batch,), 0, jnp.int32, ROWS)
    if s.batch:
        active = s.full((s.batch_shards,), 0, jnp.int32, ROWS)
    else:
        active = s.full((), 0, jnp.int32, REPLICATED)
    return cls(**placed, lengths=rows, active_batch_size=active, sharding=s)


# Functional ops (``sharding=``): the layers as in a KVCacheManager, any other rows tensor split
# on its leading axis.
def _rows_spec(s: CacheSharding, rows: int, op: str) -> P:
    s.require_divides(op, "max_batch", rows, "batch")
    return s.spec(*ROWS)


def _padded_mapping(batch_mapping, rows: int):
    """A mapping of every row: rows past ``n_old`` are evicted, as the unsharded op does."""
    extra = rows - batch_mapping.shape[0]
    if extra == 0:
        return batch_mapping
    return jnp.concatenate([batch_mapping, jnp.full((extra,), -1, jnp.int32)])


def compact_kv_cache(layers, lengths, batch_mapping, s: CacheSharding):
    from . import ops

    op = "compact_kv_cache"
    _eval_shape(ops.compact_kv_cache, layers, lengths, batch_mapping)
    rows = lengths.shape[0]
    row_spec = _rows_spec(s, rows, op)
    layer_specs = jax.tree.map(lambda _: s.spec(*LAYER), layers)

    def body(layers, lengths, mapping):
        return ops.compact_kv_cache(layers, lengths, localize_mapping(op, s, mapping, rows))

    return per_shard(s, body, (layers, lengths, _padded_mapping(batch_mapping, rows)),
                     (layer_specs, row_spec, row_spec), (layer_specs, row_spec))


def compact_tensor_batch(x, batch_mapping, s: CacheSharding):
    from . import ops

    op = "compact_tensor_batch"
    _eval_shape(ops.compact_tensor_batch, x, batch_mapping)
    rows = x.shape[0]
    row_spec = _rows_spec(s, rows, op)

    def body(x, mapping):
        return ops.compact_tensor_batch(x, localize_mapping(op, s, mapping, rows))

    return per_shard(s, body, (x, _padded_mapping(batch_mapping, rows)), (row_spec, row_spec),
                     row_spec)


def _prompt_layers(op: str, s: CacheSharding, layers):
    """(rows, rows per batch shard, the layers' specs) of a save / instantiate, checked."""
    items, _ = reuse._layer_list(op, layers)
    rows = items[0].shape[0]
    _rows_spec(s, rows, op)
    for i, layer in enumerate(items):
        s.require_divides(op, f"num_kv_heads of layer {i}", layer.shape[2], "heads")
    return rows, rows // s.batch_shards, jax.tree.map(lambda _: s.spec(*LAYER), layers)


def save_kv_cache(layers, batch_idx, seq_len: int, s: CacheSharding):
    op = "save_kv_cache"
    _eval_shape(lambda l, i: reuse.save_kv_cache(l, i, seq_len), layers, batch_idx)
    rows, local_rows, layer_specs = _prompt_layers(op, s, layers)
    saved_specs = jax.tree.map(lambda _: s.spec(*SAVED), layers)

    def body(layers, idx):
        local, owned = s.local_rows(idx, local_rows)
        foreign = (idx >= 0) & (idx < rows) & ~owned
        items, names = reuse._layer_list(op, layers)
        out = reuse.save_buffers(op, items, names, local, seq_len, foreign=foreign)
        return reuse._like(layers, [s.from_owner(x, owned) for x in out])

    return per_shard(s, body, (layers, _row_ids(op, batch_idx)), (layer_specs, P()), saved_specs)


def instantiate_kv_cache(layers, saved, batch_idx, s: CacheSharding):
    op = "instantiate_kv_cache"
    _eval_shape(reuse.instantiate_kv_cache, layers, saved, batch_idx)
    rows, local_rows, layer_specs = _prompt_layers(op, s, layers)
    saved_specs = jax.tree.map(lambda _: s.spec(*SAVED), saved)

    def body(layers, saved, idx):
        local, owned = s.local_rows(idx, local_rows)
        foreign = (idx >= 0) & (idx < rows) & ~owned
        items, names = reuse._layer_list(op, layers)
        saved_items = list(saved) if isinstance(saved, (list, tuple)) else [saved]
        saved_names = [f"saved[{i}]" for i in range(len(saved_items))]
        out = reuse.instantiate_buffers(op, items, names, saved_items, saved_names, local,
                                        foreign=foreign)
        return reuse._like(layers, out)

    return per_shard(s, body, (layers, saved, _row_ids(op, batch_idx)),
                     (layer_specs, saved_specs, P()), layer_specs)


# The paged cache: each batch shard owns an equal share of the pages, its own allocator
# (ref_counts of its share) and page tables of local page ids.
def create_paged(cls, op: str, s, shape, dtype, layout: str, num_pages: int, max_batch: int,
                 max_pages_per_seq: int, num_kv_heads: int):
    from .paged_ops import NO_PAGE

    if not isinstance(s, CacheSharding):
        raise TypeError(f"{op}: sharding must be a jaxkv.CacheSharding, got {type(s).__name__}")
    s.require_divides(op, "max_batch", max_batch, "batch")
    s.require_divides(op, "num_pages", num_pages, "batch")
    s.require_divides(op, "num_kv_heads", num_kv_heads, "heads")
    pool = POOL[layout]
    return cls(
        k_pages=s.full(shape, 0, dtype, pool),
        v_pages=s.full(shape, 0, dtype, pool),
        page_table=s.full((max_batch, max_pages_per_seq), NO_PAGE, jnp.int32, ROWS),
        lengths=s.full((max_batch,), 0, jnp.int32, ROWS),
        ref_counts=s.full((num_pages,), 0, jnp.int32, ROWS),
        new_tokens=s.full((max_batch,), 0, jnp.int32, ROWS),
        layout=layout,
        sharding=s,
    )


def reserve(cache, num_new_tokens):
    s = cache.sharding
    return method(cache, "reserve", (num_new_tokens,), (ROWS,),
                  out_specs=(cache_specs(cache), s.spec(*ROWS)))


def release(cache, mask):
    return method(cache, "release", (mask,), (ROWS,))


def paged_append(cache, name: str, layer_idx, k, v, new_lengths):
    roles = KV_LAYERS if name == "append_layers" else KV
    args = (k, v, new_lengths) if name == "append_layers" else (layer_idx, k, v, new_lengths)
    return method(cache, name, args, ((REPLICATED,) if name == "append" else ()) + (roles, roles, ROWS))


def gather(cache, layer_idx, max_len: int, split: bool):
    s = cache.sharding
    dense = s.spec("batch", None, "heads", None, None)
    out = (s.spec(*KV),) * 2 if split else dense
    validate_method(cache, "gather", layer_idx, max_len)
    layer = _row_ids("PagedKVCache.gather", layer_idx)

    def body(c, layer):
        return _local(c).gather(layer, max_len, split=split)

    return per_shard(s, body, (cache, layer), (cache_specs(cache), P()), out)


def paged_metadata(cache, name: str, combine: str):
    """A global query from one int per shard: ``psum`` or ``pmax`` over the batch shards."""
    s = cache.sharding

    def body(c):
        x = getattr(_local(c), name).astype(jnp.int32)
        if s.batch is None:
            return x
        if combine == "max":
            return jax.lax.pmax(x, s.batch)
        return jax.lax.psum(x, s.batch)

    out = per_shard(s, body, (cache,), (cache_specs(cache),), P())
    return out == s.batch_shards if combine == "all" else out


def fork(cache, src_slot, dst_slots):
    """Forks inside one batch shard (pages never cross shards); ``forked`` is combined from
    the shards with one psum of an int32 per destination."""
    from . import _checks

    op = "PagedKVCache.fork"
    validate_method(cache, "fork", src_slot, dst_slots)
    s = cache.sharding
    rows = cache.max_batch
    local_rows = rows // s.batch_shards
    src = _row_ids(op, src_slot)

    def body(c, src, dst):
        src_local, src_here = s.local_rows(src, local_rows)
        dst_local, dst_here = s.local_rows(dst, local_rows)
        mine = dst_here & src_here
        # The local fork sees other shards' destinations as invalid: its own reports are
        # replaced by the global ones below.
        with _checks.collected():
            out, forked = _local(c).fork(jnp.where(src_here, src_local, 0),
                                         jnp.where(mine, dst_local, local_rows))
        ok = (src >= 0) & (src < rows) & (dst >= 0) & (dst < rows) & (dst != src)
        hits = jnp.zeros((rows + 1,), jnp.int32).at[jnp.where(ok, dst, rows)].add(1)[:rows]
        check(jnp.all(ok) & jnp.all(hits <= 1),
              f"{op}: dst_slots must be distinct valid slots other than src_slot")
        shard_of = lambda r: r // local_rows  # noqa: E731
        check(~ok | (shard_of(dst) == shard_of(src)),
              f"{op}: a destination on another batch shard than the source is not forked "
              "(pages never cross shards)")
        check(forked | ~mine, f"{op}: out of pages")
        done = s.psum_batch((forked & mine).astype(jnp.int32)) > 0
        return _global(out, s), done

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, src, dst_slots), (specs, P(), P()), (specs, P()))


def localize_pages(op: str, s: CacheSharding, src, dst, num_pages: int):
    """Global page ids -> this shard's local ids; a pair of another shard (or straddling two,
    reported) gets -1, which copy_pages skips."""
    share = num_pages // s.batch_shards
    src_local, src_here = s.local_rows(src, share)
    dst_local, dst_here = s.local_rows(dst, share)
    valid = (src >= 0) & (src < num_pages) & (dst >= 0) & (dst < num_pages)
    check(~valid | (src // share == dst // share),
          f"{op}: a pair of pages on two batch shards is skipped (pages never cross shards)")
    mine = src_here & dst_here
    return jnp.where(mine, src_local, -1), jnp.where(mine, dst_local, -1)


def copy_pages(cache, src_pages, dst_pages):
    op = "PagedKVCache.copy_pages"
    validate_method(cache, "copy_pages", src_pages, dst_pages)
    s = cache.sharding

    def body(c, src, dst):
        src, dst = localize_pages(op, s, src, dst, cache.num_pages)
        return _global(_local(c).copy_pages(src, dst), s)

    specs = cache_specs(cache)
    return per_shard(s, body, (cache, src_pages, dst_pages), (specs, P(), P()), specs)


# The paged functional ops: pools split as a PagedKVCache's, page tables of local page ids.
def _pool_specs(op, s: CacheSharding, k_pages, page_table, layout: str):
    from .paged_ops import pool_geometry

    g = pool_geometry(layout, k_pages.shape)
    s.require_divides(op, "num_pages", g["num_pages"], "batch")
    s.require_divides(op, "num_kv_heads", g["num_kv_heads"], "heads")
    s.require_divides(op, "max_batch", page_table.shape[0], "batch")
    return s.spec(*POOL[layout])


def paged_append_op(k_pages, v_pages, page_table, lengths, layer_idx, k, v, new_lengths,
                    layout: str, s: CacheSharding):
    from . import paged_ops

    op = "paged_append"
    _eval_shape(lambda *a: paged_ops.paged_append(*a, layout=layout), k_pages, v_pages,
                page_table, lengths, layer_idx, k, v, new_lengths)
    pool = _pool_specs(op, s, k_pages, page_table, layout)
    rows = s.spec(*ROWS)
    kv = s.spec(*(KV_LAYERS if k.ndim == 5 else KV))
    layer = _row_ids(op, layer_idx) if k.ndim == 4 else jnp.zeros((), jnp.int32)

    def body(kp, vp, table, lengths, layer, k, v, new_lengths):
        return paged_ops.paged_append(kp, vp, table, lengths, layer, k, v, new_lengths,
                                      layout=layout)

    return per_shard(s, body, (k_pages, v_pages, page_table, lengths, layer, k, v, new_lengths),
                     (pool, pool, rows, rows, P(), kv, kv, rows), (pool, pool))


def paged_gather_op(k_pages, v_pages, page_table, lengths, layer_idx, max_len, layout: str,
                    split: bool, s: CacheSharding):
    from . import paged_ops

    op = "paged_gather"
    _eval_shape(lambda k, v, t, n, i: paged_ops.paged_gather(k, v, t, n, i, max_len,
                                                             layout=layout, split=split),
                k_pages, v_pages, page_table, lengths, layer_idx)
    pool = _pool_specs(op, s, k_pages, page_table, layout)
    rows = s.spec(*ROWS)
    out = (s.spec(*KV),) * 2 if split else s.spec("batch", None, "heads", None, None)

    def body(kp, vp, table, lengths, layer):
        return paged_ops.paged_gather(kp, vp, table, lengths, layer, max_len, layout=layout,
                                      split=split)

    return per_shard(s, body, (k_pages, v_pages, page_table, lengths, _row_ids(op, layer_idx)),
                     (pool, pool, rows, rows, P()), out)


def copy_pages_op(k_pages, v_pages, src_pages, dst_pages, layout: str, s: CacheSharding):
    from . import paged_ops
    from .paged_ops import pool_geometry

    op = "copy_pages"
    _eval_shape(lambda *a: paged_ops.copy_pages(*a, layout=layout), k_pages, v_pages,
                src_pages, dst_pages)
    g = pool_geometry(layout, k_pages.shape)
    s.require_divides(op, "num_pages", g["num_pages"], "batch")
    s.require_divides(op, "num_kv_heads", g["num_kv_heads"], "heads")
    pool = s.spec(*POOL[layout])

    def body(kp, vp, src, dst):
        src, dst = localize_pages(op, s, src, dst, g["num_pages"])
        return paged_ops.copy_pages(kp, vp, src, dst, layout=layout)

    return per_shard(s, body, (k_pages, v_pages, src_pages, dst_pages), (pool, pool, P(), P()),
                     (pool, pool))


# Attention (jaxkv.attention) on a sharded cache: each device attends with its own rows and KV
# heads, and the q heads that read them (q head h reads KV head h // group, so splitting q heads
# and KV heads into the same number of contiguous blocks keeps every group on one device).
def _attend(call, cache, q, layer_idx, rows, q_roles, scales):
    s = cache.sharding
    _eval_shape(lambda c, q, l, r, sc: call(q, c, l, r, *sc), _unsharded(cache), q, layer_idx,
                rows, scales)
    dynamic_layer = _is_array(layer_idx)
    dynamic_scales = [i for i, x in enumerate(scales) if _is_array(x)]

    def body(c, q, r, *rest):
        layer = rest[0] if dynamic_layer else layer_idx
        local_scales = list(scales)
        for i, x in zip(dynamic_scales, rest[dynamic_layer:]):
            local_scales[i] = x
        return call(q, _local(c), layer, r, *local_scales)

    extra = ((jnp.asarray(layer_idx, jnp.int32),) if dynamic_layer else ()) + tuple(
        scales[i] for i in dynamic_scales)
    q_spec = s.spec(*q_roles)
    specs = (cache_specs(cache), q_spec, s.spec(*ROWS)) + (P(),) * len(extra)
    return per_shard(s, body, (cache, q, rows, *extra), specs, q_spec)


# Per shard the default attention is jaxkv's kernel: cuDNN's inside shard_map has not run on
# several GPUs yet (an explicit implementation="cudnn" is passed through).
def _per_shard(implementation):
    return "jaxkv" if implementation is None else implementation


def attention_decode(cache, q, layer_idx, kv_lengths, scale, k_scale, v_scale, implementation):
    from . import attention

    implementation = _per_shard(implementation)

    def call(q, c, layer, rows, k_scale, v_scale):
        return attention.decode(q, c, layer, kv_lengths=rows, scale=scale, k_scale=k_scale,
                                v_scale=v_scale, implementation=implementation)

    rows = cache.lengths if kv_lengths is None else kv_lengths
    return _attend(call, cache, q, layer_idx, rows, ("batch", "heads", None), (k_scale, v_scale))


def attention_prefill(cache, q, layer_idx, q_lengths, scale, k_scale, v_scale, implementation):
    from . import attention

    implementation = _per_shard(implementation)

    def call(q, c, layer, rows, k_scale, v_scale):
        return attention.prefill(q, c, layer, rows, scale=scale, k_scale=k_scale,
                                 v_scale=v_scale, implementation=implementation)

    return _attend(call, cache, q, layer_idx, q_lengths, ("batch", None, "heads", None),
                   (k_scale, v_scale))
