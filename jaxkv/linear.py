"""LinearKVCache: one buffer for every layer, as in TensorRT Edge-LLM's LinearKVCache."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp

from . import _lifecycle as lifecycle
from . import _validate as validate
from . import quantization
from . import reuse
from ._checks import check
from .layout import COUNT, KV, LINEAR_BUFFER, REPLICATED, ROWS
from .sharding import (CacheSharding, Combined, Count, Destinations, FromOwner, Role, create,
                       per_shard, row_ids)

IntOrArray = Union[int, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearKVCache:
    """KV cache of every decoder layer in one buffer, sized for ``max_batch`` x ``max_seq_len``.

    Every method returns a new cache; under ``jit`` with the cache donated they run in place.

    >>> cache = LinearKVCache.create(num_layers=2, max_batch=4, num_kv_heads=2, max_seq_len=16,
    ...                              head_dim=16, dtype=jnp.float32)
    >>> cache = cache.reset(jnp.zeros((3,), jnp.int32))          # 3 active sequences
    >>> k = v = jnp.ones((4, 2, 5, 16), jnp.float32)               # prefill 5 tokens
    >>> cache = cache.append(0, k, v).append(1, k, v).commit(5)
    >>> cache.lengths
    Array([5, 5, 5, 0], dtype=int32)

    With ``ring=True`` every layer is a ring of ``max_seq_len`` slots (a sliding-window model,
    Mistral-style; TensorRT-LLM's cyclic cache): a row keeps its last ``max_seq_len`` tokens,
    token ``p`` at slot ``p % max_seq_len``, and its length counts on past ``max_seq_len``.
    Size the ring for the window and the chunks appended: ``max_seq_len >= window + T - 1`` for
    chunks of ``T`` tokens (the first query of a chunk sees ``window - 1`` earlier tokens).

    >>> ring = LinearKVCache.create(1, 1, 1, 4, 16, jnp.float32, ring=True)
    >>> ring = ring.reset(jnp.zeros((1,), jnp.int32))
    >>> for t in range(6):                                         # 6 tokens into 4 slots
    ...     x = jnp.full((1, 1, 1, 16), t, jnp.float32)
    ...     ring = ring.append(0, x, x).commit(1)
    >>> ring.lengths, ring.keys(0)[0, 0, :, 0]                     # slot p % 4 holds token p
    (Array([6], dtype=int32), Array([4., 5., 2., 3.], dtype=float32))
    """

    buffer: jax.Array  # [num_layers, max_batch, 2, num_kv_heads, max_seq_len, head_dim]
    lengths: jax.Array  # int32 [max_batch]: tokens stored per sequence
    active_batch_size: jax.Array  # int32 []: sequences [0, active_batch_size) are live
    # ([batch_shards] when the batch is sharded: a count per shard; docs/sharding.md)
    sharding: CacheSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    # 8-bit caches (jaxkv.quantization): float32 [L, B, H, S] per token and head, or [L] per tensor
    k_scales: Any = None  # an array, or None
    v_scales: Any = None
    scaling: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # every layer a ring of max_seq_len slots: token p at slot p % max_seq_len
    ring: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def leaf_roles(self) -> dict:
        """Where each leaf keeps its rows and heads (``jaxkv.layout``)."""
        scales = (None, "batch", "heads", None) if self.scaling == "per_token_head" else REPLICATED
        return dict(buffer=LINEAR_BUFFER, lengths=ROWS, active_batch_size=COUNT, k_scales=scales,
                    v_scales=scales)

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
        scaling: str | None = None,
        k_scale=None,
        v_scale=None,
        ring: bool = False,
    ) -> "LinearKVCache":
        """An empty cache: ``buffer`` ``[num_layers, max_batch, 2, num_kv_heads, max_seq_len,
        head_dim]`` of ``dtype`` (zeros), ``lengths`` int32 ``[max_batch]`` zeros, no active row
        (``reset`` starts sequences; ``append`` and ``commit`` leave inactive rows as they are).

        **Arguments:** Python ints >= 1 for the sizes, ``num_layers <= 256`` and
        ``max_batch <= 8192`` (what one compaction launch takes: refused here, not in ``compact``
        after the cache was donated); ``dtype`` one of float32, bfloat16, float16, float8_e4m3fn,
        float8_e5m2, int8, uint8.

        **Raises:** ``TypeError`` for a size that is not an int or an unsupported dtype,
        ``ValueError`` for a size out of range (each names the argument).

        With ``sharding`` (a ``jaxkv.CacheSharding``) every buffer is created already placed on
        its mesh, never on one device first (docs/sharding.md); a size the mesh axis does not
        divide is a ``ValueError`` naming it.

        An 8-bit cache (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) keeps float32 scales
        (``jaxkv.quantization``): with ``scaling="per_token_head"`` (the default) ``k_scales``,
        ``v_scales`` ``[num_layers, max_batch, num_kv_heads, max_seq_len]``, written by
        ``append``; with ``"per_tensor"`` ``[num_layers]``, from ``k_scale``, ``v_scale``
        (default 1.0; ``with_scales`` replaces them). Its ``append`` takes float32, bfloat16 or
        float16 K/V and quantizes them on the way in.

        ``ring=True``: every layer is a ring of ``max_seq_len`` slots (at most 2**30 - 1), which
        keeps each row's last ``max_seq_len`` tokens, token ``p`` at slot ``p % max_seq_len``;
        lengths are positions and count on to 2**31 - 1 (``max_length``). Attention reads a ring
        with its positions intact; a read of a position that has left it is reported through
        ``checkify`` and never returns another token's data (``jaxkv.attention``).
        """
        op = "LinearKVCache.create"
        dims = dict(num_layers=num_layers, max_batch=max_batch, num_kv_heads=num_kv_heads,
                    max_seq_len=max_seq_len, head_dim=head_dim)
        for name, value in dims.items():
            validate.static_int(op, name, value, lo=1, hi=validate.CREATE_LIMITS.get(name))
        if lifecycle.ring_arg(op, "ring", ring):
            lifecycle.ring_slots(op, "max_seq_len", max_seq_len)
        validate.new_cache_dtype(op, dtype)
        shape = (num_layers, max_batch, 2, num_kv_heads, max_seq_len, head_dim)
        leaves = dict(buffer=(shape, dtype, 0), lengths=((max_batch,), jnp.int32, 0),
                      active_batch_size=((), jnp.int32, 0))
        scaling = quantization.scaling_of(op, dtype, scaling)
        leaves.update(quantization.scale_leaves(op, scaling, num_layers,
                                                (num_layers, max_batch, num_kv_heads, max_seq_len),
                                                k_scale, v_scale))
        divides = dict(max_batch=(max_batch, "batch"), num_kv_heads=(num_kv_heads, "heads"))
        return create(cls, op, sharding, leaves, divides, scaling=scaling, ring=bool(ring))

    # Static configuration, read off the buffer's shape.
    num_layers = property(lambda self: self.buffer.shape[0], doc="Decoder layers (static).")
    max_batch = property(lambda self: self.buffer.shape[1], doc="Rows of the cache (static).")
    num_kv_heads = property(lambda self: self.buffer.shape[3], doc="KV heads per layer (static).")
    max_seq_len = property(lambda self: self.buffer.shape[4],
                           doc="Tokens each row holds, a ring's slots (static).")
    max_length = property(lambda self: lifecycle.MAX_POSITIONS if self.ring else self.max_seq_len,
                          doc="Where lengths stop: max_seq_len, or 2**31 - 1 for a ring (static).")
    head_dim = property(lambda self: self.buffer.shape[5], doc="Elements per head (static).")
    dtype = property(lambda self: self.buffer.dtype, doc="Element type of the buffer.")

    def with_scales(self, k_scale=None, v_scale=None) -> "LinearKVCache":
        """A per-tensor cache with new scales (a float, or float32 ``[]`` / ``[num_layers]``; None
        keeps the current ones). The stored bytes are unchanged: they read with the new scales."""
        return quantization.with_scales(self, "LinearKVCache.with_scales", k_scale, v_scale)

    def layer(self, i: IntOrArray, dtype: Any = None) -> jax.Array:
        """``[max_batch, 2, H, S, D]`` of layer ``i`` as stored (a view under ``jit``; a ring's
        slots: ``jaxkv.reference.ring_to_positions`` orders them). A Python int
        out of range is a ``ValueError``; a traced one is reported through ``checkify`` (and
        clamped, as JAX indexes).

        ``dtype`` (float32, bfloat16 or float16): the values instead, an 8-bit cache's
        dequantized (``float32(q) * scale``, its stored codes are not values), any other's
        converted."""
        op = "LinearKVCache.layer"
        layer = self._layer(op, i)
        if dtype is None:
            return self.buffer[layer]
        return jnp.stack([self._read(op, layer, kv, dtype) for kv in (0, 1)], axis=1)

    def keys(self, i: IntOrArray, dtype: Any = None) -> jax.Array:
        """``[max_batch, H, S, D]`` of layer ``i`` (checked, and ``dtype``, as in ``layer``)."""
        op = "LinearKVCache.keys"
        layer = self._layer(op, i)
        return self.buffer[layer, :, 0] if dtype is None else self._read(op, layer, 0, dtype)

    def values(self, i: IntOrArray, dtype: Any = None) -> jax.Array:
        """``[max_batch, H, S, D]`` of layer ``i`` (checked, and ``dtype``, as in ``layer``)."""
        op = "LinearKVCache.values"
        layer = self._layer(op, i)
        return self.buffer[layer, :, 1] if dtype is None else self._read(op, layer, 1, dtype)

    def _layer(self, op: str, i: IntOrArray) -> jax.Array:
        layer = validate.layer_index(op, i, self.num_layers)
        check((layer >= 0) & (layer < self.num_layers), f"{op}: layer_idx out of range")
        return layer

    def _read(self, op: str, layer: jax.Array, kv: int, dtype) -> jax.Array:
        scale = None if self.scaling is None else (self.k_scales, self.v_scales)[kv][layer]
        return quantization.read_values(op, self.scaling, self.buffer[layer, :, kv], scale, dtype)

    @property
    @per_shard(out=Combined("all"))
    def all_empty(self) -> jax.Array:
        """bool ``[]``: no active sequence holds a token (TensorRT Edge-LLM's getKVCacheAllEmpty)."""
        return lifecycle.all_empty(self.lengths, self.active_batch_size)

    @per_shard(n=Count("self"))
    def set_active_batch_size(self, n: IntOrArray) -> "LinearKVCache":
        """Marks rows ``[0, n)`` active (TensorRT Edge-LLM's setActiveBatchSize); lengths are kept.

        ``n``: a Python int in ``[0, max_batch]`` (checked at trace time) or an int32 scalar
        (clipped to that range, reported through ``checkify``)."""
        n = lifecycle.active_batch_size_arg("LinearKVCache.set_active_batch_size", n, self.max_batch)
        return dataclasses.replace(self, active_batch_size=n)

    @per_shard(reuse_lengths=Role(ROWS))
    def reset(self, reuse_lengths: jax.Array) -> "LinearKVCache":
        """Starts a new batch of ``n`` sequences (TensorRT Edge-LLM's resetForNewSequences).

        ``reuse_lengths``: int32 ``[n]``, ``n <= max_batch``: tokens already in the cache for each
        new sequence (a reused prompt; 0 for none). Slots past ``n`` get length 0.
        """
        lengths, active = lifecycle.reset_lengths(
            "LinearKVCache.reset", reuse_lengths, self.max_batch, self.max_length
        )
        return dataclasses.replace(self, lengths=lengths, active_batch_size=active)

    @per_shard(k=Role(KV), v=Role(KV), new_lengths=Role(ROWS))
    def append(self, layer_idx: IntOrArray, k: jax.Array, v: jax.Array, new_lengths=None):
        """Writes ``k``, ``v`` ``[max_batch, H, T, D]`` after each active sequence's tokens.

        Token ``t`` of row ``b`` lands at position ``lengths[b] + t``, for ``t < new_lengths[b]``
        when ``new_lengths`` (int32 ``[max_batch]``, ragged prefill) is given. Rows of inactive
        slots are ignored; lengths are unchanged (see ``commit``). ``layer_idx`` may be traced
        (a ``scan`` over layers); out of range writes nothing. Tokens past ``max_seq_len`` are
        dropped; both cases are reported through ``checkify``. A ring drops none: position ``p``
        goes to slot ``p % max_seq_len``; of more than ``max_seq_len`` tokens at once (a
        ``ValueError`` for ``T`` past it without ``new_lengths``, else reported) it keeps the
        last ``max_seq_len``.
        """
        buffer, k_scales, v_scales = lifecycle.append(
            "LinearKVCache.append", self.buffer, layer_idx, k, v, self.lengths,
            self.active_batch_size, new_lengths, quantization.scales_of(self), self.ring,
        )
        return dataclasses.replace(self, buffer=buffer, k_scales=k_scales, v_scales=v_scales)

    @per_shard(new_lengths=Role(ROWS))
    def commit(self, new_lengths: IntOrArray) -> "LinearKVCache":
        """Advances the lengths of active sequences (TensorRT Edge-LLM's commitSequenceLength).

        ``new_lengths``: a Python int or int32 scalar (e.g. 1 per decode step), or int32
        ``[max_batch]`` (tokens appended per sequence by a ragged prefill). Lengths stop at
        ``max_length`` (``max_seq_len``; a ring's at 2**31 - 1); a negative increment leaves the
        row as it was (both reported through ``checkify``).
        """
        lengths = lifecycle.commit_lengths(
            "LinearKVCache.commit", self.lengths, self.active_batch_size, new_lengths,
            self.max_length,
        )
        return dataclasses.replace(self, lengths=lengths)

    @per_shard(batch_mapping=Destinations("self"))
    def compact(self, batch_mapping: jax.Array) -> "LinearKVCache":
        """Evicts and compacts every layer in one launch (see ``jaxkv.compact_kv_cache``).

        ``batch_mapping``: int32 ``[max_batch]``, new row of each slot or -1 (inactive slots: -1);
        survivors are expected on rows ``[0, survivors)``. Lengths follow their sequences and the
        active batch size becomes the number of survivors.
        """
        moving = quantization.token_scales(self)
        lengths, (buffer, *scales), survivors = lifecycle.compact(
            "LinearKVCache.compact", [self.buffer, *moving], self.lengths, batch_mapping)
        return dataclasses.replace(self, buffer=buffer, lengths=lengths,
                                   active_batch_size=survivors,
                                   **quantization.replaced_scales(self, scales))

    @per_shard(batch_idx=row_ids("self"), out=FromOwner())
    def save(self, batch_idx: IntOrArray, seq_len: int):
        """Tokens ``[0, seq_len)`` of row ``batch_idx``, every layer, in one launch: a
        ``jaxkv.SavedKV`` (see ``jaxkv.save_kv_cache``). A ring saves the last ``min(seq_len,
        max_seq_len)`` of them, in order (its ``length`` stays ``seq_len``); the row must still
        hold them (its length at most ``max(seq_len, max_seq_len)``, reported through
        ``checkify``)."""
        op = "LinearKVCache.save"
        saved = reuse.save_saved_kv(op, [self.buffer], ["buffer"], batch_idx, seq_len,
                                    quantization.scales_of(self), [self.ring])
        if self.ring:
            reuse.check_ring_save(op, self.lengths, batch_idx, seq_len, self.max_seq_len)
        return saved

    @per_shard(batch_idx=row_ids("self"))
    def instantiate(self, saved, batch_idx: IntOrArray) -> "LinearKVCache":
        """Writes a ``jaxkv.SavedKV`` into tokens ``[0, T)`` of row ``batch_idx`` (an int, an int32
        scalar or an int32 ``[n]`` array of rows), every layer in one launch. Lengths are
        unchanged: give the rows ``saved.length`` through ``reset`` (e.g. ``reset(jnp.full((n,),
        saved.length))`` for rows ``0..n-1``). An 8-bit cache takes a float prefix too, quantized
        as ``append`` would store it. A ring places position ``p`` at slot ``p % max_seq_len``
        and takes a longer prompt's last ``max_seq_len`` tokens; a prompt saved from a ring
        (its last tokens only) goes into a ring of as many slots (else reported, nothing
        written)."""
        (buffer,), scales = reuse.instantiate_saved_kv(
            "LinearKVCache.instantiate", [self.buffer], ["buffer"], saved, batch_idx,
            quantization.scales_of(self), [self.ring])
        return dataclasses.replace(self, buffer=buffer, **quantization.replaced_scales(self, scales))
