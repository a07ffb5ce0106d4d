"""The host tier of a paged cache: a second pool of pages in host memory, and rows swapped to it.

``PagedKVCache.create(..., host_pages=N)`` adds a ``HostPages``: a pool of ``N`` pages in the
``pinned_host`` memory kind, the device pools' dtype (and a per-token-head scale pool for an
8-bit cache), with an allocator and a table of host pages per row kept on the device, so that
swapping runs under ``jit`` with no host round trip.

A swapped row keeps its length; its own device pages go back to the pool and leave its page table
(the pages it shares with other rows stay), so nothing reads or writes memory it no longer owns:
``append``, ``reserve``, ``commit``, ``fork`` and attention see a row on the host and report it.
Its host pages are listed in ``HostPages.table`` at the positions of the pages they hold. With
``windows`` (``jaxkv._windows``) each layer group has its own page table: the host table is as
wide as all of them side by side (the "wide table", ``_wide_table``), so a row's pages of every
group move in one transfer and come back to the same columns of the same groups' tables; a
window group's columns its window released hold nothing and move nothing.

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
from ._allocator import allocate, allocate_indexed, served_rows
from ._checks import check
from .layout import PAGE_AXIS, host_roles

NO_PAGE = -1
# What a report on a row that is on the host tells the caller to do (a row an overlapped swap_in
# is bringing back stays on the host until settle_swaps).
SWAP_IN_FIRST = "swap_in first; after an overlapped swap_in, settle_swaps"


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
    # int32 [max_batch, groups * max_pages_per_seq] (one group without windows): a swapped row's
    # host pages at the positions of the pages it moved in the wide table (``_wide_table``); the
    # shared pages it kept on the device stay in its page tables
    table: jax.Array
    # Overlapped transfers (``overlap=True``), until ``settle``: int32 [num_pages] the holds of
    # swap_outs still reading each device page (a count: a page matched into another row while in
    # flight can go out again), and int32 like ``table`` the device pages a swap_in writes, at
    # the row's positions (the row stays on the host meanwhile)
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
          width: int, num_device_pages: int, sharding=None) -> HostPages:
    """An empty host tier: every host page free, no row swapped; its pages of ``device_pool``'s
    shape and dtype, in the host memory of its device (with ``sharding``, a ``CacheSharding``:
    of its devices, each batch shard's share of the host pages in its own device's host memory).
    ``width``: the columns of a row's host table, its wide table's (``_wide_table``)."""
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

    rows = (max_batch, width)
    return HostPages(pages=host("pages", page, device_pool.dtype),
                     scales=host("scales", page[:3], jnp.float32) if scaled else None,
                     ref_counts=state("ref_counts", (num_pages,), 0),
                     table=state("table", rows, NO_PAGE),
                     outgoing=state("outgoing", (num_device_pages,), 0),
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


def _move_to_host(cache, host: HostPages, src, dst, overlap: bool = False):
    """Device pages ``src`` copied to host pages ``dst``: K and V, and the per-token-head scales
    of an 8-bit cache. Returns ``(cache, host)`` with the new host pools.

    The device pools are only read, but a later in-place write of them (an append in the same
    ``jit``) would have XLA copy them unless it is ordered after the read: done, they pass
    through a fence that reads the new host pools. Overlapped, the transfer is still running
    when the call returns; the pages it reads are held until ``settle`` instead."""
    axis, pools = PAGE_AXIS[cache.layout], _pool_pairs(host)
    for to, k, v in pools:
        host = dataclasses.replace(host, **{to: _to_host(
            axis, getattr(host, to), getattr(cache, k), getattr(cache, v), src, dst, overlap)})
    if not overlap:
        read = [name for _, k, v in pools for name in (k, v)]
        done = _fence(tuple(getattr(cache, n) for n in read),
                      tuple(getattr(host, to) for to, _, _ in pools))
        cache = dataclasses.replace(cache, **dict(zip(read, done)))
    return cache, host


def _pool_pairs(host: HostPages) -> list[tuple[str, str, str]]:
    """Each host pool's field with its device pools' fields: the data, and the per-token-head
    scales of an 8-bit cache."""
    pairs = [("pages", "k_pages", "v_pages")]
    if host.scales is not None:
        pairs.append(("scales", "k_scales", "v_scales"))
    return pairs


def _move_to_device(cache, src, dst, overlap: bool = False):
    """Host pages ``src`` copied to device pages ``dst``: returns the cache with its new device
    pools. As in ``_move_to_host``, the pools only read (here the host's) pass through a fence
    that reads the transfer's result when it is done, so that a later write of them in the same
    ``jit`` (a spill, a swap_out) is ordered after the read instead of copying them."""
    axis, host = PAGE_AXIS[cache.layout], cache.host
    pools = _pool_pairs(host)
    for frm, k, v in pools:
        cache = dataclasses.replace(cache, **dict(zip((k, v), _from_host(
            axis, getattr(cache, k), getattr(cache, v), getattr(host, frm), src, dst, overlap))))
    if not overlap:
        read = [frm for frm, _, _ in pools]
        done = _fence(tuple(getattr(host, n) for n in read),
                      tuple(getattr(cache, name) for _, k, v in pools for name in (k, v)))
        host = dataclasses.replace(host, **dict(zip(read, done)))
    return dataclasses.replace(cache, host=host)


def _wide_table(cache) -> jax.Array:
    """int32 ``[max_batch, groups * max_pages_per_seq]``: every layer group's page table side by
    side (the page table itself without windows), laid out like ``HostPages.table``."""
    tables = cache._tables()
    return tables[0] if len(tables) == 1 else jnp.concatenate(tables, axis=1)


def _with_wide_table(cache, wide: jax.Array) -> dict:
    """The cache's fields holding ``wide`` (``_wide_table``'s layout) split back into the groups'
    page tables, for ``dataclasses.replace``."""
    groups = wide.shape[1] // cache.max_pages_per_seq
    return cache._with_tables([wide] if groups == 1 else jnp.split(wide, groups, axis=1))


def _moves(table: jax.Array, live: jax.Array, first: jax.Array, free_ids: jax.Array,
           max_pages: int, limit: int):
    """The transfer's page pairs: row ``b``'s pages ``table[b, j]`` where ``live[b, j]``, in
    column order, take slots ``first[b]``, ``first[b] + 1``, ... of the transfer, each moving
    to ``free_ids`` at its slot. The columns need not be adjacent (a window group's released
    ones, a shared page kept). Returns ``(src, dst, new_rows)``: ``src``, ``dst`` int32
    ``[max_pages]`` (unused entries: ``dst = limit``, out of range), ``new_rows`` each moved
    row's destination pages laid out like ``table``."""
    rank = jnp.cumsum(live, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(live, first[:, None] + rank, max_pages)
    src = jnp.zeros((max_pages,), jnp.int32).at[slot].set(table, mode="drop")
    new_rows = jnp.where(live, free_ids[jnp.clip(slot, 0, free_ids.shape[0] - 1)], NO_PAGE)
    dst = jnp.full((max_pages,), limit, jnp.int32).at[slot].set(new_rows, mode="drop")
    return src, dst, new_rows


def _budget(need: jax.Array, eligible: jax.Array, max_pages: int) -> jax.Array:
    """Eligible rows, in slot order, while their pages fit in one transfer of ``max_pages``."""
    want = jnp.where(eligible, need, 0)
    return eligible & (jnp.cumsum(want) <= max_pages)


def swap_out(op: str, cache, rows: jax.Array, max_pages: int, overlap: bool):
    """``PagedKVCache.swap_out``'s body (arguments checked). A row's pages that another row also
    holds (a forked or matched prefix) stay on the device, held by the row: moving them would
    free nothing and bring them back unshared. Every other page the row holds, in any layer
    group, moves. Overlapped, the pages moved stay held (``outgoing``) until ``settle``."""
    host = cache.host
    on_host = host.on_host
    table = _wide_table(cache)
    # held by another row: an in-flight swap_out's hold (outgoing) is not a row
    holders = cache.ref_counts - host.outgoing
    shared = holders[jnp.clip(table, 0, cache.num_pages - 1)] > 1
    # Asked page by page: in the wide table a row's pages are no prefix (a window group's row
    # holds none before its window) and every group's table has its own shared run. Without
    # windows, the shared pages are the row's leading ones, as before.
    mine = (table >= 0) & ~shared
    own = jnp.sum(mine, axis=1, dtype=jnp.int32)
    check(~rows | (~on_host & (own > 0)),
          f"{op}: a selected row is already on the host or holds no pages of its own (nothing "
          "moved)")
    eligible = _budget(own, rows & ~on_host & (own > 0), max_pages)
    host_counts, swapped, first, free_ids, index = _allocate_host(cache, own, eligible)
    src, dst, host_rows = _moves(table, swapped[:, None] & mine, first, free_ids, max_pages,
                                 host.num_pages)
    # The pages moved go back to the pool (after the transfer, if overlapped); the shared
    # ones stay in the page tables.
    gone = host_rows >= 0
    moved = jnp.where(gone, table, cache.num_pages)
    ref_counts, outgoing = cache.ref_counts, host.outgoing
    if overlap:
        outgoing = outgoing.at[moved].add(1, mode="drop")
    else:
        ref_counts = ref_counts.at[moved].add(-1, mode="drop")
    cache, host = _move_to_host(cache, host, src, dst, overlap)
    host = dataclasses.replace(host, ref_counts=host_counts, outgoing=outgoing,
                               table=jnp.where(swapped[:, None], host_rows, host.table))
    return dataclasses.replace(
        cache, host=host, prefix_cache=index, ref_counts=ref_counts,
        new_tokens=jnp.where(swapped, 0, cache.new_tokens),
        **_with_wide_table(cache, jnp.where(gone, NO_PAGE, table))), swapped


def _allocate_host(cache, need: jax.Array, eligible: jax.Array):
    """``allocate`` over the host pool: pages free of rows and of cached prefix pages first, then
    cached ones least recently used, which leave the index (their descendants with them)."""
    host, index, p = cache.host, cache.prefix_cache, cache.num_pages
    if index is None or index.entries == p:
        return (*allocate(host.ref_counts, need, eligible), index)
    return allocate_indexed(host.ref_counts, need, eligible, index, p, cache.max_pages_per_seq)


def swap_in(op: str, cache, rows: jax.Array, max_pages: int, overlap: bool):
    """``PagedKVCache.swap_in``'s body (arguments checked): a row's host pages come back to new
    device pages at their columns of the wide table (``_wide_table``). Overlapped, the rows stay
    on the host, their new pages in ``incoming``, until ``settle``."""
    host = cache.host
    waiting = host.on_host & ~host.arriving
    check(~rows | waiting,
          f"{op}: a selected row is not on the host, or is already coming back (nothing moved)")
    held = host.held
    eligible = _budget(held, rows & waiting, max_pages)
    cache, ref_counts, served, first, free_ids = cache._allocate(held, eligible)
    host = cache.host  # an eviction's spill wrote the host pool
    src, dst, device_rows = _moves(host.table, served[:, None] & (host.table >= 0), first,
                                   free_ids, max_pages, cache.num_pages)
    cache = _move_to_device(cache, src, dst, overlap)
    host = cache.host
    if overlap:
        host = dataclasses.replace(host, incoming=jnp.where(served[:, None], device_rows,
                                                            host.incoming))
        return dataclasses.replace(cache, host=host, ref_counts=ref_counts), served
    table = jnp.where(device_rows >= 0, device_rows, _wide_table(cache))
    cache = dataclasses.replace(cache, host=released(host, served), ref_counts=ref_counts,
                                **_with_wide_table(cache, table))
    return cache, served


def settle(cache):
    """``PagedKVCache.settle_swaps``' body: waits for the overlapped transfers, then frees the
    device pages swapped out and puts the rows swapped in back on their pages (in every layer
    group's table)."""
    host = cache.host
    # Fenced: the allocator state and page tables, from which every later use of these pages is
    # computed, after the transfers (their pools read by the fence).
    pools = [cache.k_pages, cache.v_pages, host.pages]
    if host.scales is not None:
        pools += [cache.k_scales, cache.v_scales, host.scales]
    ref_counts, table = _fence((cache.ref_counts, _wide_table(cache)), pools)
    incoming, outgoing, arrived = host.incoming, host.outgoing, host.arriving
    host = dataclasses.replace(host, incoming=jnp.full_like(incoming, NO_PAGE),
                               outgoing=jnp.zeros_like(outgoing))
    return dataclasses.replace(
        cache, host=released(host, arrived),
        ref_counts=ref_counts - outgoing,
        **_with_wide_table(cache, jnp.where(incoming >= 0, incoming, table)))


def released(host: HostPages, mask: jax.Array) -> HostPages:
    """The host pages of the rows in ``mask`` freed (the rows end, or came back). Device pages
    an overlapped swap_in is still writing for them are freed by ``settle``, after it."""
    freed = jnp.where(mask[:, None] & (host.table >= 0), host.table, host.num_pages)
    coming = mask[:, None] & (host.incoming >= 0)
    outgoing = host.outgoing.at[jnp.where(coming, host.incoming, host.outgoing.shape[0])].add(
        1, mode="drop")
    return dataclasses.replace(host, ref_counts=host.ref_counts.at[freed].set(0, mode="drop"),
                               table=jnp.where(mask[:, None], NO_PAGE, host.table),
                               incoming=jnp.where(mask[:, None], NO_PAGE, host.incoming),
                               outgoing=outgoing)


def outside_swaps(op: str, host: HostPages, src_pages: jax.Array, dst_pages: jax.Array):
    """``copy_pages``' pairs with no page an overlapped swap still moves: until ``settle`` a
    swap_out reads its pages (``outgoing``) and a swap_in writes its new ones (``incoming``).
    A pair writing either, or reading a page still arriving, is reported and skipped (both its
    ids ``NO_PAGE``), so a copy never races the side stream's."""
    pages = host.outgoing.shape[0]
    arriving = jnp.zeros((pages + 1,), jnp.bool_).at[
        jnp.where(host.incoming >= 0, host.incoming, pages)].set(True)[:pages]
    moving = arriving | (host.outgoing > 0)

    def named(mask, ids):
        return mask[jnp.clip(ids, 0, pages - 1)] & (ids >= 0) & (ids < pages)

    racing = named(moving, dst_pages) | named(arriving, src_pages)
    check(~jnp.any(racing), f"{op}: src_pages / dst_pages name a page an overlapped swap still "
          "moves (a destination it reads or writes, a source it writes); settle_swaps first")
    return jnp.where(racing, NO_PAGE, src_pages), jnp.where(racing, NO_PAGE, dst_pages)


# --- the prefix cache's host tier --------------------------------------------------------------
def spill(cache, max_pages: int, count=None):
    """``PagedKVCache.spill_prefix``'s body: up to ``max_pages`` (and ``count``, traced) cached
    free device pages, least recently used first, move to host pages free of rows and of cached
    pages (one transfer); their index entries move with them and the device pages become
    never-cached free pages. Returns ``(cache, pages spilled)``."""
    p = cache.num_pages
    device = page_index.part(cache.prefix_cache, 0, p)
    free = cache.ref_counts == 0
    # the order lists the never-cached free pages first, then the cached free ones, LRU first
    order = page_index.eviction_order(device, free)
    never = jnp.sum(free & ~device.indexed, dtype=jnp.int32)
    n = jnp.minimum(jnp.sum(free & device.indexed), jnp.sum(_host_room(cache)))
    if count is not None:
        n = jnp.minimum(n, count)
    i = jnp.arange(max_pages, dtype=jnp.int32)
    return _spill(cache, order[jnp.clip(never + i, 0, p - 1)], i < n)


def spill_evicted(cache, ref_counts: jax.Array, need: jax.Array, eligible: jax.Array,
                  order: jax.Array):
    """The cached pages an allocation of ``need`` pages for the ``eligible`` rows (``allocate``'s
    rule, over ``ref_counts``, taking pages in ``order``: the pool's eviction order) is about to
    evict, spilled to the host first while it has room: they stay findable there, and the
    allocation takes their device pages as never-cached ones (still in ``order``: the same pages
    as without the spill). Where the host lacks room for them all, the shallowest go first: the
    allocation evicts the rest, and with each evicted page every page below it leaves the index,
    so a page spilled below one evicted would be lost. One transfer, its size the most one
    allocation can take; nothing moves when the never-cached free pages suffice (the
    transfer's padding costs the kernel no loop)."""
    p, index, deepest = cache.num_pages, cache.prefix_cache, cache.max_pages_per_seq
    served = served_rows(ref_counts, need, eligible)
    taken = jnp.sum(jnp.where(served, need, 0), dtype=jnp.int32)
    free = ref_counts == 0
    device = page_index.part(index, 0, p)
    never = jnp.sum(free & ~device.indexed, dtype=jnp.int32)
    # Slot i of the transfer: the page at position never + i of the order. The allocation takes
    # the positions before ``taken``: at most the pages one allocation can take.
    i = jnp.arange(min(p, cache.max_batch * deepest), dtype=jnp.int32)
    pages = order[jnp.clip(never + i, 0, p - 1)]
    evicted = never + i < taken
    n = jnp.minimum(jnp.maximum(taken - never, 0), jnp.sum(_host_room(cache)))
    # The n shallowest of them (by depth, then in order), found without a sort: the depth below
    # which all are taken, and the first ones at that depth.
    depth = jnp.where(evicted, device.depth[pages], deepest)
    per_depth = jnp.zeros((deepest,), jnp.int32).at[depth].add(1, mode="drop")
    below = jnp.cumsum(per_depth) - per_depth  # pages at smaller depths
    cut = jnp.minimum(jnp.sum(below + per_depth < n, dtype=jnp.int32), deepest - 1)
    at_cut = evicted & (depth == cut)
    live = evicted & ((depth < cut) | (at_cut & (jnp.cumsum(at_cut) <= n - below[cut])))
    cache, _ = _spill(cache, pages, live)
    return cache


def _host_room(cache) -> jax.Array:
    """bool ``[host pages]``: host pages free of rows and of cached pages."""
    p = cache.num_pages
    part = page_index.part(cache.prefix_cache, p, cache.prefix_cache.entries)
    return (cache.host.ref_counts == 0) & ~part.indexed


def _spill(cache, pages: jax.Array, live: jax.Array):
    """Moves the cached free device pages ``pages[i]`` where ``live[i]`` (no more than the host's
    room) to free host pages, index entries and all: one transfer of ``pages``' length.
    Returns ``(cache, pages spilled)``."""
    p, host, index = cache.num_pages, cache.host, cache.prefix_cache
    n_host = host.num_pages
    host_ids = jnp.nonzero(_host_room(cache), size=n_host, fill_value=n_host)[0]
    rank = jnp.cumsum(live, dtype=jnp.int32) - 1
    dst = jnp.where(live, host_ids[jnp.clip(rank, 0, n_host - 1)].astype(jnp.int32), n_host)
    live = dst < n_host
    src = jnp.where(live, pages, 0)
    index = page_index.move(index, jnp.where(live, src, -1), jnp.where(live, p + dst, -1))
    cache, host = _move_to_host(cache, host, src, dst)
    return (dataclasses.replace(cache, prefix_cache=index, host=host),
            jnp.sum(live, dtype=jnp.int32))


def bring_back(cache, found: jax.Array, run: jax.Array, budget: int):
    """``match_prefix``'s pages on the host brought to device pages.

    ``found`` int32 ``[B, K]`` (entry ids: a host page ``h`` is ``num_pages + h``), ``run``
    int32 ``[B]``: each row's match (``page_index.lookup``). A host page comes back once, for the
    first row that found it (its owner); rows in slot order bring theirs while they fit in
    ``budget`` (one transfer) and device pages last, and every row that found a page brought back
    shares it. A row keeps its match up to its first host page that does not come back.
    **Returns** ``(cache, found, run)``: the pages moved (data and index entries), ``found``
    naming device pages within ``run``, and the reference counts of every page in the runs
    raised by one."""
    p = cache.num_pages
    b, k = found.shape
    level = jnp.arange(k, dtype=jnp.int32)[None, :]
    on_host = (level < run[:, None]) & (found >= p)
    before_host = jnp.minimum(run, jnp.min(jnp.where(on_host, level, k), axis=1))
    if budget == 0:  # nothing comes back: each row matches up to its first host page
        device = (level < before_host[:, None]) & (found >= 0)
        counts = cache.ref_counts.at[jnp.where(device, found, p)].add(1, mode="drop")
        return dataclasses.replace(cache, ref_counts=counts), found, before_host
    # A host page's owner is the first (row, level) that found it: an entry sits at one depth of
    # every chain, so a later finder is a later row. Only owners take device pages for it.
    n_entries = cache.prefix_cache.entries
    at = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    entry = jnp.where(on_host, found, n_entries)
    owner = jnp.full((n_entries + 1,), b * k, jnp.int32).at[entry].min(at)[entry]
    owned = on_host & (owner == at)
    count = jnp.sum(owned, axis=1, dtype=jnp.int32)
    fits = jnp.cumsum(count) <= budget
    need = jnp.where(fits, count, 0)
    # The device pages of every run are held while pages are taken for the host ones, so that
    # the allocator cannot evict them.
    device = (level < run[:, None]) & (found >= 0) & (found < p)
    held = cache.ref_counts.at[jnp.where(device, found, p)].add(1, mode="drop")
    cache, ref_counts, served, first, free_ids = cache._allocate(need, need > 0, held)
    index = cache.prefix_cache
    # Rows bring theirs back in slot order, first come first served in both the transfer and the
    # pool, so a row that brings pages back finds every earlier owner's pages back too.
    brings = served & (need > 0)
    back = on_host & brings[jnp.clip(owner // k, 0, b - 1)]
    runs = jnp.minimum(run, jnp.min(jnp.where(on_host & ~back, level, k), axis=1))
    ref_counts = ref_counts.at[jnp.where(device & (level >= runs[:, None]), found, p)].add(
        -1, mode="drop")
    moving = owned & brings[:, None]
    j = jnp.cumsum(owned, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(moving, first[:, None] + j, budget)
    new = jnp.where(moving, free_ids[jnp.clip(slot, 0, p - 1)], -1)
    # Every finder within its run maps the owner's new page; the owner's count (1) is the
    # allocator's, each other finder adds one.
    new_of = jnp.full((n_entries + 1,), -1, jnp.int32).at[jnp.where(moving, found, n_entries)].set(
        new)[entry]
    sharing = back & ~owned & (level < runs[:, None])
    ref_counts = ref_counts.at[jnp.where(sharing, new_of, p)].add(1, mode="drop")
    src = jnp.zeros((budget,), jnp.int32).at[slot].set(found - p, mode="drop")
    dst = jnp.full((budget,), p, jnp.int32).at[slot].set(new, mode="drop")
    index = page_index.move(index, jnp.where(dst < p, src + p, -1), jnp.where(dst < p, dst, -1))
    cache = dataclasses.replace(_move_to_device(cache, src, dst), ref_counts=ref_counts,
                                prefix_cache=index)
    return cache, jnp.where(back, new_of, found), runs
