"""Functional ops of the compaction family and the length ops.

Every op validates shapes, dtypes and static arguments at trace time, then makes one FFI call whose
outputs alias the cache inputs: donate the cache to the caller's ``jit`` and the op runs in place.
Data-dependent problems are reported through ``jax.experimental.checkify`` (``_checks.check``: free
unless the caller wraps the function in ``checkify.checkify``).
"""

from __future__ import annotations

from typing import Any, Sequence, Union, cast

import jax
import jax.numpy as jnp

from . import _ffi
from . import _lengths
from . import _validate as validate
from ._checks import check
from .layout import LAYER, ROWS
from .sharding import Destinations, Role, per_shard

Layers = Union[jax.Array, Sequence[jax.Array]]


def check_mapping_injective(op: str, batch_mapping: jax.Array, rows: int) -> None:
    """checkify reports when two survivors are sent to one row (the kernel keeps one of them)
    and for entries outside ``[-1, rows)``."""
    valid = (batch_mapping >= 0) & (batch_mapping < rows)
    hits = jnp.zeros((rows,), jnp.int32).at[jnp.where(valid, batch_mapping, rows)].add(1, mode="drop")
    check(
        jnp.all(hits <= 1), f"{op}: batch_mapping sends two surviving rows to the same new row"
    )
    # Documented as evictions, but a caller meaning one writes -1: anything else is a bug upstream.
    check(
        (batch_mapping >= -1) & (batch_mapping < rows),
        f"{op}: batch_mapping entries outside [-1, rows) (they count as evictions)",
    )


def _validate_mapping(op: str, batch_mapping, rows: int) -> None:
    validate.array(op, "batch_mapping", batch_mapping)
    validate.int32(op, "batch_mapping", batch_mapping)
    validate.rank(op, "batch_mapping", batch_mapping, 1, "[n_old]")
    if batch_mapping.shape[0] > rows:
        raise ValueError(
            f"{op}: batch_mapping has {batch_mapping.shape[0]} entries but the batch has {rows} rows"
        )
    if rows > validate.MAX_COMPACT_ROWS:
        raise ValueError(f"{op}: at most {validate.MAX_COMPACT_ROWS} rows, got {rows}")


def _check_one_launch(buffers, *, kv: bool, rows: int, op: str) -> None:
    """What the compaction handler takes in one launch (ffi/include/jaxkv/compact.h, layers.h),
    checked at trace time: past it the handler would fail after the buffers were donated."""
    if rows > validate.MAX_COMPACT_ROWS:
        raise ValueError(f"{op}: at most {validate.MAX_COMPACT_ROWS} rows, got {rows}")
    # A stack: [L, rows, 2, H, S, D], or the scales of one [L, rows, H, S] (layers.h).
    count = sum(b.shape[0] if kv and b.ndim in (4, 6) else 1 for b in buffers)
    if count > validate.MAX_LAYERS:
        raise ValueError(f"{op}: at most {validate.MAX_LAYERS} layers per launch, got {count}")
    for i, b in enumerate(buffers):
        if kv:
            h, s, d = (*b.shape[-2:], 1) if b.ndim in (3, 4) else b.shape[-3:]
            validate.kv_geometry(op, f"layer {i}", h, s, d * b.dtype.itemsize)
        elif rows and b.size // rows * b.dtype.itemsize > validate.INT32_MAX:
            raise ValueError(f"{op}: a row of x has {b.size // rows * b.dtype.itemsize} bytes, "
                             f"more than int32 holds (the kernel moves a row as one span)")


