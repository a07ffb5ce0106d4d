"""8-bit caches: which dtypes keep scales, the scales' leaves, and the FFI calls that quantize K/V
on their way into a cache (``jaxkv.reference.quantize`` defines the arithmetic, bit for bit).

A cache of ``float8_e4m3fn``, ``float8_e5m2`` or ``int8`` stores each value with a float32 scale:
``"per_token_head"`` (the default) keeps one per token and head, computed by the append from the
values it writes; ``"per_tensor"`` keeps one per layer for K and one for V, given at ``create`` or
by ``with_scales``. A value reads as ``float32(q) * scale``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _validate as validate
from ._checks import check

QUANTIZED_DTYPES = tuple(np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8))
"""The 8-bit cache dtypes: ``create(..., dtype=...)`` gives such a cache its scales."""
SCALINGS = ("per_token_head", "per_tensor")
"""``create``'s ``scaling`` of an 8-bit cache (``"per_token_head"`` the default)."""
INPUT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
"""The K/V dtypes an 8-bit cache quantizes on the way in (append, instantiate)."""
MAX_HEAD_DIM = 256  # a kernel's warp holds a vector, 8 values a lane
"""The largest ``head_dim`` of values quantized on the way in (a trace-time error past it)."""


def scaling_of(op: str, dtype, scaling) -> str | None:
    """The scaling of a new cache of ``dtype``: ``scaling`` checked, or the default."""
    if np.dtype(dtype) not in QUANTIZED_DTYPES:
        if scaling is not None:
            raise ValueError(f"{op}: scaling is for the 8-bit dtypes (float8_e4m3fn, float8_e5m2, "
                             f"int8); the cache's dtype is {np.dtype(dtype)}")
        return None
    scaling = "per_token_head" if scaling is None else scaling
    if scaling not in SCALINGS:
        raise ValueError(f"{op}: scaling must be one of {SCALINGS}, got {scaling!r}")
    return scaling


def tensor_scales(op: str, name: str, value, num_layers: int) -> jax.Array:
    """A per-tensor scale argument (a float, or float32 ``[]`` / ``[num_layers]``) as float32
    ``[num_layers]``; a Python float must be finite and > 0 (an array is reported through
    ``checkify`` when it is not)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a float or a float32 array, got bool")
    if isinstance(value, (int, float, np.integer, np.floating)):
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{op}: {name} must be finite and > 0, got {value}")
        return jnp.full((num_layers,), value, jnp.float32)
    validate.array(op, name, value, "a float or a float32 array")
    if value.dtype != jnp.float32:
        raise TypeError(f"{op}: {name} must be float32, got {value.dtype}")
    if value.shape not in ((), (num_layers,)):
        raise ValueError(f"{op}: {name} must have shape () or ({num_layers},), got {value.shape}")
    check(jnp.isfinite(value) & (value > 0), f"{op}: {name} must be finite and > 0")
    return jnp.broadcast_to(value, (num_layers,))


def check_head_dim(op: str, name: str, head_dim: int) -> None:
    """Values quantized on their way into an 8-bit cache: at most ``MAX_HEAD_DIM`` a vector."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: {name} has head_dim {head_dim}; values quantized on the way into "
                         f"an 8-bit cache take head_dim <= {MAX_HEAD_DIM} (a kernel's warp holds "
                         "a vector)")


def check_inputs(op: str, k, v) -> None:
    """K/V written into an 8-bit cache: float32, bfloat16 or float16 (at trace time)."""
    for name, x in (("k", k), ("v", v)):
        if np.dtype(x.dtype) not in INPUT_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}; an 8-bit cache takes float32, "
                            "bfloat16 or float16 values and quantizes them")
        check_head_dim(op, name, x.shape[-1])


def check_finite(op: str, k, v, stored: jax.Array) -> None:
    """Reports a non-finite value among the tokens written (``stored``: bool ``[B, T]``; padding
    and rows not written may hold anything). It only ever spoils its own token's bytes and
    scale."""
    written = stored[:, None, :, None]  # [B, H, T, D], and [L, ...] by broadcasting
    check(jnp.all(jnp.isfinite(k) | ~written) & jnp.all(jnp.isfinite(v) | ~written),
          f"{op}: k or v holds a non-finite value (that token's data and scale are undefined)")


def append_dense(buffer, k_scales, v_scales, per_token: bool, k, v, lengths, counts, active,
                 layer_idx, ring: bool = False):
    """The one FFI call of a quantizing append into a dense cache: (buffer, k_scales, v_scales).
    ``ring``: the cache is a ring of S slots, ``lengths`` its rows' positions in ``[0, S)``."""
    out = _ffi.call(
        "jaxkv_append_quantized",
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (buffer, k_scales, v_scales)),
        k, v, lengths, counts, jnp.asarray(active, jnp.int32), layer_idx, buffer, k_scales,
        v_scales,
        input_output_aliases={6: 0, 7: 1, 8: 2},
        per_token=per_token,
        ring=ring,
    )
    return tuple(out)


