"""The prefix cache of a paged cache: full pages found by their token ids, all on the device.

An indexed page records the token ids it holds, its parent (the indexed page holding the
``page_size`` tokens before it, or ``ROOT`` for a sequence's first page), its depth in that chain,
a 32-bit hash of every token from the sequence's start through this page, and when it was last
used. Finding a prompt's pages is one sort of the pages by hash, a binary search per (row, page)
and an exact comparison of the candidates' token ids and parents: the hash only narrows the
search, equality is always of the ids themselves, so two different prefixes never share a page.

Each indexed page also records its namespace (``match_prefix`` / ``insert_prefix``'s
``namespace``, one per row: a tenant's, so that no request can learn from its time to first token
whether another tenant sent a prefix). A page's chain belongs to one namespace: the namespace is
folded into the hash of the chain's first page (namespace 0 adds nothing: the hashes without
namespaces) and compared, like the token ids, on every page a lookup finds; equal tokens under
two namespaces are two chains and two sets of pages.

Invariants, kept by every function here:
- an indexed page's parent is indexed, one level up, in the same namespace (unindexing a page
  unindexes its descendants), so by induction a page found by walking from ``ROOT`` holds
  exactly the tokens of the chain that found it, and belongs to its namespace;
- an indexed page is never written: it is full, a sequence appends only past its length, and
  ``copy_pages`` into an indexed page unindexes it first.

Eviction (``eviction_order``): never-indexed free pages first, then indexed free pages least
recently used, deeper pages first on a tie. Matching and inserting touch a chain from its first
page, so a page is used at least as recently as any of its descendants.

With a host tier (``jaxkv.host_tier``) the index has an entry per device page and then one per
host page: entry ``num_pages + h`` is host page ``h``. A chain may run through both tiers (its
parents are entry ids), and ``move`` carries an entry from one tier to the other.

With sliding-window layers (``PagedKVCache.create(windows=...)``) each layer group has pages of
its own for the same tokens. Group 0's pages form the chains above (the anchor); a page of group
``g >= 1`` records its group and, as its parent, group 0's page of the same depth: its "twin"
of the anchor chain, so a page found through an exact anchor is exact too, and unindexing an
anchor page unindexes its twins. A window group's pages are found one by one under the anchor:
a match needs them only for the positions its window still sees (vLLM's rule).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check

ROOT = -1  # the parent of a sequence's first page
UNINDEXED = -1  # the depth of a page the index does not hold
CANDIDATES = 4  # pages with one hash examined per lookup: more only on 32-bit hash collisions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageIndex:
    """The index's arrays, one entry per physical page of the pool (split like the pages when
    the cache is sharded: each batch shard indexes its own pages)."""

    tokens: jax.Array  # int32 [num_pages, page_size]: the token ids an indexed page holds
    chain_hash: jax.Array  # uint32 [num_pages]: hash of the tokens from the chain's start
    parent: jax.Array  # int32 [num_pages]: the page before it in its chain, or ROOT
    depth: jax.Array  # int32 [num_pages]: its position in the chain (pages), or UNINDEXED
    used: jax.Array  # int32 [num_pages]: when last matched or inserted (a per-call clock)
    # int32 [num_pages]: the namespace an indexed page (and its whole chain) belongs to
    namespace: jax.Array
    # int32 [num_pages]: the layer group an indexed page belongs to (0: the anchor chains);
    # a page of group g >= 1 hangs under group 0's page of the same depth
    group: jax.Array

    @staticmethod
    def empty(num_pages: int, page_size: int, full) -> "PageIndex":
        """An empty index; ``full(shape, dtype, fill)`` makes each array (placed, if sharded)."""
        return PageIndex(tokens=full((num_pages, page_size), jnp.int32, -1),
                         chain_hash=full((num_pages,), jnp.uint32, 0),
                         parent=full((num_pages,), jnp.int32, ROOT),
                         depth=full((num_pages,), jnp.int32, UNINDEXED),
                         used=full((num_pages,), jnp.int32, 0),
                         namespace=full((num_pages,), jnp.int32, 0),
                         group=full((num_pages,), jnp.int32, 0))

    @property
    def indexed(self) -> jax.Array:
        return self.depth != UNINDEXED

    @property
    def entries(self) -> int:
        return self.depth.shape[0]


def part(index: PageIndex, lo: int, hi: int) -> PageIndex:
    """Entries ``[lo, hi)`` (one tier's), as an index of their own (parents keep their ids)."""
    return jax.tree.map(lambda x: x[lo:hi], index)


def mask_of(index: PageIndex, ids: jax.Array, where: jax.Array) -> jax.Array:
    """bool ``[entries]``: the entries ``ids[where]`` (any shape)."""
    n = index.entries
    ids = jnp.where(where & (ids >= 0) & (ids < n), ids, n)
    return jnp.zeros((n + 1,), bool).at[ids].set(True)[:n]


def move(index: PageIndex, src: jax.Array, dst: jax.Array) -> PageIndex:
    """Entries ``src[i]`` move to ``dst[i]`` (int32 ``[M]``; a pair with an id out of range
    moves nothing): the entry copied, its old place unindexed, and every parent that named the
    old id names the new one, so chains stay whole across the move."""
    n = index.entries
    ok = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
    s, d = jnp.where(ok, src, n), jnp.where(ok, dst, n)
    remap = jnp.arange(n + 1, dtype=jnp.int32).at[s].set(d, mode="drop")[:n]
    take = lambda x: x[jnp.clip(src, 0, n - 1)]  # noqa: E731
    moved = dataclasses.replace(
        index, depth=index.depth.at[s].set(UNINDEXED, mode="drop"),
        parent=jnp.where(index.parent >= 0, remap[jnp.maximum(index.parent, 0)], index.parent))
    return dataclasses.replace(
        moved,
        tokens=moved.tokens.at[d].set(take(index.tokens), mode="drop"),
        chain_hash=moved.chain_hash.at[d].set(take(index.chain_hash), mode="drop"),
        parent=moved.parent.at[d].set(take(moved.parent), mode="drop"),
        depth=moved.depth.at[d].set(take(index.depth), mode="drop"),
        used=moved.used.at[d].set(take(index.used), mode="drop"),
        namespace=moved.namespace.at[d].set(take(index.namespace), mode="drop"),
        group=moved.group.at[d].set(take(index.group), mode="drop"))


# --- hashing -----------------------------------------------------------------------------------
def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def chain_hashes(pages: jax.Array, namespace: jax.Array | None = None) -> jax.Array:
    """uint32 ``[B, K]``: hash of pages ``0 .. k`` of each row, from token ids ``[B, K, S]``,
    under each row's ``namespace`` (int32 ``[B]``; None: 0).

    A sum of mixed (token, position) words: order-sensitive, and a prefix sum over pages, so
    every (row, page) is hashed at once rather than one page after the other. The namespace is
    a mixed word added to the first page's sum, so to every page's hash: ``_mix`` is a bijection
    with ``_mix(0) = 0``, so namespace 0 hashes as before and equal tokens under two namespaces
    never hash equal."""
    _, k, s = pages.shape
    position = jnp.arange(k * s, dtype=jnp.uint32).reshape(k, s)
    words = _mix(pages.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + position + jnp.uint32(1))
    hashes = jnp.cumsum(_mix(jnp.sum(words, axis=-1, dtype=jnp.uint32)), axis=1,
                        dtype=jnp.uint32)
    if namespace is None:
        return hashes
    return hashes + _mix(namespace.astype(jnp.uint32) * jnp.uint32(0x85EBCA77))[:, None]


def group_hashes(hashes: jax.Array, group: int) -> jax.Array:
    """``chain_hashes`` of the same pages for layer ``group``'s pages: the group folded in as
    the namespace is (group 0 adds nothing)."""
    return hashes + _mix(jnp.uint32(group) * jnp.uint32(0x27D4EB2F)) if group else hashes


# --- lookup ------------------------------------------------------------------------------------
def lookup(index: PageIndex, pages: jax.Array, hashes: jax.Array, limit: jax.Array,
           namespace: jax.Array | None = None):
    """The indexed chain each row's tokens walk from ``ROOT`` in the row's namespace.

    ``pages`` int32 ``[B, K, S]``, ``hashes`` their ``chain_hashes`` (under ``namespace``),
    ``limit`` int32 ``[B]``: pages a row may match; ``namespace`` int32 ``[B]`` (None: 0).
    **Returns** ``(found, run)``: ``found`` int32 ``[B, K]``, the indexed page of the row's
    namespace holding (row, k)'s tokens whose chain hash agrees (or -1); ``run`` int32 ``[B]``,
    the pages from the first that ``found`` walks parent to child, below ``limit``."""
    b, k, _ = pages.shape
    found = _candidates(index, _by_hash(index), pages, hashes, namespace, 0)
    before = jnp.concatenate([jnp.full((b, 1), ROOT, jnp.int32), found[:, :-1]], axis=1)
    linked = ((found >= 0) & (index.parent[jnp.maximum(found, 0)] == before)
              & (jnp.arange(k)[None, :] < limit[:, None]))
    run = jnp.sum(jnp.cumprod(linked, axis=1), axis=1, dtype=jnp.int32)
    return found, run


def twins(index: PageIndex, pages: jax.Array, hashes: jax.Array, anchors: jax.Array,
          namespace: jax.Array | None, groups) -> list:
    """Per layer group ``g`` of ``groups``: int32 ``[B, K]``, group g's indexed page holding
    (row, k)'s tokens under the anchor page ``anchors[b, k]`` (group 0's page of that depth,
    found by ``lookup``; -1: none), or -1. ``hashes``: the pages' ``chain_hashes`` (group 0's).
    One sort of the index serves every group."""
    by_hash = _by_hash(index)
    out = []
    for g in groups:
        found = _candidates(index, by_hash, pages, group_hashes(hashes, g), namespace, g)
        out.append(jnp.where((found >= 0) & (anchors >= 0)
                             & (index.parent[jnp.maximum(found, 0)] == anchors), found, -1))
    return out


def _by_hash(index: PageIndex) -> tuple[jax.Array, jax.Array]:
    """``(order, sorted_key)``: the entries by chain hash, unindexed ones last."""
    key = jnp.where(index.indexed, index.chain_hash, jnp.uint32(0xFFFFFFFF))
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, key[order]


def _candidates(index: PageIndex, by_hash, pages: jax.Array, hashes: jax.Array,
                namespace: jax.Array | None, group: int) -> jax.Array:
    """int32 ``[B, K]``: an indexed page of ``group`` and the row's namespace at depth k holding
    (row, k)'s tokens with chain hash ``hashes[b, k]``, or -1 (its parent not yet compared).
    ``by_hash``: ``_by_hash(index)``."""
    num_pages = index.depth.shape[0]
    b, k, _ = pages.shape
    order, sorted_key = by_hash
    first = jnp.searchsorted(sorted_key, hashes.reshape(-1), side="left").reshape(b, k, 1)
    slot = first + jnp.arange(CANDIDATES, dtype=jnp.int32)
    in_range = slot < num_pages
    slot = jnp.minimum(slot, num_pages - 1)
    cand = order[slot]  # [B, K, C]
    level = jnp.arange(k, dtype=jnp.int32)[None, :, None]
    space = jnp.zeros((b,), jnp.int32) if namespace is None else namespace
    same = (in_range & (sorted_key[slot] == hashes[..., None]) & (index.depth[cand] == level)
            & (index.namespace[cand] == space[:, None, None]) & (index.group[cand] == group)
            & jnp.all(index.tokens[cand] == pages[:, :, None, :], axis=-1))
    return jnp.where(jnp.any(same, -1),
                     jnp.take_along_axis(cand, jnp.argmax(same, -1)[..., None], -1)[..., 0], -1)


def _clock(index: PageIndex) -> jax.Array:
    return jnp.max(index.used, initial=0) + 1


def touch(index: PageIndex, pages: jax.Array) -> PageIndex:
    """``pages`` (int32, any shape; out-of-range ids are skipped) used now."""
    num_pages = index.depth.shape[0]
    pages = jnp.where((pages >= 0) & (pages < num_pages), pages, num_pages)
    return dataclasses.replace(index, used=index.used.at[pages].set(_clock(index), mode="drop"))


# --- rows' token arguments ----------------------------------------------------------------------
def token_pages(tokens: jax.Array, page_size: int, max_pages: int):
    """``tokens`` [B, T] as whole pages ``[B, K, S]``, K = min(T // S, max_pages)."""
    b, t = tokens.shape
    k = min(t // page_size, max_pages)
    return tokens[:, :k * page_size].reshape(b, k, page_size)


def row_ok(op: str, tokens: jax.Array, num_tokens: jax.Array, capacity: int,
           namespace: jax.Array | None = None) -> jax.Array:
    """bool ``[B]``: ``num_tokens`` in ``[0, min(T, capacity)]``, no negative id among a
    row's first ``num_tokens`` tokens and, for a row asking (``num_tokens > 0``), a namespace
    ``>= 0`` (each failure reported through ``checkify``)."""
    t = tokens.shape[1]
    count_ok = (num_tokens >= 0) & (num_tokens <= t) & (num_tokens <= capacity)
    check(count_ok, f"{op}: num_tokens must be in [0, min(T, max_pages_per_seq * page_size)]")
    live = jnp.arange(t)[None, :] < num_tokens[:, None]
    ids_ok = ~jnp.any(live & (tokens < 0), axis=1)
    check(ids_ok, f"{op}: token ids must be >= 0")
    if namespace is None:
        return count_ok & ids_ok
    space_ok = (namespace >= 0) | (num_tokens == 0)
    check(space_ok, f"{op}: namespace must be >= 0 (the row matches and inserts nothing)")
    return count_ok & ids_ok & space_ok


# --- unindexing ---------------------------------------------------------------------------------
def unindex(index: PageIndex, pages: jax.Array, max_depth: int) -> PageIndex:
    """``pages`` (bool ``[num_pages]``) and every page descending from one of them (a twin of a
    layer group too) leave the index. Pointer jumping: ``ceil(log2(max_depth + 1))`` rounds,
    each a gather over the pages (a twin is one edge below its anchor)."""
    num_pages = index.depth.shape[0]
    ids = jnp.arange(num_pages, dtype=jnp.int32)
    up = jnp.where(index.indexed & (index.parent >= 0), index.parent, ids)  # roots: themselves
    gone = pages
    for _ in range(max(1, math.ceil(math.log2(max_depth + 1)))):
        gone = gone | gone[up]
        up = up[up]
    return dataclasses.replace(index, depth=jnp.where(gone, UNINDEXED, index.depth))


def eviction_order(index: PageIndex, free: jax.Array) -> jax.Array:
    """int32 ``[num_pages]``: page ids, free ones first in the order ``reserve`` takes them:
    never-indexed by id, then indexed least recently used, deeper first on a tie, then by id."""
    indexed = index.indexed & free
    used = jnp.where(indexed, index.used, 0)
    deeper = jnp.where(indexed, -index.depth, 0)
    return jnp.lexsort((deeper, used, indexed, ~free)).astype(jnp.int32)


# --- inserting ----------------------------------------------------------------------------------
def insert(index: PageIndex, page_table: jax.Array, pages: jax.Array, full: jax.Array,
           max_depth: int, namespace: jax.Array | None = None) -> PageIndex:
    """Indexes each row's first ``full[b]`` pages (``page_table[b, :full[b]]`` holding the token
    ids ``pages[b]``) under the row's ``namespace`` (int32 ``[B]``; None: 0), skipping the chain
    already indexed there.

    Rows that add the same new chain in one call (the same prompt computed twice before either
    was indexed, in one namespace) index it once: the first row's pages. A later row indexes only
    what extends past that chain, under the first row's page, once its whole prefix is compared
    equal. A row's pages already indexed under another namespace (a fork of another tenant's
    row) stay there: the row indexes none of them, nor any page below them."""
    num_pages = index.depth.shape[0]
    b, k, s = pages.shape
    space = jnp.zeros((b,), jnp.int32) if namespace is None else namespace
    hashes = chain_hashes(pages, namespace)
    found, run = lookup(index, pages, hashes, full, space)
    level = jnp.arange(k, dtype=jnp.int32)[None, :]
    own = page_table[:, :k]
    rows = jnp.arange(b, dtype=jnp.int32)
    pending = (level >= run[:, None]) & (level < full[:, None])
    # The first earlier row of the namespace with a pending page of the same chain hash at that
    # level.
    earlier = (pending[:, None, :] & pending[None, :, :]
               & (hashes[:, None, :] == hashes[None, :, :])
               & (space[:, None] == space[None, :])[:, :, None]
               & (rows[None, :, None] < rows[:, None, None]))  # [row, earlier row, level]
    dup = jnp.any(earlier, axis=1)
    canon = jnp.argmax(earlier, axis=1).astype(jnp.int32)  # [B, K]
    # A row's pending levels: duplicates of earlier rows' new pages, then its own new pages.
    first_own = jnp.min(jnp.where(pending & ~dup, level, k), axis=1)
    # Its own pages: contiguous from first_own, not already indexed, and never another row's
    # duplicate again (only a hash collision does that).
    fresh = (pending & ~dup & (own >= 0) & (own < num_pages)
             & ~index.indexed[jnp.clip(own, 0, num_pages - 1)])
    mine = jnp.cumprod(fresh | (level < first_own[:, None]), axis=1).astype(bool) & \
        (level >= first_own[:, None])
    # A physical page claimed twice (two rows naming one page with different ids): first wins.
    flat = jnp.where(mine, own, num_pages).reshape(-1)
    claim = jnp.full((num_pages + 1,), b * k, jnp.int32).at[flat].min(
        jnp.arange(b * k, dtype=jnp.int32))
    mine = mine & (claim[flat].reshape(b, k) == jnp.arange(b * k).reshape(b, k))
    # The row's chain: indexed pages found, then an earlier row's new pages it duplicates, then
    # its own new pages.
    borrowed = own[canon, jnp.broadcast_to(level, (b, k))]
    chain = jnp.where(level < run[:, None], found, jnp.where(dup, borrowed, own))
    parent = jnp.concatenate([jnp.full((b, 1), ROOT, jnp.int32), chain[:, :-1]], axis=1)
    target = jnp.where(mine, own, num_pages)
    index = dataclasses.replace(
        index,
        tokens=index.tokens.at[target].set(pages, mode="drop"),
        chain_hash=index.chain_hash.at[target].set(hashes, mode="drop"),
        parent=index.parent.at[target].set(parent, mode="drop"),
        depth=index.depth.at[target].set(jnp.broadcast_to(level, (b, k)), mode="drop"),
        namespace=index.namespace.at[target].set(jnp.broadcast_to(space[:, None], (b, k)),
                                                 mode="drop"),
        group=index.group.at[target].set(0, mode="drop"),
    )
    # Exactness, whatever the hashes did: each row's chain must walk from ROOT through pages
    # of its namespace holding its own token ids, level by level. A row whose chain does not (a
    # borrowed prefix that differs, a page claimed by another row, a page of another namespace)
    # takes its new pages out again, and with them every page below them, so no indexed page
    # ever hangs under a parent that is not its own.
    covered = (level < run[:, None]) | (pending & (level < first_own[:, None])) | mine
    end = jnp.max(jnp.where(covered, level + 1, 0), axis=1)
    c = jnp.clip(chain, 0, num_pages - 1)
    linked = ((chain >= 0) & (chain < num_pages) & (index.depth[c] == level)
              & (index.parent[c] == parent) & (index.namespace[c] == space[:, None])
              & jnp.all(index.tokens[c] == pages, axis=-1))
    broken = ~jnp.all(linked | (level >= end[:, None]), axis=1)
    rejected = jnp.zeros((num_pages + 1,), bool).at[
        jnp.where(mine & broken[:, None], own, num_pages)].set(True)[:num_pages]
    index = unindex(index, rejected, max_depth)
    used_chain = jnp.where((level < end[:, None]) & ~broken[:, None], chain, -1)
    return touch(index, used_chain)


def insert_twins(index: PageIndex, tables: list, pages: jax.Array, hashes: jax.Array,
                 anchors: jax.Array, namespace: jax.Array | None) -> PageIndex:
    """Indexes layer group ``g``'s pages ``tables[g - 1][b, k]`` (``g >= 1``, holding the tokens
    ``pages[b, k]``, whose ``chain_hashes`` are ``hashes``) as twins of the anchor pages
    ``anchors[b, k]`` (group 0's chain of the row, as ``lookup`` finds it once group 0 is
    inserted; -1 where there is none), skipping a twin already indexed and a page the row does
    not hold (released by its window). One twin per anchor and group: rows adding one in the
    same call (the same prompt twice) index the first row's page. The groups' twins never
    meet (a page is one group's), so one lookup before any insert serves them all."""
    num_pages = index.depth.shape[0]
    b, k, _ = pages.shape
    groups = range(1, len(tables) + 1)
    haves = twins(index, pages, hashes, anchors, namespace, groups)
    order = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    space = jnp.zeros((b,), jnp.int32) if namespace is None else namespace
    used = []
    for g, table, have in zip(groups, tables, haves):
        own = table[:, :k]
        want = ((anchors >= 0) & (have < 0) & (own >= 0) & (own < num_pages)
                & ~index.indexed[jnp.clip(own, 0, num_pages - 1)])
        # the first (row, depth) naming an anchor, and a physical page, wins it
        for ids in (anchors, own):
            flat = jnp.where(want, ids, num_pages)
            claim = jnp.full((num_pages + 1,), b * k, jnp.int32).at[flat].min(order)
            want = want & (claim[flat] == order)
        target = jnp.where(want, own, num_pages)
        index = dataclasses.replace(
            index,
            tokens=index.tokens.at[target].set(pages, mode="drop"),
            chain_hash=index.chain_hash.at[target].set(group_hashes(hashes, g), mode="drop"),
            parent=index.parent.at[target].set(anchors, mode="drop"),
            depth=index.depth.at[target].set(
                jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)), mode="drop"),
            namespace=index.namespace.at[target].set(jnp.broadcast_to(space[:, None], (b, k)),
                                                     mode="drop"),
            group=index.group.at[target].set(g, mode="drop"),
        )
        used.append(jnp.where(want, own, have))
    return touch(index, jnp.stack(used)) if used else index


