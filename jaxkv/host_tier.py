"""The host tier of a paged cache: a second pool of pages in host memory, and rows swapped to it.

``PagedKVCache.create(..., host_pages=N)`` adds a ``HostPages``: a pool of ``N`` pages in the
``pinned_host`` memory kind, the device pools' dtype (and a per-token-head scale pool for an
8-bit cache), with an allocator and a table of host pages per row kept on the device, so that
swapping runs under ``jit`` with no host round trip.

A swapped row keeps its length; its own device pages go back to the pool and leave its page table
(a prefix it shares with other rows stays), so nothing reads or writes memory it no longer owns:
``append``, ``reserve``, ``commit``, ``fork`` and attention see a row on the host and report it.
Its host pages are listed in ``HostPages.table`` at the positions of the pages they hold.

Data moves in one loop of copies per call, one copy per page: a host page holds the page's K and
V of every layer in one contiguous block (the host pool is page-major), which XLA moves to or
from a page-sized device buffer as one DMA, sliced from or written into the device pools on the
device; no host computation, no staging array of the whole transfer, and both pools updated in
place. The loop runs for the pages the call moves; ``max_pages`` (static) bounds them: rows are
taken in slot order while their pages fit in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import page_index
from ._allocator import allocate, allocate_indexed
from ._checks import check
from .layout import PAGE_AXIS, host_roles

NO_PAGE = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostPages:
    """The host pool of a paged cache and the device-side state that addresses it."""

    # host memory, page-major: [num_host_pages, 2, *page]: a host page holds its K then its V,
    # every layer (``page``: a device pool's shape without its page dimension), one contiguous
    # block that one copy moves
    pages: jax.Array
    scales: Any  # host memory: [num_host_pages, 2, *page scales] (an 8-bit cache's), else None
    ref_counts: jax.Array  # int32 [num_host_pages]: 1 where a swapped row holds the page
    # int32 [max_batch, max_pages_per_seq]: a swapped row's host pages at the positions of the
    # pages it moved; the shared pages it kept on the device (a prefix) stay in its page table
    table: jax.Array

    @property
    def num_pages(self) -> int:
        return self.ref_counts.shape[0]

    @property
    def on_host(self) -> jax.Array:
        """bool ``[max_batch]``: rows swapped out."""
        return jnp.any(self.table != NO_PAGE, axis=1)

    @property
    def held(self) -> jax.Array:
        """int32 ``[max_batch]``: host pages each row holds."""
        return jnp.sum(self.table != NO_PAGE, axis=1, dtype=jnp.int32)


def empty(num_pages: int, device_pool: jax.Array, layout: str, scaled: bool, max_batch: int,
          max_pages_per_seq: int, sharding=None) -> HostPages:
    """An empty host tier: every host page free, no row swapped; its pages of ``device_pool``'s
    shape and dtype, in the host memory of its device (with ``sharding``, a ``CacheSharding``:
    of its devices, each batch shard's share of the host pages in its own device's host memory)."""
    axis, pool_shape = PAGE_AXIS[layout], device_pool.shape
    page = pool_shape[:axis] + pool_shape[axis + 1:]
    roles = host_roles(layout, scaled)

    def host(name, page_shape, dtype):
        shape = (num_pages, 2) + page_shape
        if isinstance(device_pool, jax.core.Tracer):  # traced (jit, eval_shape): made by XLA
            return jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Host)
        # zeros from host memory straight to pinned host memory: made on the device, they would
        # take the pool's size of device memory while they last
        placed = sharding.named(*roles[name]) if sharding is not None else device_pool.sharding
        return jax.device_put(np.zeros(shape, dtype), placed.with_memory_kind("pinned_host"))

    def state(name, shape, fill):
        if sharding is None:
            return jnp.full(shape, fill, jnp.int32)
        return sharding.full(shape, fill, jnp.int32, roles[name])

    return HostPages(pages=host("pages", page, device_pool.dtype),
                     scales=host("scales", page[:3], jnp.float32) if scaled else None,
                     ref_counts=state("ref_counts", (num_pages,), 0),
                     table=state("table", (max_batch, max_pages_per_seq), NO_PAGE))


# --- the transfers: the only code that touches host memory ----------------------------------------
# A transfer is a loop of copies, one per page (its K and V, every layer: contiguous on the host),
# CHUNK of them unrolled per iteration. XLA:GPU compiles each into one DMA between the host pool
# and a page-sized device buffer (no host computation, no copy of either pool): 90% of the pinned
# copy bandwidth out, 78% in, on an H200 (jaxkv.bench --swap, 2026-11-26; docs/host-tier.md).
CHUNK = 16


def _each_pair(count: jax.Array, body, carry):
    """``carry = body(i, carry)`` for ``i`` in ``[0, count)``: ``CHUNK`` per loop iteration, then
    the rest one by one, so that a call copies the pages it moves and no more."""
    def chunk(c, carry):
        for j in range(CHUNK):
            carry = body(c * CHUNK + j, carry)
        return carry
    full = count // CHUNK
    carry = jax.lax.fori_loop(0, full, chunk, carry)
    return jax.lax.fori_loop(full * CHUNK, count, body, carry)


def _page(pool, axis: int, i):
    """Page ``i`` of a device pool, every layer: the pool's shape without its page dimension."""
    return jnp.squeeze(jax.lax.dynamic_slice_in_dim(pool, i, 1, axis), axis)


