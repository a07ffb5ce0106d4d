"""Cache kinds: one small adapter per jaxkv cache, behind the interface the decode loop uses.

A kind is static (hashable, closed over by ``jit``); the cache it creates is the pytree that flows
through the jitted step functions and is donated to them. Each kind moves data in one of two ways,
picked by ``ops``: ``"jaxkv"`` (the library's custom calls) or ``"xla"`` (the same operations in
plain ``jnp``: scatters, gathers, ``.at[].set``, ``dynamic_update_slice``), the baseline the demo
compares against.

With a ``sharding`` whose batch axis has ``k`` devices (``--mesh dp=k``), the ``B`` rows split into
``k`` batch shards, each a cache of its own ``B/k`` rows (docs/sharding.md): shard ``s`` owns rows
``[s * B/k, (s + 1) * B/k)`` and its live sequences occupy the first of them. Without one, ``k`` is
1: live sequences occupy rows ``[0, live)``. Interface (``B`` = max_batch, rows are global):

- ``create(max_batch, max_seq_len) -> cache``; ``batch_shards``: ``k``
- ``lengths(cache)`` int32 [B]; ``live(cache)`` bool [B]: rows holding a sequence
- ``clear(cache, n)``: n empty live rows in every batch shard
- ``reserve(cache, new_lengths)``: room for ``new_lengths`` [B] more tokens (paged: pages)
- ``append(cache, layer, k, v, new_lengths)``: k, v [B, Hkv, T, D] after each row's tokens
- ``attend(cache, layer, q, positions, new_lengths=None)``: q [B, T, Hq, D] over the cache ->
  [B, T, Hq, D]; the new tokens (appended, not yet committed) are visible. With ``ops="jaxkv"``
  this is ``jaxkv.attention.prefill``, reading the layer in place (every cache kind); queries
  past ``new_lengths[b]`` then give zeros
- ``commit(cache, new_lengths)``; ``evict(cache, batch_mapping)``: global row ids, each survivor
  to the front of its own shard
- ``save(cache, length) -> (cache, saved)``: keeps the prompt of ``length`` tokens written in the
  first row of every batch shard, for later admissions
- ``admit(cache, saved, new)``: the rows where ``new`` (bool [B]) holds, the first free ones of
  their shards, start from ``saved`` and become live
- ``memory(cache) -> (bytes in use, bytes allocated)`` (host side)

and for the serving benchmark (``serve.py``):

- ``reserve_served(cache, new_lengths) -> (cache, served)``: ``reserve`` that also says which rows
  got room (bool [B]; paged: a row whose pages do not fit takes none and is not served)
- ``attend_rows(cache, layer, rows, q, k, v, new_lengths, positions) -> (out, cache)``: a chunk
  of prefill for a few rows only: ``rows`` int32 [R] (B for an unused entry; over ``k`` batch
  shards, ``k`` equal lane groups, group ``s`` naming rows of shard ``s``), q [R, T, Hq, D],
  k and v [R, Hkv, T, D], ``new_lengths`` [R], ``positions`` [R, T] -> out [R, T, Hq, D]
- ``reserved_tokens(cache)``: int32, the tokens of memory the live sequences hold (linear: whole
  rows of ``max_seq_len``; paged: the pages in use)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import _windows, page_index, reference
from jaxkv.sharding import leaf_specs

from ..models.config import ModelConfig
from ..models.layers import AttentionSpec, dense_attention


def _kernel_attends(cfg: ModelConfig) -> bool:
    """jaxkv.attention's kernels are built for this head_dim (else: dense attention)."""
    return cfg.head_dim in jaxkv.attention.HEAD_DIMS


def _jaxkv_attend(cache, layer, q, new_lengths, spec: AttentionSpec = AttentionSpec()):
    """The new tokens attend causally over the cache, read in place (jaxkv.attention.prefill),
    with the layer's window, scale, soft cap and sinks."""
    if new_lengths is None:
        new_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    # An 8-bit cache is read under a 16-bit query (the kernels' pairs), any other under its dtype.
    q_dtype = jnp.bfloat16 if getattr(cache, "scaling", None) else cache.dtype
    out = jaxkv.attention.prefill(q.astype(q_dtype), cache, layer, new_lengths,
                                  window=spec.window, scale=spec.scale, soft_cap=spec.soft_cap,
                                  sinks=spec.sinks)
    return out.astype(q.dtype)


