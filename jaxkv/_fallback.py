"""The XLA formulation of every jaxkv FFI target: what runs where this build registered no kernel
for the platform (a TPU, a ROCm or Apple GPU, a CPU-only build on a CUDA machine), or anywhere
with ``JAXKV_KERNELS=xla``.

Each function takes a target's operands and attributes exactly as ``_ffi.call`` passes them and
returns its results, computed in ``jnp``: writes are scatters into the donated buffers (in place
where XLA reuses a donated operand, which it does for a scatter), reads gather what the kernel
reads. The data-movement targets give the kernels' bytes wherever their contracts say; attention
is float32 softmax(q k^T) v over the keys each query sees, as the CPU kernel computes it. The host
tier's targets have none: they need the kernels (a clear error).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import reference

_DENSE, _PAGED_HND, _PAGED_NHD, _DENSE_RING = 0, 1, 2, 3  # attention.py's layout codes


_BITS = {1: jnp.uint8, 2: jnp.uint16}


def _as_bits(x):
    """A float of 8 or 16 bits as its bits: data movement that XLA does not convert (XLA:CPU
    computes bfloat16 through float32, which takes a scatter out of place, and a float8 scatter
    may rewrite a NaN's payload)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize in _BITS:
        return jax.lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype).itemsize])
    return x


def _from_bits(bits, dtype):
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _set(buf, index, value):
    """``buf.at[index].set(value, mode="drop")``, moving bits (``_as_bits``)."""
    new = _as_bits(buf).at[index].set(_as_bits(value.astype(buf.dtype)), mode="drop")
    return _from_bits(new, buf.dtype)


def _axis_index(axis: int, index) -> tuple:
    return (slice(None),) * axis + (index,)


def _move_order(targets, n: int, rows: int):
    """The order of an in-place row permutation (old row ``i < n`` to ``targets[i]``, targets
    distinct; ``rows``: not moved), as the kernels' move schedule: a chain from its far end, so
    that each row is read before it is overwritten; then each cycle, cut at its lowest row (read
    into a spare row first, written last). Returns (``order``: rows by their turn, ``moves``,
    ``first``: a cycle's first move, ``last``: a cycle's cut row, read from the spare)."""
    idx = jnp.arange(rows, dtype=jnp.int32)
    nxt = jnp.full((rows,), -1, jnp.int32).at[:n].set(jnp.where(targets < rows, targets, -1))
    nxt = jnp.where(nxt == idx, -1, nxt)  # a row that stays is no move
    moving = nxt >= 0
    succ = jnp.where(moving & moving[jnp.maximum(nxt, 0)], nxt, -1)  # the move that must go first
    steps = max(1, int(np.ceil(np.log2(rows))) + 1)

    def jump(cut, least: bool):  # (moves to the chain's end or to ``cut``, the least row on
        p = jnp.where(succ == cut, -1, succ)  # the way where ``least``, the last pointer)
        d, low = (p >= 0).astype(jnp.int32), jnp.where(p >= 0, jnp.minimum(idx, p), idx)
        for _ in range(steps):
            at = jnp.maximum(p, 0)
            d = d + jnp.where(p >= 0, d[at], 0)
            if least:
                low = jnp.where(p >= 0, jnp.minimum(low, low[at]), low)
            p = jnp.where(p >= 0, p[at], -1)
        return d, low, p

    depth, low, p = jump(jnp.full((rows,), -2, jnp.int32), least=True)
    cycle = moving & (p >= 0)  # never reaches a chain's end
    breaker = jnp.where(cycle, low, -1)
    # On a cycle: moves to its cut row, the cut row's own move last (its turn: the cycle's length).
    to_cut, _, _ = jump(jnp.where(cycle, breaker[jnp.maximum(succ, 0)], -2), least=False)
    key = jnp.where(cycle, rows + 1 + breaker * (rows + 2) + to_cut, depth)
    key = jnp.where(moving, key, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key).astype(jnp.int32)
    first = cycle & (to_cut == 0)
    last = cycle & (idx == breaker)
    return order, jnp.sum(moving, dtype=jnp.int32), nxt, first, last


