"""Prompt KV reuse: saving the first tokens of a cache row and instantiating them into other rows.

TensorRT Edge-LLM's saveKVCacheLayerIntoTensor / saveKVCacheBatched and
instantiateKVCacheLayerFromTensor / instantiateKVCacheBatched, for layers of any shape and dtype
in one launch. Both directions are one FFI target ("jaxkv_copy_prefix"): per (layer, slot, K/V
head) the copy is one contiguous run of ``T * head_dim`` elements on both sides. An unquantized
prefix instantiated into an 8-bit cache takes "jaxkv_quantize_prefix", which quantizes on the way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _validate as validate
from . import ops
from . import quantization
from ._checks import check, elsewhere
from .layout import LAYER, REPLICATED, SAVED
from .sharding import FromOwner, Role, per_shard, row_ids

Layers = Union[jax.Array, Sequence[jax.Array]]
IntOrArray = Union[int, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SavedKV:
    """A saved prompt: the first ``T`` tokens of one cache row, every layer.

    Made by ``LinearKVCache.save`` / ``KVCacheManager.save``; instantiate it into any cache whose
    layers have the same heads, head dims and dtypes (and ``max_seq_len >= T``), as often as
    wanted: it is an ordinary pytree (pass it through ``jit``, keep it across requests).
    """

    layers: tuple[jax.Array, ...]  # per layer [2, num_kv_heads_i, T, head_dim_i]
    length: jax.Array  # int32 []: tokens of the prompt, the reuse length to pass to reset (T)
    # From an 8-bit cache: per layer float32 [num_kv_heads_i, T] (per token and head) or []
    k_scales: Any = None  # a tuple of arrays, or None
    v_scales: Any = None
    scaling: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    num_layers = property(lambda self: len(self.layers), doc="Layers saved (static).")
    tokens = property(lambda self: self.layers[0].shape[2], doc="Tokens saved, T (static).")

    def leaf_roles(self) -> dict:
        """Where each leaf keeps its heads (``jaxkv.layout``): a saved prompt has no rows."""
        scales = ("heads", None) if self.scaling == "per_token_head" else REPLICATED
        return dict(layers=SAVED, length=REPLICATED, k_scales=scales, v_scales=scales)


def _described(op: str, buffers: Sequence[jax.Array], names: Sequence[str]):
    """(name, shape, dtype) of every layer the kernel sees, in order: a KV layer
    [max_batch, 2, H, S, D] or its scales [max_batch, H, S]; a stack (rank 6, scales rank 4)
    [L, ...] is L layers."""
    out = []
    for buf, name in zip(buffers, names):
        if buf.ndim in (4, 6):
            out += [(f"{name}[{l}]", buf.shape[1:], buf.dtype) for l in range(buf.shape[0])]
        else:
            out.append((name, buf.shape, buf.dtype))
    if len(out) > validate.MAX_LAYERS:
        raise ValueError(f"{op}: at most {validate.MAX_LAYERS} layers per call, got {len(out)}")
    return out


def _slots(op: str, batch_idx, rows: int, allow_many: bool) -> jax.Array:
    """``batch_idx`` as an int32 ``[]`` (or ``[n]``) array of cache rows.

    A Python int is checked now; array entries outside ``[0, rows)`` are reported through
    ``checkify`` and the kernel skips them (another batch shard's rows silently).
    """
    if isinstance(batch_idx, (int, np.integer)) and not isinstance(batch_idx, (bool, np.bool_)):
        validate.static_int(op, "batch_idx", batch_idx, 0, rows - 1)
        return jnp.asarray(batch_idx, jnp.int32)
    if isinstance(batch_idx, (bool, np.bool_)):
        raise TypeError(f"{op}: batch_idx must be an int or an int32 array, got bool")
    validate.array(op, "batch_idx", batch_idx,
                   "an int or an int32 array" if allow_many else "an int or an int32 scalar")
    validate.int32(op, "batch_idx", batch_idx)
    if batch_idx.ndim != 0 and not (allow_many and batch_idx.ndim == 1):
        layout = "[] or [n]" if allow_many else "[]"
        raise ValueError(
            f"{op}: batch_idx must have shape {layout}, got {tuple(batch_idx.shape)}"
        )
    in_range = (batch_idx >= 0) & (batch_idx < rows)
    check(
        jnp.all(in_range | elsewhere(batch_idx)),
        f"{op}: batch_idx outside [0, max_batch): nothing written there",
    )
    return batch_idx


def _described_rings(buffers, rings) -> list[bool]:
    """Per described layer (``_described``'s order): whether it is a ring (``rings``: one flag
    per buffer, None: none is)."""
    rings = [False] * len(buffers) if rings is None else list(rings)
    return [r for buf, r in zip(buffers, rings) for _ in range(buf.shape[0] if buf.ndim in (4, 6)
                                                              else 1)]


def _slots_axis(shape) -> int:
    """The token axis of a described layer: [B, 2, H, S, D] or its scales [B, H, S]."""
    return len(shape) - 2 if len(shape) == 5 else len(shape) - 1


def save_buffers(op, buffers, names, batch_idx, seq_len, rings=None) -> list[jax.Array]:
    """The one FFI call of a save; ``buffers``: rank-5 layers or rank-6 stacks, same max_batch.

    Returns one ``[2, H, T, D]`` array per described layer (a stack gives one per layer), ``T =
    seq_len``. ``rings`` (a flag per buffer): a ring layer of ``S`` slots (position ``p`` at slot
    ``p % S``) gives its last ``T = min(seq_len, S)`` tokens, positions ``[seq_len - T,
    seq_len)`` in order (the kernel reads its slots, then one static roll puts them in order).
    """
    rows = buffers[0].shape[-5]
    layers = _described(op, buffers, names)
    flags = _described_rings(buffers, rings)
    seq_len = validate.static_int(op, "seq_len", seq_len, lo=0)
    tokens = []
    for (name, shape, _), ring in zip(layers, flags):
        slots = shape[_slots_axis(shape)]
        if seq_len > slots and not ring:
            raise ValueError(f"{op}: seq_len {seq_len} exceeds max_seq_len {slots} of {name}")
        tokens.append(min(seq_len, slots))
    slots = _slots(op, batch_idx, rows, allow_many=False)
    results = [jax.ShapeDtypeStruct((2, shape[2], t, shape[4]) if len(shape) == 5
                                    else (shape[1], t), dt)
               for (_, shape, dt), t in zip(layers, tokens)]
    out = list(_ffi.call("jaxkv_copy_prefix", results, slots, *buffers, to_cache=False,
                         rows=rows))
    for i, ((_, shape, _), ring) in enumerate(zip(layers, flags)):
        size = shape[_slots_axis(shape)]
        if ring and seq_len > size:  # slot j holds position seq_len - S + (j - seq_len) % S
            out[i] = jnp.roll(out[i], -(seq_len % size), axis=_saved_axis(out[i]))
    return out


def _saved_axis(x) -> int:
    """The token axis of a saved layer: [2, H, T, D] or its scales [H, T]."""
    return x.ndim - 2 if x.ndim == 4 else x.ndim - 1


def _into_rings(op, layers, flags, saved, length):
    """``saved`` placed for the layers it goes into, and whether the writes may go ahead (bool
    ``[]``). Saved layer ``i`` holds positions ``[length - T_i, length)``: a ring of ``S`` slots
    takes the last ``S`` of them (``T_i >= S``: position ``p`` rolled to slot ``p % S``, a
    traced roll) or, ``T_i < S``, the whole prompt (``length == T_i``); any other layer the whole
    prompt. A saved layer that lacks positions its layer holds (a prompt saved from a smaller
    ring) is reported, and nothing is written."""
    placed, whole, complete = [], [], [jnp.asarray(True)]
    for (_, shape, _), ring, x in zip(layers, flags, saved):
        axis = _saved_axis(x)
        t, size = x.shape[axis], shape[_slots_axis(shape)]
        if ring and t >= size:
            x = jax.lax.slice_in_dim(x, t - size, t, axis=axis)
            x = jnp.roll(x, jnp.remainder(length, size), axis=axis)
            complete.append(length >= t)
        else:
            whole.append(length == t)
            complete.append(length <= t)
        placed.append(x)
    complete = jnp.all(jnp.stack(complete))
    check(complete, f"{op}: a saved layer lacks positions its cache layer holds (a prompt saved "
          "from a ring of S slots holds its last S tokens: it goes into a ring of S slots, not a "
          "larger ring or a layer of full attention): nothing is written")
    check(jnp.all(jnp.stack(whole)) if whole else True,
          f"{op}: saved.length differs from the tokens of a saved layer taken whole")
    return placed, complete


def instantiate_buffers(op, buffers, names, saved, saved_names, batch_idx, rings=None,
                        length=None) -> list[jax.Array]:
    """The one FFI call of an instantiate; ``saved``: one ``[2, H, T, D]`` per described layer.

    ``rings`` (a flag per buffer) and ``length`` (int32 ``[]``, the prompt's tokens: a saved
    layer holds positions ``[length - T, length)``): see ``_into_rings``; a ring takes a saved
    layer longer than its slots (its last ``S`` tokens). Returns the new ``buffers`` (aliased:
    donate them to run in place).
    """
    rows = buffers[0].shape[-5]
    layers = _described(op, buffers, names)
    flags = _described_rings(buffers, rings)
    if len(saved) != len(layers):
        raise ValueError(f"{op}: {len(saved)} saved tensors for {len(layers)} cache layers")
    for (name, shape, dt), x, sname, ring in zip(layers, saved, saved_names, flags):
        validate.array(op, sname, x)
        if len(shape) == 3:  # the scales of a layer: [H, T]
            _, h, s = shape
            validate.rank(op, sname, x, 2, "[num_kv_heads, T]")
            if x.dtype != dt or x.shape[0] != h or (x.shape[1] > s and not ring):
                raise ValueError(f"{op}: {sname} must be float32 [{h}, T <= {s}] to fit {name}, "
                                 f"got {x.dtype}{x.shape}")
            continue
        _, _, h, s, d = shape
        validate.rank(op, sname, x, 4, "[2, num_kv_heads, T, head_dim]")
        if x.dtype != dt:
            raise TypeError(f"{op}: {sname} has dtype {x.dtype} but {name} holds {dt}")
        if x.shape[0] != 2 or x.shape[1] != h or x.shape[3] != d:
            raise ValueError(
                f"{op}: {sname} must have shape (2, {h}, T, {d}) to fit {name}, got {x.shape}"
            )
        if x.shape[2] > s and not ring:
            raise ValueError(
                f"{op}: {sname} holds {x.shape[2]} tokens, more than max_seq_len {s} of {name}"
            )
    slots = _slots(op, batch_idx, rows, allow_many=True)
    if length is not None:
        saved, complete = _into_rings(op, layers, flags, saved, length)
        slots = jnp.where(complete, slots, -1)  # the kernel skips a row outside [0, rows)
    n = len(saved)
    out = _ffi.call(
        "jaxkv_copy_prefix",
        [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers],
        slots,
        *saved,
        *buffers,
        input_output_aliases={1 + n + i: i for i in range(len(buffers))},
        to_cache=True,
        rows=rows,
    )
    return list(out)


def _layer_list(op: str, layers: Layers) -> tuple[list[jax.Array], list[str]]:
    items = ops.validate_kv_layers(op, layers)
    is_list = isinstance(layers, (list, tuple))
    names = [f"layers[{i}]" for i in range(len(items))] if is_list else ["layers"]
    rows = items[0].shape[0]
    for name, layer in zip(names, items):
        if layer.shape[0] != rows:
            raise ValueError(f"{op}: {name} has max_batch {layer.shape[0]}, layers[0] has {rows}")
    return items, names


def _like(layers: Layers, out: list[jax.Array]):
    return type(layers)(out) if isinstance(layers, (list, tuple)) else out[0]


@per_shard(layers=Role(LAYER), batch_idx=row_ids("layers"), out=FromOwner(SAVED))
def save_kv_cache(layers: Layers, batch_idx: IntOrArray, seq_len: int, sharding=None):
    """Copies tokens ``[0, seq_len)`` of cache row ``batch_idx`` out of every layer, in one launch.

    **Arguments:**
    - ``layers``: one ``[max_batch, 2, H, S, D]`` array or a list/tuple of them; H, S, D and the
      dtype may differ per layer.
    - ``batch_idx``: the row, a Python int or an int32 scalar (traced is fine). A traced index
      outside ``[0, max_batch)`` reads nothing (the result is zeros) and is reported through
      ``checkify``.
    - ``seq_len``: static int, ``seq_len <= S`` of every layer.

    **Returns:** with the structure of ``layers``, ``[2, H, seq_len, D]`` per layer: the K and V of
    tokens ``[0, seq_len)`` of row ``batch_idx``. Fresh arrays; the cache is not modified.

    With ``sharding`` (a ``jaxkv.CacheSharding``; layers split as a KVCacheManager's), the shard
    that owns the row reads it and one all-reduce of the result's size hands it to the others.

    >>> cache = jnp.arange(2 * 2 * 1 * 4 * 2, dtype=jnp.float32).reshape(2, 2, 1, 4, 2)
    >>> save_kv_cache(cache, 1, 2)[0, 0]
    Array([[16., 17.],
           [18., 19.]], dtype=float32)
    """
    op = "save_kv_cache"
    items, names = _layer_list(op, layers)
    return _like(layers, save_buffers(op, items, names, batch_idx, seq_len))


@per_shard(layers=Role(LAYER), saved=Role(SAVED), batch_idx=row_ids("layers"), out=Role(LAYER))
def instantiate_kv_cache(layers: Layers, saved: Layers, batch_idx: IntOrArray, sharding=None):
    """Writes saved prefixes into tokens ``[0, T)`` of cache rows, every layer in one launch.

    **Arguments:**
    - ``layers``: one ``[max_batch, 2, H, S, D]`` array or a list/tuple of them. Donate them to
      run in place.
    - ``saved``: the same structure, ``[2, H, T, D]`` per layer (``T <= S``; H, D and dtype those
      of the layer), e.g. from ``save_kv_cache``.
    - ``batch_idx``: the target row: a Python int, an int32 scalar, or an int32 ``[n]`` array of
      rows that all receive the same prefix in the one launch (one system prompt shared by many
      new requests). Traced rows outside ``[0, max_batch)`` are skipped and reported through
      ``checkify``.

    **Returns:** ``layers'``: tokens ``[0, T)`` of each target row replaced by ``saved``;
    every other byte unchanged.

    With ``sharding`` (a ``jaxkv.CacheSharding``; layers split as a KVCacheManager's, ``saved``
    by heads), each batch shard writes the target rows it owns.

    >>> cache = jnp.zeros((3, 2, 1, 4, 2), jnp.float32)
    >>> prefix = jnp.ones((2, 1, 2, 2), jnp.float32)
    >>> out = instantiate_kv_cache(cache, prefix, jnp.array([0, 2], jnp.int32))
    >>> out[:, 0, 0, :, 0]
    Array([[1., 1., 0., 0.],
           [0., 0., 0., 0.],
           [1., 1., 0., 0.]], dtype=float32)
    """
    op = "instantiate_kv_cache"
    items, names = _layer_list(op, layers)
    if isinstance(layers, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            raise TypeError(f"{op}: layers is a {type(layers).__name__}, so saved must be one too")
        saved_items = list(saved)
        saved_names = [f"saved[{i}]" for i in range(len(saved_items))]
    else:
        if isinstance(saved, (list, tuple)):
            raise TypeError(f"{op}: layers is one array, so saved must be one array too")
        saved_items, saved_names = [saved], ["saved"]
    out = instantiate_buffers(op, items, names, saved_items, saved_names, batch_idx)
    return _like(layers, out)


def save_saved_kv(op, buffers, names, batch_idx, seq_len, scales=None, rings=None) -> SavedKV:
    """``save`` of the cache classes: a SavedKV of every layer of ``buffers``, with the scales of
    an 8-bit cache (``scales``: ``quantization.scales_of``) in the same launch. ``rings``: a
    flag per buffer (a ring layer saves its last tokens, ``save_buffers``)."""
    k_scales: Any
    v_scales: Any
    k_scales, v_scales, per_token = scales if scales is not None else (None, None, False)
    n = len(_described(op, buffers, names))
    extra, extra_names = (_scale_buffers(k_scales, v_scales) if per_token else ([], []))
    rings = None if rings is None else [*rings, *(_scale_rings(rings) if per_token else [])]
    out = save_buffers(op, [*buffers, *extra], [*names, *extra_names], batch_idx, seq_len, rings)
    saved_k: Any = None
    saved_v: Any = None
    if per_token:
        saved_k, saved_v = tuple(out[n:2 * n]), tuple(out[2 * n:])
    elif scales is not None:  # per tensor: each layer's scale
        saved_k, saved_v = tuple(k_scales), tuple(v_scales)
    return SavedKV(layers=tuple(out[:n]), length=jnp.asarray(seq_len, jnp.int32),
                   k_scales=saved_k, v_scales=saved_v,
                   scaling=None if scales is None else ("per_token_head" if per_token
                                                        else "per_tensor"))


def check_ring_save(op: str, lengths: jax.Array, batch_idx, seq_len: int, slots: int) -> None:
    """Reports a save of ``seq_len`` tokens from a ring of ``slots`` whose row has gone on past
    them: it holds positions ``[length - slots, length)``, the save takes ``[seq_len - T,
    seq_len)``, ``T = min(seq_len, slots)`` (a row of another batch shard is not checked)."""
    rows = lengths.shape[0]
    row = jnp.asarray(batch_idx, jnp.int32)
    length = lengths[jnp.clip(row, 0, rows - 1)]
    mine = (row >= 0) & (row < rows)
    check(~mine | (length <= max(seq_len, slots)),
          f"{op}: the row's length passed max(seq_len, max_seq_len) of a ring: tokens the save "
          "takes have left the ring (their slots hold later tokens)")


def _instantiate_quantizing(op, buffers, names, saved: SavedKV, batch_idx, scales, rings=None):
    """An unquantized ``saved`` into an 8-bit cache: the one FFI call ("jaxkv_quantize_prefix")
    quantizes each (slot, K/V head, token) vector on its way, bit for bit as the cache's
    ``append`` stores it (per token and head: its own scale, written beside it; per tensor: the
    cache's scale of each layer). Returns (buffers, the per-token scale leaves written)."""
    k_scales, v_scales, per_token = scales
    rows = buffers[0].shape[-5]
    layers = _described(op, buffers, names)
    flags = _described_rings(buffers, rings)
    if saved.num_layers != len(layers):
        raise ValueError(f"{op}: {saved.num_layers} saved layers for {len(layers)} cache layers")
    for i, ((name, shape, _), x, ring) in enumerate(zip(layers, saved.layers, flags)):
        if np.dtype(x.dtype) not in quantization.INPUT_DTYPES:
            raise TypeError(f"{op}: saved.layers[{i}] has dtype {x.dtype}; an 8-bit cache "
                            "takes a float32, bfloat16 or float16 prefix (quantized on the way)")
        _, _, h, s, d = shape
        if (x.ndim != 4 or x.shape[0] != 2 or x.shape[1] != h or x.shape[3] != d
                or (x.shape[2] > s and not ring)):
            raise ValueError(f"{op}: saved.layers[{i}] must have shape (2, {h}, T <= {s}, {d}) "
                             f"to fit {name}, got {x.shape}")
        quantization.check_head_dim(op, f"saved.layers[{i}]", d)
    check(jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in saved.layers])),
          f"{op}: saved holds a non-finite value (that token's data and scale are undefined)")
    slots = _slots(op, batch_idx, rows, allow_many=True)
    prefix, complete = _into_rings(op, layers, flags, list(saved.layers), saved.length)
    slots = jnp.where(complete, slots, -1)  # the kernel skips a row outside [0, rows)
    n = len(layers)
    if per_token:
        given = jnp.zeros((0,), jnp.float32)
        extra = _scale_buffers(k_scales, v_scales)[0]
    else:  # [2, n]: each layer's K scale, then its V scale
        given = jnp.stack([jnp.stack([jnp.reshape(jnp.asarray(sc[i], jnp.float32), ())
                                      for i in range(n)]) for sc in (k_scales, v_scales)])
        extra = []
    targets = [*buffers, *extra]
    # The prefix as arrays of their own: XLA:GPU's dynamic slice fusion of a call on slices of
    # the prefix wrote wrong scales once (the append's pass over it: H200, jax 0.11.2).
    prefix = jax.lax.optimization_barrier(tuple(prefix))
    out = _ffi.call(
        "jaxkv_quantize_prefix",
        [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in targets],
        slots,
        given,
        *prefix,
        *targets,
        input_output_aliases={2 + n + i: i for i in range(len(targets))},
        rows=rows,
    )
    return list(out[:len(buffers)]), list(out[len(buffers):])


