"""The lifecycle the dense caches share (``LinearKVCache``, ``KVCacheManager``): active rows,
reset, append, commit and compaction, as TensorRT Edge-LLM's KVCacheManager runs it.

A ring layer (a sliding-window layer of ``S`` slots, TensorRT-LLM's cyclic cache) keeps each
row's last ``S`` tokens, token ``p`` at slot ``p % S``; its rows' lengths are positions and count
on past ``S`` (to ``MAX_POSITIONS``). Its kernels take positions less a multiple of ``S``
(``ffi/include/jaxkv/kv_view.h``: the frame of two laps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _lengths
from . import _validate as validate
from . import ops
from . import quantization
from ._checks import check


MAX_POSITIONS = validate.INT32_MAX
"""Where the lengths of a cache whose every layer is a ring stop (positions are int32)."""
MAX_RING_SLOTS = 2**30 - 1
"""The most slots of a ring: its kernels' frame of two laps, ``2 * S`` positions, fits int32."""


def ring_arg(op: str, name: str, ring) -> bool:
    """A ``ring`` flag: a Python bool."""
    if not isinstance(ring, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool, got {type(ring).__name__}")
    return bool(ring)


def ring_slots(op: str, name: str, slots: int) -> None:
    """A ring's slots: at most ``MAX_RING_SLOTS``."""
    if slots > MAX_RING_SLOTS:
        raise ValueError(f"{op}: {name} is {slots}, more than a ring holds ({MAX_RING_SLOTS}: "
                         "its kernels address two laps of it in int32)")


def ring_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """Rows' positions in a ring's frame: less the largest multiple of ``slots`` not above them
    (a negative one as it is: the kernels write nothing there)."""
    return jnp.where(lengths >= 0, jnp.remainder(lengths, slots), lengths)


def all_empty(lengths: jax.Array, active_batch_size: jax.Array) -> jax.Array:
    """bool ``[]``: no active row holds a token."""
    active = jnp.arange(lengths.shape[0]) < active_batch_size
    return jnp.all(jnp.where(active, lengths, 0) == 0)


def active_batch_size_arg(op: str, n, max_batch: int) -> jax.Array:
    """A new active batch size: an int in [0, max_batch] or an int32 scalar (clipped, checkify)."""
    if isinstance(n, (int, np.integer)):
        validate.static_int(op, "n", n, 0, max_batch)
    n = validate.int_scalar(op, "n", n)
    check((n >= 0) & (n <= max_batch), f"{op}: n out of [0, max_batch]")
    return jnp.clip(n, 0, max_batch)


def reset_lengths(op: str, reuse_lengths, max_batch: int, max_seq_len: int):
    """(lengths [max_batch], active batch size) of a reset to ``n = len(reuse_lengths)`` rows."""
    validate.array(op, "reuse_lengths", reuse_lengths)
    validate.int32(op, "reuse_lengths", reuse_lengths)
    validate.rank(op, "reuse_lengths", reuse_lengths, 1, "[n]")
    n = reuse_lengths.shape[0]
    if n > max_batch:
        raise ValueError(f"{op}: reuse_lengths has {n} entries, max_batch is {max_batch}")
    lengths = _lengths.reset(op, reuse_lengths, max_batch, max_seq_len)
    return lengths, jnp.asarray(n, jnp.int32)


def counts_arg(op: str, new_lengths, batch: int) -> jax.Array:
    """An append's ``new_lengths``, checked at trace time: int32 ``[batch]``."""
    validate.array(op, "new_lengths", new_lengths)
    validate.int32(op, "new_lengths", new_lengths)
    validate.shape(op, "new_lengths", new_lengths, (batch,), "[max_batch]")
    return new_lengths


def append_counts(op: str, new_lengths, batch: int, tokens: int):
    """(tokens written per row, for checks; the kernel's counts argument: [0] means all T)."""
    if new_lengths is None:
        return jnp.full((batch,), tokens, jnp.int32), jnp.zeros((0,), jnp.int32)
    counts_arg(op, new_lengths, batch)
    check(jnp.all((new_lengths >= 0) & (new_lengths <= tokens)),
          f"{op}: new_lengths outside [0, T] (T = {tokens}, k's tokens): clipped")
    return jnp.clip(new_lengths, 0, tokens), new_lengths


def written(count: jax.Array, tokens: int) -> jax.Array:
    """bool ``[B, T]``: the tokens an append of ``count`` per row writes."""
    return jnp.arange(tokens)[None, :] < count[:, None]


def commit_lengths(op, lengths, active_batch_size, new_lengths, max_seq_len) -> jax.Array:
    """``lengths + new_lengths`` on active rows, saturating in ``[0, max_seq_len]``
    (``_lengths.grow``: a negative or overflowing increment is reported and ignored)."""
    increment = _lengths.increment_arg(op, "new_lengths", new_lengths, lengths.shape[0])
    active = jnp.arange(lengths.shape[0]) < active_batch_size
    return _lengths.grow(op, lengths, increment, max_seq_len, rows=active)


def compact(op: str, buffers: list, lengths: jax.Array, batch_mapping: jax.Array):
    """Every buffer's rows compacted in one launch: ``(lengths, buffers, survivors)``, the new
    active batch size being the number of survivors (expected on rows ``[0, survivors)``)."""
    rows = lengths.shape[0]
    validate.array(op, "batch_mapping", batch_mapping)
    validate.int32(op, "batch_mapping", batch_mapping)
    validate.shape(op, "batch_mapping", batch_mapping, (rows,), "[max_batch]")
    ops.check_mapping_injective(op, batch_mapping, rows)
    lengths, buffers = ops.compact_buffers(buffers, lengths, batch_mapping, kv=True, rows=rows,
                                           op=op)
    # the rows written: two survivors sent to one row (reported above) fill it once
    kept = jnp.where((batch_mapping >= 0) & (batch_mapping < rows), batch_mapping, rows)
    survivors = jnp.sum(jnp.zeros((rows + 1,), jnp.bool_).at[kept].set(True)[:rows],
                        dtype=jnp.int32)
    check(
        jnp.all(jnp.where(batch_mapping >= 0, batch_mapping < survivors, True)),
        f"{op}: survivors must land on rows [0, survivors)",
    )
    return lengths, buffers, survivors


def append(op, buffer, layer_idx, k, v, lengths, active_batch_size, new_lengths=None,
           scales=None, ring: bool = False):
    """Checks the arguments and makes the one FFI call of an append into ``[L, B, 2, H, S, D]``,
    or into one layer ``[B, 2, H, S, D]`` (``layer_idx`` 0; reshaping it would cost a copy).

    ``scales``: ``(k_scales, v_scales, per_token)`` of an 8-bit cache, whose append quantizes
    float K/V on the way in. ``ring``: the layers are rings of ``S`` slots (the module's
    docstring): nothing is dropped at ``S``; more than ``S`` tokens at once keep their last
    ``S`` (an error when ``new_lengths`` is None and ``T > S``, else reported). Returns
    ``(buffer, k_scales, v_scales)`` (None, None unscaled)."""
    stack = buffer.shape if buffer.ndim == 6 else (1, *buffer.shape)
    num_layers, batch, _, heads, capacity, head_dim = stack
    layer_idx = validate.layer_index(op, layer_idx, num_layers)
    for name, x in (("k", k), ("v", v)):
        validate.array(op, name, x)
        validate.rank(op, name, x, 4, "[max_batch, num_kv_heads, T, head_dim]")
        if x.dtype != buffer.dtype and scales is None:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}, the cache holds {buffer.dtype}")
        if (x.shape[0], x.shape[1], x.shape[3]) != (batch, heads, head_dim):
            raise ValueError(
                f"{op}: {name} must have shape ({batch}, {heads}, T, {head_dim}), got {x.shape}"
            )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"{op}: k and v differ: {k.dtype}{k.shape} vs {v.dtype}{v.shape}")
    if scales is not None:
        quantization.check_inputs(op, k, v)
    validate.int32_dims(op, "cache", buffer)
    validate.int32_dims(op, "k", k)
    validate.kv_geometry(op, "cache", heads, capacity, head_dim * buffer.dtype.itemsize)
    if ring and new_lengths is None and k.shape[2] > capacity:
        raise ValueError(f"{op}: k has {k.shape[2]} tokens, more than the ring's {capacity} slots "
                         "(a ring keeps a row's last max_seq_len tokens: append at most that many "
                         "at once)")
    count, new_lengths_in = append_counts(op, new_lengths, batch, k.shape[2])
    active = jnp.arange(batch) < active_batch_size
    if scales is not None:
        quantization.check_finite(op, k, v, active[:, None] & written(count, k.shape[2]))
    check(
        (layer_idx >= 0) & (layer_idx < num_layers), f"{op}: layer_idx out of range"
    )
    writing = active & (count > 0)
    if ring:
        check(jnp.all(jnp.where(writing, count <= capacity, True)),
              f"{op}: more than max_seq_len tokens appended at once into a ring: it keeps their "
              "last max_seq_len")
        fits = (lengths >= 0) & (count <= MAX_POSITIONS - jnp.maximum(lengths, 0))
        check(jnp.all(jnp.where(writing, fits, True)),
              f"{op}: positions past int32 (a ring's lengths stop at 2**31 - 1) or a negative "
              "length")
        lengths = ring_positions(lengths, capacity)
    else:
        # Without forming lengths + count, which may pass int32 (the kernel computes in 64 bits).
        fits = (lengths >= 0) & (lengths <= capacity) & (count <= capacity - lengths)
        check(jnp.all(jnp.where(writing, fits, True)), f"{op}: tokens past max_seq_len are dropped")
    if scales is not None:
        k_scales, v_scales, per_token = scales
        return quantization.append_dense(buffer, k_scales, v_scales, per_token, k, v, lengths,
                                         new_lengths_in, active_batch_size, layer_idx, ring)
    out = _ffi.call(
        "jaxkv_append",
        jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
        k, v, lengths, new_lengths_in, jnp.asarray(active_batch_size, jnp.int32), layer_idx,
        buffer,
        input_output_aliases={6: 0},
        ring=ring,
    )
    return out, None, None
