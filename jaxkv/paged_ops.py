"""The paged cache's kernels: append, gather and copy_pages on a pair of page pools.

A pool stacks every layer's pages: ``"HND"`` ``[L, H, P, S, D]`` (``pool[l]`` is what JAX's Pallas
``paged_attention`` takes) or ``"NHD"`` ``[L, P, S, H, D]`` (vLLM / FlashInfer / MAX). The page
table ``[B, max_pages_per_seq]`` maps (row, logical page) to a physical page; entries outside
``[0, P)`` (``NO_PAGE`` for unassigned) are never dereferenced. ``PagedKVCache`` wraps these; they
are public for callers that keep their own page tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _ffi
from . import _validate as validate
from . import quantization
from ._checks import check
from ._lifecycle import append_counts, written
from .layout import KV, KV_LAYERS, LAYER, LAYOUTS, POOL, ROWS, pool_geometry
from .sharding import Ids, Role, per_shard, same_shard

NO_PAGE = -1  # page-table sentinel: no page assigned

# How the ops given ``sharding=`` split their arguments: as a PagedKVCache's leaves.
_pool = lambda args: Role(POOL.get(args["layout"], ()))  # noqa: E731
_pools = lambda args: (_pool(args), _pool(args))  # noqa: E731
_new_kv = lambda args: Role(KV_LAYERS if getattr(args["k"], "ndim", 4) == 5 else KV)  # noqa: E731
_gathered = lambda args: (Role(KV), Role(KV)) if args["split"] else Role(LAYER)  # noqa: E731
_pages = lambda args: pool_geometry(args["layout"], args["k_pages"].shape)["num_pages"]  # noqa: E731


def _check_pools(op: str, k_pages, v_pages, layout: str, rank: int = 5) -> dict:
    """The pools' geometry, checked; ``rank`` 4: pools of one value a token (scales)."""
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    hint = "[L, H, P, S, D]" if layout == "HND" else "[L, P, S, H, D]"
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        validate.array(op, name, x)
        validate.rank(op, name, x, rank, hint.replace(", D]", "]") if rank == 4 else hint)
        validate.cache_dtype(op, name, x)
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"{op}: k_pages {k_pages.dtype}{tuple(k_pages.shape)} and v_pages "
            f"{v_pages.dtype}{tuple(v_pages.shape)} differ"
        )
    validate.int32_dims(op, "k_pages", k_pages)
    g = pool_geometry(layout, k_pages.shape)
    validate.kv_geometry(op, "k_pages", g["num_kv_heads"], g["page_size"],
                         g["head_dim"] * k_pages.dtype.itemsize)
    return g


def _check_table(op: str, page_table, lengths) -> int:
    validate.array(op, "lengths", lengths)
    validate.int32(op, "lengths", lengths)
    validate.rank(op, "lengths", lengths, 1, "[max_batch]")
    validate.array(op, "page_table", page_table)
    validate.int32(op, "page_table", page_table)
    validate.rank(op, "page_table", page_table, 2, "[max_batch, max_pages_per_seq]")
    if page_table.shape[0] != lengths.shape[0]:
        raise ValueError(
            f"{op}: page_table has {page_table.shape[0]} rows, lengths {lengths.shape[0]}"
        )
    validate.int32_dims(op, "page_table", page_table)
    return lengths.shape[0]


def pages_held(page_table: jax.Array) -> jax.Array:
    """int32 ``[B]``: pages assigned to each row (they are a prefix of its page-table row)."""
    return jnp.sum(page_table != NO_PAGE, axis=1, dtype=jnp.int32)