def append_paged(k_pages, v_pages, k_scales, v_scales, per_token: bool, page_table, lengths, k, v,
                 counts, layer_idx, nhd: bool):
    """The one FFI call of a quantizing paged append: (k_pages, v_pages, k_scales, v_scales)."""
    out = _ffi.call(
        "jaxkv_paged_append_quantized",
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_pages, v_pages, k_scales,
                                                                v_scales)),
        k, v, page_table, lengths, counts, layer_idx, k_pages, v_pages, k_scales, v_scales,
        input_output_aliases={6: 0, 7: 1, 8: 2, 9: 3},
        per_token=per_token,
        nhd=nhd,
    )
    return tuple(out)


def scale_leaves(op: str, scaling, num_layers: int, token_shape, k_scale, v_scale) -> dict:
    """The scale leaves of a new cache (``sharding.create``'s (shape, dtype, fill)): per token
    and head ``token_shape`` (a list of shapes: one leaf per layer), per tensor ``[num_layers]``."""
    given = k_scale is not None or v_scale is not None
    if scaling is None and given:
        raise ValueError(f"{op}: k_scale / v_scale are for an 8-bit cache (float8_e4m3fn, "
                         "float8_e5m2, int8) with scaling='per_tensor'")
    if scaling != "per_tensor" and given:
        raise ValueError(f"{op}: k_scale / v_scale are for scaling='per_tensor' (this cache: "
                         f"{scaling!r})")
    if scaling is None:
        return {}
    if scaling == "per_token_head":
        if isinstance(token_shape, list):
            return dict(k_scales=[(s, jnp.float32, 0) for s in token_shape],
                        v_scales=[(s, jnp.float32, 0) for s in token_shape])
        return dict(k_scales=(token_shape, jnp.float32, 0), v_scales=(token_shape, jnp.float32, 0))
    return dict(
        k_scales=((num_layers,), jnp.float32,
                  tensor_scales(op, "k_scale", 1.0 if k_scale is None else k_scale, num_layers)),
        v_scales=((num_layers,), jnp.float32,
                  tensor_scales(op, "v_scale", 1.0 if v_scale is None else v_scale, num_layers)))


def scales_of(cache):
    """``(k_scales, v_scales, per_token)`` of an 8-bit cache, None for any other."""
    if cache.scaling is None:
        return None
    return cache.k_scales, cache.v_scales, cache.scaling == "per_token_head"


def token_scales(cache) -> list:
    """The scale leaves that move with the tokens (per token and head), as a flat list."""
    if cache.scaling != "per_token_head":
        return []
    if isinstance(cache.k_scales, tuple):
        return [*cache.k_scales, *cache.v_scales]
    return [cache.k_scales, cache.v_scales]


def replaced_scales(cache, moved) -> dict:
    """The fields of a cache whose token scales are now ``moved`` (``token_scales``' order)."""
    if cache.scaling != "per_token_head":
        return {}
    if isinstance(cache.k_scales, tuple):
        n = len(cache.k_scales)
        return dict(k_scales=tuple(moved[:n]), v_scales=tuple(moved[n:]))
    return dict(k_scales=moved[0], v_scales=moved[1])


def with_scales(cache, op: str, k_scale, v_scale):
    """``cache`` (per tensor) with new scales; None keeps one."""
    if cache.scaling != "per_tensor":
        raise ValueError(f"{op}: only a cache with scaling='per_tensor' takes scales "
                         f"(this one: {cache.scaling})")
    n = cache.k_scales.shape[0]
    fields = {}
    if k_scale is not None:
        fields["k_scales"] = tensor_scales(op, "k_scale", k_scale, n)
    if v_scale is not None:
        fields["v_scales"] = tensor_scales(op, "v_scale", v_scale, n)
    return dataclasses.replace(cache, **fields)


def float_dtype(op: str, dtype) -> np.dtype:
    """``dtype`` checked as a dtype to read values in: float32, bfloat16 or float16."""
    try:
        got = np.dtype(dtype)
    except TypeError:  # not a dtype at all ("foo")
        got = None
    if got not in INPUT_DTYPES:
        shown = repr(dtype) if got is None else got
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {shown}")
    return got


def read_values(op: str, scaling, stored, scale, dtype) -> jax.Array:
    """A dense read's ``stored`` tokens as values in ``dtype`` (float32, bfloat16 or float16):
    an 8-bit cache's dequantized by ``scale`` (per token and head, or one), others converted."""
    dtype = float_dtype(op, dtype)
    return stored.astype(dtype) if scaling is None else dequantize(stored, scale, dtype)


def dequantize(q, scale, dtype):
    """``float32(q) * scale`` (a scale per vector over the last axis) in ``dtype``."""
    return (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[..., None]).astype(dtype)
