"""PagedKVCache: a pool of fixed-size pages shared by every sequence (Modular MAX's PagedKVCache).

The allocator lives in the pytree as arrays (a reference count per page; a page is free when its
count is 0), so reserving, forking and releasing run on device under ``jit`` with no host round
trip. Data moves through the kernels of ``paged_ops``; everything else is small jnp arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _lengths
from . import _lifecycle as lifecycle
from . import _windows
from . import host_tier
from . import _validate as validate
from . import ops
from . import page_index
from . import paged_ops
from . import quantization
from ._allocator import allocate, allocate_indexed
from ._checks import check, elsewhere
from ._validate import INT32_MAX
from .layout import (KV, KV_LAYERS, LAYER, LAYOUTS, POOL, REPLICATED, ROWS, host_roles,
                     pool_geometry, pool_shape)
from .paged_ops import NO_PAGE
from .sharding import (CacheSharding, Combined, Destinations, Ids, Role, create, per_shard,
                       row_ids, rows_of, same_shard)

IntOrArray = Union[int, jax.Array]
_pages_of = lambda args: args["self"].num_pages  # noqa: E731  (the pages one shard owns)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged KV cache of every decoder layer: pools of pages, a page table, lengths, an allocator.

    Every method returns a new cache; under ``jit`` with the cache donated the pools are updated in
    place. A decode step: ``reserve`` pages for the new tokens, ``append`` each layer's K/V,
    ``commit`` the lengths; ``release`` finished sequences.

    >>> cache = PagedKVCache.create(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2,
    ...                             head_dim=16, max_batch=2, max_pages_per_seq=4,
    ...                             dtype=jnp.float32)
    >>> n = jnp.array([5, 3], jnp.int32)                      # ragged prefill
    >>> cache, served = cache.reserve(n)
    >>> k = v = jnp.ones((2, 2, 5, 16), jnp.float32)
    >>> cache = cache.append(0, k, v, n).append(1, k, v, n).commit(n)
    >>> cache.lengths, cache.num_free_pages
    (Array([5, 3], dtype=int32), Array(5, dtype=int32))
    """

    k_pages: jax.Array  # HND [L, H, num_pages, page_size, D]; NHD [L, num_pages, page_size, H, D]
    v_pages: jax.Array  # same as k_pages
    page_table: jax.Array  # int32 [max_batch, max_pages_per_seq]: physical page, or NO_PAGE
    lengths: jax.Array  # int32 [max_batch]: tokens stored per sequence (cache_lengths)
    ref_counts: jax.Array  # int32 [num_pages]: page-table entries naming each page; 0 = free
    new_tokens: jax.Array  # int32 [max_batch]: tokens the last reserve made room for
    layout: str = dataclasses.field(default="HND", metadata=dict(static=True))
    # Sharded: pools, tables and allocator split per batch shard, local page ids (docs/sharding.md)
    sharding: CacheSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    # 8-bit caches (jaxkv.quantization): float32 pools without D (HND [L, H, P, S], NHD
    # [L, P, S, H]) per token and head, or [num_layers] per tensor
    k_scales: Any = None  # an array, or None
    v_scales: Any = None
    scaling: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # create(prefix_cache=True): full pages found by their token ids (jaxkv.page_index), one
    # entry per page, split like the pages
    prefix_cache: page_index.PageIndex | None = None
    # create(host_pages=N): a pool of N pages in host memory and the rows swapped to it
    # (jaxkv.host_tier)
    host: host_tier.HostPages | None = None
    # create(windows=...): each layer's window (jaxkv._windows). The pools then hold one layer
    # group's layers (its slots); page_table is group 0's table, group_tables the other groups'.
    windows: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
    group_tables: jax.Array | None = None  # int32 [groups - 1, max_batch, max_pages_per_seq]

    def leaf_roles(self) -> dict:
        """Where each leaf keeps its rows, pages and heads (``jaxkv.layout``)."""
        pool = POOL[self.layout]
        scales = pool[:4] if self.scaling == "per_token_head" else REPLICATED
        return dict(k_pages=pool, v_pages=pool, page_table=ROWS, lengths=ROWS, ref_counts=ROWS,
                    new_tokens=ROWS, k_scales=scales, v_scales=scales, prefix_cache=ROWS,
                    host=host_roles(self.layout, self.scaling == "per_token_head"),
                    group_tables=(None,) + ROWS)

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch: int,
        max_pages_per_seq: int,
        dtype=jnp.bfloat16,
        layout: str = "HND",
        sharding: CacheSharding | None = None,
        scaling: str | None = None,
        k_scale=None,
        v_scale=None,
        prefix_cache: bool = False,
        host_pages: int = 0,
        windows=None,
    ) -> "PagedKVCache":
        """An empty cache: every page free, every page-table entry ``NO_PAGE``, lengths 0.

        ``k_pages``, ``v_pages``: ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]``
        (``layout="HND"``) or ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``
        (``"NHD"``) of ``dtype``; ``page_table`` int32 ``[max_batch, max_pages_per_seq]``;
        ``lengths``, ``new_tokens`` int32 ``[max_batch]``; ``ref_counts`` int32 ``[num_pages]``.
        A sequence holds at most ``max_pages_per_seq * page_size`` tokens.

        **Raises:** ``TypeError`` / ``ValueError`` naming the argument: sizes must be Python ints
        in ``[1, 2**31 - 1]``, positions and per-layer head counts must fit in int32, ``layout``
        one of ``"HND"``, ``"NHD"``.

        With ``sharding`` (a ``jaxkv.CacheSharding``) every leaf is created already placed, each
        batch shard owning ``num_pages / batch_shards`` pages (docs/sharding.md).

        ``scaling``, ``k_scale``, ``v_scale``: as for ``LinearKVCache.create``; per token and head
        ``k_scales`` and ``v_scales`` are pools without D: ``[L, H, P, S]`` (HND) or
        ``[L, P, S, H]`` (NHD).

        ``prefix_cache``: keep an index of full pages by their token ids (``match_prefix``,
        ``insert_prefix``; docs/prefix-caching.md). Indexed pages keep their data when no
        sequence holds them, count as free, and ``reserve`` evicts them least recently used
        after the pages never indexed.

        ``host_pages``: pages of a second pool in host memory (``pinned_host``), same layout and
        dtype, and scales for a per-token-head cache; ``swap_out`` moves rows there and
        ``swap_in`` brings them back (docs/host-tier.md); with ``sharding``, each batch shard has
        ``host_pages / batch_shards`` of them.

        ``windows``: one entry per layer, ``None`` for a layer of full attention or the int
        window of a sliding-window layer (docs/hybrid-caches.md). Window layers keep only the
        pages their window still sees: ``reserve`` releases a row's older pages as it advances,
        so a row holds at most ``ceil((window + new tokens) / page_size) + 1`` pages for them.
        The layers are grouped (groups of equal size, one window each), each group with its own
        page table and one pool and allocator for all: the pools are
        ``[slots, ...]`` with ``slots`` the layers of a group, and ``num_pages`` pages serve every
        group. ``jaxkv.attention`` reads a layer with its window by default. Not yet with
        ``prefix_cache`` and ``host_pages`` together. With ``sharding``, every group's table
        splits by batch like ``page_table``.
        """
        op = "PagedKVCache.create"
        dims = dict(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, max_batch=max_batch,
                    max_pages_per_seq=max_pages_per_seq)
        for name, value in dims.items():
            validate.static_int(op, name, value, lo=1, hi=INT32_MAX)
        if layout not in LAYOUTS:
            raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
        validate.new_cache_dtype(op, dtype)
        if max_pages_per_seq * page_size > INT32_MAX:
            raise ValueError(f"{op}: max_pages_per_seq * page_size must fit in int32 positions")
        if num_layers * max_batch * num_kv_heads > INT32_MAX:
            raise ValueError(f"{op}: num_layers * max_batch * num_kv_heads must fit in int32")
        windows = _windows.check_windows(op, windows, num_layers)
        slots = num_layers
        if windows is not None:
            if prefix_cache and host_pages:
                raise ValueError(f"{op}: windows are not yet supported with prefix_cache and "
                                 "host_pages together (either one works)")
            slots = _windows.groups(windows).slots
        shape = pool_shape(layout, slots, num_kv_heads, num_pages, page_size, head_dim)
        rows = ((max_batch,), jnp.int32, 0)
        leaves: dict[str, Any] = dict(
            k_pages=(shape, dtype, 0), v_pages=(shape, dtype, 0),
            page_table=((max_batch, max_pages_per_seq), jnp.int32, NO_PAGE),
            lengths=rows, ref_counts=((num_pages,), jnp.int32, 0), new_tokens=rows)
        scaling = quantization.scaling_of(op, dtype, scaling)
        # The scale pools: the pools without D, in either layout.
        leaves.update(quantization.scale_leaves(op, scaling, num_layers, shape[:4], k_scale,
                                                v_scale))
        if windows is not None and _windows.groups(windows).num_groups > 1:
            groups = _windows.groups(windows).num_groups
            leaves["group_tables"] = ((groups - 1, max_batch, max_pages_per_seq), jnp.int32,
                                      NO_PAGE)
        host_pages = validate.static_int(op, "host_pages", host_pages, lo=0, hi=INT32_MAX)
        if not isinstance(prefix_cache, bool):
            raise TypeError(f"{op}: prefix_cache must be a bool, got {type(prefix_cache).__name__}")
        if prefix_cache:
            # an entry per device page, then one per host page (jaxkv.page_index)
            entries = num_pages + host_pages
            leaves["prefix_cache"] = lambda full: page_index.PageIndex.empty(entries, page_size,
                                                                             full)
        divides = dict(max_batch=(max_batch, "batch"), num_pages=(num_pages, "batch"),
                       num_kv_heads=(num_kv_heads, "heads"), host_pages=(host_pages, "batch"))
        cache = create(cls, op, sharding, leaves, divides, layout=layout, scaling=scaling,
                       windows=windows)
        if not host_pages:
            return cache
        # a row's host pages: a table as wide as every group's tables side by side
        width = max_pages_per_seq * len(cache._tables())
        cache = dataclasses.replace(cache, host=host_tier.empty(
            host_pages, cache.k_pages, layout, scaling == "per_token_head", max_batch,
            width, num_pages, sharding))
        if sharding is None and not isinstance(cache.k_pages, jax.core.Tracer):
            # The host pools are committed to their device (placed in its host memory), and a
            # jit's outputs are committed when an input is: the other leaves committed too, the
            # cache a step returns has the signature of the one it took (one compile, not two).
            device = cache.k_pages.sharding
            cache = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, device), cache)
        return cache

    # Static configuration, read off the shapes.
    def _geometry(self) -> dict:
        return pool_geometry(self.layout, self.k_pages.shape)

    num_layers = property(lambda self: (len(self.windows) if self.windows is not None
                                        else self._geometry()["num_layers"]),
                          doc="Decoder layers (static).")
    num_kv_heads = property(lambda self: self._geometry()["num_kv_heads"],
                            doc="KV heads per layer (static).")
    num_pages = property(lambda self: self._geometry()["num_pages"],
                         doc="Pages in the pool (static).")
    page_size = property(lambda self: self._geometry()["page_size"],
                         doc="Tokens per page (static).")
    head_dim = property(lambda self: self._geometry()["head_dim"],
                        doc="Elements per head (static).")
    max_batch = property(lambda self: self.page_table.shape[0],
                         doc="Rows of the page table (static).")
    max_pages_per_seq = property(lambda self: self.page_table.shape[1],
                                 doc="Page-table entries per row (static).")
    dtype = property(lambda self: self.k_pages.dtype, doc="Element type of the pools.")

    # Read-side queries (the seed's).
    @property
    def pages_held(self) -> jax.Array:
        """int32 ``[max_batch]``: pages assigned to each sequence (a prefix of its table row;
        with ``windows``, the pages of every layer group together)."""
        held = paged_ops.pages_held(self.page_table)
        if self.group_tables is not None:
            held += jnp.sum(self.group_tables >= 0, axis=(0, 2), dtype=jnp.int32)
        return held

    # Layer groups (create(windows=...), jaxkv._windows): one table each, pools of slots.
    def _tables(self) -> list:
        """Each layer group's page table ``[max_batch, max_pages_per_seq]`` (one without
        windows)."""
        extra = [] if self.group_tables is None else list(self.group_tables)
        return [self.page_table, *extra]

    def _with_tables(self, tables: list) -> dict:
        """The fields holding ``tables`` (``_tables``' order)."""
        rest = dict(group_tables=jnp.stack(tables[1:])) if len(tables) > 1 else {}
        return dict(page_table=tables[0], **rest)

    def _group_windows(self) -> tuple:
        return (None,) if self.windows is None else _windows.groups(self.windows).group_windows

    def _reach(self) -> jax.Array:
        """int32 ``[max_batch]``: positions ``[0, reach)`` backed by a page in every group (a
        window group's released pages count: no query reads them)."""
        if self.windows is None:
            return paged_ops.pages_held(self.page_table) * self.page_size
        ends = [_windows.end_column(t) if w is not None else paged_ops.pages_held(t)
                for t, w in zip(self._tables(), self._group_windows())]
        return jnp.min(jnp.stack(ends), axis=0) * self.page_size

    def route(self, op: str, layer_idx: IntOrArray) -> tuple[jax.Array, Any, Any]:
        """``(page_table, slot, window)`` of layer ``layer_idx`` (an int, or an int32 scalar
        that may be traced): the table of its group, its slot in the pools, and its window (a
        Python int or None for an int index; for a traced one an int32 scalar, INT32_MAX for
        full attention). A Python int out of range is a ``ValueError``; a traced one gives a
        slot past the pools, which the kernels skip."""
        if self.windows is None:
            return self.page_table, layer_idx, None
        groups = _windows.groups(self.windows)
        if isinstance(layer_idx, (int, np.integer)) and not isinstance(layer_idx, bool):
            validate.layer_index(op, layer_idx, self.num_layers)
            return (self._tables()[groups.group_of[layer_idx]], groups.slot_of[layer_idx],
                    self.windows[layer_idx])
        i = validate.layer_index(op, layer_idx, self.num_layers)
        ok = (i >= 0) & (i < self.num_layers)
        i = jnp.clip(i, 0, self.num_layers - 1)
        tables = jnp.stack(self._tables())
        slot = jnp.where(ok, jnp.asarray(groups.slot_of, jnp.int32)[i], groups.slots)
        return (tables[jnp.asarray(groups.group_of, jnp.int32)[i]], slot,
                groups.layer_windows()[i])

    @property
    @per_shard(out=Combined("sum"))
    def num_free_pages(self) -> jax.Array:
        """int32 ``[]``: pages no sequence holds. Sharded over the batch: the shards' total,
        while a row takes pages of its own shard's pool only."""
        return jnp.sum(self.ref_counts == 0, dtype=jnp.int32)

    @property
    @per_shard(out=Combined("max"))
    def max_context_length(self) -> jax.Array:
        """int32 ``[]``: the longest sequence in the cache (max of ``lengths``)."""
        return jnp.max(self.lengths)

    @property
    @per_shard(out=Combined("max"))
    def max_prompt_length(self) -> jax.Array:
        """int32 ``[]``: the most tokens the last ``reserve`` made room for in one sequence."""
        return jnp.max(self.new_tokens)

    @property
    @per_shard(out=Combined("all"))
    def empty(self) -> jax.Array:
        """bool ``[]``: no sequence holds a token (the seed's empty_cache)."""
        return jnp.all(self.lengths == 0)

    @property
    def on_host(self) -> jax.Array:
        """bool ``[max_batch]``: rows swapped out to the host tier (all false without one)."""
        if self.host is None:
            return jnp.zeros((self.max_batch,), bool)
        return self.host.on_host

    @property
    def arriving(self) -> jax.Array:
        """bool ``[max_batch]``: rows an overlapped ``swap_in`` is bringing back (still
        ``on_host`` until ``settle_swaps``; all false without a host tier)."""
        if self.host is None:
            return jnp.zeros((self.max_batch,), bool)
        return self.host.arriving

    @property
    def num_free_host_pages(self) -> jax.Array:
        """int32 ``[]``: host pages no swapped row holds (0 without a host tier). Sharded over
        the batch: the shards' total, while a row moves to its own shard's host pages only."""
        if self.host is None:
            return jnp.zeros((), jnp.int32)
        return jnp.sum(self.host.ref_counts == 0, dtype=jnp.int32)

    def with_scales(self, k_scale=None, v_scale=None) -> "PagedKVCache":
        """A per-tensor cache with new scales; see ``LinearKVCache.with_scales``."""
        return quantization.with_scales(self, "PagedKVCache.with_scales", k_scale, v_scale)

    def cache_length(self, b: IntOrArray) -> jax.Array:
        """int32 ``[]``: tokens stored for sequence ``b`` (a Python int out of ``[0, max_batch)`` is
        a ``ValueError``; a traced one is reported through ``checkify``, and clamped)."""
        op = "PagedKVCache.cache_length"
        row = validate.index(op, "b", b, self.max_batch)
        check((row >= 0) & (row < self.max_batch), f"{op}: b out of range")
        # a masked sum, not lengths[row]: an index into rows split over an Explicit mesh axis
        # has no sharding of its own to take (a reduction of B ints, no cache data)
        rows = jnp.arange(self.max_batch) == jnp.clip(row, 0, self.max_batch - 1)
        return jnp.sum(jnp.where(rows, self.lengths, 0), dtype=jnp.int32)

    @property
    def block_tables(self) -> jax.Array:
        """The page table with unassigned entries pointing at page 0, for readers that load whole
        blocks of pages past a sequence's length and mask by length (JAX's Pallas
        ``paged_attention``): int32 ``[max_batch, max_pages_per_seq]``."""
        return jnp.maximum(self.page_table, 0)

    # Allocation.
    @per_shard(num_new_tokens=Role(ROWS), out=(None, Role(ROWS)))
    def reserve(self, num_new_tokens: jax.Array) -> tuple["PagedKVCache", jax.Array]:
        """Assigns the pages each sequence needs for its next ``num_new_tokens`` tokens.

        ``num_new_tokens``: int32 ``[max_batch]`` (0 for slots with nothing to add). Sequences are
        served in slot order while free pages last; a sequence whose pages do not fit in the pool
        is not served and is left as it was, and so is every later sequence that needs pages
        (first come, first served: small requests do not starve a large one). A sequence that
        asks for more than its own room (``max_pages_per_seq * page_size`` tokens) is not served
        either, but it takes nothing from the pool and holds back no one: it could never be
        served, and holding the queue behind it would stall every later sequence for good.
        Pages are taken lowest index first, so the result is deterministic. With a prefix
        index, never-cached free pages go first, then cached ones least recently used, which
        leave the index; with a host tier too, those spill to free host pages first and stay
        findable there (docs/host-tier.md). With ``windows``, each row first releases the pages
        of its window groups that no query from position ``lengths`` on can see, then takes
        the pages each group needs, every group's from the one pool.

        **Returns:** ``(cache, served)``, ``served`` bool ``[max_batch]``. A shortage is reported
        through ``checkify``; ``max_prompt_length`` then reads the served sequences' counts.
        """
        op = "PagedKVCache.reserve"
        validate.array(op, "num_new_tokens", num_new_tokens)
        validate.int32(op, "num_new_tokens", num_new_tokens)
        validate.shape(op, "num_new_tokens", num_new_tokens, (self.max_batch,), "[max_batch]")
        check(jnp.all(num_new_tokens >= 0), f"{op}: num_new_tokens < 0")
        n = jnp.maximum(num_new_tokens, 0)
        parked = self.on_host
        check(~parked | (n == 0),
              f"{op}: a row asking for pages is on the host ({host_tier.SWAP_IN_FIRST})")
        room = self.max_pages_per_seq * self.page_size - self.lengths
        fits = n <= room
        end = self.lengths + jnp.minimum(n, room)  # no int32 overflow
        want = end // self.page_size + (end % self.page_size != 0).astype(jnp.int32)
        eligible = fits & ~(parked & (n > 0))  # a row on the host asking nothing is served
        # Per group: release what its window no longer sees, then the columns [start, want).
        cols = jnp.arange(self.max_pages_per_seq, dtype=jnp.int32)[None, :]
        tables, starts, needs = [], [], []
        counts = self.ref_counts
        for table, window in zip(self._tables(), self._group_windows()):
            if window is None:
                start = paged_ops.pages_held(table)
            else:
                keep = _windows.first_kept_column(self.lengths, window, self.page_size)
                drop = (cols < keep[:, None]) & (table >= 0) & (table < self.num_pages)
                counts = counts.at[jnp.where(drop, table, self.num_pages)].add(-1, mode="drop")
                table = jnp.where(drop, NO_PAGE, table)
                start = jnp.maximum(_windows.end_column(table), keep)
            tables.append(table)
            starts.append(start)
            needs.append(jnp.where(eligible & ~parked, jnp.maximum(want - start, 0), 0)
                         .astype(jnp.int32))
        need = sum(needs[1:], needs[0])
        cache, ref_counts, served, first, free_ids = self._allocate(need, eligible, counts)
        check(
            jnp.all(fits), f"{op}: a sequence would pass max_pages_per_seq * page_size tokens"
        )
        check(jnp.all(served | ~fits), f"{op}: out of pages")
        # Row b's pages [first[b], first[b] + need[b]) of free_ids go to its groups in order,
        # group g's to its table entries [start, start + need_g).
        offset = first
        for g, (start, need_g) in enumerate(zip(starts, needs)):
            k = cols - start[:, None]
            new = served[:, None] & (k >= 0) & (k < need_g[:, None])
            pick = jnp.clip(offset[:, None] + k, 0, self.num_pages - 1)
            tables[g] = jnp.where(new, free_ids[pick], tables[g])
            offset = offset + need_g
        new_tokens = jnp.where(served, n, 0)
        cache = dataclasses.replace(cache, ref_counts=ref_counts, new_tokens=new_tokens,
                                    **self._with_tables(tables))
        return cache, served

    @per_shard(mask=Role(ROWS))
    def release(self, mask: jax.Array) -> "PagedKVCache":
        """Ends the sequences where ``mask`` (bool ``[max_batch]``) is set: their pages go back to
        the pool (a shared page when its last holder ends), their lengths become 0."""
        op = "PagedKVCache.release"
        validate.array(op, "mask", mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"{op}: mask must be bool, got {mask.dtype}")
        validate.shape(op, "mask", mask, (self.max_batch,), "[max_batch]")
        return self._release(mask)

    def _release(self, mask: jax.Array) -> "PagedKVCache":
        ref_counts, tables = self.ref_counts, []
        for table in self._tables():
            held = mask[:, None] & (table >= 0) & (table < self.num_pages)
            ref_counts = ref_counts.at[jnp.where(held, table, self.num_pages)].add(-1,
                                                                                  mode="drop")
            tables.append(jnp.where(mask[:, None], NO_PAGE, table))
        host = None if self.host is None else host_tier.released(self.host, mask)
        return dataclasses.replace(
            self,
            host=host,
            lengths=jnp.where(mask, 0, self.lengths),
            new_tokens=jnp.where(mask, 0, self.new_tokens),
            ref_counts=ref_counts,
            **self._with_tables(tables),
        )

    @per_shard(batch_mapping=Destinations("self"))
    def compact(self, batch_mapping: jax.Array) -> "PagedKVCache":
        """Moves sequences to new slots; page-table rows and lengths move, KV data does not.

        ``batch_mapping``: int32 ``[max_batch]``, the new slot of each sequence or -1 to end it
        (its pages are released). Any injective mapping works; slots no sequence moves into become
        empty. Two sequences sent to one slot is reported through ``checkify``; the higher old slot
        keeps it and the other is released, so no page leaks.
        """
        op = "PagedKVCache.compact"
        validate.array(op, "batch_mapping", batch_mapping)
        validate.int32(op, "batch_mapping", batch_mapping)
        validate.shape(op, "batch_mapping", batch_mapping, (self.max_batch,), "[max_batch]")
        ops.check_mapping_injective(op, batch_mapping, self.max_batch)
        rows = self.max_batch
        old = jnp.arange(rows, dtype=jnp.int32)
        moves = (batch_mapping >= 0) & (batch_mapping < rows)
        target = jnp.where(moves, batch_mapping, rows)
        source = jnp.full((rows,), -1, jnp.int32).at[target].max(old, mode="drop")
        kept = moves & (source[jnp.clip(target, 0, rows - 1)] == old)
        cache = self._release(~kept)
        src = jnp.clip(source, 0, rows - 1)
        filled = source >= 0
        host = cache.host
        if host is not None and self.host is not None:  # swapped rows move with the others
            host = dataclasses.replace(
                host, table=jnp.where(filled[:, None], self.host.table[src], NO_PAGE),
                incoming=jnp.where(filled[:, None], self.host.incoming[src], NO_PAGE))
        tables = [jnp.where(filled[:, None], t[src], NO_PAGE) for t in self._tables()]
        return dataclasses.replace(
            cache,
            host=host,
            lengths=jnp.where(filled, self.lengths[src], 0),
            new_tokens=jnp.where(filled, self.new_tokens[src], 0),
            **self._with_tables(tables),
        )

    @per_shard(src_slot=row_ids("self"), dst_slots=row_ids("self"), out=(None, Combined("any")),
               rule=same_shard("src_slot", "dst_slots", rows_of("self"),
                               "a destination on another batch shard than the source is not "
                               "forked (pages never cross shards)"))
    def fork(self, src_slot: IntOrArray, dst_slots: jax.Array) -> tuple["PagedKVCache", jax.Array]:
        """Starts sequences in ``dst_slots`` as copies of the one in ``src_slot``.

        They share the source's full pages (reference counts go up: a shared prompt is stored
        once) and each gets a private copy of its partially filled last page (copy-on-write, one
        ``copy_pages`` launch), so every sequence can append on its own. Pages the destinations
        held before are released.

        ``src_slot``: int or int32 scalar (may be traced); ``dst_slots``: int32 ``[n]``, distinct
        slots other than ``src_slot``. **Returns:** ``(cache, forked)``, ``forked`` bool ``[n]``:
        false where a destination is invalid or no page was left for its copy (``checkify``
        reports both); such a destination is left empty. A slot repeated in ``dst_slots`` is
        forked once: its first entry reads true, the repeats false (also reported), so the
        true entries count the new sequences.
        """
        op = "PagedKVCache.fork"
        src = validate.index(op, "src_slot", src_slot, self.max_batch)
        validate.array(op, "dst_slots", dst_slots)
        validate.int32(op, "dst_slots", dst_slots)
        validate.rank(op, "dst_slots", dst_slots, 1, "[n]")
        rows, size = self.max_batch, self.page_size
        src_ok = (src >= 0) & (src < rows)
        src_home = ~self.on_host[jnp.clip(src, 0, rows - 1)]
        check(src_home | ~src_ok | elsewhere(src),
              f"{op}: src_slot is on the host ({host_tier.SWAP_IN_FIRST}); nothing forked")
        ok = src_ok & src_home & (dst_slots >= 0) & (dst_slots < rows) & (dst_slots != src)
        dst_index = jnp.where(ok, dst_slots, rows)
        hits = jnp.zeros((rows + 1,), jnp.int32).at[dst_index].add(1)[:rows]
        here = ~elsewhere(src) & ~elsewhere(dst_slots)  # else another batch shard's pair
        check(
            jnp.all(ok | ~here) & jnp.all(hits <= 1),
            f"{op}: dst_slots must be distinct valid slots other than src_slot",
        )
        is_dst = hits > 0
        cache = self._release(is_dst)

        src = jnp.clip(src, 0, rows - 1)
        length = self.lengths[src]
        full = length // size
        partial = length % size != 0
        # A page a group for each destination (its partly filled last page: every group of a
        # windowed cache holds one).
        groups = len(self._tables())
        need = jnp.where(is_dst & partial, groups, 0).astype(jnp.int32)
        cache, ref_counts, served, first, free_ids = cache._allocate(need, is_dst)
        check(jnp.all(served | ~is_dst), f"{op}: out of pages")
        j = jnp.arange(self.max_pages_per_seq, dtype=jnp.int32)[None, :]
        tables, copy_src, copy_dst = [], [], []
        for g, (table, old) in enumerate(zip(cache._tables(), self._tables())):
            src_row = old[src]  # the source's own row is untouched by the release above
            pick = jnp.clip(first + g, 0, self.num_pages - 1)
            new_page = jnp.where(served & partial, free_ids[pick], NO_PAGE)
            row = jnp.where(j < full, src_row[None, :], NO_PAGE)
            row = jnp.where(j == full, new_page[:, None], row)
            tables.append(jnp.where(served[:, None], row, table))
            shared = jnp.where((j[0] < full) & (src_row >= 0), src_row, self.num_pages)
            ref_counts = ref_counts.at[shared].add(jnp.sum(served, dtype=jnp.int32),
                                                   mode="drop")
            last = src_row[jnp.clip(full, 0, self.max_pages_per_seq - 1)]
            copy_src.append(jnp.where(new_page >= 0, last, NO_PAGE))
            copy_dst.append(new_page)
        cache = dataclasses.replace(
            cache._copied(op, jnp.concatenate(copy_src), jnp.concatenate(copy_dst)),
            lengths=jnp.where(served, length, cache.lengths),
            ref_counts=ref_counts,
            **self._with_tables(tables),
        )
        slot = jnp.clip(dst_slots, 0, rows - 1)
        i = jnp.arange(dst_slots.shape[0])
        # A repeat: an earlier entry names the same slot.
        repeat = jnp.any((dst_slots[None, :] == dst_slots[:, None]) & (i[None, :] < i[:, None]), 1)
        forked = ok & served[slot] & ~repeat
        return cache, forked

    @per_shard(src_pages=Ids(_pages_of, NO_PAGE), dst_pages=Ids(_pages_of, NO_PAGE),
               rule=same_shard("src_pages", "dst_pages", _pages_of,
                               "a pair of pages on two batch shards is skipped (pages never "
                               "cross shards)"))
    def copy_pages(self, src_pages: jax.Array, dst_pages: jax.Array) -> "PagedKVCache":
        """Copies physical pages ``src_pages[i]`` -> ``dst_pages[i]`` (every layer, K and V, one
        launch); see ``jaxkv.paged_ops.copy_pages``. The page table is not changed. With a host
        tier, a pair naming a page an overlapped swap still moves is skipped (``checkify``)."""
        op = "PagedKVCache.copy_pages"
        if self.host is not None:
            paged_ops.check_pairs(op, src_pages, dst_pages)
            src_pages, dst_pages = host_tier.outside_swaps(op, self.host, src_pages, dst_pages)
        return self._copied(op, src_pages, dst_pages)

    def _copied(self, op, src_pages, dst_pages) -> "PagedKVCache":
        """Pages copied with their per-token scales (pools of one-value tokens: a second launch
        of the same kernel). A page written leaves the prefix index, with the pages indexed
        below it."""
        k_pages, v_pages = paged_ops.copy_pairs(
            op, self.k_pages, self.v_pages, src_pages, dst_pages, self.layout)
        fields = {}
        if self.scaling == "per_token_head":
            ks, vs = paged_ops.copy_pairs(op, self.k_scales, self.v_scales, src_pages, dst_pages,
                                          self.layout, rank=4)
            fields = dict(k_scales=ks, v_scales=vs)
        if self.prefix_cache is not None:
            copied = paged_ops.copied_pairs(src_pages, dst_pages, self.num_pages)
            written = page_index.mask_of(self.prefix_cache, dst_pages, copied)
            fields["prefix_cache"] = page_index.unindex(self.prefix_cache, written,
                                                        self.max_pages_per_seq)
        return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages, **fields)

    def _allocate(self, need: jax.Array, eligible: jax.Array, ref_counts=None):
        """``allocate`` over this cache's free pages (of ``ref_counts``, default the cache's):
        with a prefix index, pages never indexed first, then indexed ones least recently used,
        which leave the index (their descendants with them, on either tier); with a host tier
        too, the cached pages to be evicted spill to free host pages first, and stay findable.
        Returns ``(cache, ref_counts, served, first, free_ids)``: ``allocate``'s results and
        the cache with its index (and host pages) brought up to date."""
        counts = self.ref_counts if ref_counts is None else ref_counts
        if self.prefix_cache is None:
            return (self, *allocate(counts, need, eligible))
        cache = self
        order = page_index.eviction_order(page_index.part(self.prefix_cache, 0, self.num_pages),
                                          counts == 0)  # found once: the spill takes its pages
        if self.host is not None:
            cache = host_tier.spill_evicted(self, counts, need, eligible, order)
        assert cache.prefix_cache is not None  # the spill moves entries, it keeps the index
        counts, served, first, free_ids, index = allocate_indexed(
            counts, need, eligible, cache.prefix_cache, 0, self.max_pages_per_seq, order)
        return dataclasses.replace(cache, prefix_cache=index), counts, served, first, free_ids

    # The host tier.
    @per_shard(rows=Role(ROWS), out=(None, Role(ROWS)))
    def swap_out(self, rows: jax.Array, max_pages: int | None = None, *, overlap: bool = False):
        """Moves the pages of each selected row (all layers, K, V and per-token scales) to the
        host tier and frees them on the device; the row keeps its length and is ``on_host`` until
        ``swap_in``. Its leading pages that another row also holds (a forked or matched prefix)
        stay on the device, held by the row: moving them would free nothing.

        ``rows``: bool ``[max_batch]``, like ``release``'s mask. ``max_pages``: the most pages
        this call moves (static: the size of its one transfer; default every page that could
        move, the smaller pool's size: then only the host pool's room limits the call). Rows are
        taken in slot order while their pages fit in both ``max_pages`` and the free host pages;
        the first that does not fit stops the rest (first come, first served, as ``reserve``).

        **Returns:** ``(cache, swapped)``, ``swapped`` bool ``[max_batch]``. A selected row that
        is already on the host or holds no pages of its own is left as it was and reported
        through ``checkify``; one that did not fit reads false.

        ``overlap`` (static): the copy runs on a stream of its own, beside the work queued after
        it (on a GPU; on CPU it is done when the call returns), and the pages moved stay held
        until ``settle_swaps``, which frees them.
        """
        op = "PagedKVCache.swap_out"
        return host_tier.swap_out(op, self, *self._swap_args(op, rows, max_pages, overlap))

    @per_shard(rows=Role(ROWS), out=(None, Role(ROWS)))
    def swap_in(self, rows: jax.Array, max_pages: int | None = None, *, overlap: bool = False):
        """Brings each selected row back from the host tier: reserves device pages (as
        ``reserve`` does, evicting cached prefix pages if need be), copies its pages in and frees
        its host pages.

        ``rows``, ``max_pages``: as for ``swap_out``. **Returns:** ``(cache, served)``, ``served``
        bool ``[max_batch]``: false where the device pool lacked the row's pages (or
        ``max_pages`` was used up): nothing changes for such a row. A selected row that is not on
        the host, or is already coming back, is reported through ``checkify``.

        ``overlap`` (static): the copy runs beside the work queued after it (as for
        ``swap_out``); a row served stays ``on_host`` (and ``arriving``) until
        ``settle_swaps`` puts it back on its new pages.
        """
        op = "PagedKVCache.swap_in"
        return host_tier.swap_in(op, self, *self._swap_args(op, rows, max_pages, overlap))

    @per_shard()
    def settle_swaps(self) -> "PagedKVCache":
        """Completes the swaps started with ``overlap=True``: waits for their copies (the work
        after it in the same stream waits; the host is not blocked), frees the device pages
        swapped out and puts the rows swapped in back on their pages. Call it before reading
        the host pool, and one step after an overlapped swap: the decode in between runs beside
        the copies. A no-op when nothing is in flight. Until it, every call that takes the
        cache must donate it and the cache must not be dropped (XLA does not know the copy is
        still running: it would copy, or free, the pools under it)."""
        if self.host is None:
            raise ValueError("PagedKVCache.settle_swaps: the cache has no host tier "
                             "(PagedKVCache.create(..., host_pages=N))")
        return host_tier.settle(self)

    @per_shard(out=(None, Combined("sum")))
    def spill_prefix(self, max_pages: int | None = None, count: IntOrArray | None = None):
        """Moves cached pages that no row holds (those ``reserve`` would evict next, least
        recently used first) to free host pages, at most ``max_pages`` (static: the size of the
        one transfer; default every page that could move, the smaller pool's size) and at most
        ``count`` (an int or int32 scalar, traced: one compiled spill of any count). They stay
        findable: ``match_prefix`` brings them back. The device pages become never-cached free
        pages, which ``reserve`` takes first (its own evictions spill too, while the host has
        room; spilling ahead keeps the copy off the step that needs the pages). Host pages
        holding rows (``swap_out``) or cached pages are not overwritten; ``swap_out`` evicts
        cached host pages least recently used when it needs them. Sharded over the batch, each
        shard moves up to ``max_pages`` and ``count`` of its own pages.

        **Returns:** ``(cache, spilled)``, ``spilled`` int32 ``[]``: pages moved (sharded: the
        shards' total).
        """
        op = "PagedKVCache.spill_prefix"
        if self.host is None or self.prefix_cache is None:
            raise ValueError(f"{op}: the cache needs a prefix index and a host tier "
                             "(PagedKVCache.create(..., prefix_cache=True, host_pages=N))")
        size = self._transfer_size(op, "max_pages", max_pages, lo=1)
        if count is not None:
            count = validate.int_scalar(op, "count", count)
            check(count >= 0, f"{op}: count must be >= 0 (none moves)")
        return host_tier.spill(self, size, count)

    def _swap_args(self, op: str, rows, max_pages, overlap) -> tuple[jax.Array, int, bool]:
        if self.host is None:
            raise ValueError(f"{op}: the cache has no host tier "
                             "(PagedKVCache.create(..., host_pages=N))")
        validate.array(op, "rows", rows)
        if rows.dtype != jnp.bool_:
            raise TypeError(f"{op}: rows must be bool, got {rows.dtype}")
        validate.shape(op, "rows", rows, (self.max_batch,), "[max_batch]")
        if not isinstance(overlap, bool):
            raise TypeError(f"{op}: overlap must be a bool, got {type(overlap).__name__}")
        return rows, self._transfer_size(op, "max_pages", max_pages, lo=1), overlap

    def _transfer_size(self, op: str, name: str, pages, lo: int) -> int:
        """A host transfer's static size in pages: ``pages``, or when None every page that could
        move (the smaller pool): a call's default is limited by the pools' room alone. The
        transfer skips its unused entries, so the bound costs index arithmetic, not copies."""
        if pages is None:
            assert self.host is not None  # every caller checked it
            return min(self.num_pages, self.host.num_pages)
        return validate.static_int(op, name, pages, lo=lo, hi=INT32_MAX)

    # The prefix cache.
    @per_shard(tokens=Role(ROWS), num_tokens=Role(ROWS), namespace=Role(ROWS),
               out=(None, Role(ROWS)))
    def match_prefix(self, tokens: jax.Array, num_tokens: jax.Array,
                     namespace: jax.Array | None = None, *, max_host_pages: int | None = None):
        """Starts empty rows on the cached pages of their prompts' longest indexed prefix.

        ``tokens`` int32 ``[max_batch, T]``: each row's prompt; ``num_tokens`` int32
        ``[max_batch]``: its length (0: the row does not ask). An asking row gets the longest
        run of indexed full pages whose token ids equal ``tokens[b, :k * page_size]``, page by
        page from the first, with ``k * page_size <= num_tokens[b] - 1`` (one token at least is
        left to compute: it gives the logits). The pages are mapped into the row's page table
        (shared: reference counts + 1) and ``lengths[b]`` becomes ``k * page_size``.

        ``namespace`` int32 ``[max_batch]`` (default: all 0, one namespace shared by every
        row): a row finds only pages inserted under its own namespace, so a tenant's time to
        first token tells nothing of another tenant's prompts (docs/prefix-caching.md).

        **Returns:** ``(cache, matched)``, ``matched`` int32 ``[max_batch]``: tokens each row
        starts with. An asking row that is not empty, a count outside ``[0, min(T, capacity)]``,
        a negative id among a row's tokens or a negative namespace is reported through
        ``checkify``; such a row matches nothing and changes nothing.

        >>> cache = PagedKVCache.create(num_layers=1, num_pages=8, page_size=2, num_kv_heads=1,
        ...                             head_dim=8, max_batch=2, max_pages_per_seq=4,
        ...                             dtype=jnp.float32, prefix_cache=True)
        >>> tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
        >>> n, tenant = jnp.array([8, 0], jnp.int32), jnp.array([1, 2], jnp.int32)
        >>> cache, _ = cache.reserve(n)
        >>> cache = cache.commit(n).insert_prefix(tokens, n, namespace=tenant)
        >>> ask = jnp.array([0, 8], jnp.int32)
        >>> cache.match_prefix(tokens, ask, namespace=tenant)[1]  # row 1: tenant 2
        Array([0, 0], dtype=int32)
        >>> cache.match_prefix(tokens, ask, namespace=jnp.array([0, 1], jnp.int32))[1]
        Array([0, 6], dtype=int32)

        With a host tier, pages the index holds on the host (``spill_prefix``) are found too and
        come back to device pages (taken as ``reserve`` takes them) in one transfer of at most
        ``max_host_pages`` pages (static; default the smaller pool's size), once each: every row
        that found a page shares it. Rows bring theirs in slot order while the transfer and the
        device pool have room; a row past them matches up to its first host page that does not
        come back.

        With ``windows``, a window group needs its cached pages only from the first one its
        window sees at the matched length, and the row gets only those (docs/hybrid-caches.md).
        """
        op = "PagedKVCache.match_prefix"
        index = self._index_args(op, tokens, num_tokens, namespace)
        rows, size = self.max_batch, self.page_size
        capacity = self.max_pages_per_seq * size
        asking = num_tokens > 0
        empty = (self.lengths == 0) & (self.pages_held == 0) & ~self.on_host
        check(empty | ~asking,
              f"{op}: a row asking for a prefix must be empty (release it; a row on the host too)")
        ok = page_index.row_ok(op, tokens, num_tokens, capacity, namespace) & empty & asking
        pages = page_index.token_pages(tokens, size, self.max_pages_per_seq)
        k = pages.shape[1]
        if k == 0:
            return self, jnp.zeros((rows,), jnp.int32)
        limit = jnp.where(ok, (num_tokens - 1) // size, 0)
        hashes = page_index.chain_hashes(pages, namespace)
        found, run = page_index.lookup(index, pages, hashes, limit, namespace)
        cache, cols = self, jnp.arange(k)[None, :]
        if index.entries > self.num_pages:  # pages found on the host come back to the device
            cache, found, run = host_tier.bring_back(
                cache, found, run, self._transfer_size(op, "max_host_pages", max_host_pages, lo=0))
        founds = [found]
        if self.windows is not None:  # each group's twins of the chain; a run all can start on
            anchors = jnp.where(cols < run[:, None], found, NO_PAGE)
            founds += page_index.twins(index, pages, hashes, anchors, namespace,
                                       range(1, len(self._tables())))
            run = _windows.matched_run(founds, run, self._group_windows(), size)
        matched = run * size
        # each group's pages from the first its window sees at the matched length
        mapped = [jnp.where((cols >= _windows.first_kept_column(matched, w, size)[:, None])
                            & (cols < run[:, None]), f, NO_PAGE)
                  for f, w in zip(founds, self._group_windows())]
        if index.entries == self.num_pages:  # (bring_back counted its own)
            every = jnp.concatenate(mapped, axis=1)
            cache = dataclasses.replace(cache, ref_counts=cache.ref_counts.at[
                jnp.where(every >= 0, every, self.num_pages)].add(1, mode="drop"))
        width = self.max_pages_per_seq  # a where over whole rows, not an update of a slice
        tables = [jnp.where(run[:, None] > 0,
                            jnp.pad(m, ((0, 0), (0, width - k)), constant_values=NO_PAGE), t)
                  for m, t in zip(mapped, self._tables())]
        now = cache.prefix_cache
        assert now is not None  # _index_args checked it; bring_back keeps it
        # the whole anchor chain is used (a window group's match stands on it), not only mapped
        used = jnp.concatenate([jnp.where(cols < run[:, None], found, NO_PAGE), *mapped[1:]], 1)
        cache = dataclasses.replace(
            cache, lengths=jnp.where(run > 0, matched, self.lengths),
            prefix_cache=page_index.touch(now, used), **self._with_tables(tables))
        return cache, matched

    @per_shard(tokens=Role(ROWS), num_tokens=Role(ROWS), namespace=Role(ROWS))
    def insert_prefix(self, tokens: jax.Array, num_tokens: jax.Array,
                      namespace: jax.Array | None = None) -> "PagedKVCache":
        """Makes each row's full pages covering ``tokens[b, :num_tokens[b]]`` findable by
        ``match_prefix`` (``tokens``, ``num_tokens``, ``namespace`` as there; 0 tokens: the row
        is skipped) for rows of the same namespace only.

        Call it once the row's tokens are appended and committed: a count past ``lengths[b]``
        is reported through ``checkify`` and the row indexes nothing. Idempotent: a chain
        already indexed is not indexed twice, and rows adding the same new chain in one call
        index it once (under one namespace; equal tokens under two namespaces are two chains of
        two sets of pages). A row holding pages of another namespace's chain (forked from a row
        of another tenant) does not index them. Bad rows are reported as for ``match_prefix``
        and index nothing. With ``windows``, each group's pages the row still holds are indexed
        (a window group's released pages are not: insert after each prefill chunk).
        """
        op = "PagedKVCache.insert_prefix"
        index = self._index_args(op, tokens, num_tokens, namespace)
        size = self.page_size
        capacity = self.max_pages_per_seq * size
        ok = page_index.row_ok(op, tokens, num_tokens, capacity, namespace)
        committed = num_tokens <= self.lengths
        check(committed,
              f"{op}: num_tokens past a row's length (append and commit the tokens first)")
        pages = page_index.token_pages(tokens, size, self.max_pages_per_seq)
        if pages.shape[1] == 0:
            return self
        full = jnp.where(ok & committed, num_tokens // size, 0)
        held = (paged_ops.pages_held(self.page_table) if self.windows is None
                else _windows.end_column(self.page_table))
        full = jnp.minimum(jnp.minimum(full, held), pages.shape[1])
        index = page_index.insert(index, self.page_table, pages, full, self.max_pages_per_seq,
                                  namespace)
        if self.windows is not None:  # every other group's pages, as twins of the chain
            # looked up again: the chain as inserted (a row whose borrowed chain was taken out
            # again must not hang twins under pages no longer indexed)
            hashes = page_index.chain_hashes(pages, namespace)
            found, run = page_index.lookup(index, pages, hashes, full, namespace)
            anchors = jnp.where(jnp.arange(pages.shape[1])[None, :] < run[:, None], found,
                                NO_PAGE)
            index = page_index.insert_twins(index, self._tables()[1:], pages, hashes, anchors,
                                            namespace)
        return dataclasses.replace(self, prefix_cache=index)

    def _index_args(self, op: str, tokens, num_tokens, namespace) -> page_index.PageIndex:
        """The trace-time checks of ``match_prefix`` / ``insert_prefix``; the index."""
        if self.prefix_cache is None:
            raise ValueError(f"{op}: the cache has no prefix index "
                             "(PagedKVCache.create(..., prefix_cache=True))")
        named = [("tokens", tokens), ("num_tokens", num_tokens)]
        if namespace is not None:  # None: every row in namespace 0
            named.append(("namespace", namespace))
        for name, x in named:
            validate.array(op, name, x)
            validate.int32(op, name, x)
        validate.rank(op, "tokens", tokens, 2, "[max_batch, T]")
        if tokens.shape[0] != self.max_batch:
            raise ValueError(f"{op}: tokens must be [max_batch, T] = [{self.max_batch}, T], got "
                             f"{list(tokens.shape)}")
        validate.shape(op, "num_tokens", num_tokens, (self.max_batch,), "[max_batch]")
        if namespace is not None:
            validate.shape(op, "namespace", namespace, (self.max_batch,), "[max_batch]")
        return self.prefix_cache

    # Data.
    @per_shard(k=Role(KV), v=Role(KV), new_lengths=Role(ROWS))
    def append(self, layer_idx: IntOrArray, k: jax.Array, v: jax.Array, new_lengths=None):
        """Writes ``k``, ``v`` ``[max_batch, H, T, D]`` at positions ``lengths[b] ..`` of layer
        ``layer_idx`` (may be traced), through the page table, K and V in one launch.

        ``new_lengths``: int32 ``[max_batch]``: tokens of each row to write (ragged prefill; 0 for
        idle slots); None writes all ``T``. Positions without a reserved page are skipped and
        reported through ``checkify``. Lengths are unchanged (see ``commit``).
        """
        op = "PagedKVCache.append"
        for name, x in (("k", k), ("v", v)):
            validate.array(op, name, x)
            validate.rank(op, name, x, 4, "[max_batch, num_kv_heads, T, head_dim]")
        return self._appended(op, layer_idx, k, v, new_lengths)

    def _appended(self, op, layer_idx, k, v, new_lengths) -> "PagedKVCache":
        # A row on the host has no page past its shared prefix: the kernel writes nothing for it.
        writes = True if new_lengths is None else lifecycle.counts_arg(op, new_lengths,
                                                                        self.max_batch) > 0
        check(~(self.on_host & writes),
              f"{op}: a row is on the host ({host_tier.SWAP_IN_FIRST})")
        if getattr(k, "ndim", None) == 5 and self.windows is not None:  # every layer, a group
            groups = _windows.groups(self.windows)  # a launch at a time
            for name, x in (("k", k), ("v", v)):
                validate.shape(op, name, x, (self.num_layers, *x.shape[1:]),
                               "[num_layers, max_batch, num_kv_heads, T, head_dim]")
            cache = self
            for g, table in enumerate(self._tables()):
                layers = [i for i in range(self.num_layers) if groups.group_of[i] == g]
                layers.sort(key=lambda i: groups.slot_of[i])
                cache = cache._appended_to(op, table, 0, k[jnp.asarray(layers)],
                                           v[jnp.asarray(layers)], new_lengths,
                                           jnp.asarray(layers, jnp.int32))
            return cache
        if k.ndim == 5:
            return self._appended_to(op, self.page_table, 0, k, v, new_lengths)
        table, slot, _ = self.route(op, layer_idx)
        slot_layers = None
        if self.windows is not None and self.scaling == "per_tensor":
            layer = jnp.clip(jnp.asarray(layer_idx, jnp.int32), 0, self.num_layers - 1)
            slot_layers = jnp.broadcast_to(layer, (_windows.groups(self.windows).slots,))
        return self._appended_to(op, table, slot, k, v, new_lengths, slot_layers)

    def _appended_to(self, op, table, slot, k, v, new_lengths, layers=None) -> "PagedKVCache":
        """The append kernel's call on one page table (a layer group's) and pool slot.
        ``layers``: int32 ``[slots]``, the layer each pool slot holds in this call (a windowed
        cache's per-tensor scales are per layer, its pools per slot)."""
        scales = quantization.scales_of(self)
        per_layer = self.scaling == "per_tensor" and self.windows is not None
        if per_layer:  # the kernel reads the scale of the slot it writes
            scales = (self.k_scales[layers], self.v_scales[layers], False)
        k_pages, v_pages, k_scales, v_scales = paged_ops.append_tokens(
            op, self.k_pages, self.v_pages, table, self.lengths, slot, k, v, new_lengths,
            self.layout, scales)
        kept = self.scaling is not None and not per_layer  # per tensor: scales are not written
        scales = dict(k_scales=k_scales, v_scales=v_scales) if kept else {}
        return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages, **scales)

    @per_shard(k=Role(KV_LAYERS), v=Role(KV_LAYERS), new_lengths=Role(ROWS))
    def append_layers(self, k: jax.Array, v: jax.Array, new_lengths=None):
        """``append`` of every layer at once, one launch: ``k``, ``v`` ``[L, max_batch, H, T, D]``."""
        op = "PagedKVCache.append_layers"
        for name, x in (("k", k), ("v", v)):
            validate.array(op, name, x)
            validate.rank(op, name, x, 5, "[num_layers, max_batch, num_kv_heads, T, head_dim]")
        return self._appended(op, 0, k, v, new_lengths)

    @per_shard(num_new_tokens=Role(ROWS))
    def commit(self, num_new_tokens: IntOrArray) -> "PagedKVCache":
        """Advances the lengths by ``num_new_tokens`` (a Python int or int32 scalar for every row,
        or int32 ``[max_batch]``).

        Lengths stop at each sequence's reserved pages (the tokens ``append`` could write), and a
        negative count leaves the row as it was (both reported through ``checkify``). A row
        ``reserve`` did not serve still advances into the room left in its last page, so commit
        ``jnp.where(served, n, 0)`` to keep an unserved chunk out whole.
        """
        op = "PagedKVCache.commit"
        n = _lengths.increment_arg(op, "num_new_tokens", num_new_tokens, self.max_batch)
        capacity = self._reach()
        home = ~self.on_host  # a swapped row keeps its length, past the pages it holds
        check(home | (n <= 0), f"{op}: a row is on the host ({host_tier.SWAP_IN_FIRST})")
        check(home | (n >= 0), f"{op}: an increment is negative (a row on the host keeps its "
              "length)")  # grow reports the rows at home
        return dataclasses.replace(self, lengths=_lengths.grow(op, self.lengths, n, capacity,
                                                               rows=home))

    @per_shard(out=lambda args: (Role(KV), Role(KV)) if args["split"] else Role(LAYER))
    def gather(self, layer_idx: IntOrArray, max_len: int, *, split: bool = False, dtype=None):
        """Layer ``layer_idx``'s tokens in dense memory: ``[max_batch, 2, H, max_len, D]``, or with
        ``split`` a ``(k, v)`` pair of ``[max_batch, H, max_len, D]``. Positions at or past a
        sequence's length are zeros, and so are those a window layer has released.

        ``dtype``: the result's dtype. An 8-bit cache gives its values dequantized
        (``float32(q) * scale``), in float32 unless ``dtype`` names another float dtype; any
        other cache gives its own dtype, converted to ``dtype`` if given."""
        op = "PagedKVCache.gather"
        table, slot, _ = self.route(op, layer_idx)
        gathered = paged_ops.gather_tokens(
            op, self.k_pages, self.v_pages, table, self.lengths, slot, max_len,
            self.layout, split or self.scaling is not None)
        if self.scaling is None:
            if dtype is None:
                return gathered
            return jax.tree.map(lambda x: x.astype(quantization.float_dtype(op, dtype)), gathered)
        k, v = _dequantized(op, self, gathered, layer_idx, table, slot, max_len, dtype)
        return (k, v) if split else jnp.stack((k, v), axis=1)


def _dequantized(op: str, cache, gathered, layer_idx, table, slot, max_len: int, dtype):
    """The gathered ``(k, v)`` ``[B, H, max_len, D]`` of a paged 8-bit cache as values:
    ``float32(q) * scale`` in ``dtype`` (default float32). Per token and head, the scales are
    gathered by the same kernel from the scale pools seen as pools of one-value tokens."""
    dtype = quantization.float_dtype(op, jnp.float32 if dtype is None else dtype)
    k, v = gathered
    if cache.scaling == "per_token_head":
        ks, vs = paged_ops.gather_tokens(op, cache.k_scales[..., None], cache.v_scales[..., None],
                                         table, cache.lengths, slot, max_len, cache.layout, True)
        ks, vs = ks[..., 0], vs[..., 0]
    else:
        layer = jnp.clip(jnp.asarray(layer_idx, jnp.int32), 0, cache.num_layers - 1)
        ks, vs = cache.k_scales[layer], cache.v_scales[layer]
    return (quantization.dequantize(k, ks, dtype), quantization.dequantize(v, vs, dtype))