def _moved_rows(buffers, axes, targets, n: int):
    """``buffers`` with row ``i < n`` (along each one's axis) moved to row ``targets[i]``
    (``rows``: not moved), as ``reference.compact_tensor_batch``: one row at a time in the
    kernels' order (``_move_order``), in place in a donated buffer, one spare row a buffer."""
    rows = buffers[0].shape[axes[0]]
    order, moves, nxt, first, last = _move_order(targets, n, rows)

    def row(x, axis, i):
        return jax.lax.dynamic_slice_in_dim(x, i, 1, axis)

    def body(j, carry):
        xs, spares = carry
        i = order[j]
        dst = nxt[i]
        out_x, out_s = [], []
        for x, spare, axis in zip(xs, spares, axes):
            spare = jnp.where(first[i], row(x, axis, dst), spare)  # a cycle's cut row, kept
            src = jnp.where(last[i], spare, row(x, axis, i))
            out_x.append(jax.lax.dynamic_update_slice_in_dim(x, src, dst, axis))
            out_s.append(spare)
        return out_x, out_s

    bits = [_as_bits(x) for x in buffers]
    spares = [jnp.zeros_like(row(x, axis, 0)) for x, axis in zip(bits, axes)]
    moved = jax.lax.fori_loop(0, moves, body, (bits, spares))[0]
    return [_from_bits(x, b.dtype) for x, b in zip(moved, buffers)]


def compact(results, batch_mapping, lengths, *buffers, kv: bool, rows: int):
    n = batch_mapping.shape[0]
    targets = jnp.where((batch_mapping >= 0) & (batch_mapping < rows), batch_mapping, rows)
    # kv: layers [(L,) rows, 2, H, S, D] and scales [(L,) rows, H, S]; else [rows, ...]
    axes = [(b.ndim - 5 if b.ndim >= 5 else b.ndim - 3) if kv else 0 for b in buffers]
    moved = _moved_rows(buffers, axes, targets, n) if buffers else []
    if lengths.shape[0]:
        lengths = reference.compact_lengths(lengths, batch_mapping)
    return [lengths, *moved]


def _counts(counts, batch: int, tokens: int):
    """The kernels' counts argument: ``[0]`` means every row appends all ``T``."""
    if counts.shape[0] == 0:
        return jnp.full((batch,), tokens, jnp.int32)
    return jnp.clip(counts, 0, tokens)


def _append_slots(lengths, counts, active, tokens: int, capacity: int, ring: bool):
    """int32 ``[B, T]``: where each token of a dense append goes (``capacity``: dropped)."""
    batch = lengths.shape[0]
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    keep = (t < counts[:, None]) & (jnp.arange(batch)[:, None] < active) & (
        lengths[:, None] >= 0)
    if ring:  # of more than S tokens, the last S
        keep &= t >= counts[:, None] - capacity
        return jnp.where(keep, (lengths[:, None] + t) % capacity, capacity)
    pos = lengths[:, None] + t
    return jnp.where(keep & (pos < capacity), pos, capacity)


def _layer_of(layer_idx, num_layers: int):
    """The layer a write goes to: ``num_layers`` (dropped) when out of range."""
    layer = jnp.asarray(layer_idx, jnp.int32)
    return jnp.where((layer >= 0) & (layer < num_layers), layer, num_layers)


