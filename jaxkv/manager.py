"""KVCacheManager: one buffer per attention layer, so layers may differ in heads, head_dim and
max_seq_len (TensorRT Edge-LLM's KVCacheManager and KVLayerConfig)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp

from . import _lifecycle as lifecycle
from . import _validate as validate
from . import quantization
from . import reuse
from .layout import COUNT, KV, LAYER, REPLICATED, ROWS
from .linear import LinearKVCache
from .reuse import SavedKV
from .sharding import (CacheSharding, Combined, Count, Destinations, FromOwner, Role, create,
                       per_shard, row_ids)

IntOrArray = Union[int, jax.Array]


@dataclasses.dataclass(frozen=True)
class KVLayerConfig:
    """Shape of one attention layer's cache; ``max_seq_len=None`` means the cache-wide maximum.

    ``ring=True``: a sliding-window layer whose cache is a ring of ``max_seq_len`` slots
    (TensorRT-LLM's cyclic cache): it keeps each row's last ``max_seq_len`` tokens, token ``p`` at
    slot ``p % max_seq_len``, whatever the row's length. Give it ``window + T - 1`` slots for a
    window of ``window`` tokens and chunks of at most ``T`` appended at once (the first query of
    a chunk sees ``window - 1`` earlier tokens; decode: ``T = 1``)."""

    num_kv_heads: int
    head_dim: int
    max_seq_len: int | None = None
    ring: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCacheManager:
    """KV cache with one buffer per attention layer; the layers may have different shapes.

    Same lifecycle as ``LinearKVCache`` (reset, append, commit, compact, save, instantiate). Every
    op that touches several layers (compact, save, instantiate) is one kernel launch for all of
    them, whatever their shapes. Methods return a new cache; donate it to ``jit`` to run in place.

    >>> cfg = [KVLayerConfig(8, 64), KVLayerConfig(2, 128, max_seq_len=8)]
    >>> cache = KVCacheManager.create(cfg, max_batch=2, max_seq_len=16, dtype=jnp.float32)
    >>> cache = cache.reset(jnp.zeros((2,), jnp.int32))
    >>> cache = cache.append(0, jnp.ones((2, 8, 3, 64)), jnp.ones((2, 8, 3, 64)))
    >>> cache = cache.append(1, jnp.ones((2, 2, 3, 128)), jnp.ones((2, 2, 3, 128))).commit(3)
    >>> cache.lengths, cache.combined(1).shape
    (Array([3, 3], dtype=int32), (2, 2, 2, 8, 128))

    A layer made with ``KVLayerConfig(..., ring=True)`` is a ring (its memory bounded by its
    window, not the context; Gemma 2 / 3, gpt-oss): lengths then stop at the longest layer of
    full attention, or at 2**31 - 1 when every layer is a ring (``max_length``).
    """

    layers: tuple[jax.Array, ...]  # per layer [max_batch, 2, H_i, S_i, D_i] (layer_config(i))
    lengths: jax.Array  # int32 [max_batch]: tokens stored per sequence
    active_batch_size: jax.Array  # int32 []: sequences [0, active_batch_size) are live
    # ([batch_shards] when the batch is sharded: a count per shard; docs/sharding.md)
    sharding: CacheSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    # 8-bit caches (jaxkv.quantization): per layer float32 [B, H_i, S_i] per token and head, or
    # [num_layers] per tensor
    k_scales: Any = None  # a tuple of arrays, an array, or None
    v_scales: Any = None
    scaling: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # per layer: a ring (KVLayerConfig.ring); () when none is
    rings: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def leaf_roles(self) -> dict:
        """Where each leaf keeps its rows and heads (``jaxkv.layout``)."""
        scales = ("batch", "heads", None) if self.scaling == "per_token_head" else REPLICATED
        return dict(layers=LAYER, lengths=ROWS, active_batch_size=COUNT, k_scales=scales,
                    v_scales=scales)

    @classmethod
    def create(
        cls,
        layer_configs: Sequence[KVLayerConfig],
        max_batch: int,
        max_seq_len: int,
        dtype=jnp.bfloat16,
        sharding: CacheSharding | None = None,
        scaling: str | None = None,
        k_scale=None,
        v_scale=None,
    ) -> "KVCacheManager":
        """An empty cache: layer ``i`` is ``[max_batch, 2, H_i, S_i, D_i]`` of ``dtype`` (zeros)
        with ``H_i, D_i`` from ``layer_configs[i]`` and ``S_i`` its ``max_seq_len`` (default:
        ``max_seq_len``); ``lengths`` int32 ``[max_batch]`` zeros, no active row.

        **Arguments:** ``layer_configs``: 1 to 256 ``KVLayerConfig``; ``max_batch``,
        ``max_seq_len``: Python ints >= 1, ``max_batch <= 8192`` (one compaction launch);
        ``dtype`` as for ``LinearKVCache.create``.

        **Raises:** ``TypeError`` / ``ValueError`` naming the argument (a layer's ``max_seq_len``
        above the cache's included, and a ring's above 2**30 - 1).

        With ``sharding`` (a ``jaxkv.CacheSharding``) every layer is created already placed on
        its mesh (docs/sharding.md). ``scaling``, ``k_scale``, ``v_scale``: as for
        ``LinearKVCache.create``; per token and head, ``k_scales`` and ``v_scales`` hold one
        ``[max_batch, H_i, S_i]`` per layer.
        """
        op = "KVCacheManager.create"
        validate.static_int(op, "max_batch", max_batch, lo=1, hi=validate.MAX_COMPACT_ROWS)
        validate.static_int(op, "max_seq_len", max_seq_len, lo=1)
        validate.new_cache_dtype(op, dtype)
        configs = list(layer_configs)
        if not 1 <= len(configs) <= validate.MAX_LAYERS:
            raise ValueError(f"{op}: 1 to {validate.MAX_LAYERS} layer configs needed, got {len(configs)}")
        shapes = []
        for i, c in enumerate(configs):
            if not isinstance(c, KVLayerConfig):
                raise TypeError(
                    f"{op}: layer_configs[{i}] must be a KVLayerConfig, got {type(c).__name__}"
                )
            validate.static_int(op, f"layer_configs[{i}].num_kv_heads", c.num_kv_heads, lo=1)
            validate.static_int(op, f"layer_configs[{i}].head_dim", c.head_dim, lo=1)
            seq = max_seq_len if c.max_seq_len is None else c.max_seq_len
            validate.static_int(op, f"layer_configs[{i}].max_seq_len", seq, lo=1, hi=max_seq_len)
            if lifecycle.ring_arg(op, f"layer_configs[{i}].ring", c.ring):
                lifecycle.ring_slots(op, f"layer_configs[{i}].max_seq_len", seq)
            shapes.append((max_batch, 2, c.num_kv_heads, seq, c.head_dim))
        rings = tuple(bool(c.ring) for c in configs)
        leaves = dict(layers=[(shape, dtype, 0) for shape in shapes],
                      lengths=((max_batch,), jnp.int32, 0), active_batch_size=((), jnp.int32, 0))
        scaling = quantization.scaling_of(op, dtype, scaling)
        leaves.update(quantization.scale_leaves(op, scaling, len(configs),
                                                [(b, h, s) for b, _, h, s, _ in shapes],
                                                k_scale, v_scale))
        divides = dict(max_batch=(max_batch, "batch"))
        divides.update({f"layer_configs[{i}].num_kv_heads": (c.num_kv_heads, "heads")
                        for i, c in enumerate(configs)})
        return create(cls, op, sharding, leaves, divides, scaling=scaling,
                      rings=rings if any(rings) else ())

    # Static configuration, read off the buffers' shapes.
    num_layers = property(lambda self: len(self.layers), doc="Attention layers (static).")
    max_batch = property(lambda self: self.lengths.shape[0], doc="Rows of the cache (static).")
    # Cache-wide max_seq_len: the longest layer's.
    max_seq_len = property(lambda self: max(layer.shape[3] for layer in self.layers),
                           doc="The longest layer capacity, in tokens (static).")

    @property
    def max_length(self) -> int:
        """Where lengths stop (static): the longest layer of full attention's ``max_seq_len``,
        2**31 - 1 when every layer is a ring."""
        full = [layer.shape[3] for i, layer in enumerate(self.layers) if not self.is_ring(i)]
        return max(full) if full else lifecycle.MAX_POSITIONS

    def is_ring(self, i: int) -> bool:
        """Layer ``i`` (a static int) is a ring (``KVLayerConfig.ring``)."""
        return bool(self.rings) and self.rings[i]

    def _rings(self) -> list[bool]:
        return [self.is_ring(i) for i in range(self.num_layers)]
    dtype = property(lambda self: self.layers[0].dtype, doc="Element type of every layer.")

    def with_scales(self, k_scale=None, v_scale=None) -> "KVCacheManager":
        """A per-tensor cache with new scales; see ``LinearKVCache.with_scales``."""
        return quantization.with_scales(self, "KVCacheManager.with_scales", k_scale, v_scale)

    def _index(self, op: str, i: int) -> int:
        """Layer ``i`` checked: a Python int, since the layers may differ in shape."""
        if isinstance(i, jax.Array):
            raise TypeError(f"{op}: layer_idx must be a Python int for a KVCacheManager (its layers "
                            f"differ in shape: unroll them), got {type(i).__name__}")
        return validate.static_int(op, "layer_idx", i, 0, self.num_layers - 1)

    def layer_config(self, i: int) -> KVLayerConfig:
        """The configuration of layer ``i`` (``max_seq_len`` filled in)."""
        i = self._index("KVCacheManager.layer_config", i)
        _, _, h, s, d = self.layers[i].shape
        return KVLayerConfig(num_kv_heads=h, head_dim=d, max_seq_len=s, ring=self.is_ring(i))

    @property
    def is_uniform(self) -> bool:
        """Every layer has the same shape and dtype and is a ring or not alike (the cache could
        be a LinearKVCache)."""
        return len({(layer.shape, layer.dtype, self.is_ring(i))
                    for i, layer in enumerate(self.layers)}) == 1

    def combined(self, i: int, dtype: Any = None) -> jax.Array:
        """``[max_batch, 2, H_i, S_i, D_i]`` of layer ``i`` as stored; with ``dtype`` (float32,
        bfloat16 or float16) the values instead, an 8-bit cache's dequantized
        (``float32(q) * scale``), any other's converted."""
        if dtype is None:
            return self.layers[self._index("KVCacheManager.combined", i)]
        return jnp.stack(self._read("KVCacheManager.combined", i, dtype), axis=1)

    def separate(self, i: int, dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        """``(K, V)`` of layer ``i``, each ``[max_batch, H_i, S_i, D_i]`` (``dtype`` as in
        ``combined``)."""
        if dtype is None:
            layer = self.layers[self._index("KVCacheManager.separate", i)]
            return layer[:, 0], layer[:, 1]
        return self._read("KVCacheManager.separate", i, dtype)

    def _read(self, op: str, i: int, dtype) -> tuple[jax.Array, jax.Array]:
        i = self._index(op, i)
        scales = (None, None) if self.scaling is None else (self.k_scales[i], self.v_scales[i])
        k, v = (quantization.read_values(op, self.scaling, self.layers[i][:, kv], scales[kv], dtype)
                for kv in (0, 1))
        return k, v

    @classmethod
    def from_linear(cls, cache: LinearKVCache) -> "KVCacheManager":
        """The same cache with one buffer per layer. XLA has no views of a buffer, so the layers
        are copied once (under ``jit`` with the cache donated, that one copy is all); lengths and
        the active batch size are carried over."""
        layers = tuple(cache.buffer[i] for i in range(cache.num_layers))
        scales = {}
        if cache.scaling == "per_token_head":
            scales = dict(k_scales=tuple(cache.k_scales[i] for i in range(cache.num_layers)),
                          v_scales=tuple(cache.v_scales[i] for i in range(cache.num_layers)))
        elif cache.scaling == "per_tensor":
            scales = dict(k_scales=cache.k_scales, v_scales=cache.v_scales)
        return cls(layers=layers, lengths=cache.lengths, active_batch_size=cache.active_batch_size,
                   sharding=cache.sharding, scaling=cache.scaling,
                   rings=(True,) * cache.num_layers if cache.ring else (), **scales)

    def to_linear(self) -> LinearKVCache:
        """A LinearKVCache of a uniform cache: the layers stacked into one buffer (one copy)."""
        if not self.is_uniform:
            raise ValueError("KVCacheManager.to_linear: layers differ in shape or dtype")
        scales = {}
        if self.scaling == "per_token_head":
            scales = dict(k_scales=jnp.stack(self.k_scales), v_scales=jnp.stack(self.v_scales))
        elif self.scaling == "per_tensor":
            scales = dict(k_scales=self.k_scales, v_scales=self.v_scales)
        return LinearKVCache(
            buffer=jnp.stack(self.layers),
            lengths=self.lengths,
            active_batch_size=self.active_batch_size,
            sharding=self.sharding,
            scaling=self.scaling,
            ring=self.is_ring(0),
            **scales,
        )

    @property
    @per_shard(out=Combined("all"))
    def all_empty(self) -> jax.Array:
        """bool ``[]``: no active sequence holds a token."""
        return lifecycle.all_empty(self.lengths, self.active_batch_size)

    @per_shard(n=Count("self"))
    def set_active_batch_size(self, n: IntOrArray) -> "KVCacheManager":
        """Marks rows ``[0, n)`` active; see ``LinearKVCache.set_active_batch_size``."""
        n = lifecycle.active_batch_size_arg("KVCacheManager.set_active_batch_size", n, self.max_batch)
        return dataclasses.replace(self, active_batch_size=n)

    @per_shard(reuse_lengths=Role(ROWS))
    def reset(self, reuse_lengths: jax.Array) -> "KVCacheManager":
        """Starts a new batch of ``n`` sequences; ``reuse_lengths``: int32 ``[n]``, tokens already
        in the cache for each (a prompt instantiated with ``instantiate``; 0 for none)."""
        lengths, active = lifecycle.reset_lengths(
            "KVCacheManager.reset", reuse_lengths, self.max_batch, self.max_length
        )
        return dataclasses.replace(self, lengths=lengths, active_batch_size=active)

    @per_shard(k=Role(KV), v=Role(KV), new_lengths=Role(ROWS))
    def append(self, layer_idx: int, k: jax.Array, v: jax.Array, new_lengths=None):
        """Writes ``k``, ``v`` ``[max_batch, H_i, T, D_i]`` into layer ``layer_idx`` (a static int:
        layers differ in shape) after each active sequence's tokens; see ``LinearKVCache.append``.
        Tokens past the layer's ``max_seq_len`` are dropped (reported through ``checkify``); a
        ring layer drops none (``LinearKVCache.append``)."""
        op = "KVCacheManager.append"
        i = self._index(op, layer_idx)
        scales: tuple | None = None
        fields: dict[str, Any] = {}
        if self.scaling == "per_token_head":
            scales = (self.k_scales[i], self.v_scales[i], True)
        elif self.scaling == "per_tensor":  # the layer's own scales, read only
            scales = (self.k_scales[i:i + 1], self.v_scales[i:i + 1], False)
        layer, k_scales, v_scales = lifecycle.append(
            op, self.layers[i], 0, k, v, self.lengths, self.active_batch_size, new_lengths, scales,
            self.is_ring(i)
        )
        if self.scaling == "per_token_head":
            fields = dict(k_scales=_replaced(self.k_scales, i, k_scales),
                          v_scales=_replaced(self.v_scales, i, v_scales))
        return dataclasses.replace(self, layers=_replaced(self.layers, i, layer), **fields)

    @per_shard(new_lengths=Role(ROWS))
    def commit(self, new_lengths: IntOrArray) -> "KVCacheManager":
        """Advances the lengths of active sequences (a Python int, an int32 scalar or int32
        ``[max_batch]``); lengths stop at ``max_length``, a negative increment is ignored (both
        reported through ``checkify``)."""
        lengths = lifecycle.commit_lengths(
            "KVCacheManager.commit", self.lengths, self.active_batch_size, new_lengths,
            self.max_length,
        )
        return dataclasses.replace(self, lengths=lengths)

    @per_shard(batch_mapping=Destinations("self"))
    def compact(self, batch_mapping: jax.Array) -> "KVCacheManager":
        """Evicts and compacts every layer in one launch (see ``LinearKVCache.compact``)."""
        n = self.num_layers
        lengths, moved, survivors = lifecycle.compact(
            "KVCacheManager.compact", [*self.layers, *quantization.token_scales(self)],
            self.lengths, batch_mapping)
        return dataclasses.replace(self, layers=tuple(moved[:n]), lengths=lengths,
                                   active_batch_size=survivors,
                                   **quantization.replaced_scales(self, moved[n:]))

    def _names(self) -> list[str]:
        return [f"layers[{i}]" for i in range(self.num_layers)]

    @per_shard(batch_idx=row_ids("self"), out=FromOwner())
    def save(self, batch_idx: IntOrArray, seq_len: int) -> SavedKV:
        """Tokens ``[0, seq_len)`` of row ``batch_idx``, every layer, in one launch (see
        ``jaxkv.save_kv_cache``); ``seq_len`` (static) must fit every layer of full attention.
        A ring layer saves the last ``min(seq_len, S_i)`` of them, in order (the row must still
        hold them, reported through ``checkify``; ``LinearKVCache.save``)."""
        op = "KVCacheManager.save"
        saved = reuse.save_saved_kv(op, list(self.layers), self._names(), batch_idx, seq_len,
                                    quantization.scales_of(self), self._rings())
        for i in range(self.num_layers):
            if self.is_ring(i):
                reuse.check_ring_save(op, self.lengths, batch_idx, seq_len,
                                      self.layers[i].shape[3])
        return saved

    @per_shard(batch_idx=row_ids("self"))
    def instantiate(self, saved: SavedKV, batch_idx: IntOrArray) -> "KVCacheManager":
        """Writes ``saved`` into tokens ``[0, T)`` of row ``batch_idx`` (an int, an int32 scalar or
        an int32 ``[n]`` array of rows), every layer in one launch (see
        ``jaxkv.instantiate_kv_cache``). Lengths are unchanged: give the rows ``saved.length``
        through ``reset`` (e.g. ``reset(jnp.full((n,), saved.length))`` for rows ``0..n-1``). An
        8-bit cache takes a float prefix too, quantized as ``append`` would store it. A ring
        layer places position ``p`` at slot ``p % S_i`` (``LinearKVCache.instantiate``).
        """
        layers, scales = reuse.instantiate_saved_kv(
            "KVCacheManager.instantiate", list(self.layers), self._names(), saved, batch_idx,
            quantization.scales_of(self), self._rings())
        return dataclasses.replace(self, layers=tuple(layers),
                                   **quantization.replaced_scales(self, scales))


def _replaced(items: tuple, i: int, x) -> tuple:
    return items[:i] + (x,) + items[i + 1:]
