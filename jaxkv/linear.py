"""LinearKVCache: one buffer for every layer, as in TensorRT Edge-LLM's LinearKVCache."""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _lengths
from . import _sharded
from . import _validate as validate
from . import ops
from ._checks import check
from .sharding import LINEAR_BUFFER, CacheSharding

IntOrArray = Union[int, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearKVCache:
    """KV cache of every decoder layer in one buffer, sized for ``max_batch`` x ``max_seq_len``.

    Every method returns a new cache; under ``jit`` with the cache donated they run in place.

    >>> cache = LinearKVCache.create(num_layers=2, max_batch=4, num_kv_heads=2, max_seq_len=16,
    ...                              head_dim=8, dtype=jnp.float32)
    >>> cache = cache.reset(jnp.zeros((3,), jnp.int32))          # 3 active sequences
    >>> k = v = jnp.ones((4, 2, 5, 8), jnp.float32)                # prefill 5 tokens
    >>> cache = cache.append(0, k, v).append(1, k, v).commit(5)
    >>> cache.lengths
    Array([5, 5, 5, 0], dtype=int32)
    """

    buffer: jax.Array  # [num_layers, max_batch, 2, num_kv_heads, max_seq_len, head_dim]
    lengths: jax.Array  # int32 [max_batch]: tokens stored per sequence
    active_batch_size: jax.Array  # int32 []: sequences [0, active_batch_size) are live
    # ([batch_shards] when the batch is sharded: a count per shard; docs/sharding.md)
    sharding: CacheSharding | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        sharding: CacheSharding | None = None,
    ) -> "LinearKVCache":
        """An empty cache: ``buffer`` ``[num_layers, max_batch, 2, num_kv_heads, max_seq_len,
        head_dim]`` of ``dtype`` (zeros), ``lengths`` int32 ``[max_batch]`` zeros, no active row.

        **Arguments:** Python ints >= 1 for the sizes, ``num_layers <= 256`` and
        ``max_batch <= 8192`` (what one compaction launch takes: refused here, not in ``compact``
        after the cache was donated); ``dtype`` one of float32, bfloat16, float16, float8_e4m3fn,
        float8_e5m2, int8, uint8.

        **Raises:** ``TypeError`` for a size that is not an int or an unsupported dtype,
        ``ValueError`` for a size out of range (each names the argument).

        With ``sharding`` (a ``jaxkv.CacheSharding``) every buffer is created already placed on
        its mesh, never on one device first (docs/sharding.md); a size the mesh axis does not
        divide is a ``ValueError`` naming it.
        """
        op = "LinearKVCache.create"
        dims = dict(num_layers=num_layers, max_batch=max_batch, num_kv_heads=num_kv_heads,
                    max_seq_len=max_seq_len, head_dim=head_dim)
        for name, value in dims.items():
            validate.static_int(op, name, value, lo=1, hi=validate.CREATE_LIMITS.get(name))
        if np.dtype(dtype) not in validate.CACHE_DTYPES:
            raise TypeError(f"{op}: unsupported dtype {np.dtype(dtype)}")
        shape = (num_layers, max_batch, 2, num_kv_heads, max_seq_len, head_dim)
        if sharding is not None:
            return _sharded.create(cls, op, sharding, dict(buffer=(shape, dtype, LINEAR_BUFFER)),
                                   max_batch, dict(num_kv_heads=num_kv_heads))
        return cls(
            buffer=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((max_batch,), jnp.int32),
            active_batch_size=jnp.zeros((), jnp.int32),
        )

    # Static configuration, read off the buffer's shape.
    num_layers = property(lambda self: self.buffer.shape[0], doc="Decoder layers (static).")
    max_batch = property(lambda self: self.buffer.shape[1], doc="Rows of the cache (static).")
    num_kv_heads = property(lambda self: self.buffer.shape[3], doc="KV heads per layer (static).")
    max_seq_len = property(lambda self: self.buffer.shape[4], doc="Tokens each row holds (static).")
    head_dim = property(lambda self: self.buffer.shape[5], doc="Elements per head (static).")
    dtype = property(lambda self: self.buffer.dtype, doc="Element type of the buffer.")

    def layer(self, i: IntOrArray) -> jax.Array:
        """``[max_batch, 2, H, S, D]`` of layer ``i`` (a view under ``jit``)."""
        return self.buffer[i]

    def keys(self, i: IntOrArray) -> jax.Array:
        """``[max_batch, H, S, D]``."""
        return self.buffer[i, :, 0]

    def values(self, i: IntOrArray) -> jax.Array:
        """``[max_batch, H, S, D]``."""
        return self.buffer[i, :, 1]

    @property
    def all_empty(self) -> jax.Array:
        """bool ``[]``: no active sequence holds a token (TensorRT Edge-LLM's getKVCacheAllEmpty)."""
        if self.sharding is not None:
            return _sharded.all_empty(self)
        active = jnp.arange(self.max_batch) < self.active_batch_size
        return jnp.all(jnp.where(active, self.lengths, 0) == 0)

    def set_active_batch_size(self, n: IntOrArray) -> "LinearKVCache":
        """Marks rows ``[0, n)`` active (TensorRT Edge-LLM's setActiveBatchSize); lengths are kept.

        ``n``: a Python int in ``[0, max_batch]`` (checked at trace time) or an int32 scalar
        (clipped to that range, reported through ``checkify``)."""
        if self.sharding is not None:
            return _sharded.set_active_batch_size(self, n)
        n = active_batch_size_arg("LinearKVCache.set_active_batch_size", n, self.max_batch)
        return dataclasses.replace(self, active_batch_size=n)

    def reset(self, reuse_lengths: jax.Array) -> "LinearKVCache":
        """Starts a new batch of ``n`` sequences (TensorRT Edge-LLM's resetForNewSequences).

        ``reuse_lengths``: int32 ``[n]``, ``n <= max_batch``: tokens already in the cache for each
        new sequence (a reused prompt; 0 for none). Slots past ``n`` get length 0.
        """
        if self.sharding is not None:
            return _sharded.reset(self, reuse_lengths)
        lengths, active = reset_lengths(
            "LinearKVCache.reset", reuse_lengths, self.max_batch, self.max_seq_len
        )
        return dataclasses.replace(self, lengths=lengths, active_batch_size=active)

    def append(self, layer_idx: IntOrArray, k: jax.Array, v: jax.Array, new_lengths=None):
        """Writes ``k``, ``v`` ``[max_batch, H, T, D]`` after each active sequence's tokens.

        Token ``t`` of row ``b`` lands at position ``lengths[b] + t``, for ``t < new_lengths[b]``
        when ``new_lengths`` (int32 ``[max_batch]``, ragged prefill) is given. Rows of inactive
        slots are ignored; lengths are unchanged (see ``commit``). ``layer_idx`` may be traced
        (a ``scan`` over layers); out of range writes nothing. Tokens past ``max_seq_len`` are
        dropped; both cases are reported through ``checkify``.
        """
        if self.sharding is not None:
            return _sharded.append(self, layer_idx, k, v, new_lengths)
        buffer = append_stacked(
            "LinearKVCache.append", self.buffer, layer_idx, k, v, self.lengths,
            self.active_batch_size, new_lengths,
        )
        return dataclasses.replace(self, buffer=buffer)

    def commit(self, new_lengths: IntOrArray) -> "LinearKVCache":
        """Advances the lengths of active sequences (TensorRT Edge-LLM's commitSequenceLength).

        ``new_lengths``: a Python int (e.g. 1 per decode step) or int32 ``[max_batch]`` (tokens
        appended per sequence by a ragged prefill). Lengths stop at ``max_seq_len``; a negative
        increment leaves the row as it was (both reported through ``checkify``).
        """
        if self.sharding is not None:
            return _sharded.commit(self, new_lengths)
        self_lengths = commit_lengths(
            "LinearKVCache.commit", self.lengths, self.active_batch_size, new_lengths,
            self.max_seq_len,
        )
        return dataclasses.replace(self, lengths=self_lengths)

    def compact(self, batch_mapping: jax.Array) -> "LinearKVCache":
        """Evicts and compacts every layer in one launch (see ``jaxkv.compact_kv_cache``).

        ``batch_mapping``: int32 ``[max_batch]``, new row of each slot or -1 (inactive slots: -1);
        survivors are expected on rows ``[0, survivors)``. Lengths follow their sequences and the
        active batch size becomes the number of survivors.
        """
        if self.sharding is not None:
            return _sharded.compact(self, batch_mapping)
        op = "LinearKVCache.compact"
        validate.array(op, "batch_mapping", batch_mapping)
        validate.int32(op, "batch_mapping", batch_mapping)
        validate.shape(op, "batch_mapping", batch_mapping, (self.max_batch,), "[max_batch]")
        ops.check_mapping_injective(op, batch_mapping, self.max_batch)
        lengths, (buffer,) = ops.compact_buffers(
            [self.buffer], self.lengths, batch_mapping, kv=True, rows=self.max_batch, op=op
        )
        survivors = surviving_count(batch_mapping, self.max_batch)
        check(
            jnp.all(jnp.where(batch_mapping >= 0, batch_mapping < survivors, True)),
            f"{op}: survivors must land on rows [0, survivors)",
        )
        return LinearKVCache(buffer=buffer, lengths=lengths, active_batch_size=survivors)

    def save(self, batch_idx: IntOrArray, seq_len: int):
        """Tokens ``[0, seq_len)`` of row ``batch_idx``, every layer, in one launch: a
        ``jaxkv.SavedKV`` (see ``jaxkv.save_kv_cache``)."""
        from . import reuse  # the prompt-reuse family, reuse.py

        if self.sharding is not None:
            return _sharded.save(self, batch_idx, seq_len)
        op = "LinearKVCache.save"
        return reuse.save_saved_kv(op, [self.buffer], ["buffer"], batch_idx, seq_len)

    def instantiate(self, saved, batch_idx: IntOrArray) -> "LinearKVCache":
        """Writes a ``jaxkv.SavedKV`` into tokens ``[0, T)`` of row ``batch_idx`` (an int, an int32
        scalar or an int32 ``[n]`` array of rows), every layer in one launch. Lengths are
        unchanged: pass ``saved.length`` to ``reset``."""
        from . import reuse

        if self.sharding is not None:
            return _sharded.instantiate(self, saved, batch_idx)
        (buffer,) = reuse.instantiate_saved_kv(
            "LinearKVCache.instantiate", [self.buffer], ["buffer"], saved, batch_idx
        )
        return dataclasses.replace(self, buffer=buffer)