def _to_host(axis: int, host_pool, k_pool, v_pool, src, dst):
    """Device pages ``src`` (of ``k_pool`` and ``v_pool``) -> host pages ``dst``. ``src``, ``dst``
    int32 ``[M]``, the pairs first and dense: a ``dst`` out of range ends them."""
    count = jnp.sum(dst < host_pool.shape[0], dtype=jnp.int32)

    def copy(i, host_pool):
        kv = jnp.stack([_page(k_pool, axis, src[i]), _page(v_pool, axis, src[i])])[None]
        return jax.lax.dynamic_update_slice_in_dim(
            host_pool, jax.device_put(kv, jax.memory.Space.Host), dst[i], 0)
    return _each_pair(count, copy, host_pool)


def _from_host(axis: int, k_pool, v_pool, host_pool, src, dst):
    """Host pages ``src`` -> device pages ``dst`` of ``k_pool`` and ``v_pool`` (the pairs first
    and dense: a ``dst`` out of range ends them)."""
    count = jnp.sum(dst < k_pool.shape[axis], dtype=jnp.int32)

    def copy(i, pools):
        kv = jax.device_put(jax.lax.dynamic_slice_in_dim(host_pool, src[i], 1, 0),
                            jax.memory.Space.Device)[0]
        return tuple(jax.lax.dynamic_update_slice_in_dim(pool, jnp.expand_dims(x, axis), dst[i],
                                                         axis) for pool, x in zip(pools, kv))
    return _each_pair(count, copy, (k_pool, v_pool))


def _move_to_host(cache, host: HostPages, src, dst) -> dict:
    """``HostPages`` fields with device pages ``src`` copied to host pages ``dst``: K and V, and
    the per-token-head scales of an 8-bit cache."""
    axis = PAGE_AXIS[cache.layout]
    fields = {"pages": _to_host(axis, host.pages, cache.k_pages, cache.v_pages, src, dst)}
    if host.scales is not None:
        fields["scales"] = _to_host(axis, host.scales, cache.k_scales, cache.v_scales, src, dst)
    return fields


def _move_to_device(cache, src, dst) -> dict:
    """Cache fields with host pages ``src`` copied to device pages ``dst``."""
    axis, host = PAGE_AXIS[cache.layout], cache.host
    k, v = _from_host(axis, cache.k_pages, cache.v_pages, host.pages, src, dst)
    fields = {"k_pages": k, "v_pages": v}
    if host.scales is not None:
        fields["k_scales"], fields["v_scales"] = _from_host(
            axis, cache.k_scales, cache.v_scales, host.scales, src, dst)
    return fields


def _moves(table: jax.Array, start: jax.Array, counts: jax.Array, moved: jax.Array,
           first: jax.Array, free_ids: jax.Array, max_pages: int, limit: int):
    """The transfer's page pairs: slot ``first[b] + j`` moves page ``table[b, start[b] + j]`` to
    ``free_ids[first[b] + j]``, for ``j < counts[b]`` of each moved row. Returns ``(src, dst,
    new_rows)``: ``src``, ``dst`` int32 ``[max_pages]`` (unused entries: ``dst = limit``, out of
    range), ``new_rows`` each moved row's destination pages laid out like ``table``."""
    j = jnp.arange(table.shape[1], dtype=jnp.int32)[None, :] - start[:, None]
    live = moved[:, None] & (j >= 0) & (j < counts[:, None])
    slot = jnp.where(live, first[:, None] + j, max_pages)
    src = jnp.zeros((max_pages,), jnp.int32).at[slot].set(table, mode="drop")
    new_rows = jnp.where(live, free_ids[jnp.clip(slot, 0, free_ids.shape[0] - 1)], NO_PAGE)
    dst = jnp.full((max_pages,), limit, jnp.int32).at[slot].set(new_rows, mode="drop")
    return src, dst, new_rows


