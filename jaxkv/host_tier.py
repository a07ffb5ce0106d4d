"""The host tier of a paged cache: a second pool of pages in host memory, and rows swapped to it.

``PagedKVCache.create(..., host_pages=N)`` adds a ``HostPages``: a pool of ``N`` pages in the
``pinned_host`` memory kind, the device pools' dtype (and a per-token-head scale pool for an
8-bit cache), with an allocator and a table of host pages per row kept on the device, so that
swapping runs under ``jit`` with no host round trip.

A swapped row keeps its length; its own device pages go back to the pool and leave its page table
(a prefix it shares with other rows stays), so nothing reads or writes memory it no longer owns:
``append``, ``reserve``, ``commit``, ``fork`` and attention see a row on the host and report it.
Its host pages are listed in ``HostPages.table`` at the positions of the pages they hold.

Data moves in one custom call per direction (and pool pair) for every page and layer of a
call: a host page holds the page's K and V of every layer in one contiguous block (the host
pool is page-major), and the kernel reads the page ids on the device (no host round trip, no
staging buffer, both pools updated in place). ``max_pages`` (static) bounds a call: rows are
taken in slot order while their pages fit in it. With ``overlap=True`` the copy runs on a side
stream beside the work after it, its pages held out of reach until ``settle``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, page_index
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
    # Overlapped transfers (``overlap=True``), until ``settle``: bool [num_pages] device pages a
    # swap_out still reads (held meanwhile), and int32 [max_batch, max_pages_per_seq] the device
    # pages a swap_in writes, at the row's positions (the row stays on the host meanwhile)
    outgoing: jax.Array
    incoming: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages of the host pool (``create``'s ``host_pages``)."""
        return self.ref_counts.shape[0]

    @property
    def on_host(self) -> jax.Array:
        """bool ``[max_batch]``: rows swapped out."""
        return jnp.any(self.table != NO_PAGE, axis=1)

    @property
    def arriving(self) -> jax.Array:
        """bool ``[max_batch]``: rows an overlapped ``swap_in`` is bringing back."""
        return jnp.any(self.incoming != NO_PAGE, axis=1)

    @property
    def held(self) -> jax.Array:
        """int32 ``[max_batch]``: host pages each row holds."""
        return jnp.sum(self.table != NO_PAGE, axis=1, dtype=jnp.int32)


def empty(num_pages: int, device_pool: jax.Array, layout: str, scaled: bool, max_batch: int,
          max_pages_per_seq: int, num_device_pages: int, sharding=None) -> HostPages:
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

    def state(name, shape, fill, dtype=jnp.int32):
        if sharding is None:
            return jnp.full(shape, fill, dtype)
        return sharding.full(shape, fill, dtype, roles[name])

    rows = (max_batch, max_pages_per_seq)
    return HostPages(pages=host("pages", page, device_pool.dtype),
                     scales=host("scales", page[:3], jnp.float32) if scaled else None,
                     ref_counts=state("ref_counts", (num_pages,), 0),
                     table=state("table", rows, NO_PAGE),
                     outgoing=state("outgoing", (num_device_pages,), False, jnp.bool_),
                     incoming=state("incoming", rows, NO_PAGE))


# --- the transfers: the only code that touches host memory ----------------------------------------
# One custom call per pool pair and direction moves every page of a call, all layers, K and V
# (ffi/cuda/host_pages.cu: one kernel reaching the pinned host pool through unified addressing,
# the page ids read on the device; on CPU, one memcpy per run). Pairs naming a page out of range
# (the padding past the pages moved) are skipped.
def _to_host(axis: int, host_pool, k_pool, v_pool, src, dst, overlap: bool = False):
    """Device pages ``src`` (of ``k_pool`` and ``v_pool``) -> host pages ``dst``, in place."""
    if not overlap:  # after the overlapped transfers: they may still use these pages
        src, dst = _fence((src, dst), (host_pool, k_pool, v_pool))
    # the result typed like the pool, memory space included (a ShapeDtypeStruct says "device")
    return _ffi.call("jaxkv_pages_to_host", jax.typeof(host_pool), src, dst, k_pool, v_pool,
                     host_pool, input_output_aliases={4: 0}, axis=np.int64(axis),
                     overlap=overlap)


def _from_host(axis: int, k_pool, v_pool, host_pool, src, dst, overlap: bool = False):
    """Host pages ``src`` -> device pages ``dst`` of ``k_pool`` and ``v_pool``, in place."""
    if not overlap:
        src, dst = _fence((src, dst), (host_pool, k_pool, v_pool))
    return tuple(_ffi.call("jaxkv_pages_from_host", (jax.typeof(k_pool), jax.typeof(v_pool)),
                           src, dst, host_pool, k_pool, v_pool, input_output_aliases={3: 0, 4: 1},
                           axis=np.int64(axis), overlap=overlap))


def _fence(arrays, after):
    """``arrays`` (small: page ids, allocator state), once every transfer started with
    ``overlap`` has ended: the compute stream waits for jaxkv's side stream, and whatever is
    computed from them comes after. ``after``: the pools the transfers produce, read by the
    fence (not written, so never copied) so that XLA runs it after them."""
    return tuple(_ffi.call("jaxkv_host_fence", tuple(jax.typeof(a) for a in arrays), *arrays,
                           *after, input_output_aliases={i: i for i in range(len(arrays))}))


def _move_to_host(cache, host: HostPages, src, dst, overlap: bool = False) -> dict:
    """``HostPages`` fields with device pages ``src`` copied to host pages ``dst``: K and V, and
    the per-token-head scales of an 8-bit cache."""
    axis = PAGE_AXIS[cache.layout]
    fields = {"pages": _to_host(axis, host.pages, cache.k_pages, cache.v_pages, src, dst,
                                overlap)}
    if host.scales is not None:
        fields["scales"] = _to_host(axis, host.scales, cache.k_scales, cache.v_scales, src, dst,
                                    overlap)
    return fields


