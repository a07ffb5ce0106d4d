"""Batch-mapping patterns for the compaction tests: every shape of move the kernels must handle."""

from __future__ import annotations

import numpy as np


def mapping_patterns(rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """name -> int32 [rows] injective mapping (-1: evicted)."""
    ident = np.arange(rows, dtype=np.int32)
    keep_even = np.full(rows, -1, np.int32)
    keep_even[::2] = np.arange((rows + 1) // 2)
    swaps = ident.copy()
    swaps[0 : rows - rows % 2 : 2], swaps[1::2] = ident[1::2], ident[0 : rows - rows % 2 : 2]
    chain_up = np.append(ident[1:], -1).astype(np.int32)  # i -> i+1, last row evicted
    chain_down = np.append(-1, ident[:-1]).astype(np.int32)  # i -> i-1, row 0 evicted
    rand_perm = rng.permutation(rows).astype(np.int32)
    rand_partial = rng.permutation(rows).astype(np.int32)
    rand_partial[rng.random(rows) < 0.4] = -1
    return {
        "nothing_evicted": ident,
        "all_evicted": np.full(rows, -1, np.int32),
        "order_preserving": keep_even,
        "swaps": swaps,
        "cycle": np.roll(ident, 1).astype(np.int32),  # i -> i+1 mod rows
        "chain_up": chain_up,  # each move overwrites a row still to be read
        "chain_down": chain_down,
        "random_permutation": rand_perm,
        "random_injective": rand_partial,
        "out_of_range_is_evicted": np.where(ident % 3 == 0, rows + 5, ident).astype(np.int32),
    }