def _scale_rings(rings) -> list[bool]:
    """The ring flags of ``_scale_buffers``' leaves: a layer's scales are a ring as it is."""
    return [*rings, *rings]


def _scale_buffers(k_scales, v_scales):
    """The per-token scale leaves as kernel layers, and their names."""
    if isinstance(k_scales, tuple):
        n = len(k_scales)
        return ([*k_scales, *v_scales],
                [f"k_scales[{i}]" for i in range(n)] + [f"v_scales[{i}]" for i in range(n)])
    return [k_scales, v_scales], ["k_scales", "v_scales"]


def instantiate_saved_kv(op, buffers, names, saved: SavedKV, batch_idx, scales=None, rings=None):
    """``instantiate`` of the cache classes: ``saved`` into every layer of ``buffers`` (and, an
    8-bit cache's, its scales, in the same launch). ``rings``: a flag per buffer (a ring layer
    places position ``p`` at slot ``p % S``, ``instantiate_buffers``). Returns (buffers, the
    moved scale leaves)."""
    if not isinstance(saved, SavedKV):
        raise TypeError(f"{op}: saved must be a SavedKV, got {type(saved).__name__}")
    k_scales: Any
    v_scales: Any
    k_scales, v_scales, per_token = scales if scales is not None else (None, None, False)
    scaling = None if scales is None else ("per_token_head" if per_token else "per_tensor")
    if saved.scaling is None and scaling is not None:  # quantized on the way, in one launch
        return _instantiate_quantizing(op, buffers, names, saved, batch_idx, scales, rings)
    if saved.scaling != scaling:
        raise ValueError(
            f"{op}: saved was saved from a cache with scaling={saved.scaling!r}, this cache has "
            f"scaling={scaling!r}: an 8-bit prefix instantiates into a cache of its own kind")
    names_saved = [f"saved.layers[{i}]" for i in range(saved.num_layers)]
    items, saved_items = list(buffers), list(saved.layers)
    if per_token:
        extra, extra_names = _scale_buffers(k_scales, v_scales)
        items += extra
        names = [*names, *extra_names]
        rings = None if rings is None else [*rings, *_scale_rings(rings)]
        saved_items += [*saved.k_scales, *saved.v_scales]
        names_saved += [f"saved.k_scales[{i}]" for i in range(saved.num_layers)]
        names_saved += [f"saved.v_scales[{i}]" for i in range(saved.num_layers)]
    elif scales is not None:
        same = [jnp.all(a == b) for a, b in zip((*saved.k_scales, *saved.v_scales),
                                               (*k_scales, *v_scales))]
        check(jnp.all(jnp.asarray(same)),
              f"{op}: saved's per-tensor scales differ from the cache's (its bytes read otherwise)")
    out = instantiate_buffers(op, items, names, saved_items, names_saved, batch_idx, rings,
                              saved.length)
    return out[:len(buffers)], out[len(buffers):]