def _batch_shards(sharding) -> int:
    return 1 if sharding is None else sharding.batch_shards


def _live_rows(active, max_batch: int) -> jax.Array:
    """bool [B]: the live rows of a cache whose shard ``s`` has live local rows
    ``[0, active[s])`` (``active``: an int32 scalar, one shard, or ``[k]``)."""
    active = jnp.reshape(active, (-1,))
    per_shard = max_batch // active.shape[0]
    local = jnp.arange(max_batch, dtype=jnp.int32) % per_shard
    return local < jnp.repeat(active, per_shard, total_repeat_length=max_batch)


def _for_new_rows(new, body, cache):
    """``body(row, cache)`` for each row where ``new`` (bool [B], traced) holds, in order."""
    rows = jnp.nonzero(new, size=new.shape[0], fill_value=0)[0].astype(jnp.int32)
    count = jnp.sum(new, dtype=jnp.int32)
    return jax.lax.fori_loop(0, count, lambda i, c: body(rows[i], c), cache)


def _lane_groups(width: int, shards: int) -> jax.Array:
    """int32 [width]: each lane's group, the batch shard whose rows it holds (schedule.Chunk)."""
    return jnp.arange(width, dtype=jnp.int32) // (width // shards)


def _lane_blocks(x, rows, shards: int):
    """(``x`` [R, ...] as [shards, R / shards, ...], ``rows`` [W] as each lane group's rows
    within its block [shards, W / shards]; a row past ``x``: R / shards, past every block)."""
    per = x.shape[0] // shards
    local = jnp.where(rows < x.shape[0], rows - _lane_groups(rows.shape[0], shards) * per, per)
    return x.reshape(shards, per, *x.shape[1:]), local.reshape(shards, -1)


def _take_rows(x, rows, shards: int = 1):
    """``x[rows]``, where over ``shards`` batch shards the lanes are equal groups, group ``s``
    naming rows of block ``s`` of ``x`` (schedule.Chunk): taken block by block, so that no row
    crosses devices. A row past ``x`` gives one of its block's (its lane is unused)."""
    if shards == 1:
        return x[jnp.clip(rows, 0, x.shape[0] - 1)]
    blocks, local = _lane_blocks(x, rows, shards)
    local = jnp.minimum(local, blocks.shape[1] - 1)
    return jax.vmap(lambda b, i: b[i])(blocks, local).reshape(-1, *x.shape[1:])


def _put_rows(x, rows, values, shards: int = 1):
    """``x.at[rows].set(values)`` block by block as ``_take_rows``; rows past ``x`` dropped."""
    if shards == 1:
        return x.at[rows].set(values, mode="drop")
    blocks, local = _lane_blocks(x, rows, shards)
    values = values.reshape(shards, -1, *values.shape[1:])
    put = jax.vmap(lambda b, i, u: b.at[i].set(u, mode="drop"))
    return put(blocks, local, values).reshape(x.shape)


def _attend_rows_full(kind, cache, layer, rows, q, k, v, new_lengths, positions, spec):
    """``attend_rows`` through the full-batch ``append`` and ``attend``: the chunk's rows are
    scattered into otherwise empty ``[B, ...]`` arrays (rows taking no part add no token)."""
    batch, shards = kind.lengths(cache).shape[0], kind.batch_shards
    full = lambda x: _put_rows(jnp.zeros((batch, *x.shape[1:]), x.dtype), rows, x, shards)  # noqa
    n = full(new_lengths)
    cache = kind.append(cache, layer, full(k), full(v), n)
    if kind.ops == "xla" and hasattr(kind, "kv"):  # dense attention over the chunk's rows only
        keys, values = kind.kv(cache, layer)
        return dense_attention(q, _take_rows(keys, rows, shards),
                               _take_rows(values, rows, shards), positions, spec), cache
    out = kind.attend(cache, layer, full(q), full(positions), n, spec)
    return _take_rows(out, rows, shards), cache


# --- plain-XLA data movement, on layers [..., B, 2, H, S, D] (a leading layer axis or not) ---