def append(results, k, v, lengths, counts, active, layer_idx, buffer, *, ring: bool):
    stacked = buffer.ndim == 6
    batch, heads, tokens, _ = k.shape
    capacity = buffer.shape[-2]
    slots = _append_slots(lengths, _counts(counts, batch, tokens), active, tokens, capacity, ring)
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slots.shape)
    kv = jnp.moveaxis(jnp.stack([k, v], axis=1), 3, 1)  # [B, T, 2, H, D]
    if not stacked:  # one layer: layer_idx is 0
        return _set(buffer, (rows, slice(None), slice(None), slots), kv)
    layer = jnp.broadcast_to(_layer_of(layer_idx, buffer.shape[0]), slots.shape)
    return _set(buffer, (layer, rows, slice(None), slice(None), slots), kv)


def _paged_places(page_table, lengths, counts, tokens: int, num_pages: int, page_size: int):
    """(page, slot) ``[B, T]`` of each token of a paged append (page ``num_pages``: dropped)."""
    batch, max_pages = page_table.shape
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] + t
    logical = pos // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
    ok = (t < counts[:, None]) & (pos >= 0) & (logical < max_pages) & (page >= 0) & (
        page < num_pages)
    return jnp.where(ok, page, num_pages), pos % page_size


def _pool_geometry(pool, nhd: bool):
    """(num_layers, num_pages, page_size) of a pool: HND [L, H, P, S, D] or NHD [L, P, S, H, D],
    a scale pool the same without D."""
    return (pool.shape[0], pool.shape[1], pool.shape[2]) if nhd else (
        pool.shape[0], pool.shape[2], pool.shape[3])


def _paged_write(pool, layer, page, slot, x, nhd: bool):
    """``x`` [B, T, H(, D)] into ``pool`` at (layer, page, slot) [B, T] (out of range: dropped)."""
    if nhd:
        return _set(pool, (layer, page, slot), x)
    return _set(pool, (layer, slice(None), page, slot), x)


def paged_append(results, k, v, page_table, lengths, counts, layer_idx, k_pages, v_pages, *,
                 nhd: bool):
    num_layers, num_pages, page_size = _pool_geometry(k_pages, nhd)
    every = k.ndim == 5  # [L, B, H, T, D]: every layer at once
    tokens = k.shape[-2]
    count = _counts(counts, k.shape[-4], tokens)
    page, slot = _paged_places(page_table, lengths, count, tokens, num_pages, page_size)
    layers = range(num_layers) if every else [None]
    for i in layers:
        ki, vi = (k[i], v[i]) if every else (k, v)
        layer = jnp.broadcast_to(_layer_of(i if every else layer_idx, num_layers), page.shape)
        k_pages = _paged_write(k_pages, layer, page, slot, jnp.swapaxes(ki, 1, 2), nhd)
        v_pages = _paged_write(v_pages, layer, page, slot, jnp.swapaxes(vi, 1, 2), nhd)
    return [k_pages, v_pages]


def _paged_read(pool, layer, page_table, positions: int, nhd: bool):
    """(the layer's tokens [B, H, X(, D)] at positions [0, X), bool [B, X]: a page holds it)."""
    num_layers, num_pages, page_size = _pool_geometry(pool, nhd)
    pos = jnp.arange(positions, dtype=jnp.int32)
    logical = pos // page_size
    page = page_table[:, jnp.clip(logical, 0, page_table.shape[1] - 1)]  # [B, X]
    held = (page >= 0) & (page < num_pages) & (logical < page_table.shape[1])[None, :]
    held &= (layer >= 0) & (layer < num_layers)
    at = jnp.clip(page, 0, num_pages - 1)
    lay = jnp.clip(layer, 0, num_layers - 1)
    # One gather of the tokens read, by their bits: no slice of the pool, and no conversion of
    # all of it (XLA:CPU computes a bfloat16 slice through float32).
    bits = _as_bits(pool)
    if nhd:  # [L, P, S, H(, D)] -> [B, X, H(, D)]
        x = bits[lay, at, pos % page_size]
    else:  # [L, H, P, S(, D)] -> [B, X, H(, D)]
        x = bits[lay, :, at, pos % page_size]
    x = _from_bits(jnp.swapaxes(x, 1, 2), pool.dtype)
    shape = held.shape[:1] + (1,) + held.shape[1:] + (1,) * (x.ndim - 3)
    return jnp.where(held.reshape(shape), x, jnp.zeros((), x.dtype)), held