def _budget(need: jax.Array, eligible: jax.Array, max_pages: int) -> jax.Array:
    """Eligible rows, in slot order, while their pages fit in one transfer of ``max_pages``."""
    want = jnp.where(eligible, need, 0)
    return eligible & (jnp.cumsum(want) <= max_pages)


def swap_out(op: str, cache, rows: jax.Array, max_pages: int):
    """``PagedKVCache.swap_out``'s body (arguments checked). A row's leading pages that another
    row also holds (a forked or matched prefix) stay on the device, held by the row: moving them
    would free nothing and bring them back unshared."""
    host = cache.host
    held = cache.pages_held
    on_host = host.on_host
    table = cache.page_table
    shared = (table >= 0) & (cache.ref_counts[jnp.clip(table, 0, cache.num_pages - 1)] > 1)
    kept = jnp.sum(jnp.cumprod(shared, axis=1), axis=1, dtype=jnp.int32)
    own = held - kept
    check(~rows | (~on_host & (own > 0)),
          f"{op}: a selected row is already on the host or holds no pages of its own (nothing "
          "moved)")
    eligible = _budget(own, rows & ~on_host & (own > 0), max_pages)
    host_counts, swapped, first, free_ids, index = _allocate_host(cache, own, eligible)
    src, dst, host_rows = _moves(table, kept, own, swapped, first, free_ids, max_pages,
                                 host.num_pages)
    host = dataclasses.replace(host, ref_counts=host_counts,
                               table=jnp.where(swapped[:, None], host_rows, host.table),
                               **_move_to_host(cache, host, src, dst))
    # The pages moved go back to the pool; the shared prefix stays in the page table.
    gone = host_rows >= 0
    return dataclasses.replace(
        cache, host=host, prefix_cache=index,
        ref_counts=cache.ref_counts.at[jnp.where(gone, table, cache.num_pages)].add(
            -1, mode="drop"),
        page_table=jnp.where(gone, NO_PAGE, table),
        new_tokens=jnp.where(swapped, 0, cache.new_tokens)), swapped


def _allocate_host(cache, need: jax.Array, eligible: jax.Array):
    """``allocate`` over the host pool: pages free of rows and of cached prefix pages first, then
    cached ones least recently used, which leave the index (their descendants with them)."""
    host, index, p = cache.host, cache.prefix_cache, cache.num_pages
    if index is None or index.entries == p:
        return (*allocate(host.ref_counts, need, eligible), index)
    return allocate_indexed(host.ref_counts, need, eligible, index, p, cache.max_pages_per_seq)


def swap_in(op: str, cache, rows: jax.Array, max_pages: int):
    """``PagedKVCache.swap_in``'s body (arguments checked)."""
    host = cache.host
    on_host = host.on_host
    check(~rows | on_host, f"{op}: a selected row is not on the host (nothing moved)")
    held = host.held
    eligible = _budget(held, rows & on_host, max_pages)
    ref_counts, served, first, free_ids, index = cache._allocate(held, eligible)
    src, dst, device_rows = _moves(host.table, cache.pages_held, held, served, first, free_ids,
                                   max_pages, cache.num_pages)
    cache = dataclasses.replace(
        cache, host=released(host, served), ref_counts=ref_counts, prefix_cache=index,
        page_table=jnp.where(device_rows >= 0, device_rows, cache.page_table),
        **_move_to_device(cache, src, dst))
    return cache, served


def released(host: HostPages, mask: jax.Array) -> HostPages:
    """The host pages of the rows in ``mask`` freed (the rows end)."""
    freed = jnp.where(mask[:, None] & (host.table >= 0), host.table, host.num_pages)
    return dataclasses.replace(host, ref_counts=host.ref_counts.at[freed].set(0, mode="drop"),
                               table=jnp.where(mask[:, None], NO_PAGE, host.table))


