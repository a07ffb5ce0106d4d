"""The one place that computes new sequence lengths, for every cache kind.

Lengths live in ``[0, capacity]``. A commit adds an increment per row; done naively in int32,
``length + 2**31 - 1`` wraps negative and later appends silently skip the row. Here the increment
is clipped to ``[0, capacity - length]`` first, so the sum can never overflow, and a negative or
overflowing increment is reported through ``checkify`` and otherwise ignored: lengths never go
negative, never shrink through a commit and never pass their capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate as validate
from ._checks import check


def increment_arg(op: str, name: str, increment, rows: int, hint: str = "[max_batch]"
                  ) -> jax.Array:
    """A commit's increment as int32 ``[rows]``: a Python int or an int32 scalar (every row), or
    an int32 ``[rows]``.

    A Python int that does not fit int32 is refused now rather than wrapped by ``jnp.asarray``.
    """
    if isinstance(increment, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be an int or an int32 array, got bool")
    if isinstance(increment, (int, np.integer)):
        validate.static_int(op, name, increment, lo=-(2**31), hi=2**31 - 1)
        return jnp.full((rows,), int(increment), jnp.int32)
    validate.array(op, name, increment, "an int or an int32 array")
    validate.int32(op, name, increment)
    if increment.ndim == 0:  # a traced count for every row
        return jnp.broadcast_to(increment, (rows,))
    validate.shape(op, name, increment, (rows,), f"{hint} (or a scalar)")
    return increment


def grow(op: str, lengths: jax.Array, increment: jax.Array, capacity, rows=None) -> jax.Array:
    """``lengths + increment`` on ``rows`` (bool ``[B]``, None: every row), saturating at
    ``capacity`` (a static int or int32 ``[B]``), with a report for a negative increment or one
    that passes the capacity. Rows not selected keep their length whatever their increment."""
    capacity = jnp.asarray(capacity, jnp.int32)
    length = jnp.clip(lengths, 0, capacity)  # a length outside [0, capacity] is never trusted
    room = capacity - length  # in [0, capacity]: no overflow
    selected = jnp.ones(lengths.shape, bool) if rows is None else rows
    bad = selected & ((increment < 0) | (increment > room))
    check(~bad, f"{op}: an increment is negative or passes the capacity (lengths saturate)")
    step = jnp.where(selected, jnp.clip(increment, 0, room), 0)
    return jnp.where(selected, length + step, lengths)


def reset(op: str, reuse_lengths: jax.Array, max_batch: int, capacity: int) -> jax.Array:
    """Lengths ``[max_batch]`` of a reset: ``reuse_lengths`` (int32 ``[n]``) clipped to
    ``[0, capacity]`` (reported when outside), then zeros."""
    n = reuse_lengths.shape[0]
    check(
        (reuse_lengths >= 0) & (reuse_lengths <= capacity),
        f"{op}: reuse_lengths outside [0, max_seq_len]",
    )
    clipped = jnp.clip(reuse_lengths, 0, capacity)
    # A pad, not `zeros.at[:n].set`: under jax 0.11's shard_map that update, when it covers the
    # whole array, crashes XLA's CPU compiler (a segfault, not an error).
    return jnp.pad(clipped, (0, max_batch - n))