def paged_gather(results, k_pages, v_pages, page_table, lengths, layer_idx, *, nhd: bool):
    max_len = results[0].shape[-2]
    layer = jnp.asarray(layer_idx, jnp.int32)
    live = jnp.arange(max_len)[None, :] < lengths[:, None]  # [B, M]
    out = []
    for pool in (k_pages, v_pages):
        x, _ = _paged_read(pool, layer, page_table, max_len, nhd)
        out.append(jnp.where(live[:, None, :, None], x, jnp.zeros((), x.dtype)))
    if len(results) == 2:
        return out
    return [jnp.stack(out, axis=1)]


def paged_copy(results, src_pages, dst_pages, k_pages, v_pages, *, nhd: bool):
    axis = 1 if nhd else 2  # the pages' axis, of 16-bit pools and of scale pools alike
    num_pages = k_pages.shape[axis]
    ok = (src_pages >= 0) & (src_pages < num_pages) & (dst_pages >= 0) & (dst_pages < num_pages)
    ok &= src_pages != dst_pages
    dst = jnp.where(ok, dst_pages, num_pages)
    src = jnp.clip(src_pages, 0, num_pages - 1)
    move = lambda pool: _set(pool, _axis_index(axis, dst),  # noqa: E731
                             jnp.take(pool, src, axis=axis))
    return [move(k_pages), move(v_pages)]


def _kernel_layers(buf) -> list:
    """The layers the kernel sees in a buffer: itself (a layer [rows, 2, H, S, D], scales
    [rows, H, S]), or each of a stack's (rank 6, scales rank 4) by its index."""
    return [()] if buf.ndim in (5, 3) else [(i,) for i in range(buf.shape[0])]


def copy_prefix(results, slots, *arrays, to_cache: bool, rows: int):
    """Save: each layer's tokens ``[0, t)`` of row ``slots`` (zeros for a row out of range);
    instantiate: each saved prefix into rows ``slots`` (out of range: skipped)."""
    slots = jnp.reshape(slots, (-1,))
    if not to_cache:
        slot = slots[0]
        ok = (slot >= 0) & (slot < rows)
        at = jnp.clip(slot, 0, rows - 1)
        layers = [(buf, i) for buf in arrays for i in _kernel_layers(buf)]
        out = []
        for (buf, i), res in zip(layers, results):
            t = res.shape[-2] if res.ndim == 4 else res.shape[-1]
            row = buf[(*i, at)]  # [2, H, S, D] or [H, S]
            x = row[..., :t, :] if res.ndim == 4 else row[..., :t]
            out.append(jnp.where(ok, x, jnp.zeros((), x.dtype)))
        return out
    buffers = list(arrays[len(arrays) - len(results):])
    saved = iter(arrays[:len(arrays) - len(results)])
    for j, buf in enumerate(buffers):
        for i in _kernel_layers(buf):
            x = next(saved).astype(buf.dtype)
            # one dynamic-update-slice a slot under a cond (a slot out of range: skipped): XLA
            # updates it in place inside a scan too, where a scatter, or a select fused into the
            # update, of a 16-bit float went through a copy of the buffer on XLA:CPU
            value = _as_bits(x.reshape((1,) * (len(i) + 1) + x.shape))
            bits = _as_bits(buf)
            for slot in slots:
                start = (*i, slot) + (0,) * x.ndim
                bits = jax.lax.cond((slot >= 0) & (slot < rows),
                                    lambda b, s=start: jax.lax.dynamic_update_slice(b, value, s),
                                    lambda b: b, bits)
            buf = _from_bits(bits, buf.dtype)
        buffers[j] = buf
    return buffers


