"""Cache kinds: one small adapter per jaxkv cache, behind the interface the decode loop uses.

A kind is static (hashable, closed over by ``jit``); the cache it creates is the pytree that flows
through the jitted step functions and is donated to them. Each kind moves data in one of two ways,
picked by ``ops``: ``"jaxkv"`` (the library's custom calls) or ``"xla"`` (the same operations in
plain ``jnp``: scatters, gathers, ``.at[].set``, ``dynamic_update_slice``), the baseline the demo
compares against. Interface (``B`` = max_batch; live sequences occupy rows ``[0, active)``):

- ``create(max_batch, max_seq_len) -> cache``
- ``lengths(cache)`` int32 [B]; ``active(cache)`` int32 []; ``clear(cache, n)``: n empty live rows
- ``reserve(cache, new_lengths)``: room for ``new_lengths`` [B] more tokens (paged: pages)
- ``append(cache, layer, k, v, new_lengths)``: k, v [B, Hkv, T, D] after each row's tokens
- ``attend(cache, layer, q, positions, new_lengths=None)``: q [B, T, Hq, D] over the cache ->
  [B, T, Hq, D]; the new tokens (appended, not yet committed) are visible. With ``ops="jaxkv"``
  this is ``jaxkv.attention.prefill``, reading the layer in place (every cache kind); queries
  past ``new_lengths[b]`` then give zeros
- ``commit(cache, new_lengths)``; ``evict(cache, batch_mapping)`` (survivors to ``[0, survivors)``)
- ``save(cache, slot, length) -> (cache, saved)``: keeps a prompt's KV for later admissions
- ``admit(cache, saved, n_old, n_new)``: rows ``[n_old, n_old + n_new)`` start from ``saved``
- ``memory(cache) -> (bytes in use, bytes allocated)`` (host side)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import reference

from .model import LlamaConfig, dense_attention


def _kernel_attends(cfg: LlamaConfig) -> bool:
    """jaxkv.attention's kernels are built for this head_dim (else: dense attention)."""
    return cfg.head_dim in jaxkv.attention.HEAD_DIMS


def _jaxkv_attend(cache, layer, q, new_lengths):
    """The new tokens attend causally over the cache, read in place (jaxkv.attention.prefill)."""
    if new_lengths is None:
        new_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    out = jaxkv.attention.prefill(q.astype(cache.dtype), cache, layer, new_lengths)
    return out.astype(q.dtype)


def _rows_in(max_batch: int, lo, hi) -> jax.Array:
    """bool [B]: rows in ``[lo, hi)``."""
    rows = jnp.arange(max_batch, dtype=jnp.int32)
    return (rows >= lo) & (rows < hi)


def _for_rows(lo, hi, body, cache):
    """``body(row, cache)`` for each row in ``[lo, hi)`` (traced bounds), cache as the carry."""
    return jax.lax.fori_loop(lo, hi, lambda row, c: body(row.astype(jnp.int32), c), cache)


# --- plain-XLA data movement, on layers [..., B, 2, H, S, D] (a leading layer axis or not) ---


def _xla_save(buffer, slot: int, length: int) -> jax.Array:
    return buffer[..., slot, :, :, :length, :]  # [..., 2, H, T, D]


def _xla_instantiate_row(buffer, saved, row) -> jax.Array:
    update = jnp.expand_dims(saved, -5)  # [..., 1, 2, H, T, D]
    start = (0,) * (buffer.ndim - 5) + (row, 0, 0, 0, 0)
    return jax.lax.dynamic_update_slice(buffer, update, start)


def _xla_compact(buffer, batch_mapping) -> jax.Array:
    rows = buffer.shape[-5]
    target = jnp.where((batch_mapping >= 0) & (batch_mapping < rows), batch_mapping, rows)
    return buffer.at[..., target, :, :, :, :].set(buffer, mode="drop")


