"""The bar jaxkv is measured against: a fixed-slot KV cache in pure JAX, with no jaxkv in it.

This is how a JAX serving loop is written without a cache library (JetStream, jax-llm-examples):
every sequence gets a slot of ``max_seq_len`` tokens in preallocated K and V buffers,
``[slots, num_kv_heads, max_seq_len, head_dim]`` per layer (``per_layer``, with the layers as a
Python loop, as jax-llm-examples keeps them: attention reads a layer's buffer as it is) or one
``[num_layers, ...]`` buffer (layers in a ``scan``: the layer is a slice of it, which XLA copies
before the attention's matmuls); a new request is inserted into a free
slot (the shared system prompt copied in with ``dynamic_update_slice``, its prompt written by
chunks), decode steps scatter one token per slot, attention reads each slot's whole buffer and
masks the positions past its length, and a finished request just frees its slot: no data moves.
Memory is reserved for ``max_seq_len`` tokens per sequence whatever its length, which is what a
paged cache avoids.

It is a cache kind of the serving loop (``serve.py``: the interface of ``caches.py``) and imports
only jax, numpy and the model (``tests/test_serve.py`` checks that no jaxkv cache code is reached).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ModelConfig
from ..models.layers import AttentionSpec, dense_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedSlotCache:
    k: jax.Array | tuple  # [L, slots, Hkv, max_seq_len, D], or L arrays [slots, Hkv, S, D]
    v: jax.Array | tuple
    lengths: jax.Array  # int32 [slots]: tokens each slot holds
    live: jax.Array  # bool [slots]: the slot holds a sequence


@dataclasses.dataclass(frozen=True)
class FixedSlotKind:
    """Slots of ``max_seq_len`` tokens; freed in place (``compacts = False``: the scheduler keeps
    a free list instead of compacting survivors to the front)."""

    cfg: ModelConfig
    dtype: str = "float32"
    per_layer: bool = False  # one buffer per layer (layers unrolled, static layer indices)
    ops: str = "xla"  # (what it is; the loop prints it)
    # A jax Mesh (``serve --mesh``): the buffers' KV heads split over its "tp" axis, the way a
    # tensor-parallel JAX server keeps them; the slots are not split (one free list).
    mesh: Any = None
    compacts = False
    batch_shards = 1

    def create(self, max_batch: int, max_seq_len: int) -> FixedSlotCache:
        c = self.cfg
        shape = (max_batch, c.num_kv_heads, max_seq_len, c.head_dim)

        def make():
            if self.per_layer:
                k = tuple(jnp.zeros(shape, self.dtype) for _ in range(c.num_layers))
                v = tuple(jnp.zeros(shape, self.dtype) for _ in range(c.num_layers))
            else:
                k, v = (jnp.zeros((c.num_layers, *shape), self.dtype) for _ in "kv")
            return FixedSlotCache(k=k, v=v, lengths=jnp.zeros((max_batch,), jnp.int32),
                                  live=jnp.zeros((max_batch,), bool))

        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=self.placement(jax.eval_shape(make)))()

    def placement(self, cache):
        """The ``NamedSharding`` of each leaf of ``cache`` on ``mesh``: buffers' KV heads over
        "tp", the rest replicated."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        heads = "tp" if "tp" in self.mesh.axis_names else None
        return jax.tree.map(lambda x: NamedSharding(
            self.mesh, P(*([None] * (x.ndim - 3)), heads) if x.ndim >= 4 else P()), cache)

    def _update(self, buffer, layer, fn):
        """``buffer`` with layer ``layer`` replaced by ``fn(index, layer's array)``, where
        ``index`` prefixes the layer's own indices into ``buffer[...]`` (in place either way)."""
        if isinstance(buffer, tuple):
            return buffer[:layer] + (fn((), buffer[layer]),) + buffer[layer + 1:]
        return fn((layer,), buffer)

    def lengths(self, cache):
        return cache.lengths

    def live(self, cache):
        return cache.live

    def clear(self, cache, n: int):
        slots = cache.lengths.shape[0]
        return dataclasses.replace(cache, lengths=jnp.zeros_like(cache.lengths),
                                   live=jnp.arange(slots) < n)

    def reserve(self, cache, new_lengths):
        return cache

    def reserve_served(self, cache, new_lengths):
        return cache, jnp.ones(new_lengths.shape, bool)

    def reserved_tokens(self, cache):
        return jnp.sum(cache.live, dtype=jnp.int32) * cache.k[0].shape[-2]

    def _write(self, cache, layer, slots, k, v, new_lengths):
        """Token t < new_lengths[i] of k, v [R, Hkv, T, D] goes to position lengths + t of slot
        slots[i] (one scatter per buffer, in place; padding past the count is dropped, never
        clamped onto real tokens as a dynamic_update_slice near the end of a slot would be)."""
        capacity = cache.k[0].shape[-2]
        t = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
        start = cache.lengths[jnp.clip(slots, 0, cache.lengths.shape[0] - 1)]
        pos = jnp.where(t < new_lengths[:, None], start[:, None] + t, capacity)  # [R, T]
        s = jnp.broadcast_to(slots[:, None], pos.shape)

        def put(buffer, x):  # x [R, Hkv, T, D] -> updates [R, T, Hkv, D] at (layer, s, :, pos)
            return self._update(buffer, layer, lambda at, b: b.at[(*at, s, slice(None), pos)].set(
                jnp.swapaxes(x, 1, 2), mode="drop"))

        return dataclasses.replace(cache, k=put(cache.k, k), v=put(cache.v, v))

    def append(self, cache, layer, k, v, new_lengths):
        slots = jnp.arange(cache.lengths.shape[0], dtype=jnp.int32)
        return self._write(cache, layer, slots, k, v, jnp.where(cache.live, new_lengths, 0))

    def attend(self, cache, layer, q, positions, new_lengths=None, spec=AttentionSpec()):
        """Every slot's whole buffer, masked past each query's position (dense attention)."""
        return dense_attention(q, cache.k[layer], cache.v[layer], positions, spec)

    def attend_rows(self, cache, layer, rows, q, k, v, new_lengths, positions,
                    spec=AttentionSpec()):
        cache = self._write(cache, layer, rows, k, v, new_lengths)
        slot = jnp.clip(rows, 0, cache.lengths.shape[0] - 1)
        return dense_attention(q, cache.k[layer][slot], cache.v[layer][slot], positions,
                               spec), cache

    def commit(self, cache, new_lengths):
        return dataclasses.replace(
            cache, lengths=cache.lengths + jnp.where(cache.live, new_lengths, 0))

    def save(self, cache, length: int):
        """The system prompt prefilled into slot 0: K and V ``[L, Hkv, length, D]``."""
        if self.per_layer:
            return cache, tuple(jnp.stack([x[0, :, :length] for x in b]) for b in (cache.k, cache.v))
        return cache, (cache.k[:, 0, :, :length], cache.v[:, 0, :, :length])

    def admit(self, cache, saved, new):
        """Inserts the saved prompt into each new slot with ``dynamic_update_slice``."""
        sk, sv = saved
        slots = jnp.nonzero(new, size=new.shape[0], fill_value=0)[0].astype(jnp.int32)

        def insert(i, c):
            if self.per_layer:
                at = (slots[i], 0, 0, 0)
                put = lambda b, x: tuple(jax.lax.dynamic_update_slice(b[l], x[l][None], at)  # noqa: E731
                                         for l in range(len(b)))
            else:
                at = (0, slots[i], 0, 0, 0)
                put = lambda b, x: jax.lax.dynamic_update_slice(b, x[:, None], at)  # noqa: E731
            return dataclasses.replace(c, k=put(c.k, sk), v=put(c.v, sv))

        cache = jax.lax.fori_loop(0, jnp.sum(new, dtype=jnp.int32), insert, cache)
        return dataclasses.replace(cache, lengths=jnp.where(new, sk.shape[2], cache.lengths),
                                   live=cache.live | new)

    def evict(self, cache, batch_mapping):
        """Frees the slots mapped to -1; the others stay where they are (no data moves)."""
        done = batch_mapping < 0
        return dataclasses.replace(cache, lengths=jnp.where(done, 0, cache.lengths),
                                   live=cache.live & ~done)

    def memory(self, cache) -> tuple[int, int]:
        live = np.asarray(cache.live)
        per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim
        tokens = int(np.sum(np.asarray(cache.lengths)[live]))
        held = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
        return tokens * per_token * jnp.dtype(self.dtype).itemsize, held