# --- 8-bit caches: reference.quantize is the kernels' arithmetic, bit for bit ---


def _tensor_scale(scales, layer):
    """A per-tensor cache's scale of ``layer`` (``[L]``; one layer's: ``[]`` or ``[1]``)."""
    flat = jnp.reshape(scales, (-1,))
    return flat[jnp.clip(layer, 0, flat.shape[0] - 1)]


def _quantized(x, dtype, scale, per_token: bool):
    """(codes, per-token scales or None) of ``x`` [..., D] into ``dtype``. A NaN of float8_e5m2
    as the kernels store it, 0x7E (XLA's fused conversion may give 0x7F)."""
    q, s = reference.quantize(x, dtype, None if per_token else scale)
    if jnp.dtype(dtype) == jnp.float8_e5m2:  # chosen among the bits: no float rule folds it
        bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
        bits = jnp.where(jnp.isnan(x) & (s[..., None] > 0), jnp.uint8(0x7E), bits)
        q = jax.lax.bitcast_convert_type(bits, dtype)
    return q, (s if per_token else None)


def append_quantized(results, k, v, lengths, counts, active, layer_idx, buffer, k_scales,
                     v_scales, *, per_token: bool, ring: bool):
    stacked = buffer.ndim == 6
    batch, heads, tokens, _ = k.shape
    capacity = buffer.shape[-2]
    slots = _append_slots(lengths, _counts(counts, batch, tokens), active, tokens, capacity, ring)
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slots.shape)
    layer = _layer_of(layer_idx, buffer.shape[0] if stacked else 1)
    lead = (jnp.broadcast_to(layer, slots.shape), rows) if stacked else (rows,)
    scales = [k_scales, v_scales]
    for kv, x in enumerate((k, v)):
        q, s = _quantized(jnp.swapaxes(x, 1, 2), buffer.dtype,
                          None if per_token else _tensor_scale(scales[kv], layer), per_token)
        buffer = _set(buffer, (*lead, kv, slice(None), slots), q)  # [B, T, H, D]
        if per_token:
            scales[kv] = _set(scales[kv], (*lead, slice(None), slots), s)
    return [buffer, *scales]


def paged_append_quantized(results, k, v, page_table, lengths, counts, layer_idx, k_pages,
                           v_pages, k_scales, v_scales, *, per_token: bool, nhd: bool):
    num_layers, num_pages, page_size = _pool_geometry(k_pages, nhd)
    every = k.ndim == 5
    tokens = k.shape[-2]
    count = _counts(counts, k.shape[-4], tokens)
    page, slot = _paged_places(page_table, lengths, count, tokens, num_pages, page_size)
    pools, scales = [k_pages, v_pages], [k_scales, v_scales]
    for i in (range(num_layers) if every else [None]):
        layer = _layer_of(i if every else layer_idx, num_layers)
        at = jnp.broadcast_to(layer, page.shape)
        for kv, x in enumerate((k, v)):
            xi = x[i] if every else x
            q, s = _quantized(jnp.swapaxes(xi, 1, 2), k_pages.dtype,
                              None if per_token else _tensor_scale(scales[kv], layer), per_token)
            pools[kv] = _paged_write(pools[kv], at, page, slot, q, nhd)
            if per_token:
                scales[kv] = _paged_write(scales[kv], at, page, slot, s, nhd)
    return [*pools, *scales]