@dataclasses.dataclass(frozen=True)
class _RowKind:
    """Shared by the two caches whose rows hold whole sequences (linear and manager)."""

    cfg: LlamaConfig
    dtype: str = "float32"
    ops: str = "jaxkv"  # or "xla"
    sharding: jaxkv.CacheSharding | None = None  # --mesh: KV heads split over devices

    def lengths(self, cache):
        return cache.lengths

    def active(self, cache):
        return cache.active_batch_size

    def clear(self, cache, n: int):
        return cache.reset(jnp.zeros((n,), jnp.int32))

    def reserve(self, cache, new_lengths):
        return cache  # rows are preallocated to max_seq_len

    def commit(self, cache, new_lengths):
        return cache.commit(new_lengths)

    def attend(self, cache, layer, q, positions, new_lengths=None):
        if self.ops == "jaxkv" and _kernel_attends(self.cfg):
            return _jaxkv_attend(cache, layer, q, new_lengths)
        k, v = self.kv(cache, layer)
        return dense_attention(q, k, v, positions)

    def admit(self, cache, saved, n_old, n_new):
        if self.ops == "jaxkv":
            cache = _for_rows(n_old, n_old + n_new, lambda r, c: c.instantiate(saved, r), cache)
        else:
            cache = _for_rows(n_old, n_old + n_new, self._xla_instantiate(saved), cache)
        # Freed rows have length 0 (compact), so committing the prompt length sets it.
        cache = cache.set_active_batch_size(n_old + n_new)
        new = _rows_in(cache.max_batch, n_old, n_old + n_new)
        return cache.commit(jnp.where(new, saved.length, 0).astype(jnp.int32))

    def evict(self, cache, batch_mapping):
        if self.ops == "jaxkv":
            return cache.compact(batch_mapping)
        cache = self._xla_compact(cache, batch_mapping)
        survivors = jnp.sum(batch_mapping >= 0).astype(jnp.int32)
        lengths = reference.compact_lengths(cache.lengths, batch_mapping)
        return dataclasses.replace(cache, lengths=lengths, active_batch_size=survivors)

    def memory(self, cache) -> tuple[int, int]:
        active = int(cache.active_batch_size)
        tokens = int(np.sum(np.asarray(cache.lengths)[:active]))
        itemsize = jnp.dtype(self.dtype).itemsize
        per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * itemsize
        return tokens * per_token, sum(x.nbytes for x in jax.tree.leaves(cache))


@dataclasses.dataclass(frozen=True)
class LinearKind(_RowKind):
    """``jaxkv.LinearKVCache``: one buffer ``[L, B, 2, Hkv, S, D]``; attention masks by length."""

    def create(self, max_batch: int, max_seq_len: int):
        c = self.cfg
        return jaxkv.LinearKVCache.create(c.num_layers, max_batch, c.num_kv_heads, max_seq_len,
                                          c.head_dim, jnp.dtype(self.dtype), self.sharding)

    def kv(self, cache, layer):
        return cache.keys(layer), cache.values(layer)

    def append(self, cache, layer, k, v, new_lengths):
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, new_lengths)
        buffer = cache.buffer.at[layer].set(reference.append_layer(
            cache.buffer[layer], k, v, cache.lengths, cache.active_batch_size, new_lengths))
        return dataclasses.replace(cache, buffer=buffer)

    def save(self, cache, slot: int, length: int):
        if self.ops == "jaxkv":
            return cache, cache.save(slot, length)
        saved = _xla_save(cache.buffer, slot, length)
        return cache, jaxkv.SavedKV(layers=tuple(saved), length=jnp.asarray(length, jnp.int32))

    def _xla_instantiate(self, saved):
        stacked = jnp.stack(saved.layers)
        return lambda row, c: dataclasses.replace(
            c, buffer=_xla_instantiate_row(c.buffer, stacked, row))

    def _xla_compact(self, cache, batch_mapping):
        return dataclasses.replace(cache, buffer=_xla_compact(cache.buffer, batch_mapping))


@dataclasses.dataclass(frozen=True)
class ManagerKind(_RowKind):
    """``jaxkv.KVCacheManager``: one buffer ``[B, 2, Hkv, S, D]`` per layer."""

    def create(self, max_batch: int, max_seq_len: int):
        c = self.cfg
        layers = [jaxkv.KVLayerConfig(c.num_kv_heads, c.head_dim)] * c.num_layers
        return jaxkv.KVCacheManager.create(layers, max_batch, max_seq_len, jnp.dtype(self.dtype),
                                           self.sharding)

    def kv(self, cache, layer):
        return cache.separate(layer)

    def append(self, cache, layer, k, v, new_lengths):
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, new_lengths)
        new = reference.append_layer(cache.layers[layer], k, v, cache.lengths,
                                     cache.active_batch_size, new_lengths)
        layers = cache.layers[:layer] + (new,) + cache.layers[layer + 1:]
        return dataclasses.replace(cache, layers=layers)

    def save(self, cache, slot: int, length: int):
        if self.ops == "jaxkv":
            return cache, cache.save(slot, length)
        saved = tuple(_xla_save(x, slot, length) for x in cache.layers)
        return cache, jaxkv.SavedKV(layers=saved, length=jnp.asarray(length, jnp.int32))

    def _xla_instantiate(self, saved):
        return lambda row, c: dataclasses.replace(c, layers=tuple(
            _xla_instantiate_row(x, s, row) for x, s in zip(c.layers, saved.layers)))

    def _xla_compact(self, cache, batch_mapping):
        return dataclasses.replace(
            cache, layers=tuple(_xla_compact(x, batch_mapping) for x in cache.layers))


