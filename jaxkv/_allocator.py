"""Taking free pages from a pool whose allocator is a reference count per page (0: free).

Shared by the device pool of a paged cache and its host pool (``jaxkv.host_tier``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import page_index


def served_rows(ref_counts: jax.Array, need: jax.Array, eligible: jax.Array) -> jax.Array:
    """The rows ``allocate`` serves: eligible ones in row order while the free pages last (a row
    needing none is served; once one does not fit, no later row needing pages is)."""
    want = jnp.where(eligible, need, 0)
    free = jnp.sum(ref_counts == 0, dtype=jnp.int32)
    return eligible & ((need == 0) | (jnp.cumsum(want) <= free))


def allocate(ref_counts: jax.Array, need: jax.Array, eligible: jax.Array, order=None):
    """Takes ``need[b]`` free pages for each eligible row, in row order, while they last: the
    lowest ids first, or in ``order`` (every page id, the free ones first).

    Returns ``(ref_counts', served, first, free_ids)``: row ``b`` (served) owns
    ``free_ids[first[b] : first[b] + need[b]]``, each now with count 1. A row needing no page is
    served when eligible; once one row does not fit, no later row needing pages is served, so no
    page is ever given twice.
    """
    num_pages = ref_counts.shape[0]
    free = ref_counts == 0
    if order is None:
        free_ids = jnp.nonzero(free, size=num_pages, fill_value=num_pages)[0].astype(jnp.int32)
    else:
        free_ids = jnp.where(free[order], order, num_pages)
    served = served_rows(ref_counts, need, eligible)
    take = jnp.where(served, need, 0)
    first = jnp.cumsum(take) - take
    total = jnp.sum(take)
    taken = jnp.where(jnp.arange(num_pages) < total, free_ids, num_pages)
    return ref_counts.at[taken].set(1, mode="drop"), served, first.astype(jnp.int32), free_ids


def allocate_indexed(ref_counts: jax.Array, need: jax.Array, eligible: jax.Array,
                     index: page_index.PageIndex, first_entry: int, max_depth: int, order=None):
    """``allocate`` over a pool whose pages are the prefix index's entries ``[first_entry,
    first_entry + pages)``: never-indexed free pages first, then indexed ones least recently
    used, which leave the index (their descendants with them, on either tier). ``order``: the
    pool's ``page_index.eviction_order``, if already found. Returns ``allocate``'s results and
    the new index."""
    last = first_entry + ref_counts.shape[0]
    if order is None:
        order = page_index.eviction_order(page_index.part(index, first_entry, last),
                                          ref_counts == 0)
    counts, served, first, free_ids = allocate(ref_counts, need, eligible, order)
    taken = jnp.pad((ref_counts == 0) & (counts > 0), (first_entry, index.entries - last))
    return counts, served, first, free_ids, page_index.unindex(index, taken, max_depth)