def quantize_prefix(results, slots, given, *arrays, rows: int):
    """Each saved float layer ``[2, H, T, D]`` quantized into rows ``slots`` of its 8-bit layer,
    per token and head (its scales written into the scale leaves after the buffers) or with the
    ``given`` ``[2, n]`` per-tensor scales."""
    targets = list(arrays[len(arrays) - len(results):])
    prefix = arrays[:len(arrays) - len(results)]
    n = len(prefix)
    per_token = given.shape[0] == 0
    # the described layers: buffers' first, then (per token) the K scales', then the V scales'
    layers = [(j, i) for j, buf in enumerate(targets) for i in _kernel_layers(buf)]
    slots = jnp.reshape(slots, (-1,))
    at = jnp.where((slots >= 0) & (slots < rows), slots, rows)
    for li, x in enumerate(prefix):
        j, i = layers[li]
        t = x.shape[2]
        for kv in (0, 1):
            scale = None if per_token else given[kv, li]
            q, s = _quantized(jnp.swapaxes(x[kv], 0, 1), targets[j].dtype, scale, per_token)
            # q [T, H, D] -> rows at, positions [0, t): buffer [..., rows, 2, H, S, D]
            value = jnp.broadcast_to(jnp.swapaxes(q, 0, 1), (at.shape[0], *q.shape[1:2],
                                                             t, q.shape[2]))
            targets[j] = _set(targets[j], (*i, at, kv, slice(None), slice(0, t)), value)
            if per_token:
                sj, si = layers[n * (1 + kv) + li]
                sv = jnp.broadcast_to(jnp.swapaxes(s, 0, 1), (at.shape[0], s.shape[1], t))
                targets[sj] = _set(targets[sj], (*si, at, slice(None), slice(0, t)), sv)
    return targets


# --- attention ---


def _dense_keys(buf, scales, layer, kv: int, positions: int, ring: int):
    """A dense layer's K (``kv`` 0) or V (1) at positions [0, positions) ([B, H, X, D]), a ring's
    slot ``p % S`` for position ``p``; its per-token scales [B, H, X] or None."""
    slot = jnp.arange(positions, dtype=jnp.int32) % (ring or buf.shape[-2])
    bits = _as_bits(buf)  # one gather, as _paged_read's
    if buf.ndim == 6:  # [L, B, 2, H, S, D]: the layer's slots, [X, B, H, D]
        x = bits[jnp.clip(layer, 0, buf.shape[0] - 1), :, kv, :, slot]
    else:  # [B, 2, H, S, D]
        x = bits[:, kv, :, slot]
    x = _from_bits(jnp.moveaxis(x, 0, 2), buf.dtype)  # [B, H, X, D]
    if scales is None:
        return x, None
    if scales.ndim == 4:  # [L, B, H, S]
        s = jnp.moveaxis(scales[jnp.clip(layer, 0, scales.shape[0] - 1), :, :, slot], 0, 2)
    else:
        s = scales[:, :, slot]
    return x, s