# --- the prefix cache's host tier --------------------------------------------------------------
def spill(cache, max_pages: int):
    """``PagedKVCache.spill_prefix``'s body: up to ``max_pages`` cached free device pages, least
    recently used first, move to host pages free of rows and of cached pages (one transfer); their
    index entries move with them and the device pages become never-cached free pages."""
    p, host, index = cache.num_pages, cache.host, cache.prefix_cache
    n_host = host.num_pages
    device = page_index.part(index, 0, p)
    cached_free = device.indexed & (cache.ref_counts == 0)
    order = page_index.eviction_order(device, cached_free)  # the cached free ones, LRU first
    room = (host.ref_counts == 0) & ~page_index.part(index, p, index.entries).indexed
    host_ids = jnp.nonzero(room, size=n_host, fill_value=n_host)[0].astype(jnp.int32)
    n = jnp.minimum(jnp.minimum(jnp.sum(cached_free), jnp.sum(room)), max_pages)
    i = jnp.arange(max_pages, dtype=jnp.int32)
    live = i < n
    src = jnp.where(live, order[jnp.clip(i, 0, p - 1)], 0)
    dst = jnp.where(live, host_ids[jnp.clip(i, 0, n_host - 1)], n_host)
    index = page_index.move(index, jnp.where(live, src, -1), jnp.where(live, p + dst, -1))
    return dataclasses.replace(
        cache, prefix_cache=index,
        host=dataclasses.replace(host, **_move_to_host(cache, host, src, dst))), n.astype(jnp.int32)


def bring_back(cache, found: jax.Array, run: jax.Array, budget: int):
    """``match_prefix``'s pages on the host brought to device pages.

    ``found`` int32 ``[B, K]`` (entry ids: a host page ``h`` is ``num_pages + h``), ``run``
    int32 ``[B]``: each row's match (``page_index.lookup``). Rows in slot order while their host
    pages fit in ``budget`` (one transfer) and device pages last; a row past them keeps its match
    up to its first host page. **Returns** ``(cache, found, run)``: the pages moved (data and
    index entries), ``found`` naming device pages only within ``run``, and the reference counts
    of every page in the runs raised by one."""
    p = cache.num_pages
    b, k = found.shape
    level = jnp.arange(k, dtype=jnp.int32)[None, :]
    on_host = (level < run[:, None]) & (found >= p)
    # A host page two rows found in one call comes back once: the first row brings it, and a
    # later row's match stops before it (it finds the page on the device next time).
    n_entries = cache.prefix_cache.entries
    at = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    owner = jnp.full((n_entries + 1,), b * k, jnp.int32).at[
        jnp.where(on_host, found, n_entries)].min(at)
    foreign = on_host & (owner[jnp.clip(found, 0, n_entries)] != at)
    run = jnp.minimum(run, jnp.min(jnp.where(foreign, level, k), axis=1))
    taken = level < run[:, None]
    on_host = taken & (found >= p)
    count = jnp.sum(on_host, axis=1, dtype=jnp.int32)
    before_host = jnp.minimum(run, jnp.min(jnp.where(on_host, level, k), axis=1))
    if budget == 0:  # nothing comes back: each row matches up to its first host page
        device = (level < before_host[:, None]) & (found >= 0)
        counts = cache.ref_counts.at[jnp.where(device, found, p)].add(1, mode="drop")
        return dataclasses.replace(cache, ref_counts=counts), found, before_host
    fits = jnp.cumsum(count) <= budget
    need = jnp.where(fits, count, 0)
    runs = jnp.where(fits, run, before_host)
    # The device pages of every run are held while pages are taken for the host ones, so that
    # the allocator cannot evict them.
    device = (level < runs[:, None]) & (found >= 0) & (found < p)
    held = cache.ref_counts.at[jnp.where(device, found, p)].add(1, mode="drop")
    ref_counts, served, first, free_ids, index = cache._allocate(need, need > 0, held)
    runs = jnp.where((need > 0) & ~served, before_host, runs)
    ref_counts = ref_counts.at[jnp.where(device & (level >= runs[:, None]), found, p)].add(
        -1, mode="drop")
    moving = on_host & (served & (need > 0))[:, None]
    j = jnp.cumsum(on_host, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(moving, first[:, None] + j, budget)
    new = jnp.where(moving, free_ids[jnp.clip(slot, 0, p - 1)], -1)
    src = jnp.zeros((budget,), jnp.int32).at[slot].set(found - p, mode="drop")
    dst = jnp.full((budget,), p, jnp.int32).at[slot].set(new, mode="drop")
    index = page_index.move(index, jnp.where(dst < p, src + p, -1), jnp.where(dst < p, dst, -1))
    cache = dataclasses.replace(cache, ref_counts=ref_counts, prefix_cache=index,
                                **_move_to_device(cache, src, dst))
    return cache, jnp.where(moving, new, found), runs
