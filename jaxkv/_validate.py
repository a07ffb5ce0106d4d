"""Trace-time argument checks shared by every op: messages name the op and the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Dtypes the byte-moving kernels accept (they only look at the element width).
CACHE_DTYPES = tuple(
    np.dtype(d)
    for d in (
        jnp.float32,
        jnp.bfloat16,
        jnp.float16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.int8,
        jnp.uint8,
    )
)

MAX_LAYERS = 256  # layers one launch takes (ffi/include/jaxkv/layers.h: kMaxLayers)
MAX_COMPACT_ROWS = 8192  # rows one compaction schedules (ffi/include/jaxkv/compact.h)
# What LinearKVCache / KVCacheManager.create accept: every method (compact in one launch) must
# support the cache it makes, so a larger one is refused at create, not after donation.
CREATE_LIMITS = dict(num_layers=MAX_LAYERS, max_batch=MAX_COMPACT_ROWS)
INT32_MAX = 2**31 - 1  # the kernels keep sizes (tokens, heads, bytes of a token) in int32


def array(op: str, name: str, x, what: str = "an array") -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be {what}, got {type(x).__name__}")
    return x


def rank(op: str, name: str, x, expected: int, layout: str = "") -> None:
    if x.ndim != expected:
        hint = f" {layout}" if layout else ""
        raise ValueError(f"{op}: {name} must have rank {expected}{hint}, got shape {tuple(x.shape)}")


def int32(op: str, name: str, x) -> None:
    if x.dtype != jnp.int32:
        raise TypeError(f"{op}: {name} must be int32, got {x.dtype}")


def new_cache_dtype(op: str, dtype) -> np.dtype:
    """A cache dtype given to ``create``: one of CACHE_DTYPES, or a TypeError naming op."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in CACHE_DTYPES:
        names = ", ".join(c.name for c in CACHE_DTYPES)
        raise TypeError(f"{op}: unsupported dtype {d if d is not None else repr(dtype)}; "
                        f"supported: {names}")
    return d


def cache_dtype(op: str, name: str, x) -> None:
    if np.dtype(x.dtype) not in CACHE_DTYPES:
        names = ", ".join(d.name for d in CACHE_DTYPES)
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; supported: {names}")


def shape(op: str, name: str, x, expected: tuple, layout: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        hint = f" {layout}" if layout else ""
        raise ValueError(
            f"{op}: {name} must have shape {tuple(expected)}{hint}, got {tuple(x.shape)}"
        )


def static_int(op: str, name: str, value, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be a Python int, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{op}: {name} must be {bound}, got {value}")
    return value


def int_scalar(op: str, name: str, x) -> jax.Array:
    """A Python int or an int32 scalar array (traced is fine)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be an int or an int32 scalar, got bool")
    if isinstance(x, (int, np.integer)):
        return jnp.asarray(static_int(op, name, x, -INT32_MAX - 1, INT32_MAX), jnp.int32)
    array(op, name, x, "an int or an int32 scalar")
    int32(op, name, x)
    rank(op, name, x, 0)
    return x


def index(op: str, name: str, x, size: int) -> jax.Array:
    """An index into ``size`` entries: a Python int in ``[0, size)`` (checked now) or an int32
    scalar (traced is fine; the caller reports it through checkify when out of range)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        static_int(op, name, x, 0, size - 1)
    return int_scalar(op, name, x)


def layer_index(op: str, x, num_layers: int) -> jax.Array:
    """``index`` of a layer (argument ``layer_idx``)."""
    return index(op, "layer_idx", x, num_layers)


def kv_geometry(op: str, name: str, heads: int, capacity: int, token_bytes: int) -> None:
    """The kernels' int32 fields of a layer (ffi/include/jaxkv/layers.h: LayerSpan; paged.h:
    PagedView) hold its sizes: 2 * heads, the token capacity and the bytes of one token."""
    for what, v in (("2 * num_kv_heads", 2 * heads), ("max_seq_len", capacity),
                    ("head_dim * itemsize", token_bytes)):
        if v > INT32_MAX:
            raise ValueError(f"{op}: {name} has {what} = {v}, more than int32 holds")


def int32_dims(op: str, name: str, x) -> None:
    """Every dimension of ``x`` fits the kernels' int32 size fields."""
    if any(n > INT32_MAX for n in x.shape):
        raise ValueError(f"{op}: {name} has a dimension past int32: {tuple(x.shape)}")


def one_launch(op: str, what: str, count: int) -> None:
    """``count`` (blocks, spans) fits one CUDA launch's grid.x (the handler would fail after
    donation)."""
    if count > INT32_MAX:
        raise ValueError(f"{op}: {what} = {count}, more than one launch takes (2**31 - 1)")

