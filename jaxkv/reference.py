"""Pure-jnp implementations of every jaxkv op: the oracle for the tests and a readable spec.

They follow each op's contract on valid input; where the contract leaves bytes unspecified (tokens
past a length) they may differ from the kernels, and tests compare only what is specified.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _targets(batch_mapping: jax.Array, rows: int) -> jax.Array:
    """Each old row's new row, or `rows` (dropped by mode="drop") when evicted or out of range."""
    valid = (batch_mapping >= 0) & (batch_mapping < rows)
    return jnp.where(valid, batch_mapping, rows)


def compact_tensor_batch(x: jax.Array, batch_mapping: jax.Array) -> jax.Array:
    """``x`` with old row ``i`` moved to row ``batch_mapping[i]`` (rows ``i < len(batch_mapping)``;
    an entry outside ``[0, rows)`` evicts the row); rows no survivor targets keep their values."""
    n = batch_mapping.shape[0]
    return x.at[_targets(batch_mapping, x.shape[0])].set(x[:n], mode="drop")


def compact_lengths(lengths: jax.Array, batch_mapping: jax.Array) -> jax.Array:
    """The lengths after ``compact_tensor_batch``: each survivor's at its new row, 0 elsewhere."""
    n = batch_mapping.shape[0]
    zeros = jnp.zeros_like(lengths)
    return zeros.at[_targets(batch_mapping, lengths.shape[0])].set(lengths[:n], mode="drop")


def compact_kv_cache(layers, lengths: jax.Array, batch_mapping: jax.Array):
    """Moves whole rows; only tokens below the new lengths are specified."""
    move = lambda layer: compact_tensor_batch(layer, batch_mapping)
    out = type(layers)(map(move, layers)) if isinstance(layers, (list, tuple)) else move(layers)
    return out, compact_lengths(lengths, batch_mapping)


def increment_lengths(lengths: jax.Array, increment) -> jax.Array:
    """``lengths + increment`` in int32 (two's complement: it wraps where the sum does)."""
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


# --- rings (a sliding-window layer of S slots: position p at slot p % S) ---


def ring_slot_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """int32 ``[B, slots]``: the position each slot of a ring holds after ``lengths[b]`` tokens,
    the newest ``p < lengths[b]`` with ``p % slots == s``, or -1 where there is none yet."""
    s = jnp.arange(slots, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    pos = last - jnp.remainder(last - s, slots)
    return jnp.where(pos >= 0, pos, -1)


def ring_from_positions(layer, lengths, slots: int):
    """The ring of ``slots`` slots that a row of ``lengths[b]`` tokens leaves: ``layer`` ``[B, 2,
    H, P, D]`` (or scales ``[B, H, P]``) holds each row's tokens at their positions; slot ``s``
    gets the position ``ring_slot_positions`` names, zeros where it names none."""
    pos = ring_slot_positions(lengths, slots)  # [B, slots]
    axis = layer.ndim - 2 if layer.ndim == 5 else layer.ndim - 1
    idx = jnp.clip(pos, 0, layer.shape[axis] - 1)
    shape = [1] * layer.ndim
    shape[0], shape[axis] = idx.shape
    got = jnp.take_along_axis(layer, idx.reshape(shape), axis=axis)
    keep = (pos >= 0).reshape(shape)
    return jnp.where(keep, got, jnp.zeros((), layer.dtype))


def ring_to_positions(ring, lengths, max_len: int):
    """The tokens a ring ``[B, 2, H, S, D]`` (or its scales ``[B, H, S]``) holds, at their
    positions: ``[B, 2, H, max_len, D]`` with position ``p`` from slot ``p % S`` for ``p`` in
    ``[lengths[b] - S, lengths[b])``, zeros elsewhere."""
    axis = ring.ndim - 2 if ring.ndim == 5 else ring.ndim - 1
    slots = ring.shape[axis]
    p = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    held = (p < lengths[:, None]) & (p >= lengths[:, None] - slots)  # [B, max_len]
    shape = [1] * ring.ndim
    shape[0], shape[axis] = held.shape
    got = jnp.take_along_axis(ring, jnp.broadcast_to(p % slots, held.shape).reshape(shape),
                              axis=axis)
    return jnp.where(held.reshape(shape), got, jnp.zeros((), ring.dtype))


def ring_append_layer(layer, k, v, lengths, active_batch_size, new_lengths=None):
    """``append_layer`` into a ring ``[B, 2, H, S, D]``: token ``t < new_lengths[b]`` of an
    active row goes to slot ``(lengths[b] + t) % S``; of more than ``S`` tokens, the last ``S``
    (nothing is dropped at ``S``)."""
    batch, _, heads, slots, _ = layer.shape
    tokens = k.shape[2]
    count = jnp.full((batch,), tokens, jnp.int32) if new_lengths is None else new_lengths
    count = jnp.minimum(count, tokens)
    t = jnp.arange(tokens)[None, :]
    keep = (t < count[:, None]) & (t >= count[:, None] - slots)
    keep &= (jnp.arange(batch)[:, None] < active_batch_size) & (lengths[:, None] >= 0)
    slot = jnp.where(keep, (lengths[:, None] + t) % slots, slots)  # slots: dropped
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], slot.shape)
    kv = jnp.moveaxis(jnp.stack([k, v], axis=1), 3, 1)  # [B, T, 2, H, D]
    return layer.at[b, :, :, slot].set(kv, mode="drop")


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

