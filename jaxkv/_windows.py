"""Sliding-window layers of a paged cache: layer groups, and which pages a window lets go.

A model whose layers mix windows (Gemma 2 / 3, gpt-oss, Mistral) keeps every layer's tokens in
one pool of pages and one allocator, as vLLM's hybrid KV cache manager does: the layers are split
into groups of the same size, each group of one window (or of full attention), and each group has
its own page table. A pool page id belongs to one group at a time; the pool's layer axis holds
one layer of a group (a "slot"), so the page holds that group's layers. A window group's rows
keep only the pages their window still sees: the memory a row holds for it is bounded by the
window, not the context.

Groups: for each distinct window (None for full attention) with ``n`` layers, ``n / s`` groups of
``s`` layers, ``s`` the greatest common divisor of the counts (Gemma 3's 40 windowed and 8 global
layers: 6 groups of 8; Gemma 2's 21 and 21: 2 groups of 21; Mistral: 1 group).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Groups:
    """The layer groups of a cache whose layers have ``windows`` (static)."""

    windows: tuple  # per layer: None (full attention) or an int >= 1
    slots: int  # layers a group holds: the pool's layer axis
    group_windows: tuple  # per group: its window, or None
    group_of: tuple  # per layer: its group
    slot_of: tuple  # per layer: its slot in the group

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def layer_windows(self) -> jax.Array:
        """int32 ``[num_layers]``: each layer's window, INT32_MAX for full attention."""
        full = np.iinfo(np.int32).max
        return jnp.asarray([full if w is None else w for w in self.windows], jnp.int32)


def check_windows(op: str, windows, num_layers: int) -> tuple | None:
    """``windows`` as a tuple of ``num_layers`` entries (None or an int >= 1), or None."""
    if windows is None:
        return None
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__"):
        raise TypeError(f"{op}: windows must be a sequence of num_layers entries (None or an int "
                        f">= 1), got {type(windows).__name__}")
    windows = tuple(windows)
    if len(windows) != num_layers:
        raise ValueError(f"{op}: windows has {len(windows)} entries, num_layers is {num_layers}")
    for i, w in enumerate(windows):
        if w is None:
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"{op}: windows[{i}] must be None or a Python int, got "
                            f"{type(w).__name__}")
        if not 1 <= w <= np.iinfo(np.int32).max:
            raise ValueError(f"{op}: windows[{i}] must be >= 1, got {w}")
    if all(w is None for w in windows):
        return None
    return tuple(None if w is None else int(w) for w in windows)


@functools.cache
def groups(windows: tuple) -> Groups:
    """The groups of ``windows`` (module docstring)."""
    # full attention's group first (the cache's page_table), then the windows as they come
    values = sorted(dict.fromkeys(windows), key=lambda w: w is not None)
    counts = [windows.count(v) for v in values]
    slots = math.gcd(*counts)
    group_windows: list = []
    base: dict = {}
    for v, n in zip(values, counts):
        base[v] = len(group_windows)
        group_windows += [v] * (n // slots)
    seen = {v: 0 for v in values}
    group_of, slot_of = [], []
    for w in windows:
        k = seen[w]
        seen[w] += 1
        group_of.append(base[w] + k // slots)
        slot_of.append(k % slots)
    return Groups(windows, slots, tuple(group_windows), tuple(group_of), tuple(slot_of))


def first_kept_column(lengths: jax.Array, window: int | None, page_size: int) -> jax.Array:
    """int32 ``[B]``: the first page-table column a row of a ``window`` group still needs when
    its next queries start at position ``lengths``: that query sees keys from
    ``lengths + 1 - window``, and every later query from further on; the pages wholly before it
    are seen by no query any more. 0 for full attention."""
    if window is None:
        return jnp.zeros_like(lengths)
    first_key = jnp.maximum(lengths - (window - 1), 0)  # no int32 overflow
    return first_key // page_size


def first_column(table: jax.Array) -> jax.Array:
    """int32 ``[B]``: the first column of each row that holds a page (the table's width: none)."""
    cols = jnp.arange(table.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(table >= 0, cols, table.shape[-1]), axis=-1)


def end_column(table: jax.Array) -> jax.Array:
    """int32 ``[B]``: one past the last column of each row that holds a page (0: none)."""
    cols = jnp.arange(1, table.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(table >= 0, cols, 0), axis=-1)


def matched_run(founds: list, run: jax.Array, group_windows: tuple, page_size: int) -> jax.Array:
    """int32 ``[B]``: the most pages ``k <= run`` a row can start on from a prefix cache, where
    ``founds[g]`` (int32 ``[B, K]``, -1: none) are the cached pages of group ``g`` (group 0's
    chain is whole below ``run``): each window group needs its pages from the first its window
    sees at position ``k * page_size`` (``first_kept_column``) to ``k``, a full-attention group
    all of them."""
    b, k = founds[0].shape
    ks = jnp.arange(k + 1, dtype=jnp.int32)
    ok = ks[None, :] <= run[:, None]
    for found, window in zip(founds[1:], group_windows[1:]):
        have = jnp.pad(jnp.cumsum(found >= 0, axis=1, dtype=jnp.int32), ((0, 0), (1, 0)))
        first = first_kept_column(ks * page_size, window, page_size)
        ok &= (have[:, ks] - have[:, first]) == ks - first
    return jnp.max(jnp.where(ok, ks[None, :], 0), axis=1)


def max_pages_held(window: int, tokens: int, page_size: int) -> int:
    """The most pages a row of a ``window`` group holds while ``tokens`` are appended at once:
    ``ceil((window + tokens) / page_size) + 1``."""
    return -(-(window + tokens) // page_size) + 1