def active_batch_size_arg(op: str, n, max_batch: int) -> jax.Array:
    """A new active batch size: an int in [0, max_batch] or an int32 scalar (clipped, checkify)."""
    if isinstance(n, (int, np.integer)):
        validate.static_int(op, "n", n, 0, max_batch)
    n = validate.int_scalar(op, "n", n)
    check((n >= 0) & (n <= max_batch), f"{op}: n out of [0, max_batch]")
    return jnp.clip(n, 0, max_batch)


def reset_lengths(op: str, reuse_lengths, max_batch: int, max_seq_len: int):
    """(lengths [max_batch], active batch size) of a reset to ``n = len(reuse_lengths)`` rows."""
    validate.array(op, "reuse_lengths", reuse_lengths)
    validate.int32(op, "reuse_lengths", reuse_lengths)
    validate.rank(op, "reuse_lengths", reuse_lengths, 1, "[n]")
    n = reuse_lengths.shape[0]
    if n > max_batch:
        raise ValueError(f"{op}: reuse_lengths has {n} entries, max_batch is {max_batch}")
    lengths = _lengths.reset(op, reuse_lengths, max_batch, max_seq_len)
    return lengths, jnp.asarray(n, jnp.int32)


def append_counts(op: str, new_lengths, batch: int, tokens: int):
    """(tokens written per row, for checks; the kernel's counts argument: [0] means all T)."""
    if new_lengths is None:
        return jnp.full((batch,), tokens, jnp.int32), jnp.zeros((0,), jnp.int32)
    validate.array(op, "new_lengths", new_lengths)
    validate.int32(op, "new_lengths", new_lengths)
    validate.shape(op, "new_lengths", new_lengths, (batch,), "[max_batch]")
    return jnp.clip(new_lengths, 0, tokens), new_lengths