# --- paged ---


def _to_hnd(pool, layout):
    return pool if layout == "HND" else jnp.transpose(pool, (0, 3, 1, 2, 4))


def _from_hnd(pool, layout):
    return pool if layout == "HND" else jnp.transpose(pool, (0, 2, 3, 1, 4))


def _page_of(page_table, rows, logical, num_pages):
    """Physical page of (row, logical page), or num_pages (dropped) when unassigned/out of range."""
    in_table = (logical >= 0) & (logical < page_table.shape[1])
    page = page_table[rows, jnp.clip(logical, 0, page_table.shape[1] - 1)]
    ok = in_table & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page, num_pages)


def paged_append(k_pages, v_pages, page_table, lengths, layer_idx, k, v, new_lengths=None,
                 layout="HND"):
    """Token t < new_lengths[b] of row b goes to page page_table[b, pos // S], slot pos % S of
    layer layer_idx (pos = lengths[b] + t); tokens without a valid page are dropped. k, v
    [L, B, H, T, D] write every layer."""
    if k.ndim == 5:
        for layer in range(k.shape[0]):
            k_pages, v_pages = paged_append(k_pages, v_pages, page_table, lengths, layer, k[layer],
                                            v[layer], new_lengths, layout)
        return k_pages, v_pages
    kp, vp = _to_hnd(k_pages, layout), _to_hnd(v_pages, layout)
    num_layers, _, num_pages, size, _ = kp.shape
    batch, _, tokens, _ = k.shape
    if 0 in (num_layers, num_pages, size, page_table.shape[1]):
        return k_pages, v_pages  # no page to write to
    count = jnp.full((batch,), tokens, jnp.int32) if new_lengths is None else new_lengths
    t = jnp.arange(tokens)[None, :]
    pos = lengths[:, None] + t  # [B, T]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], pos.shape)
    page = _page_of(page_table, rows, pos // size, num_pages)
    page = jnp.where((t < count[:, None]) & (pos >= 0), page, num_pages)
    layer_ok = (layer_idx >= 0) & (layer_idx < num_layers)
    layer = jnp.clip(layer_idx, 0, num_layers - 1)

    def write(pool, x):  # pool [L, H, P, S, D], x [B, H, T, D]
        new = pool[layer].at[:, page, pos % size].set(jnp.swapaxes(x, 0, 1), mode="drop")
        return jnp.where(layer_ok, pool.at[layer].set(new), pool)

    return _from_hnd(write(kp, k), layout), _from_hnd(write(vp, v), layout)


def paged_gather(k_pages, v_pages, page_table, lengths, layer_idx, max_len, layout="HND"):
    """[B, 2, H, max_len, D]: token t < lengths[b] of row b, zeros elsewhere."""
    kp, vp = _to_hnd(k_pages, layout), _to_hnd(v_pages, layout)
    num_layers, heads, num_pages, size, head_dim = kp.shape
    batch = page_table.shape[0]
    if 0 in (num_layers, num_pages, size, page_table.shape[1]):  # no page to read from
        return jnp.zeros((batch, 2, heads, max_len, head_dim), kp.dtype)
    t = jnp.arange(max_len)[None, :]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, max_len))
    page = _page_of(page_table, rows, t // size, num_pages)
    layer_ok = (layer_idx >= 0) & (layer_idx < num_layers)
    ok = (t < lengths[:, None]) & (page < num_pages) & layer_ok  # [B, M]
    layer = jnp.clip(layer_idx, 0, num_layers - 1)
    page = jnp.clip(page, 0, num_pages - 1)

    def read(pool):  # -> [B, H, M, D]
        x = pool[layer][:, page, t % size]  # [H, B, M, D]
        x = jnp.swapaxes(x, 0, 1)
        return jnp.where(ok[:, None, :, None], x, jnp.zeros((), x.dtype))

    return jnp.stack([read(kp), read(vp)], axis=1)


def copy_pages(k_pages, v_pages, src_pages, dst_pages, layout="HND"):
    """Page dst[i] of every layer becomes page src[i]; pairs with an invalid page, or copying a
    page onto itself, are skipped."""
    kp, vp = _to_hnd(k_pages, layout), _to_hnd(v_pages, layout)
    num_pages = kp.shape[2]
    ok = (src_pages >= 0) & (src_pages < num_pages) & (dst_pages >= 0) & (dst_pages < num_pages)
    ok &= src_pages != dst_pages  # a no-op, but it would race a real copy into the same page
    dst = jnp.where(ok, dst_pages, num_pages)
    src = jnp.clip(src_pages, 0, num_pages - 1)
    move = lambda pool: pool.at[:, :, dst].set(pool[:, :, src], mode="drop")
    return _from_hnd(move(kp), layout), _from_hnd(move(vp), layout)


def _host_pairs(src_pages, dst_pages, src_count, dst_count):
    ok = (src_pages >= 0) & (src_pages < src_count) & (dst_pages >= 0) & (dst_pages < dst_count)
    return jnp.clip(src_pages, 0, src_count - 1), jnp.where(ok, dst_pages, dst_count)


def pages_to_host(host_pool, k_pages, v_pages, src_pages, dst_pages, axis: int):
    """Host page ``dst[i]`` (``[2, *page]``: K then V, the device pools' shape without the page
    axis ``axis``) becomes device page ``src[i]``; pairs with a page out of range are skipped."""
    src, dst = _host_pairs(src_pages, dst_pages, k_pages.shape[axis], host_pool.shape[0])
    page = lambda pool: jnp.moveaxis(jnp.take(pool, src, axis=axis), axis, 0)
    return host_pool.at[dst].set(jnp.stack([page(k_pages), page(v_pages)], 1), mode="drop")


def pages_from_host(k_pages, v_pages, host_pool, src_pages, dst_pages, axis: int):
    """Device page ``dst[i]`` of both pools becomes host page ``src[i]``'s K and V; pairs with a
    page out of range are skipped."""
    src, dst = _host_pairs(src_pages, dst_pages, host_pool.shape[0], k_pages.shape[axis])

    def put(pool, kv):
        moved = jnp.moveaxis(pool, axis, 0).at[dst].set(host_pool[src, kv], mode="drop")
        return jnp.moveaxis(moved, 0, axis)
    return put(k_pages, 0), put(v_pages, 1)


# --- attention ---


def attention(q, k, v, starts, counts, scale=None, k_scale=1.0, v_scale=1.0, window=None,
              soft_cap=None, sinks=None):
    """Dense float32 attention, the oracle of ``jaxkv.attention``.

    q [B, T, Hq, D]; k, v [B, Hkv, S, D] (the cache's tokens, dequantized by ``k_scale`` and
    ``v_scale``). Query t < counts[b] of row b, at position p = starts[b] + t, attends to keys
    (p - window, p] (``window`` None: [0, p]; Hq / Hkv query heads per KV head); other queries
    give zeros. ``soft_cap``: each score, after ``scale``, becomes ``soft_cap * tanh(s /
    soft_cap)``. ``sinks`` (float32 [Hq]): head h's logit enters the softmax's denominator only,
    ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``. A query that sees no key gives zeros.
    Returns float32 [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
    q = f32(q).reshape(b, t, hkv, hq // hkv, d)
    k, v = f32(k) * k_scale, f32(v) * v_scale
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, precision=hi) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    last = starts[:, None] + jnp.arange(t)[None, :]  # [B, T]: the last key each query sees
    key = jnp.arange(s)[None, None, :]
    visible = key <= last[:, :, None]
    if window is not None:
        visible &= key > last[:, :, None] - window
    live = jnp.arange(t)[None, :] < counts[:, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink as one more logit, dropped after the softmax
        sink = jnp.broadcast_to(f32(sinks).reshape(1, hkv, hq // hkv, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(visible[:, None, None] & live[:, None, None, :, None], probs, 0.0)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v, precision=hi)
    return out.reshape(b, t, hq, d)


def decode_attention(q, k, v, kv_lengths, scale=None, k_scale=1.0, v_scale=1.0, window=None,
                     soft_cap=None, sinks=None):
    """q [B, Hq, D] over keys [0, kv_lengths[b]) of k, v [B, Hkv, S, D] (the last ``window`` of
    them): float32 [B, Hq, D] (zeros where the length is 0)."""
    out = attention(q[:, None], k, v, kv_lengths - 1, (kv_lengths > 0).astype(jnp.int32), scale,
                    k_scale, v_scale, window, soft_cap, sinks)
    return out[:, 0]


def prefill_attention(q, k, v, lengths, q_lengths, scale=None, k_scale=1.0, v_scale=1.0,
                      window=None, soft_cap=None, sinks=None):
    """q [B, T, Hq, D] at positions lengths[b] + t (t < q_lengths[b]): causal over k, v
    [B, Hkv, S, D], which already hold the new tokens. float32 [B, T, Hq, D]."""
    return attention(q, k, v, lengths, q_lengths, scale, k_scale, v_scale, window, soft_cap,
                     sinks)


# 8-bit caches (jaxkv.quantization): the definition the quantizing kernels match bit for bit.
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
"""The largest magnitude each 8-bit dtype stores (by its numpy name): a scale is ``max|x| / QMAX``."""


@functools.partial(jax.jit, static_argnames="dtype")  # one program, not an op at a time, eagerly
def quantize(x: jax.Array, dtype, scale=None):
    """``(q, scale)``: ``x`` (float, ``[..., D]``) in 8 bits.

    ``scale=None``: one float32 scale per vector over the last axis, ``max|x| / QMAX``;
    otherwise the given float32 scale (broadcast against ``x[..., 0]``). The stored value is
    ``x / scale`` in float32, clipped to ``[-QMAX, QMAX]`` and rounded to nearest even into
    ``dtype``; a zero scale stores zeros. A NaN is left out of its vector's scale and stored as
    the format's NaN under a scale > 0 (its sign unspecified; int8, which has none: 0), as the
    kernels store it.

    >>> q, s = quantize(jnp.array([[0.5, -1.0, 0.25]]), jnp.int8)
    >>> q.tolist(), s.tolist()                           # scale 1 / 127; 63.5 rounds to even
    ([[64, -127, 32]], [0.007874015718698502])
    """
    dtype = jnp.dtype(dtype)
    if dtype.name not in QMAX:
        raise ValueError(f"reference.quantize: dtype must be one of {tuple(QMAX)}, got {dtype}")
    qmax = jnp.float32(QMAX[dtype.name])
    x = x.astype(jnp.float32)
    nan = jnp.isnan(x)
    if scale is None:
        scale = _divide(jnp.max(jnp.where(nan, 0, jnp.abs(x)), axis=-1), qmax)
    scale = jnp.asarray(scale, jnp.float32)
    s = jnp.broadcast_to(scale, x.shape[:-1])[..., None]
    v = jnp.clip(jnp.where(s > 0, _divide(x, jnp.where(s > 0, s, 1)), 0), -qmax, qmax)
    if dtype == jnp.int8:
        v = jnp.where(nan, 0, jnp.round(v))  # to nearest even, as the float formats round
    return v.astype(dtype), jnp.broadcast_to(scale, x.shape[:-1])


def _divide(a, b):
    """``a / b`` in float32, correctly rounded (``b > 0``), on every backend. XLA:CPU divides
    so, once a divisor of ``a``'s full shape sits behind a barrier (a division by a broadcast
    value becomes a multiplication by its reciprocal); XLA:GPU's division is within 2 ulp only
    (``div.full.f32``, openxla/xla#37181), as is TPU's: there, integer long division."""
    a = a.astype(jnp.float32)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape))
    return jax.lax.platform_dependent(a, b, cpu=lambda a, b: a / b, default=divide_exact)