def skipped_tokens(page_table, lengths, count, tokens: int, num_pages: int, page_size: int):
    """bool ``[B, T]``: token ``t < count[b]`` of row ``b`` that the append kernel skips, asking
    what it asks (ffi/include/jaxkv/paged.h: paged_offset, PagedView::page): is position
    ``lengths[b] + t`` in the row's table, and is its entry a page of this pool,
    ``0 <= entry < num_pages``? ``count``: int32 ``[B]`` already clipped to ``[0, T]``."""
    batch, max_pages = page_table.shape
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    wanted = t < count[:, None]
    if max_pages == 0 or page_size == 0:
        return wanted
    length = lengths[:, None]
    # (length + t) // page_size without forming length + t, which may pass int32.
    logical = length // page_size + (length % page_size + t) // page_size
    in_row = (length >= 0) & (logical < max_pages)
    entry = jnp.take_along_axis(page_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
    return wanted & ~(in_row & (entry >= 0) & (entry < num_pages))


@per_shard(k_pages=_pool, v_pages=_pool, page_table=Role(ROWS), lengths=Role(ROWS), k=_new_kv,
           v=_new_kv, new_lengths=Role(ROWS), out=_pools)
def paged_append(k_pages, v_pages, page_table, lengths, layer_idx, k, v, new_lengths=None,
                 *, layout: str = "HND", sharding=None):
    """Writes ``k``, ``v`` into the pools through the page table, K and V in one launch.

    **Arguments:**
    - ``k_pages``, ``v_pages``: the pools (see the module docstring). Donate them to run in place.
    - ``page_table``: int32 ``[B, max_pages_per_seq]``; ``lengths``: int32 ``[B]``.
    - ``layer_idx``: int or int32 scalar (may be traced): the layer ``k`` belongs to. Ignored when
      ``k`` has a leading layer axis.
    - ``k``, ``v``: ``[B, H, T, D]`` (one layer) or ``[L, B, H, T, D]`` (every layer, one launch).
    - ``new_lengths``: int32 ``[B]`` or None: row ``b`` writes its first ``min(T, new_lengths[b])``
      tokens (ragged prefill; 0 for rows with nothing to add); None writes all ``T``.
    - ``layout``: the pools' layout, ``"HND"`` ``[L, H, P, S, D]`` or ``"NHD"`` ``[L, P, S, H, D]``.

    **Returns:** ``(k_pages', v_pages')``: token ``t`` of row ``b`` is at position
    ``lengths[b] + t`` of that row, i.e. in page ``page_table[b, pos // S]``, slot ``pos % S``.
    Positions without an assigned page are skipped (reported through ``checkify``); no other
    byte of the pools is written.

    With ``sharding`` (a ``jaxkv.CacheSharding``): pools, table and tokens split as a
    PagedKVCache's; each shard's table holds page ids local to its share (docs/sharding.md).

    >>> pool = jnp.zeros((1, 2, 4, 4, 8), jnp.float32)     # HND: 1 layer, 2 heads, 4 pages of 4
    >>> table = jnp.array([[2, 0], [1, -1]], jnp.int32)    # row 0: pages 2, 0; row 1: page 1
    >>> k = jnp.ones((2, 2, 3, 8), jnp.float32)            # 3 tokens a row
    >>> kp, vp = paged_append(pool, pool, table, jnp.array([2, 0], jnp.int32), 0, k, k)
    >>> [int(kp[0, 0, page].any(-1).sum()) for page in range(4)]  # tokens written a page
    [1, 3, 2, 0]
    """
    out = append_tokens("paged_append", k_pages, v_pages, page_table, lengths, layer_idx, k, v,
                        new_lengths, layout)
    return out[:2]


def append_tokens(op, k_pages, v_pages, page_table, lengths, layer_idx, k, v, new_lengths,
                  layout: str, scales=None):
    """``paged_append``'s checks and its one FFI call; ``scales``: ``(k_scales, v_scales,
    per_token)`` of an 8-bit cache, whose append quantizes float K/V on the way in. Returns
    ``(k_pages, v_pages, k_scales, v_scales)`` (None, None unscaled)."""
    g = _check_pools(op, k_pages, v_pages, layout)
    batch = _check_table(op, page_table, lengths)
    all_layers = getattr(k, "ndim", None) == 5
    layer_idx = (jnp.zeros((), jnp.int32) if all_layers
                 else validate.layer_index(op, layer_idx, g["num_layers"]))
    lead = (g["num_layers"],) if all_layers else ()
    for name, x in (("k", k), ("v", v)):
        validate.array(op, name, x)
        validate.rank(op, name, x, len(lead) + 4, "[B, H, T, D] or [L, B, H, T, D]")
        if x.dtype != k_pages.dtype and scales is None:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}, the pools hold {k_pages.dtype}")
        expected = lead + (batch, g["num_kv_heads"], x.shape[-2], g["head_dim"])
        validate.shape(op, name, x, expected, "[(L,) B, H, T, D]")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"{op}: k and v differ: {k.dtype}{k.shape} vs {v.dtype}{v.shape}")
    if scales is not None:
        quantization.check_inputs(op, k, v)
    tokens = k.shape[-2]
    validate.int32_dims(op, "k", k)
    spans = (g["num_layers"] if all_layers else 1) * batch * g["num_kv_heads"]
    validate.one_launch(op, "layers * rows * heads", spans)
    count, counts_in = append_counts(op, new_lengths, batch, tokens)
    if scales is not None:
        quantization.check_finite(op, k, v, written(count, tokens))
    check(
        (layer_idx >= 0) & (layer_idx < g["num_layers"]), f"{op}: layer_idx out of range"
    )
    check(
        ~skipped_tokens(page_table, lengths, count, tokens, g["num_pages"], g["page_size"]),
        f"{op}: tokens past a row's reserved pages are dropped: no page of this pool holds them "
        "(reserve first)",
    )
    if scales is not None:
        k_scales, v_scales, per_token = scales
        return quantization.append_paged(k_pages, v_pages, k_scales, v_scales, per_token,
                                         page_table, lengths, k, v, counts_in, layer_idx,
                                         layout == "NHD")
    return *_ffi.call(
        "jaxkv_paged_append",
        (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),) * 2,
        k, v, page_table, lengths, counts_in, layer_idx, k_pages, v_pages,
        input_output_aliases={6: 0, 7: 1},
        nhd=layout == "NHD",
    ), None, None