def compact_buffers(
    buffers: Sequence[jax.Array], lengths, batch_mapping, *, kv: bool, rows: int,
    op: str = "compact",
) -> tuple[Any, list[jax.Array]]:
    """The one FFI call behind every compaction (arguments already validated).

    ``buffers``: KV layers ``[rows, 2, H, S, D]`` or stacks ``[L, rows, 2, H, S, D]`` when ``kv``
    (and the scales of 8-bit ones, ``[(L,) rows, H, S]``), else plain ``[rows, ...]`` tensors moved
    whole. Returns (new lengths or None, new buffers).
    """
    _check_one_launch(buffers, kv=kv, rows=rows, op=op)
    n = len(buffers)
    has_lengths = lengths is not None
    lengths_in = lengths if has_lengths else jnp.zeros((0,), jnp.int32)
    results = (jax.ShapeDtypeStruct((rows if has_lengths else 0,), jnp.int32),) + tuple(
        jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers
    )
    out = _ffi.call(
        "jaxkv_compact",
        results,
        batch_mapping,
        lengths_in,
        *buffers,
        input_output_aliases={2 + i: 1 + i for i in range(n)},
        result_inputs={0: (0, 1)},  # the lengths come from the mapping and the lengths
        kv=kv,
        rows=rows,
    )
    return (out[0] if has_lengths else None), list(out[1:])