@dataclasses.dataclass(frozen=True)
class PagedKind:
    """``jaxkv.PagedKVCache``: a pool of pages; sequences hold pages through a page table.

    The cache has one row more than the batch: row ``B`` keeps the system prompt. Admission forks
    it (new rows share its full pages, copy-on-write of the last partial one); eviction releases
    pages through ``compact``; ``reserve`` takes pages before every forward pass. Attention is
    ``jaxkv.attention`` reading the pool in place (``ops="jaxkv"``); the XLA baseline (and
    ``attention="dense"``) gathers the layer into dense memory and attends densely;
    ``attention="pallas"`` uses JAX's deprecated Pallas ``paged_attention`` for decode steps.
    """

    cfg: LlamaConfig
    dtype: str = "float32"
    ops: str = "jaxkv"  # or "xla"
    page_size: int = 16
    attention: str = "auto"  # "auto" (jaxkv.attention with ops="jaxkv"), "dense" or "pallas"
    sharding: jaxkv.CacheSharding | None = None  # --mesh: KV heads split over devices

    def create(self, max_batch: int, max_seq_len: int):
        c = self.cfg
        pages_per_seq = -(-max_seq_len // self.page_size)
        return jaxkv.PagedKVCache.create(
            num_layers=c.num_layers, num_pages=(max_batch + 1) * pages_per_seq,
            page_size=self.page_size, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            max_batch=max_batch + 1, max_pages_per_seq=pages_per_seq, dtype=jnp.dtype(self.dtype),
            layout="HND", sharding=self.sharding)

    @staticmethod
    def _batch(cache) -> int:
        return cache.max_batch - 1  # the last row holds the system prompt

    @staticmethod
    def _pad(x, value=0):
        """[B, ...] -> [B + 1, ...]: the prompt row takes part in nothing."""
        return jnp.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    def lengths(self, cache):
        return cache.lengths[: self._batch(cache)]

    def active(self, cache):
        return jnp.sum(self.lengths(cache) > 0, dtype=jnp.int32)  # live rows hold the prompt

    def clear(self, cache, n: int):
        return cache.release(_rows_in(cache.max_batch, 0, self._batch(cache)))

    def reserve(self, cache, new_lengths):
        cache, _ = cache.reserve(self._pad(new_lengths))  # the pool fits every row at full length
        return cache

    def append(self, cache, layer, k, v, new_lengths):
        k, v, n = self._pad(k), self._pad(v), self._pad(new_lengths)
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, n)
        k_pages, v_pages = reference.paged_append(cache.k_pages, cache.v_pages, cache.page_table,
                                                  cache.lengths, layer, k, v, n, cache.layout)
        return dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages)

    def attend(self, cache, layer, q, positions, new_lengths=None):
        batch = self._batch(cache)
        visible = cache.lengths + cache.new_tokens  # committed tokens and the ones just appended
        if self._use_pallas(cache) and q.shape[1] == 1:
            return self._pallas(cache, layer, q, visible)[:, None]
        if self.ops == "jaxkv" and self.attention == "auto" and _kernel_attends(self.cfg):
            n = None if new_lengths is None else self._pad(new_lengths)
            return _jaxkv_attend(cache, layer, self._pad(q), n)[:batch]
        max_len = cache.max_pages_per_seq * cache.page_size
        if self.ops == "jaxkv":
            k, v = jaxkv.paged_gather(cache.k_pages, cache.v_pages, cache.page_table, visible,
                                      layer, max_len, layout=cache.layout, split=True,
                                      sharding=self.sharding)
        else:
            kv = reference.paged_gather(cache.k_pages, cache.v_pages, cache.page_table, visible,
                                        layer, max_len, cache.layout)
            k, v = kv[:, 0], kv[:, 1]
        return dense_attention(q, k[:batch], v[:batch], positions)

    def _use_pallas(self, cache) -> bool:
        on_gpu = jax.default_backend() == "gpu"
        if self.sharding is not None:  # the Pallas call reads the whole pool: dense, per shard
            return False
        if self.attention != "pallas":
            return False
        _, per_block = _pallas_blocks(cache.max_pages_per_seq)
        block, d = per_block * cache.page_size, cache.head_dim
        fits = all(n >= 16 and n & (n - 1) == 0 for n in (block, d))  # Triton block shapes
        if not fits and self.attention == "pallas" and on_gpu:
            raise ValueError(f"Pallas paged_attention needs power-of-two blocks of at least 16: "
                             f"{per_block} pages x page_size {cache.page_size}, head_dim {d}")
        return fits or not on_gpu

    def _pallas(self, cache, layer, q, visible):
        """One decode step of attention straight from the pool, with no slice of it.

        ``k_pages[layer]`` would be a copy of the layer's pool on every step. Instead the whole
        pool [L, H, P, S, D] is seen as one KV head with L * H * P pages (a free reshape), and each
        (sequence, KV head) pair as a sequence of its own whose page table points into its layer
        and head: the kernel reads exactly the pages it would have read, in place.
        """
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        num_layers, heads, pages, size, head_dim = cache.k_pages.shape
        batch, _, q_heads, _ = q.shape
        pool = lambda x: x.reshape(1, num_layers * heads * pages, size, head_dim)
        offset = (layer * heads + jnp.arange(heads, dtype=jnp.int32)) * pages  # [H]
        tables = cache.block_tables[:batch, None, :] + offset[None, :, None]  # [B, H, M]
        per_head = q_heads // heads
        scaled = (q[:, 0] / np.sqrt(head_dim).astype(np.float32)).astype(q.dtype)
        k_splits, per_block = _pallas_blocks(cache.max_pages_per_seq)
        out = paged_attention(
            scaled.reshape(batch * heads, per_head, head_dim), pool(cache.k_pages),
            pool(cache.v_pages), tables.reshape(batch * heads, -1),
            jnp.repeat(visible[:batch], heads), k_splits=k_splits,
            pages_per_compute_block=per_block, interpret=jax.default_backend() != "gpu")
        return out.reshape(batch, q_heads, head_dim)

    def commit(self, cache, new_lengths):
        return cache.commit(self._pad(new_lengths))

    def evict(self, cache, batch_mapping):
        prompt_row = self._batch(cache)
        return cache.compact(self._pad(batch_mapping, prompt_row))  # the prompt row stays put

    def save(self, cache, slot: int, length: int):
        """The prompt moves to the last row: a fork (sharing its full pages), then a release."""
        prompt_row = self._batch(cache)
        cache, _ = cache.fork(slot, jnp.full((1,), prompt_row, jnp.int32))
        cache = cache.release(_rows_in(cache.max_batch, slot, slot + 1))
        return cache, jnp.asarray(length, jnp.int32)

    def admit(self, cache, saved, n_old, n_new):
        prompt_row = self._batch(cache)
        fork = lambda row, c: c.fork(prompt_row, row[None])[0]
        return _for_rows(n_old, n_old + n_new, fork, cache)

    def memory(self, cache) -> tuple[int, int]:
        used = int(np.sum(np.asarray(cache.ref_counts) > 0))
        pool = cache.k_pages.nbytes + cache.v_pages.nbytes
        return used * pool // cache.num_pages, sum(x.nbytes for x in jax.tree.leaves(cache))


def _pallas_blocks(pages_per_seq: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for the Pallas kernel: both must divide the table."""
    k_splits = math.gcd(pages_per_seq, 16)
    part = pages_per_seq // k_splits
    return k_splits, max(c for c in (8, 4, 2, 1) if part % c == 0)


KINDS = {"linear": LinearKind, "manager": ManagerKind, "paged": PagedKind}


def make_kind(name: str, cfg: LlamaConfig, dtype: str = "float32", ops: str = "jaxkv", **options):
    if name not in KINDS:
        raise ValueError(f"unknown cache kind {name!r}; choose from {', '.join(KINDS)}")
    if ops not in ("jaxkv", "xla"):
        raise ValueError(f"unknown ops {ops!r}; choose jaxkv or xla")
    return KINDS[name](cfg=cfg, dtype=dtype, ops=ops, **options)
