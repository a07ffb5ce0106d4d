"""Cache kinds: one small adapter per jaxkv cache, behind the interface the decode loop uses.

A kind is static (hashable, closed over by ``jit``); the cache it creates is the pytree that flows
through the jitted step functions and is donated to them. Every kind has two implementations of
its data movement, picked by ``ops``: ``"jaxkv"`` (the library's custom calls) and ``"xla"`` (the
same operations in plain ``jnp``: scatters, gathers, ``.at[].set``), the baseline the demo compares
against. Interface (``B`` = max_batch, rows ``[0, active)`` hold live sequences):

- ``create(max_batch, max_seq_len) -> cache``
- ``lengths(cache)`` int32 [B]; ``active(cache)`` int32 []; ``clear(cache, n)``: n empty live rows
- ``reserve(cache, new_lengths)``: makes room for ``new_lengths`` [B] more tokens (paged only)
- ``append(cache, layer, k, v, new_lengths)``: k, v [B, Hkv, T, D], written after each row's tokens
- ``attend(cache, layer, q, positions)``: q [B, T, Hq, D] over the cache -> [B, T, Hq, D]
- ``commit(cache, new_lengths)``; ``evict(cache, batch_mapping)`` (survivors to ``[0, survivors)``)
- ``save(cache, slot, length) -> saved``: a prompt's KV, kept outside the batch
- ``admit(cache, saved, n_old, n_new)``: rows ``[n_old, n_old + n_new)`` start from ``saved``
- ``memory(cache) -> (bytes in use, bytes allocated)`` (host side)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import reference

from .model import LlamaConfig, dense_attention


def _new_rows(max_batch: int, n_old, n_new) -> jax.Array:
    """bool [B]: the rows being admitted."""
    rows = jnp.arange(max_batch, dtype=jnp.int32)
    return (rows >= n_old) & (rows < n_old + n_new)


@dataclasses.dataclass(frozen=True)
class LinearKind:
    """``jaxkv.LinearKVCache``: one buffer ``[L, B, 2, Hkv, S, D]``, attention masked by length."""

    cfg: LlamaConfig
    dtype: str = "float32"
    ops: str = "jaxkv"  # or "xla"
    name = "linear"

    def create(self, max_batch: int, max_seq_len: int):
        cfg = self.cfg
        return jaxkv.LinearKVCache.create(cfg.num_layers, max_batch, cfg.num_kv_heads,
                                          max_seq_len, cfg.head_dim, jnp.dtype(self.dtype))

    def lengths(self, cache):
        return cache.lengths

    def active(self, cache):
        return cache.active_batch_size

    def clear(self, cache, n: int):
        """``n`` empty live rows, nothing else."""
        return cache.reset(jnp.zeros((n,), jnp.int32))

    def reserve(self, cache, new_lengths):
        return cache

    def append(self, cache, layer, k, v, new_lengths):
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, new_lengths)
        buffer = cache.buffer.at[layer].set(reference.append_layer(
            cache.buffer[layer], k, v, cache.lengths, cache.active_batch_size, new_lengths))
        return dataclasses.replace(cache, buffer=buffer)

    def attend(self, cache, layer, q, positions):
        return dense_attention(q, cache.keys(layer), cache.values(layer), positions)

    def commit(self, cache, new_lengths):
        return cache.commit(new_lengths)

    def evict(self, cache, batch_mapping):
        if self.ops == "jaxkv":
            return cache.compact(batch_mapping)
        buffer = jax.vmap(reference.compact_tensor_batch, (0, None))(cache.buffer, batch_mapping)
        lengths = reference.compact_lengths(cache.lengths, batch_mapping)
        survivors = jnp.sum(batch_mapping >= 0).astype(jnp.int32)
        return type(cache)(buffer=buffer, lengths=lengths, active_batch_size=survivors)

    def save(self, cache, slot: int, length: int):
        # TODO(merge): jaxkv's save op replaces this slice.
        return cache.buffer[:, slot, :, :, :length]  # [L, 2, Hkv, P, D]

    def admit(self, cache, saved, n_old, n_new):
        # TODO(merge): jaxkv's instantiate op replaces this scatter.
        new = _new_rows(cache.max_batch, n_old, n_new)
        length = saved.shape[3]
        target = jnp.where(new, jnp.arange(cache.max_batch), cache.max_batch)
        buffer = cache.buffer.at[:, target, :, :, :length].set(
            jnp.broadcast_to(saved[:, None], (saved.shape[0], cache.max_batch) + saved.shape[1:]),
            mode="drop")
        lengths = jnp.where(new, length, cache.lengths)
        return type(cache)(buffer=buffer, lengths=lengths,
                           active_batch_size=jnp.asarray(n_old + n_new, jnp.int32))

    def memory(self, cache) -> tuple[int, int]:
        active = int(cache.active_batch_size)
        tokens = int(np.sum(np.asarray(cache.lengths)[:active]))
        per_token = 2 * cache.num_layers * cache.num_kv_heads * cache.head_dim * cache.dtype.itemsize
        return tokens * per_token, cache.buffer.nbytes


KINDS = {"linear": LinearKind}


def make_kind(name: str, cfg: LlamaConfig, dtype: str = "float32", ops: str = "jaxkv"):
    if name not in KINDS:
        raise ValueError(f"unknown cache kind {name!r}; choose from {', '.join(KINDS)}")
    if ops not in ("jaxkv", "xla"):
        raise ValueError(f"unknown ops {ops!r}; choose jaxkv or xla")
    return KINDS[name](cfg=cfg, dtype=dtype, ops=ops)