def _placed(cache, sharding):
    """The cache with every leaf constrained to its sharding (docs/sharding.md), as the jaxkv ops
    keep it: XLA may place the result of a plain scatter elsewhere, and each step is compiled for
    the cache as created."""
    if sharding is None:
        return cache
    place = lambda spec, x: jax.lax.with_sharding_constraint(  # noqa: E731
        x, jax.sharding.NamedSharding(sharding.mesh, spec))
    return jax.tree.map(place, leaf_specs(cache), cache,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


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

    cfg: ModelConfig
    dtype: str = "float32"
    ops: str = "jaxkv"  # or "xla"
    sharding: jaxkv.CacheSharding | None = None  # --mesh: KV heads over tp, the batch over dp

    @property
    def batch_shards(self) -> int:
        return _batch_shards(self.sharding)

    def lengths(self, cache):
        return cache.lengths

    def live(self, cache):
        return _live_rows(cache.active_batch_size, cache.max_batch)

    def _counts(self, rows):
        """bool [B] -> rows per batch shard: int32 ``[k]`` (a scalar when the batch is not
        split), as ``set_active_batch_size`` takes them."""
        counts = jnp.sum(rows.reshape(self.batch_shards, -1), axis=1, dtype=jnp.int32)
        return counts if self.batch_shards > 1 else counts[0]

    def clear(self, cache, n: int):
        return cache.reset(jnp.zeros((n * self.batch_shards,), jnp.int32))

    def reserve(self, cache, new_lengths):
        return cache  # rows are preallocated to max_seq_len

    def reserve_served(self, cache, new_lengths):
        return cache, jnp.ones(new_lengths.shape, bool)

    def attend_rows(self, cache, layer, rows, q, k, v, new_lengths, positions,
                    spec=AttentionSpec()):
        return _attend_rows_full(self, cache, layer, rows, q, k, v, new_lengths, positions, spec)

    def commit(self, cache, new_lengths):
        return cache.commit(new_lengths)

    def attend(self, cache, layer, q, positions, new_lengths=None, spec=AttentionSpec()):
        if self.ops == "jaxkv" and _kernel_attends(self.cfg):
            return _jaxkv_attend(cache, layer, q, new_lengths, spec)
        k, v = self.kv(cache, layer)
        return dense_attention(q, k, v, positions, spec)

    def admit(self, cache, saved, new):
        if self.ops == "jaxkv":
            cache = _for_new_rows(new, lambda r, c: c.instantiate(saved, r), cache)
        else:
            cache = _placed(_for_new_rows(new, self._xla_instantiate(saved), cache), self.sharding)
        # Freed rows have length 0 (compact), so committing the prompt length sets it.
        cache = cache.set_active_batch_size(self._counts(self.live(cache) | new))
        return cache.commit(jnp.where(new, saved.length, 0).astype(jnp.int32))

    def evict(self, cache, batch_mapping):
        if self.ops == "jaxkv":
            return cache.compact(batch_mapping)
        cache = self._xla_compact(cache, batch_mapping)
        lengths = reference.compact_lengths(cache.lengths, batch_mapping)
        cache = dataclasses.replace(cache, lengths=lengths,
                                    active_batch_size=self._counts(batch_mapping >= 0))
        return _placed(cache, self.sharding)

    def _xla_append(self, layer, cache, k, v, new_lengths):
        """``reference.append_layer`` on the live rows (of every batch shard)."""
        new_lengths = jnp.where(self.live(cache), new_lengths, 0)
        return reference.append_layer(layer, k, v, cache.lengths, cache.max_batch, new_lengths)

    def memory(self, cache) -> tuple[int, int]:
        live = np.asarray(self.live(cache))
        tokens = int(np.sum(np.asarray(cache.lengths)[live]))
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

    def reserved_tokens(self, cache):
        return jnp.sum(self.live(cache), dtype=jnp.int32) * cache.max_seq_len

    def append(self, cache, layer, k, v, new_lengths):
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, new_lengths)
        layer_kv = self._xla_append(cache.buffer[layer], cache, k, v, new_lengths)
        cache = dataclasses.replace(cache, buffer=cache.buffer.at[layer].set(layer_kv))
        return _placed(cache, self.sharding)

    def save(self, cache, length: int):  # row 0: every batch shard gets it (docs/sharding.md)
        if self.ops == "jaxkv":
            return cache, cache.save(0, length)
        saved = _xla_save(cache.buffer, 0, length)
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

    # A model's window layers as rings of ``window + ring_chunk - 1`` slots, ``ring_chunk`` the
    # most tokens a step appends (jaxkv.KVLayerConfig); None: every layer holds max_seq_len.
    ring_chunk: int | None = None

    def create(self, max_batch: int, max_seq_len: int):
        c = self.cfg

        def layer(i):
            w = c.window(i)
            if self.ring_chunk is None or w is None or w + self.ring_chunk - 1 >= max_seq_len:
                return jaxkv.KVLayerConfig(c.num_kv_heads, c.head_dim)
            return jaxkv.KVLayerConfig(c.num_kv_heads, c.head_dim, w + self.ring_chunk - 1,
                                       ring=True)

        layers = [layer(i) for i in range(c.num_layers)]
        return jaxkv.KVCacheManager.create(layers, max_batch, max_seq_len, jnp.dtype(self.dtype),
                                           self.sharding)

    def kv(self, cache, layer):
        return cache.separate(layer)

    def append(self, cache, layer, k, v, new_lengths):
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, new_lengths)
        new = self._xla_append(cache.layers[layer], cache, k, v, new_lengths)
        layers = cache.layers[:layer] + (new,) + cache.layers[layer + 1:]
        return _placed(dataclasses.replace(cache, layers=layers), self.sharding)

    def save(self, cache, length: int):  # row 0: every batch shard gets it (docs/sharding.md)
        if self.ops == "jaxkv":
            return cache, cache.save(0, length)
        saved = tuple(_xla_save(x, 0, length) for x in cache.layers)
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

    The cache has a row more than the batch in every batch shard: the last row of each shard keeps
    the system prompt (unsharded: row ``B``), since a fork never crosses shards, and batch row
    ``r`` is cache row ``r + r // (B/k)``. Admission forks the prompt row of the new row's shard
    (new rows share its full pages, copy-on-write of the last partial one); eviction releases pages
    through ``compact``; ``reserve`` takes pages before every forward pass (each shard's share of
    the pool holds all its rows at full length). Attention is ``jaxkv.attention`` reading the pool
    in place (``ops="jaxkv"``); the XLA baseline (and ``attention="dense"``) gathers the layer
    into dense memory and attends densely; ``attention="pallas"`` uses JAX's deprecated Pallas
    ``paged_attention`` for decode steps (jax 0.10 to 0.12.0; later jax no longer ships it).
    """

    cfg: ModelConfig
    dtype: str = "float32"
    ops: str = "jaxkv"  # or "xla"
    page_size: int = 16
    attention: str = "auto"  # "auto" (jaxkv.attention with ops="jaxkv"), "dense" or "pallas"
    sharding: jaxkv.CacheSharding | None = None  # --mesh: KV heads over tp, the batch over dp
    num_pages: int | None = None  # the pool's pages; default: every row at full length
    # NHD (jaxkv.attention reads bf16 / f16 pools of either layout through cuDNN on a GPU, NHD
    # as one pool of whole pages); HND for JAX's Pallas paged_attention, which reads only that.
    layout: str = "auto"
    # The cache in 8 bits (jaxkv.quantization, per-token-head scales; jaxkv's ops only): the
    # model's K/V are quantized on append and the attention reads the scales.
    kv_dtype: str | None = None
    # Automatic prefix caching (jaxkv.page_index): requests find the cached pages of their
    # prompts' longest indexed prefix (``match``) and index what they prefill (``insert``).
    prefix_cache: bool = False
    # A host tier of this many pages (jaxkv.host_tier): preempted rows swap their pages out to
    # host memory and back instead of recomputing them.
    host_pages: int = 0
    # Each layer's sliding window (the model's ``cfg.windows``): window layers release the pages
    # their window no longer sees (PagedKVCache(windows=...)). None: every layer keeps every
    # token (the window still applies in attention).
    windows: tuple | None = None

    @property
    def pool_layout(self) -> str:
        return self.layout if self.layout != "auto" else (
            "HND" if self.attention == "pallas" else "NHD")

    @property
    def batch_shards(self) -> int:
        return _batch_shards(self.sharding)

    @property
    def page_groups(self) -> int:
        """Page tables over the pool: one per layer group with windows, else one."""
        return 1 if self.windows is None else _windows.groups(self.windows).num_groups

    @property
    def page_layers(self) -> int:
        """Layers a page holds: a layer group's with windows, else every layer's."""
        return (self.cfg.num_layers if self.windows is None
                else _windows.groups(self.windows).slots)

    def row_pages(self, tokens: int, chunk: int = 1) -> int:
        """Pages a row of ``tokens`` tokens holds at most, in every layer group, appending
        ``chunk`` tokens at a time (a window group: ``ceil((window + chunk) / page_size) + 1``
        at most, PagedKVCache.create)."""
        full = -(-tokens // self.page_size)
        if self.windows is None:
            return full
        return sum(full if w is None else min(full, -(-(w + chunk) // self.page_size) + 1)
                   for w in _windows.groups(self.windows).group_windows)

    def create(self, max_batch: int, max_seq_len: int):
        c = self.cfg
        pages_per_seq = -(-max_seq_len // self.page_size)
        rows = max_batch + self.batch_shards  # and a prompt row per shard
        groups = self.page_groups  # each with every row at full length
        return jaxkv.PagedKVCache.create(
            num_layers=c.num_layers, num_pages=self.num_pages or rows * pages_per_seq * groups,
            page_size=self.page_size, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            max_batch=rows, max_pages_per_seq=pages_per_seq,
            dtype=jnp.dtype(self.kv_dtype or self.dtype), layout=self.pool_layout,
            sharding=self.sharding, prefix_cache=self.prefix_cache, host_pages=self.host_pages,
            windows=self.windows)

    def swap_out(self, cache, rows, max_pages: int):
        """``swap_out`` of the batch rows in ``rows`` (bool [B]); swapped [B]."""
        cache, swapped = cache.swap_out(self._pad(rows), max_pages)
        return cache, self._unpad(swapped)

    def swap_in(self, cache, rows, max_pages: int):
        """``swap_in`` of the batch rows in ``rows``; served [B]."""
        cache, served = cache.swap_in(self._pad(rows), max_pages)
        return cache, self._unpad(served)

    def on_host(self, cache):
        return self._unpad(cache.on_host)

    def pages_held(self, cache):
        return self._unpad(cache.pages_held)

    def uncached_free_pages(self, cache):
        """int32 []: free device pages that hold no cached prefix (reserve takes them first)."""
        cached = cache.prefix_cache.indexed[:cache.num_pages]
        return jnp.sum((cache.ref_counts == 0) & ~cached, dtype=jnp.int32)

    def host_pages_held(self, cache):
        return self._unpad(cache.host.held)

    def match(self, cache, rows, tokens, num_tokens, namespace=None):
        """``match_prefix`` for the batch rows ``rows`` (a row past the batch: an unused lane)
        with their ``tokens`` [lanes, T], ``num_tokens`` [lanes] and ``namespace`` [lanes] (the
        requests' tenants; None: all 0); matched [lanes]."""
        return self._on_rows(cache, rows, "match_prefix", tokens, num_tokens, namespace)

    def insert(self, cache, rows, tokens, num_tokens, namespace=None):
        """``insert_prefix`` for the batch rows ``rows``."""
        return self._on_rows(cache, rows, "insert_prefix", tokens, num_tokens, namespace)

    def cross_namespace_pages(self, cache) -> int:
        """Cached pages (of either tier) whose chain crosses namespaces (tenants), by an audit of
        the index on the host (``page_index.cross_namespace_entries``): 0 when no page is
        reachable from two tenants. Read after a run."""
        return page_index.cross_namespace_entries(cache.prefix_cache, self.batch_shards)

    def _on_rows(self, cache, rows, method: str, tokens, num_tokens, namespace=None):
        """``cache.method(tokens, num_tokens, namespace)`` for the lanes' rows only: on a view
        of the cache holding just those rows' page-table rows and lengths (the same pools,
        counts and index; over batch shards, each shard's lane group its own rows), so that the
        cost follows the lanes, not the batch; the rows written back."""
        shards = self.batch_shards
        live = rows < cache.max_batch - shards
        num_tokens = jnp.where(live, num_tokens, 0)
        at = self._lane_rows(cache, rows)
        view = _rows_view(cache, at, shards)
        out = getattr(view, method)(tokens, num_tokens, namespace)
        view, res = (out, None) if method == "insert_prefix" else out
        at = jnp.where(live, at, cache.max_batch)  # unused lanes write nothing back
        host = view.host  # its pools and counts: a match spills and brings pages back
        if host is not None:  # the rows' host tables: the whole batch's (match leaves them)
            host = dataclasses.replace(host, table=cache.host.table, incoming=cache.host.incoming)
        groups = cache.group_tables
        if groups is not None:
            groups = jax.vmap(lambda c, v: _put_rows(c, at, v, shards))(groups, view.group_tables)
        cache = dataclasses.replace(
            view, page_table=_put_rows(cache.page_table, at, view.page_table, shards),
            group_tables=groups,
            lengths=_put_rows(cache.lengths, at, view.lengths, shards),
            new_tokens=cache.new_tokens, host=host)
        return cache if res is None else (cache, res)

    def _lane_rows(self, cache, rows):
        """The cache rows of a chunk's lanes (batch rows; over batch shards, lane group ``s``
        holds rows of shard ``s``). An unused lane (a row past the batch) names its shard's
        prompt row, where it adds no token."""
        shards, per_shard = self.batch_shards, self._per_shard(cache)
        prompt_rows = (_lane_groups(rows.shape[0], shards) + 1) * per_shard - 1
        return jnp.where(rows < cache.max_batch - shards, self._row(cache, rows), prompt_rows)

    def _per_shard(self, cache) -> int:
        """Cache rows per batch shard: its share of the batch and its prompt row (the last)."""
        return cache.max_batch // self.batch_shards

    def _pad(self, x):
        """[B, ...] -> the cache's rows: each shard's prompt row takes part in nothing (zeros)."""
        y = x.reshape(self.batch_shards, -1, *x.shape[1:])
        y = jnp.pad(y, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 1))
        return y.reshape(-1, *x.shape[1:])

    def _unpad(self, x):
        """The cache's rows -> [B, ...]: the prompt rows left out."""
        y = x.reshape(self.batch_shards, -1, *x.shape[1:])[:, :-1]
        return y.reshape(-1, *x.shape[1:])

    def _prompt_rows(self, cache) -> jax.Array:
        """bool: the cache rows holding the system prompt (each shard's last)."""
        per_shard = self._per_shard(cache)
        return jnp.arange(cache.max_batch) % per_shard == per_shard - 1

    def lengths(self, cache):
        return self._unpad(cache.lengths)

    def live(self, cache):
        return self.lengths(cache) > 0  # live rows hold the prompt

    def clear(self, cache, n: int):
        return cache.release(~self._prompt_rows(cache))

    def reserve(self, cache, new_lengths):
        return self.reserve_served(cache, new_lengths)[0]

    def reserve_served(self, cache, new_lengths):
        cache, served = cache.reserve(self._pad(new_lengths))
        return cache, self._unpad(served)

    def reserved_tokens(self, cache):
        return jnp.sum(cache.ref_counts > 0, dtype=jnp.int32) * cache.page_size

    def reserved_by_shard(self, cache):
        """int32 [k]: the tokens of the pages each batch shard has in use (its own pool)."""
        used = (cache.ref_counts > 0).reshape(self.batch_shards, -1)
        return jnp.sum(used, axis=1, dtype=jnp.int32) * cache.page_size

    def attend_rows(self, cache, layer, rows, q, k, v, new_lengths, positions,
                    spec=AttentionSpec()):
        """With jaxkv's ops, a view of the cache with the chunk's rows only (their page-table
        rows and lengths; the same pools) takes the append and the attention: no full-batch
        arrays. Over batch shards, each shard's view holds its lane group's rows."""
        if not (self.ops == "jaxkv" and self.attention == "auto" and _kernel_attends(self.cfg)):
            return _attend_rows_full(self, cache, layer, rows, q, k, v, new_lengths, positions,
                                     spec)
        sub = _rows_view(cache, self._lane_rows(cache, rows), self.batch_shards)
        sub = sub.append(layer, k, v, new_lengths)
        out = _jaxkv_attend(sub, layer, q, new_lengths, spec)
        return out, dataclasses.replace(cache, k_pages=sub.k_pages, v_pages=sub.v_pages,
                                        k_scales=sub.k_scales, v_scales=sub.v_scales)

    def append(self, cache, layer, k, v, new_lengths):
        k, v, n = self._pad(k), self._pad(v), self._pad(new_lengths)
        if self.ops == "jaxkv":
            return cache.append(layer, k, v, n)
        k_pages, v_pages = reference.paged_append(cache.k_pages, cache.v_pages,
                                                  self._pool_table(cache), cache.lengths, layer,
                                                  k, v, n, cache.layout)
        return _placed(dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages),
                       self.sharding)

    def _pool_table(self, cache):
        """The page table in page ids of the whole pool, for the XLA baseline's reads and writes
        (a batch shard's table holds ids local to its share of the pages)."""
        shard = jnp.arange(cache.max_batch, dtype=jnp.int32) // self._per_shard(cache)
        first = shard * (cache.num_pages // self.batch_shards)
        table = cache.page_table
        return jnp.where(table >= 0, table + first[:, None], table)

    def attend(self, cache, layer, q, positions, new_lengths=None, spec=AttentionSpec()):
        visible = cache.lengths + cache.new_tokens  # committed tokens and the ones just appended
        if self._use_pallas(cache) and q.shape[1] == 1:
            if spec != AttentionSpec():
                raise ValueError("attention='pallas' serves plain attention only (no window, "
                                 "scale, soft cap or sinks); use attention='auto'")
            return self._pallas(cache, layer, q, visible)[:, None]
        if self.ops == "jaxkv" and self.attention == "auto" and _kernel_attends(self.cfg):
            n = None if new_lengths is None else self._pad(new_lengths)
            return self._unpad(_jaxkv_attend(cache, layer, self._pad(q), n, spec))
        max_len = cache.max_pages_per_seq * cache.page_size
        if self.ops == "jaxkv":
            k, v = jaxkv.paged_gather(cache.k_pages, cache.v_pages, cache.page_table, visible,
                                      layer, max_len, layout=cache.layout, split=True,
                                      sharding=self.sharding)
        else:
            kv = reference.paged_gather(cache.k_pages, cache.v_pages, self._pool_table(cache),
                                        visible, layer, max_len, cache.layout)
            k, v = kv[:, 0], kv[:, 1]
        return dense_attention(q, self._unpad(k), self._unpad(v), positions, spec)

    def _use_pallas(self, cache) -> bool:
        on_gpu = jax.default_backend() == "gpu"
        if self.sharding is not None:  # the Pallas call reads the whole pool: dense, per shard
            return False
        if self.attention != "pallas":
            return False
        if pallas_paged_attention() is None:
            raise ValueError(f"attention='pallas': jax {jax.__version__} no longer ships Pallas "
                             "paged_attention (removed in jax 0.12.1); use attention='auto'")
        _, per_block = _pallas_blocks(cache.max_pages_per_seq)
        block, d = per_block * cache.page_size, cache.head_dim
        fits = all(n >= 16 and n & (n - 1) == 0 for n in (block, d))  # Triton block shapes
        if not fits and self.attention == "pallas" and on_gpu:
            raise ValueError(f"Pallas paged_attention needs power-of-two blocks of at least 16: "
                             f"{per_block} pages x page_size {cache.page_size}, head_dim {d}")
        return fits or not on_gpu

    def _pallas(self, cache, layer, q, visible):  # unsharded: the prompt row is the last
        """One decode step of attention straight from the pool, with no slice of it.

        ``k_pages[layer]`` would be a copy of the layer's pool on every step. Instead the whole
        pool [L, H, P, S, D] is seen as one KV head with L * H * P pages (a free reshape), and each
        (sequence, KV head) pair as a sequence of its own whose page table points into its layer
        and head: the kernel reads exactly the pages it would have read, in place.
        """
        paged_attention = pallas_paged_attention()
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

    def _row(self, cache, row):
        """Batch row -> cache row (-1 stays -1)."""
        return jnp.where(row >= 0, row + row // (self._per_shard(cache) - 1), -1)

    def evict(self, cache, batch_mapping):
        mapping = self._pad(self._row(cache, batch_mapping))
        rows = jnp.arange(cache.max_batch, dtype=jnp.int32)
        mapping = jnp.where(self._prompt_rows(cache), rows, mapping)  # the prompt rows stay put
        return cache.compact(mapping)

    def save(self, cache, length: int):
        """Each shard's prompt moves from its first row to its last: a fork (sharing its full
        pages), then a release."""
        per_shard = self._per_shard(cache)
        for first in range(0, cache.max_batch, per_shard):
            prompt_row = jnp.full((1,), first + per_shard - 1, jnp.int32)
            cache, _ = cache.fork(first, prompt_row)
        cache = cache.release(~self._prompt_rows(cache))
        return cache, jnp.asarray(length, jnp.int32)

    def admit(self, cache, saved, new):
        per_shard = self._per_shard(cache)

        def fork(row, c):  # from the prompt row of the row's shard
            prompt_row = (row // (per_shard - 1) + 1) * per_shard - 1
            return c.fork(prompt_row, self._row(c, row)[None])[0]

        return _for_new_rows(new, fork, cache)

    def miscounted_pages(self, cache) -> int:
        """Pages (of either tier) whose reference count differs from the table entries naming
        them: 0 when the allocator and the tables agree. Read on the host after a run."""
        tables = [cache.page_table] + ([] if cache.group_tables is None
                                       else list(cache.group_tables))  # every layer group's
        named = np.zeros(cache.num_pages, np.int64)
        for t in tables:
            table = np.asarray(self._pool_table(dataclasses.replace(cache, page_table=t)))
            named += np.bincount(table[(table >= 0) & (table < cache.num_pages)],
                                 minlength=cache.num_pages)
        bad = int(np.sum(np.asarray(cache.ref_counts) != named))
        if cache.host is not None:
            host = np.asarray(cache.host.table)
            held = np.bincount(host[host != jaxkv.NO_PAGE], minlength=cache.host.num_pages)
            bad += int(np.sum(np.asarray(cache.host.ref_counts) != held))
        return bad

    def memory(self, cache) -> tuple[int, int]:
        used = int(np.sum(np.asarray(cache.ref_counts) > 0))
        pool = cache.k_pages.nbytes + cache.v_pages.nbytes
        return used * pool // cache.num_pages, sum(x.nbytes for x in jax.tree.leaves(cache))


def pallas_paged_attention():
    """JAX's Pallas ``paged_attention``, or None where this jax no longer ships it (0.12.1 on)."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError:
        return None
    return paged_attention


def _pallas_blocks(pages_per_seq: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for the Pallas kernel: both must divide the table."""
    k_splits = math.gcd(pages_per_seq, 16)
    part = pages_per_seq // k_splits
    return k_splits, max(c for c in (8, 4, 2, 1) if part % c == 0)


KINDS = {"linear": LinearKind, "manager": ManagerKind, "paged": PagedKind}


def _rows_view(cache, rows, shards: int = 1):
    """A paged cache holding only ``rows`` (int32 [n]; over batch shards, lane group ``s``
    naming rows of shard ``s``): their page-table rows, lengths and host tables; the same pools,
    counts and index."""
    take = lambda x: _take_rows(x, rows, shards)  # noqa: E731
    host = cache.host
    if host is not None:
        host = dataclasses.replace(host, table=take(host.table), incoming=take(host.incoming))
    groups = cache.group_tables
    if groups is not None:
        groups = jax.vmap(take)(groups)
    return dataclasses.replace(cache, page_table=take(cache.page_table),
                               lengths=take(cache.lengths), new_tokens=take(cache.new_tokens),
                               host=host, group_tables=groups)


def make_kind(name: str, cfg: ModelConfig, dtype: str = "float32", ops: str = "jaxkv", **options):
    if name not in KINDS:
        raise ValueError(f"unknown cache kind {name!r}; choose from {', '.join(KINDS)}")
    if ops not in ("jaxkv", "xla"):
        raise ValueError(f"unknown ops {ops!r}; choose jaxkv or xla")
    if options.get("windows") is not None and ops == "xla":
        raise ValueError("a paged cache with windows (a page table per layer group) has no XLA "
                         "baseline: use ops='jaxkv', or windows=None")
    return KINDS[name](cfg=cfg, dtype=dtype, ops=ops, **options)