@per_shard(k_pages=_pool, v_pages=_pool, page_table=Role(ROWS), lengths=Role(ROWS),
           out=_gathered)
def paged_gather(k_pages, v_pages, page_table, lengths, layer_idx, max_len: int, *,
                 layout: str = "HND", split: bool = False, sharding=None):
    """Copies one layer's tokens into dense memory.

    **Arguments:** the pools, ``page_table``, ``lengths``, ``layer_idx`` and ``sharding`` as in
    ``paged_append``; ``max_len``: a Python int, the tokens a row of the result holds;
    ``layout``: the pools' layout, ``"HND"`` ``[L, H, P, S, D]`` or ``"NHD"`` ``[L, P, S, H, D]``.

    **Returns:** ``[B, 2, H, max_len, D]`` (K then V), or with ``split`` a pair of
    ``[B, H, max_len, D]``. Position ``t`` of row ``b`` holds the cached token for
    ``t < lengths[b]`` and zeros after it (also where no page is assigned). The pools are read,
    not copied. With ``sharding``: split as in ``paged_append``; the result by batch and heads.
    """
    return gather_tokens("paged_gather", k_pages, v_pages, page_table, lengths, layer_idx,
                         max_len, layout, split)


def gather_tokens(op, k_pages, v_pages, page_table, lengths, layer_idx, max_len, layout, split):
    """``paged_gather``'s checks, under ``op``'s name, and its one FFI call."""
    g = _check_pools(op, k_pages, v_pages, layout)
    batch = _check_table(op, page_table, lengths)
    layer_idx = validate.layer_index(op, layer_idx, g["num_layers"])
    max_len = validate.static_int(op, "max_len", max_len, lo=1, hi=validate.INT32_MAX)
    validate.one_launch(op, "rows * heads", batch * g["num_kv_heads"])
    check(
        (layer_idx >= 0) & (layer_idx < g["num_layers"]), f"{op}: layer_idx out of range"
    )
    heads, head_dim, dtype = g["num_kv_heads"], g["head_dim"], k_pages.dtype
    results: tuple[jax.ShapeDtypeStruct, ...]
    if split:
        results = (jax.ShapeDtypeStruct((batch, heads, max_len, head_dim), dtype),) * 2
    else:
        results = (jax.ShapeDtypeStruct((batch, 2, heads, max_len, head_dim), dtype),)
    out = _ffi.call(
        "jaxkv_paged_gather", results, k_pages, v_pages, page_table, lengths, layer_idx,
        nhd=layout == "NHD",
    )
    return tuple(out) if split else out[0]