def attention(results, q, k, v, table, starts, counts, layer, k_scale, v_scale, k_scales,
              v_scales, window, sinks, *, scale, soft_cap, span, layout):
    """Query ``t < counts[b]`` of row ``b`` at position ``starts[b] + t`` over the keys
    ``[first, last]`` its window leaves, as the kernels' ``AttentionProblem`` bounds them."""
    del span  # the kernels' split sizing
    b, t, hq, d = q.shape
    layout = int(layout)
    per_token = k_scales.shape[0] > 0
    layer = jnp.asarray(layer, jnp.int32)
    if layout in (_PAGED_HND, _PAGED_NHD):
        nhd = layout == _PAGED_NHD
        num_layers, _, page_size = _pool_geometry(k, nhd)
        capacity = table.shape[1] * page_size
        keys, held = _paged_read(k, layer, table, capacity, nhd)
        values, _ = _paged_read(v, layer, table, capacity, nhd)
        ks = _paged_read(k_scales, layer, table, capacity, nhd)[0] if per_token else None
        vs = _paged_read(v_scales, layer, table, capacity, nhd)[0] if per_token else None
        ring = 0
    else:
        ring = k.shape[-2] if layout == _DENSE_RING else 0
        num_layers = k.shape[0] if k.ndim == 6 else 1
        capacity = 2 * ring if ring else k.shape[-2]  # a ring's frame: two laps
        keys, ks = _dense_keys(k, k_scales if per_token else None, layer, 0, capacity, ring)
        values, vs = _dense_keys(v, v_scales if per_token else None, layer, 1, capacity, ring)
        held = jnp.ones((b, capacity), bool)
    hkv = keys.shape[1]
    f32 = jnp.float32
    keys, values = keys.astype(f32), values.astype(f32)
    if per_token:
        keys, values = keys * ks[..., None], values * vs[..., None]
    qs = q.astype(f32).reshape(b, t, hkv, hq // hkv, d)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("btkgd,bksd->bkgts", qs, keys, precision=hi) * k_scale * np.float32(scale)
    if soft_cap > 0:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    # the kernels' keys(b, t) and first_key(b, t, window)
    tt = jnp.arange(t, dtype=jnp.int32)[None, :]
    live = (tt < counts[:, None]) & ((layer >= 0) & (layer < num_layers))
    n = jnp.clip(starts[:, None] + tt + 1, 0, capacity)
    n = jnp.where(live, n, 0)
    first = starts[:, None] + tt + 1 - window
    if ring:
        first = jnp.maximum(first, (starts + counts - ring)[:, None])
    first = jnp.clip(first, 0, n)
    s = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
    seen = (s >= first[:, :, None]) & (s < n[:, :, None]) & held[:, None, :]  # [B, T, X]
    seen = seen[:, None, None]  # [B, 1, 1, T, X]
    scores = jnp.where(seen, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks.shape[0]:
        top = jnp.maximum(top, sinks.astype(f32).reshape(1, hkv, hq // hkv, 1, 1))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.where(seen, jnp.exp(scores - top), 0.0)
    total = jnp.sum(w, axis=-1, keepdims=True)
    denom = total
    if sinks.shape[0]:
        denom = total + jnp.exp(sinks.astype(f32).reshape(1, hkv, hq // hkv, 1, 1) - top)
    norm = jnp.where(total > 0, v_scale / jnp.where(total > 0, denom, 1.0), 0.0)
    # A NaN value reaches the queries that see it, and no other (not as 0 * NaN).
    nan = jnp.isnan(values)
    out = jnp.einsum("bkgts,bksd->btkgd", w * norm, jnp.where(nan, 0.0, values), precision=hi)
    hits = jnp.einsum("bkgts,bksd->btkgd", jnp.broadcast_to(seen, w.shape).astype(f32),
                      nan.astype(f32), precision=hi)
    out = jnp.where(hits > 0, jnp.nan, out)
    return [out.reshape(b, t, hq, d).astype(q.dtype), jnp.zeros(results[1].shape, f32)]


TARGETS: dict[str, Callable[..., Any]] = {
    "jaxkv_compact": compact,
    "jaxkv_append": append,
    "jaxkv_paged_append": paged_append,
    "jaxkv_paged_gather": paged_gather,
    "jaxkv_paged_copy": paged_copy,
    "jaxkv_copy_prefix": copy_prefix,
    "jaxkv_append_quantized": append_quantized,
    "jaxkv_paged_append_quantized": paged_append_quantized,
    "jaxkv_quantize_prefix": quantize_prefix,
    "jaxkv_attention_decode": attention,
    "jaxkv_attention_prefill": attention,
}


def call(target: str, results, *args, **attrs):
    """``target``'s XLA formulation: its results as ``jax.ffi.ffi_call`` would return them."""
    if target not in TARGETS:
        raise NotImplementedError(
            f"jaxkv ({target}): this op has no XLA formulation yet; it needs jaxkv's kernels "
            "(JAXKV_KERNELS=xla, or a platform this build has no kernels for, runs every other "
            "op through XLA)")
    single = not isinstance(results, (list, tuple))
    args = tuple(jnp.asarray(a) for a in args)  # an operand may come as a NumPy array
    out = TARGETS[target](results if not single else (results,), *args, **attrs)
    if single:
        return out if not isinstance(out, list) else out[0]
    return out
