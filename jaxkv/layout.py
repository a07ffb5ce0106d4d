"""Where each cache leaf keeps its batch rows and its KV heads, and the paged pools' geometry.

A role tuple names, per dimension of a leaf, the mesh role that may split it: ``"batch"``,
``"heads"`` or None (never split). The cache kinds state their leaves' roles once
(``leaf_roles``); ``jaxkv.sharding`` turns roles into partition specs and runs a method per
shard, knowing leaves and roles, never cache kinds.
"""

from __future__ import annotations

REPLICATED = ()  # a scalar or a small array every shard holds whole
ROWS = ("batch",)  # [B] and [B, ...]: lengths, masks, mappings, page tables
LINEAR_BUFFER = (None, "batch", None, "heads", None, None)  # [L, B, 2, H, S, D]
LAYER = ("batch", None, "heads", None, None)  # [B, 2, H, S, D]
KV = ("batch", "heads", None, None)  # new tokens [B, H, T, D]
KV_LAYERS = (None, "batch", "heads", None, None)  # new tokens of every layer [L, B, H, T, D]
SAVED = (None, "heads", None, None)  # a saved prompt's layer [2, H, T, D]
QUERY = ("batch", "heads", None)  # decode queries [B, Hq, D]
QUERIES = ("batch", None, "heads", None)  # prefill queries [B, T, Hq, D]
HEAD_VALUES = ("heads",)  # a value per q head [Hq]: attention sinks
# A count per batch shard (the active batch size): int32 [batch_shards] split by batch, each
# shard's a scalar; an ordinary scalar when the batch is not split.
COUNT = ("count",)

LAYOUTS = ("HND", "NHD")
POOL = {  # pages split by batch (each batch shard owns a share), heads by heads
    "HND": (None, "heads", "batch", None, None),  # [L, H, P, S, D]
    "NHD": (None, "batch", None, "heads", None),  # [L, P, S, H, D]
}


PAGE_AXIS = {"HND": 2, "NHD": 1}  # the page dimension of a pool, and of its scale pool


def host_roles(layout: str, scaled: bool) -> dict:
    """Roles of a host tier's leaves (``jaxkv.host_tier``): host pages split by batch (each batch
    shard its own host pool and allocator), the heads inside a page by heads. A host page is
    ``[2, *page]`` (K and V), ``page`` a pool's dimensions without the page one; its scales the
    same without ``head_dim``."""
    axis = PAGE_AXIS[layout]
    page = POOL[layout][:axis] + POOL[layout][axis + 1:]
    return dict(pages=("batch", None) + page, ref_counts=ROWS, table=ROWS, outgoing=ROWS,
                incoming=ROWS,
                scales=("batch", None) + page[:3] if scaled else None)


def pool_shape(layout: str, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
               head_dim: int) -> tuple:
    """The shape of a pool of ``layout``."""
    if layout == "HND":
        return (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return (num_layers, num_pages, page_size, num_kv_heads, head_dim)


def pool_geometry(layout: str, shape) -> dict:
    """num_layers, num_kv_heads, num_pages, page_size, head_dim of a pool shape (of rank 4: a
    pool of one value a token, head_dim 1, as the per-token scales are)."""
    if len(shape) == 4:
        shape = (*shape, 1)
    if layout == "HND":
        layers, heads, pages, page_size, head_dim = shape
    else:
        layers, pages, page_size, heads, head_dim = shape
    return dict(num_layers=layers, num_kv_heads=heads, num_pages=pages, page_size=page_size,
                head_dim=head_dim)
