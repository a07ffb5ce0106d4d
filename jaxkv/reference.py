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


# --- prompt reuse ---


def _map_layers(fn, layers, *others):
    if isinstance(layers, (list, tuple)):
        return type(layers)(fn(*xs) for xs in zip(layers, *others))
    return fn(layers, *others)


def save_kv_cache(layers, batch_idx, seq_len: int):
    """Tokens [0, seq_len) of row batch_idx, [2, H, seq_len, D] per layer; zeros when batch_idx is
    outside [0, max_batch)."""

    def one(layer):
        rows = layer.shape[0]
        valid = (batch_idx >= 0) & (batch_idx < rows)
        row = layer[jnp.clip(batch_idx, 0, rows - 1), :, :, :seq_len]
        return jnp.where(valid, row, jnp.zeros_like(row))

    return _map_layers(one, layers)


def instantiate_kv_cache(layers, saved, batch_idx):
    """saved [2, H, T, D] into tokens [0, T) of every row in batch_idx ([] or [n]); rows outside
    [0, max_batch) are skipped."""

    def one(layer, s):
        rows = layer.shape[0]
        slots = jnp.atleast_1d(jnp.asarray(batch_idx, jnp.int32))
        slots = jnp.where((slots >= 0) & (slots < rows), slots, rows)  # dropped
        update = jnp.broadcast_to(s, (slots.shape[0],) + s.shape)
        return layer.at[slots, :, :, : s.shape[2]].set(update, mode="drop")

    return _map_layers(one, layers, saved)