@per_shard(k_pages=_pool, v_pages=_pool, src_pages=Ids(_pages, NO_PAGE),
           dst_pages=Ids(_pages, NO_PAGE), out=_pools,
           rule=same_shard("src_pages", "dst_pages", _pages,
                           "a pair of pages on two batch shards is skipped (pages never cross "
                           "shards)"))
def copy_pages(k_pages, v_pages, src_pages, dst_pages, *, layout: str = "HND", sharding=None):
    """Copies physical page ``src_pages[i]`` to ``dst_pages[i]``, every layer, K and V, in one
    launch (vLLM's copy_blocks).

    ``src_pages``, ``dst_pages``: int32 ``[n]``. Pairs with an entry outside ``[0, num_pages)``
    are skipped. Destinations must be distinct and not among the sources (``checkify``); donate the
    pools to run in place. ``layout``: the pools' layout, as in ``paged_append``.

    With ``sharding``: pools split as a PagedKVCache's; page ids are global (shard ``s`` owns
    ``[s * P/k, (s + 1) * P/k)``) and a pair straddling two shards is skipped (``checkify``).
    """
    return copy_pairs("copy_pages", k_pages, v_pages, src_pages, dst_pages, layout)


def check_pairs(op, src_pages, dst_pages):
    """Trace-time checks of ``copy_pages``' page ids: int32 ``[n]`` each, the same length."""
    for name, x in (("src_pages", src_pages), ("dst_pages", dst_pages)):
        validate.array(op, name, x)
        validate.int32(op, name, x)
        validate.rank(op, name, x, 1, "[n]")
    if src_pages.shape != dst_pages.shape:
        raise ValueError(
            f"{op}: src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} differ"
        )


def copied_pairs(src_pages, dst_pages, num_pages: int) -> jax.Array:
    """bool ``[n]``: the pairs the kernel copies (both pages in ``[0, num_pages)``, not one page
    onto itself); it skips the others."""
    in_pool = lambda ids: (ids >= 0) & (ids < num_pages)  # noqa: E731
    return in_pool(src_pages) & in_pool(dst_pages) & (src_pages != dst_pages)


def copy_pairs(op, k_pages, v_pages, src_pages, dst_pages, layout, rank: int = 5):
    """``copy_pages``' checks, under ``op``'s name, and its one FFI call. ``rank`` 4: pools of
    one value a token (an 8-bit cache's scales), which the kernel takes as they are: a view with
    a unit head_dim would cost XLA a copy of each pool on the way in and out."""
    g = _check_pools(op, k_pages, v_pages, layout, rank)
    check_pairs(op, src_pages, dst_pages)
    runs = g["num_kv_heads"] if layout == "HND" else 1  # contiguous runs per page and layer
    validate.one_launch(op, "pairs * layers * runs", src_pages.shape[0] * g["num_layers"] * runs)
    pages = g["num_pages"]
    valid = copied_pairs(src_pages, dst_pages, pages)
    dst = jnp.where(valid, dst_pages, pages)
    hits = jnp.zeros((pages + 1,), jnp.int32).at[dst].add(1)[:pages]
    is_src = jnp.zeros((pages + 1,), jnp.bool_).at[jnp.where(valid, src_pages, pages)].set(True)
    check(
        jnp.all((hits <= 1) & ~((hits > 0) & is_src[:pages])),
        f"{op}: destination pages must be distinct and not among the sources",
    )
    if src_pages.shape[0] == 0:
        return k_pages, v_pages
    return tuple(_ffi.call(
        "jaxkv_paged_copy",
        (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),) * 2,
        src_pages, dst_pages, k_pages, v_pages,
        input_output_aliases={2: 0, 3: 1},
        nhd=layout == "NHD",
    ))