def surviving_count(batch_mapping: jax.Array, rows: int) -> jax.Array:
    return jnp.sum((batch_mapping >= 0) & (batch_mapping < rows)).astype(jnp.int32)


def commit_lengths(op, lengths, active_batch_size, new_lengths, max_seq_len) -> jax.Array:
    """``lengths + new_lengths`` on active rows, saturating in ``[0, max_seq_len]``
    (``_lengths.grow``: a negative or overflowing increment is reported and ignored)."""
    increment = _lengths.increment_arg(op, "new_lengths", new_lengths, lengths.shape[0])
    active = jnp.arange(lengths.shape[0]) < active_batch_size
    return _lengths.grow(op, lengths, increment, max_seq_len, rows=active)


def append_stacked(op, buffer, layer_idx, k, v, lengths, active_batch_size, new_lengths=None):
    """Checks the arguments and makes the one FFI call of an append into ``[L, B, 2, H, S, D]``,
    or into one layer ``[B, 2, H, S, D]`` (``layer_idx`` 0; reshaping it would cost a copy)."""
    stack = buffer.shape if buffer.ndim == 6 else (1, *buffer.shape)
    num_layers, batch, _, heads, capacity, head_dim = stack
    layer_idx = validate.layer_index(op, layer_idx, num_layers)
    for name, x in (("k", k), ("v", v)):
        validate.array(op, name, x)
        validate.rank(op, name, x, 4, "[max_batch, num_kv_heads, T, head_dim]")
        if x.dtype != buffer.dtype:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}, the cache holds {buffer.dtype}")
        if (x.shape[0], x.shape[1], x.shape[3]) != (batch, heads, head_dim):
            raise ValueError(
                f"{op}: {name} must have shape ({batch}, {heads}, T, {head_dim}), got {x.shape}"
            )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v shapes differ: {k.shape} vs {v.shape}")
    validate.int32_dims(op, "cache", buffer)
    validate.int32_dims(op, "k", k)
    validate.kv_geometry(op, "cache", heads, capacity, head_dim * buffer.dtype.itemsize)
    count, new_lengths_in = append_counts(op, new_lengths, batch, k.shape[2])
    active = jnp.arange(batch) < active_batch_size
    check(
        (layer_idx >= 0) & (layer_idx < num_layers), f"{op}: layer_idx out of range"
    )
    # Without forming lengths + count, which may pass int32 (the kernel computes in 64 bits).
    fits = (lengths >= 0) & (lengths <= capacity) & (count <= capacity - lengths)
    check(
        jnp.all(jnp.where(active & (count > 0), fits, True)),
        f"{op}: tokens past max_seq_len are dropped",
    )
    return _ffi.call(
        "jaxkv_append",
        jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
        k, v, lengths, new_lengths_in, jnp.asarray(active_batch_size, jnp.int32), layer_idx,
        buffer,
        input_output_aliases={6: 0},
    )