def divide_exact(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` for float32 ``a`` and ``b > 0`` (finite, same shape), correctly rounded to
    nearest even with integer operations alone, subnormals included: 26 quotient bits by long
    division of the significands, then one rounding at the result's precision."""
    u32, i32 = jnp.uint32, jnp.int32
    ua = jax.lax.bitcast_convert_type(a, u32)
    ub = jax.lax.bitcast_convert_type(b, u32)

    def significand(u):  # (m in [2^23, 2^24), biased exponent e): |x| = m * 2^(e - 150)
        e = ((u >> 23) & 0xFF).astype(i32)
        m = u & 0x7FFFFF
        m = jnp.where(e > 0, m | 0x800000, m)
        shift = jnp.maximum(jax.lax.clz(m).astype(i32) - 8, 0)  # a subnormal's leading zeros
        return m << shift.astype(u32), jnp.maximum(e, 1) - shift

    ma, ea = significand(ua)
    mb, eb = significand(ub)
    low = ma < mb  # the quotient of the significands in [1, 2)
    ma, ea = jnp.where(low, ma << 1, ma), ea - low.astype(i32)
    q, r = jnp.zeros_like(ma), ma
    for _ in range(26):  # q: 26 bits of ma / mb, the first one 1
        bit = r >= mb
        q = (q << 1) | bit.astype(u32)
        r = jnp.where(bit, r - mb, r) << 1
    field = ea - eb + 127  # the result's biased exponent; below 1: a subnormal result
    drop = (2 + jnp.clip(1 - field, 0, 29)).astype(u32)  # q's bits below the result's last
    kept, rest, half = q >> drop, q & ((u32(1) << drop) - 1), u32(1) << (drop - 1)
    up = (rest > half) | ((rest == half) & ((r != 0) | ((kept & 1) == 1)))
    kept = kept + up.astype(u32)
    bits = jnp.where(field >= 1, (jnp.maximum(field - 1, 0).astype(u32) << 23) + kept, kept)
    bits = jnp.where(field >= 255, u32(0x7F800000), bits)
    # A zero or non-finite a in bits too: no float operation at all, so that a backend that
    # flushes subnormal operands to zero (XLA:CPU does, in some of its emitters) changes nothing.
    # inf / b is inf, nan / b the quiet nan, 0 / b zero: each with the sign of a * b.
    magnitude = ua & u32(0x7FFFFFFF)
    bits = jnp.where(magnitude == 0, u32(0), bits)
    quiet = (magnitude > 0x7F800000).astype(u32) << 22
    bits = jnp.where(magnitude >= u32(0x7F800000), magnitude | quiet, bits)
    return jax.lax.bitcast_convert_type(bits | ((ua ^ ub) & u32(0x80000000)), jnp.float32)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``float32(q) * scale`` (``scale`` per vector over the last axis), in ``dtype``."""
    return (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[..., None]).astype(dtype)
