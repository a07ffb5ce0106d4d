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
    if not dataclasses.is_dataclass(result) or not hasattr(result, "sharding"):
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


def local_count(op: str, s: CacheSharding, rows: int) -> int:
    return rows // s.batch_shards


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
    return reuse.SavedKV(layers=tuple(s.spec(*SAVED) for _ in range(num_layers)), length=P())


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

    num = len(_kv_buffers(cache)[0]) if hasattr(cache, "layers") else cache.num_layers
    return per_shard(s, body, (cache, idx), (cache_specs(cache), P()), _saved_specs(s, num))


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