@per_shard(x=Role(ROWS), batch_mapping=Destinations("x"), out=Role(ROWS))
def compact_tensor_batch(x: jax.Array, batch_mapping: jax.Array, sharding=None) -> jax.Array:
    """Moves rows of ``x`` to their new batch positions (TensorRT Edge-LLM's compactTensorBatch).

    **Arguments:**
    - ``x``: ``[rows, ...]`` in a cache dtype (float32, bfloat16, float16, float8_e4m3fn,
      float8_e5m2, int8, uint8). Donate it to run in place.
    - ``batch_mapping``: int32 ``[n_old]``, ``n_old <= rows``; ``batch_mapping[i]`` is the new row of
      old row ``i``, or -1 to evict it. Entries outside ``[-1, rows)`` count as evictions.

    **Returns:** ``x'`` with ``x'[batch_mapping[i]] = x[i]`` for every surviving ``i``; rows that no
    survivor moves into keep their contents. Any injective mapping works in place (swaps, cycles,
    chains in either direction); two survivors sent to one row is reported through ``checkify``.

    With ``sharding`` (a ``jaxkv.CacheSharding``), ``x`` is split on its rows by the batch axis
    and every shard compacts its own rows (docs/sharding.md).

    >>> x = jnp.arange(6.0).reshape(3, 2)
    >>> compact_tensor_batch(x, jnp.array([-1, 0, 1], jnp.int32))
    Array([[2., 3.],
           [4., 5.],
           [4., 5.]], dtype=float32)
    """
    op = "compact_tensor_batch"
    validate.array(op, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have a leading rows axis, got shape {tuple(x.shape)}")
    validate.cache_dtype(op, "x", x)
    rows = x.shape[0]
    _validate_mapping(op, batch_mapping, rows)
    check_mapping_injective(op, batch_mapping, rows)
    _, (out,) = compact_buffers([x], None, batch_mapping, kv=False, rows=rows, op=op)
    return out


def validate_kv_layers(op: str, layers: Layers, max_batch: int | None = None) -> list[jax.Array]:
    """``layers`` as a list of ``[max_batch, 2, H, S, D]`` arrays, checked."""
    is_list = isinstance(layers, (list, tuple))
    items = list(layers) if isinstance(layers, (list, tuple)) else [cast(jax.Array, layers)]
    if not items:
        raise ValueError(f"{op}: layers is empty")
    if len(items) > validate.MAX_LAYERS:
        raise ValueError(f"{op}: at most {validate.MAX_LAYERS} layers per call, got {len(items)}")
    for i, layer in enumerate(items):
        name = f"layers[{i}]" if is_list else "layers"
        validate.array(op, name, layer)
        validate.rank(op, name, layer, 5, "[max_batch, 2, num_kv_heads, max_seq_len, head_dim]")
        validate.cache_dtype(op, name, layer)
        if layer.shape[1] != 2:
            raise ValueError(f"{op}: {name} axis 1 must be 2 (K and V), got shape {layer.shape}")
        if max_batch is not None and layer.shape[0] != max_batch:
            raise ValueError(
                f"{op}: {name} has max_batch {layer.shape[0]} but lengths has {max_batch} entries"
            )
    return items


def validate_lengths(op: str, lengths, name: str = "lengths") -> int:
    validate.array(op, name, lengths)
    validate.int32(op, name, lengths)
    validate.rank(op, name, lengths, 1, "[max_batch]")
    return lengths.shape[0]


@per_shard(layers=Role(LAYER), lengths=Role(ROWS), batch_mapping=Destinations("lengths"),
           out=(Role(LAYER), Role(ROWS)))
def compact_kv_cache(layers: Layers, lengths: jax.Array, batch_mapping: jax.Array,
                     sharding=None):
    """Evicts finished sequences and compacts the survivors, every layer in one launch.

    (TensorRT Edge-LLM's compactKVCacheSingleLayer / compactKVCacheBatched, for any injective
    mapping: the seed only supports order-preserving ones.)

    **Arguments:**
    - ``layers``: one ``[max_batch, 2, H, S, D]`` array or a list/tuple of them; H, S, D and dtype
      may differ per layer. Donate them to run in place.
    - ``lengths``: int32 ``[max_batch]``, live tokens of each row.
    - ``batch_mapping``: int32 ``[n_old]``, ``n_old <= max_batch``: new row of old row ``i`` or -1.

    **Returns:** ``(layers', lengths')`` with the structure of ``layers``. For a survivor ``i``,
    tokens ``[0, lengths[i])`` of row ``i`` land in row ``batch_mapping[i]`` (tokens past a length
    are unspecified; rows no survivor moves into are not written); ``lengths'[batch_mapping[i]] =
    lengths[i]`` and every other slot gets 0. Only live tokens move.

    With ``sharding`` (a ``jaxkv.CacheSharding``), the layers are split as a KVCacheManager's and
    every batch shard compacts its own rows (docs/sharding.md).

    >>> cache = jnp.ones((4, 2, 1, 8, 16), jnp.bfloat16)
    >>> lengths = jnp.array([3, 5, 2, 0], jnp.int32)
    >>> _, new_lengths = compact_kv_cache(cache, lengths, jnp.array([-1, 0, 1, -1], jnp.int32))
    >>> new_lengths
    Array([5, 2, 0, 0], dtype=int32)
    """
    op = "compact_kv_cache"
    max_batch = validate_lengths(op, lengths)
    items = validate_kv_layers(op, layers, max_batch)
    _validate_mapping(op, batch_mapping, max_batch)
    check_mapping_injective(op, batch_mapping, max_batch)
    capacity = max(layer.shape[3] for layer in items)
    check(
        (lengths >= 0) & (lengths <= capacity),
        f"{op}: lengths outside [0, max_seq_len] (the kernel moves the clipped count)",
    )
    new_lengths, out = compact_buffers(
        items, lengths, batch_mapping, kv=True, rows=max_batch, op=op
    )
    if isinstance(layers, (list, tuple)):
        return type(layers)(out), new_lengths
    return out[0], new_lengths


def increment_lengths(lengths: jax.Array, increment) -> jax.Array:
    """``lengths + increment`` (TensorRT Edge-LLM's incrementLengthTensor, both overloads).

    ``increment`` is a Python int, an int32 scalar or an int32 ``[batch]`` array. It has no
    capacity to stop at (the caches' ``commit`` saturates); a sum that wraps int32 is reported
    through ``checkify``.

    This is a fused XLA op, not a kernel, by measurement (the ``increment_lengths`` section of
    docs/benchmarks.md): fused into the neighbouring length arithmetic it costs a decode step
    almost nothing, while a custom call in its place costs a launch of its own and breaks the
    fusion and XLA's command buffer around it.
    """
    op = "increment_lengths"
    batch = validate_lengths(op, lengths)
    increment = _lengths.increment_arg(op, "increment", increment, batch, "[batch]")
    total = lengths + increment
    # int32 wraps: the sum of two numbers of one sign has the other sign.
    check(
        ~((lengths >= 0) == (increment >= 0)) | ((total >= 0) == (lengths >= 0)),
        f"{op}: lengths + increment overflows int32 (it wraps)",
    )
    return total
