"""Pure-jnp implementations of every jaxkv op: the oracle for the tests and a readable spec.

They follow each op's contract on valid input; where the contract leaves bytes unspecified (tokens
past a length) they may differ from the kernels, and tests compare only what is specified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _targets(batch_mapping: jax.Array, rows: int) -> jax.Array:
    """Each old row's new row, or `rows` (dropped by mode="drop") when evicted or out of range."""
    valid = (batch_mapping >= 0) & (batch_mapping < rows)
    return jnp.where(valid, batch_mapping, rows)


def compact_tensor_batch(x: jax.Array, batch_mapping: jax.Array) -> jax.Array:
    n = batch_mapping.shape[0]
    return x.at[_targets(batch_mapping, x.shape[0])].set(x[:n], mode="drop")


def compact_lengths(lengths: jax.Array, batch_mapping: jax.Array) -> jax.Array:
    n = batch_mapping.shape[0]
    zeros = jnp.zeros_like(lengths)
    return zeros.at[_targets(batch_mapping, lengths.shape[0])].set(lengths[:n], mode="drop")


def compact_kv_cache(layers, lengths: jax.Array, batch_mapping: jax.Array):
    """Moves whole rows; only tokens below the new lengths are specified."""
    move = lambda layer: compact_tensor_batch(layer, batch_mapping)
    out = type(layers)(map(move, layers)) if isinstance(layers, (list, tuple)) else move(layers)
    return out, compact_lengths(lengths, batch_mapping)


def increment_lengths(lengths: jax.Array, increment) -> jax.Array:
    return lengths + increment


def append_layer(layer, k, v, lengths, active_batch_size, new_lengths=None):
    """Writes k, v [B, H, T, D] into layer [B, 2, H, S, D] at positions lengths[b] + t, for active
    rows and t < new_lengths[b]; positions past S are dropped."""
    batch, _, heads, capacity, _ = layer.shape
    tokens = k.shape[2]
    count = jnp.full((batch,), tokens, jnp.int32) if new_lengths is None else new_lengths
    t = jnp.arange(tokens)
    pos = lengths[:, None] + t[None, :]  # [B, T]
    keep = (t[None, :] < count[:, None]) & (jnp.arange(batch)[:, None] < active_batch_size)
    keep &= (pos >= 0) & (pos < capacity)
    pos = jnp.where(keep, pos, capacity)  # dropped
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], pos.shape)
    kv = jnp.stack([k, v], axis=1)  # [B, 2, H, T, D]
    kv = jnp.moveaxis(kv, 3, 1)  # [B, T, 2, H, D]
    return layer.at[b, :, :, pos].set(kv, mode="drop")