def _move_to_device(cache, src, dst, overlap: bool = False) -> dict:
    """Cache fields with host pages ``src`` copied to device pages ``dst``."""
    axis, host = PAGE_AXIS[cache.layout], cache.host
    k, v = _from_host(axis, cache.k_pages, cache.v_pages, host.pages, src, dst, overlap)
    fields = {"k_pages": k, "v_pages": v}
    if host.scales is not None:
        fields["k_scales"], fields["v_scales"] = _from_host(
            axis, cache.k_scales, cache.v_scales, host.scales, src, dst, overlap)
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


def swap_out(op: str, cache, rows: jax.Array, max_pages: int, overlap: bool):
    """``PagedKVCache.swap_out``'s body (arguments checked). A row's leading pages that another
    row also holds (a forked or matched prefix) stay on the device, held by the row: moving them
    would free nothing and bring them back unshared. Overlapped, the pages moved stay held
    (``outgoing``) until ``settle``."""
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
    # The pages moved go back to the pool (after the transfer, if overlapped); the shared
    # prefix stays in the page table.
    gone = host_rows >= 0
    moved = jnp.where(gone, table, cache.num_pages)
    ref_counts, outgoing = cache.ref_counts, host.outgoing
    if overlap:
        outgoing = outgoing.at[moved].set(True, mode="drop")
    else:
        ref_counts = ref_counts.at[moved].add(-1, mode="drop")
    host = dataclasses.replace(host, ref_counts=host_counts, outgoing=outgoing,
                               table=jnp.where(swapped[:, None], host_rows, host.table),
                               **_move_to_host(cache, host, src, dst, overlap))
    return dataclasses.replace(
        cache, host=host, prefix_cache=index, ref_counts=ref_counts,
        page_table=jnp.where(gone, NO_PAGE, table),
        new_tokens=jnp.where(swapped, 0, cache.new_tokens)), swapped


def _allocate_host(cache, need: jax.Array, eligible: jax.Array):
    """``allocate`` over the host pool: pages free of rows and of cached prefix pages first, then
    cached ones least recently used, which leave the index (their descendants with them)."""
    host, index, p = cache.host, cache.prefix_cache, cache.num_pages
    if index is None or index.entries == p:
        return (*allocate(host.ref_counts, need, eligible), index)
    return allocate_indexed(host.ref_counts, need, eligible, index, p, cache.max_pages_per_seq)


def swap_in(op: str, cache, rows: jax.Array, max_pages: int, overlap: bool):
    """``PagedKVCache.swap_in``'s body (arguments checked). Overlapped, the rows stay on the
    host, their new pages in ``incoming``, until ``settle``."""
    host = cache.host
    waiting = host.on_host & ~host.arriving
    check(~rows | waiting,
          f"{op}: a selected row is not on the host, or is already coming back (nothing moved)")
    held = host.held
    eligible = _budget(held, rows & waiting, max_pages)
    ref_counts, served, first, free_ids, index = cache._allocate(held, eligible)
    src, dst, device_rows = _moves(host.table, cache.pages_held, held, served, first, free_ids,
                                   max_pages, cache.num_pages)
    moved = _move_to_device(cache, src, dst, overlap)
    if overlap:
        host = dataclasses.replace(host, incoming=jnp.where(served[:, None], device_rows,
                                                            host.incoming))
        return dataclasses.replace(cache, host=host, ref_counts=ref_counts, prefix_cache=index,
                                   **moved), served
    cache = dataclasses.replace(
        cache, host=released(host, served), ref_counts=ref_counts, prefix_cache=index,
        page_table=jnp.where(device_rows >= 0, device_rows, cache.page_table), **moved)
    return cache, served


def settle(cache):
    """``PagedKVCache.settle_swaps``' body: waits for the overlapped transfers, then frees the
    device pages swapped out and puts the rows swapped in back on their pages."""
    host = cache.host
    # Fenced: the allocator state and page table, from which every later use of these pages is
    # computed, after the transfers (their pools read by the fence).
    pools = [cache.k_pages, cache.v_pages, host.pages]
    if host.scales is not None:
        pools += [cache.k_scales, cache.v_scales, host.scales]
    ref_counts, page_table = _fence((cache.ref_counts, cache.page_table), pools)
    incoming, outgoing, arrived = host.incoming, host.outgoing, host.arriving
    host = dataclasses.replace(host, incoming=jnp.full_like(incoming, NO_PAGE),
                               outgoing=jnp.zeros_like(outgoing))
    return dataclasses.replace(
        cache, host=released(host, arrived),
        ref_counts=ref_counts - outgoing.astype(jnp.int32),
        page_table=jnp.where(incoming >= 0, incoming, page_table))


def released(host: HostPages, mask: jax.Array) -> HostPages:
    """The host pages of the rows in ``mask`` freed (the rows end, or came back). Device pages
    an overlapped swap_in is still writing for them are freed by ``settle``, after it."""
    freed = jnp.where(mask[:, None] & (host.table >= 0), host.table, host.num_pages)
    coming = mask[:, None] & (host.incoming >= 0)
    outgoing = host.outgoing.at[jnp.where(coming, host.incoming, host.outgoing.shape[0])].set(
        True, mode="drop")
    return dataclasses.replace(host, ref_counts=host.ref_counts.at[freed].set(0, mode="drop"),
                               table=jnp.where(mask[:, None], NO_PAGE, host.table),
                               incoming=jnp.where(mask[:, None], NO_PAGE, host.incoming),
                               outgoing=outgoing)


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