# --- auditing (on the host) ---------------------------------------------------------------------
def cross_namespace_entries(index: PageIndex, shards: int = 1) -> int:
    """Indexed entries whose chain (the entry and its parents up to ``ROOT``) is not whole
    (indexed pages, one level apart) and of one namespace, counted on the host. 0 for any index
    the functions here keep (so no page is reachable from two namespaces): an audit of the
    invariant, independent of the code that keeps it, for a server's end of run and for
    tests. ``shards``: the batch shards of a sharded cache (each indexes its own pages, with
    parent ids of its own: its block of the entries is audited on its own)."""
    blocks = [np.asarray(x).reshape(shards, -1)
              for x in (index.depth, index.parent, index.namespace, index.group)]
    bad = 0
    for depth, parent, space, group in zip(*blocks):
        n = depth.shape[0]
        indexed = depth != UNINDEXED
        up = np.clip(parent, 0, n - 1)
        at_root = (parent == ROOT) & (group == 0)
        # a chain's edge is one level up in group 0; a twin's, group 0's page of its depth
        above = np.where(group == 0, depth - 1, depth)
        edge_ok = np.where(at_root, depth == 0,
                           (parent >= 0) & (parent < n) & indexed[up] & (group[up] == 0)
                           & (depth[up] == above) & (space[up] == space))
        broken = indexed & ~edge_ok
        # a broken edge anywhere above an entry breaks its chain: pointer jumping to the root
        jump = np.where(indexed & ~at_root & edge_ok, up, np.arange(n))
        for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
            broken = broken | broken[jump]
            jump = jump[jump]
        bad += int(np.sum(broken & indexed))
    return bad
