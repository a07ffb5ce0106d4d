"""Ring layers of the dense caches (a sliding-window layer of S slots, token p at slot p % S):
appends that wrap several times, attention with positions intact, a scan over layers and over
steps with traced windows, compaction, save / instantiate, 8-bit rings, bad inputs, in place.
Every result is compared with jaxkv.reference over the whole history (a dense cache of every
position): the bytes a ring holds bit for bit, attention to a tolerance."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from jaxkv import attention, reference
from helpers import as_bytes, assert_bytes_equal, copies_of, random_array

B, H, HQ, D = 3, 2, 4, 16
WINDOW, CHUNK = 5, 4
S = WINDOW + CHUNK - 1  # the ring a window of 5 needs for chunks of 4
P = 64  # positions of the reference history
FULL = np.iinfo(np.int32).max

ring_from = jax.jit(reference.ring_from_positions, static_argnames="slots")
ring_to = jax.jit(reference.ring_to_positions, static_argnames="max_len")
prefill_ref = jax.jit(reference.prefill_attention)
decode_ref = jax.jit(reference.decode_attention)
_quantize = jax.jit(reference.quantize, static_argnums=1)
CPU = jax.devices("cpu")[0]


def quantize(x, dtype):
    """reference.quantize on the CPU backend, whose float32 division is IEEE (a GPU's XLA turns
    the scale's division into a product by a reciprocal, which rounds differently)."""
    with jax.default_device(CPU):
        q, s = _quantize(jax.device_put(x, CPU), dtype)
    return jnp.asarray(np.asarray(q)), jnp.asarray(np.asarray(s))
EIGHT_BIT = attention.EIGHT_BIT_DTYPES
_rng = np.random.default_rng()


def normal(shape, dtype=np.float32) -> np.ndarray:
    return (_rng.standard_normal(shape, np.float32) * 2).astype(dtype)



class History:
    """Every position each row was given, per layer: the dense cache the rings are compared
    with. ``kv[l]`` is ``[B, 2, H, P, D]``: what was appended (an 8-bit cache's values before
    they were quantized, float32)."""

    def __init__(self, layers: int, dtype=np.float32, head_dim: int = D):
        self.dtype, self.d = np.dtype(dtype), head_dim
        self.eight_bit = self.dtype in EIGHT_BIT
        self.kv = np.zeros((layers, B, 2, H, P, head_dim),
                           np.float32 if self.eight_bit else self.dtype)
        self.lengths = np.zeros(B, np.int32)

    def given(self, x):
        """``x`` (float32) as an append into the cache takes it."""
        return jnp.asarray(x, jnp.float32 if self.eight_bit else self.dtype)

    def append(self, layer, k, v, counts, active=B):
        for b in range(active):
            at, n = self.lengths[b], counts[b]
            self.kv[layer, b, 0, :, at:at + n] = np.asarray(self.given(k))[b, :, :n]
            self.kv[layer, b, 1, :, at:at + n] = np.asarray(self.given(v))[b, :, :n]

    def commit(self, counts, active=B):
        self.lengths[:active] += np.asarray(counts)[:active]

    def values(self, layer):
        """The values the cache holds of ``layer``'s history, float32 ``[B, 2, H, P, D]``."""
        kv = jnp.asarray(self.kv[layer])
        if self.eight_bit:
            return reference.dequantize(*quantize(kv, self.dtype))
        return kv.astype(jnp.float32)

    def ring(self, layer, slots):
        """The ring of ``slots`` (reference.ring_from_positions) of ``layer``'s history as the
        cache stores it; an 8-bit one's ``(data, k_scales, v_scales)``."""
        lengths = jnp.asarray(self.lengths)
        if not self.eight_bit:
            return ring_from(jnp.asarray(self.kv[layer]), lengths, slots)
        data, scales = quantize(jnp.asarray(self.kv[layer]), self.dtype)
        return (ring_from(data, lengths, slots), ring_from(scales[:, 0], lengths, slots),
                ring_from(scales[:, 1], lengths, slots))


def held_slots(lengths, slots) -> np.ndarray:
    """bool [B, slots]: the slots that hold a position (the rest are unspecified)."""
    return np.asarray(reference.ring_slot_positions(jnp.asarray(lengths), slots)) >= 0


def assert_ring_equal(got, want, lengths, slots, what=""):
    """Bit for bit on the slots that hold a position."""
    held = held_slots(lengths, slots)  # [B, slots]
    mask = held[:, None, None, :, None] if np.ndim(got) == 5 else held[:, None, :]
    mask = np.broadcast_to(mask, np.shape(got))[..., None]
    assert_bytes_equal(np.where(mask, as_bytes(got), 0), np.where(mask, as_bytes(want), 0), what)


def checked(fn, **jit_kwargs):
    """``fn`` under jit and checkify: returns (error message or None, result)."""
    run = jax.jit(checkify.checkify(fn), **jit_kwargs)

    def call(*args):
        err, out = run(*args)
        return err.get(), out

    return call


# --- appends that wrap several times ---


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_appends_wrap_several_times(dtype):
    """Chunks of ragged lengths and single tokens into two ring layers (the layer index traced),
    an inactive row untouched: each ring equals the last S positions of the history, bit for
    bit, after lengths of several laps."""
    cache = jaxkv.LinearKVCache.create(2, B, H, S, D, dtype, ring=True)
    poison = random_array(cache.buffer.shape, dtype)
    cache = dataclasses.replace(cache, buffer=poison + 0).reset(jnp.zeros((2,), jnp.int32))
    hist = History(2, dtype)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(c, k, v, n):
        c = c.append(0, k[0], v[0], n).append(jnp.int32(1), k[1], v[1], n)
        return c.commit(n)

    for tokens, steps in ((CHUNK, 9), (1, 9), (CHUNK, 3)):
        for i in range(steps):  # ragged: each row 0, 2 or 4 tokens of a chunk in turn
            n = np.asarray([(0, 2, 4)[(i + b) % 3] if tokens > 1 else 1 for b in range(B)],
                           np.int32)
            k, v = normal((2, B, H, tokens, D)), normal((2, B, H, tokens, D))
            cache = step(cache, hist.given(k), hist.given(v), jnp.asarray(n))
            for layer in range(2):
                hist.append(layer, k[layer], v[layer], n, active=2)
            hist.commit(n, active=2)
    np.testing.assert_array_equal(cache.lengths, hist.lengths)
    assert hist.lengths[:2].min() > 3 * S  # several laps
    for layer in range(2):
        got = np.array(cache.layer(layer))
        assert_ring_equal(got[:2], hist.ring(layer, S)[:2], hist.lengths[:2], S, f"layer {layer}")
        assert_bytes_equal(got[2], np.asarray(poison)[layer, 2], "the inactive row")
        # read back at positions, the dense cache's last S tokens
        np.testing.assert_array_equal(
            ring_to(jnp.asarray(got), jnp.asarray(hist.lengths), P)[:2],
            ring_to(hist.ring(layer, S), jnp.asarray(hist.lengths), P)[:2])


# --- attention over a ring, positions intact ---


def _prefill_steps(cache, hist, steps, window, layer=0, qdtype=jnp.float32, tol=2e-5):
    """Chunked ragged prefill: append, attend (clean under checkify), commit; each chunk's
    output equal to the reference over the whole history with the same window."""

    def step(c, k, v, q, n, w):
        c = c.append(layer, k, v, n)
        return c.commit(n), attention.prefill(q, c, layer, n, window=w)

    run = checked(step, donate_argnums=0)
    for i in range(steps):
        n = np.asarray([(1, CHUNK, 3, 0, 2)[(i + b) % 5] for b in range(B)], np.int32)
        k, v = normal((B, H, CHUNK, hist.d)), normal((B, H, CHUNK, hist.d))
        q = normal((B, CHUNK, HQ, hist.d))
        err, (cache, out) = run(cache, hist.given(k), hist.given(v), jnp.asarray(q, qdtype),
                                jnp.asarray(n), window)
        assert err is None, err
        hist.append(layer, k, v, n)
        kv = hist.values(layer)
        want = prefill_ref(jnp.asarray(q, qdtype), kv[:, 0], kv[:, 1], jnp.asarray(hist.lengths),
                           jnp.asarray(n), window=window)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol, rtol=tol)
        hist.commit(n)
    return cache


def _decode_steps(cache, hist, steps, window, layer=0, qdtype=jnp.float32, tol=2e-5):
    """Decode steps (append, commit, attend), as ``_prefill_steps``."""

    def step(c, k, v, q, w):
        c = c.append(layer, k, v).commit(1)
        return c, attention.decode(q, c, layer, window=w)

    run = checked(step, donate_argnums=0)
    for _ in range(steps):
        k, v, q = normal((B, H, 1, hist.d)), normal((B, H, 1, hist.d)), normal((B, HQ, hist.d))
        err, (cache, out) = run(cache, hist.given(k), hist.given(v), jnp.asarray(q, qdtype),
                                window)
        assert err is None, err
        hist.append(layer, k, v, np.ones(B, np.int32))
        hist.commit(np.ones(B, np.int32))
        kv = hist.values(layer)
        want = decode_ref(jnp.asarray(q, qdtype), kv[:, 0], kv[:, 1], jnp.asarray(hist.lengths),
                          window=window)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol, rtol=tol)
    return cache


@pytest.mark.parametrize("window", [WINDOW, "traced"])
def test_attention_over_a_ring_matches_the_whole_history(window):
    """Chunked ragged prefill then decode over a ring of window + chunk - 1 slots, rows several
    laps around: equal to the reference over every position with the same window (a static or
    a traced one), and clean under checkify."""
    w = jnp.int32(WINDOW) if window == "traced" else WINDOW
    cache = jaxkv.LinearKVCache.create(1, B, H, S, D, jnp.float32, ring=True)
    cache = cache.reset(jnp.zeros((B,), jnp.int32))
    hist = History(1)
    cache = _prefill_steps(cache, hist, 8, w)
    cache = _decode_steps(cache, hist, 10, w)
    assert hist.lengths.min() > 2 * S
    assert_ring_equal(cache.layer(0), hist.ring(0, S), hist.lengths, S)


def _decode_history(hist, k, v, q, windows):
    """The reference outputs of decode steps ``k, v`` ``[steps, L, B, H, 1, D]``, ``q``
    ``[steps, L, B, HQ, D]`` (layer l with ``windows[l]``), the history advancing a token a
    step: float32 ``[steps, L, B, HQ, D]``."""
    out = []
    for t in range(k.shape[0]):
        per_layer = []
        for layer, w in enumerate(windows):
            hist.append(layer, k[t, layer], v[t, layer], np.ones(B, np.int32))
        hist.commit(np.ones(B, np.int32))
        for layer, w in enumerate(windows):
            kv = hist.values(layer)
            per_layer.append(decode_ref(jnp.asarray(q[t, layer]), kv[:, 0], kv[:, 1],
                                        jnp.asarray(hist.lengths), window=w))
        out.append(np.stack(per_layer))
    return np.stack(out)


def test_scan_over_layers_and_steps_with_traced_windows():
    """A ring LinearKVCache scanned over its layers (a traced window each) inside a scan over
    decode steps; a KVCacheManager of a ring layer and a layer of full attention (its layers
    unrolled, the windows traced) in a scan over steps. Ragged lengths (reused rows start at
    3 and 7 tokens); both equal to the reference over the whole history, clean under
    checkify."""
    steps, start = 20, jnp.asarray([0, 3, 7], jnp.int32)
    k, v = normal((steps, 2, B, H, 1, D)), normal((steps, 2, B, H, 1, D))
    q = normal((steps, 2, B, HQ, D))
    windows = jnp.asarray([WINDOW, S], jnp.int32)  # decode: a window of up to S over a ring of S

    def linear_step(c, x):
        def layer(c, y):
            i, k, v, q, w = y
            c = c.append(i, k, v)
            return c, attention.decode(q, c, i, kv_lengths=c.lengths + 1, window=w)
        kx, vx, qx = x
        c, out = jax.lax.scan(layer, c, (jnp.arange(2, dtype=jnp.int32), kx, vx, qx, windows))
        return c.commit(1), out

    cache = jaxkv.LinearKVCache.create(2, B, H, S, D, jnp.float32, ring=True).reset(start)
    run = checked(lambda c, xs: jax.lax.scan(linear_step, c, xs), donate_argnums=0)
    err, (cache, out) = run(cache, (jnp.asarray(k), jnp.asarray(v), jnp.asarray(q)))
    assert err is None, err
    hist = History(2)
    hist.lengths[:] = start
    want = _decode_history(hist, k, v, q, [WINDOW, S])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    for layer in range(2):
        assert_ring_equal(cache.layer(layer), hist.ring(layer, S), hist.lengths, S)

    configs = [jaxkv.KVLayerConfig(H, D, S, ring=True), jaxkv.KVLayerConfig(H, D)]
    cache = jaxkv.KVCacheManager.create(configs, B, P, jnp.float32).reset(start)
    assert cache.rings == (True, False) and cache.max_length == P

    def manager_step(c, x):
        kx, vx, qx, w = x
        c = c.append(0, kx[0], vx[0]).append(1, kx[1], vx[1]).commit(1)
        return c, jnp.stack([attention.decode(qx[i], c, i, window=w[i]) for i in range(2)])

    run = checked(lambda c, xs, w: jax.lax.scan(lambda c, x: manager_step(c, (*x, w)), c, xs),
                  donate_argnums=0)
    err, (cache, out) = run(cache, (jnp.asarray(k), jnp.asarray(v), jnp.asarray(q)),
                            jnp.asarray([WINDOW, FULL], jnp.int32))
    assert err is None, err
    hist = History(2)
    hist.lengths[:] = start
    want = _decode_history(hist, k, v, q, [WINDOW, None])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    assert_ring_equal(cache.combined(0), hist.ring(0, S), hist.lengths, S)
    np.testing.assert_array_equal(np.asarray(cache.combined(1))[:, :, :, :hist.lengths.max()],
                                  hist.kv[1][:, :, :, :hist.lengths.max()])


@pytest.mark.gpu_sized
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_attention_over_a_ring_at_head_dim_128(dtype):
    """The shapes of the GPU's tensor-core kernels (head_dim 128: split-KV decode, the prefill
    tiles, on Hopper warpgroup MMA and an 8-bit cache's pass over its V scales) over a ring a
    few laps around: equal to the reference over the whole history."""
    cache = jaxkv.LinearKVCache.create(1, B, H, S, 128, dtype, ring=True)
    cache = cache.reset(jnp.asarray([0, 5, 11], jnp.int32))
    hist = History(1, dtype, head_dim=128)
    hist.lengths[:] = [0, 5, 11]
    cache = _prefill_steps(cache, hist, 6, WINDOW, qdtype=jnp.bfloat16, tol=3e-2)
    cache = _decode_steps(cache, hist, 3, WINDOW, qdtype=jnp.bfloat16, tol=3e-2)
    assert hist.lengths.min() > S and hist.lengths.max() > 3 * S


# --- compaction, save / instantiate ---


def _fill(cache, hist, targets, layers=(0,)):
    """Appends chunks of random tokens (at most CHUNK at once) until the rows hold ``targets``
    tokens (every layer of ``layers``)."""
    step = jax.jit(lambda c, k, v, n: functools.reduce(
        lambda c, i: c.append(layers[i], k[i], v[i], n), range(len(layers)), c).commit(n),
        donate_argnums=0)
    while (hist.lengths < targets).any():
        n = np.minimum(np.asarray(targets) - hist.lengths, CHUNK).astype(np.int32)
        k, v = normal((len(layers), B, H, CHUNK, D)), normal((len(layers), B, H, CHUNK, D))
        cache = step(cache, hist.given(k), hist.given(v), jnp.asarray(n))
        for i, layer in enumerate(layers):
            hist.append(layer, k[i], v[i], n)
        hist.commit(n)
    return cache


def test_compaction_moves_rings_whole():
    """Rows of rings several laps long evicted and moved in one launch: the survivors' rings
    and lengths move whole, and appends go on where they left off."""
    cache = jaxkv.LinearKVCache.create(1, B, H, S, D, jnp.bfloat16, ring=True)
    cache = cache.reset(jnp.zeros((B,), jnp.int32))
    hist = History(1, jnp.bfloat16)
    cache = _fill(cache, hist, [19, 26, 13])
    mapping = jnp.asarray([-1, 1, 0], jnp.int32)
    cache = jax.jit(lambda c, m: c.compact(m), donate_argnums=0)(cache, mapping)
    hist.kv[:, :2], hist.lengths = hist.kv[:, [2, 1]], np.asarray([13, 26, 0], np.int32)
    np.testing.assert_array_equal(cache.lengths, hist.lengths)
    assert int(cache.active_batch_size) == 2
    cache = _fill(cache, hist, [22, 29, 0])
    assert_ring_equal(np.asarray(cache.layer(0))[:2], hist.ring(0, S)[:2], hist.lengths[:2], S)


def test_save_and_instantiate_rings():
    """A ring saves a prompt longer than its slots as its last S tokens, in order (a shorter one
    whole), and instantiates it back with position p at slot p % S; a KVCacheManager of a ring
    and a layer of full attention saves and instantiates both; a long prompt saved from a
    cache of full attention goes into a ring as its last S tokens. Attention over the
    instantiated rings equals the reference."""
    cache = jaxkv.LinearKVCache.create(2, B, H, S, D, jnp.float32, ring=True)
    cache = cache.reset(jnp.zeros((B,), jnp.int32))
    hist = History(2)
    cache = _fill(cache, hist, [13, 6, 8], layers=(0, 1))
    saves = {}
    for row, seq_len in ((0, 13), (1, 6), (2, 5)):
        err, saved = checked(lambda c, r: c.save(r, seq_len))(cache, jnp.int32(row))
        assert err is None, err
        want = hist.kv[:, row, :, :, max(0, seq_len - S):seq_len]
        assert saved.tokens == min(seq_len, S) and int(saved.length) == seq_len
        for layer in range(2):
            np.testing.assert_array_equal(saved.layers[layer], want[layer])
        saves[row] = saved

    fresh = jaxkv.LinearKVCache.create(2, B, H, S, D, jnp.float32, ring=True)
    instantiate = checked(lambda c, s, rows: c.instantiate(s, rows), donate_argnums=0)
    err, into = instantiate(fresh, saves[0], jnp.asarray([0, 2], jnp.int32))
    assert err is None, err
    err, into = instantiate(into, saves[1], jnp.asarray([1], jnp.int32))
    assert err is None, err
    into = into.reset(jnp.asarray([13, 6, 13], jnp.int32))
    want = History(2)
    want.kv[:, [0, 2]], want.kv[:, 1] = hist.kv[:, [0, 0]], hist.kv[:, 1]
    want.lengths[:] = [13, 6, 13]
    for layer in range(2):
        assert_ring_equal(into.layer(layer), want.ring(layer, S), want.lengths, S)
    _decode_steps(into, want, 3, WINDOW, layer=1)

    # a manager of a ring and a layer of full attention
    configs = [jaxkv.KVLayerConfig(H, D, S, ring=True), jaxkv.KVLayerConfig(H, D)]
    manager = jaxkv.KVCacheManager.create(configs, B, 32, jnp.float32)
    manager = manager.reset(jnp.zeros((B,), jnp.int32))
    mhist = History(2)
    manager = _fill(manager, mhist, [13, 3, 0], layers=(0, 1))
    saved = manager.save(0, 13)
    assert [x.shape[2] for x in saved.layers] == [S, 13]
    np.testing.assert_array_equal(saved.layers[0], mhist.kv[0, 0, :, :, 13 - S:13])
    np.testing.assert_array_equal(saved.layers[1], mhist.kv[1, 0, :, :, :13])
    err, other = instantiate(jaxkv.KVCacheManager.create(configs, B, 32, jnp.float32), saved,
                             jnp.asarray([2], jnp.int32))
    assert err is None, err
    other = other.reset(jnp.asarray([0, 0, 13], jnp.int32))
    want = History(2)
    want.kv[:, 2], want.lengths[:] = mhist.kv[:, 0], [0, 0, 13]
    assert_ring_equal(other.combined(0)[2:], want.ring(0, S)[2:], want.lengths[2:], S)
    np.testing.assert_array_equal(np.asarray(other.combined(1))[2, :, :, :13],
                                  mhist.kv[1, 0, :, :, :13])

    # a prompt of full attention, longer than the ring: its last S tokens
    dense = jaxkv.LinearKVCache.create(2, B, H, 32, D, jnp.float32).reset(
        jnp.zeros((B,), jnp.int32))
    dhist = History(2)
    dense = _fill(dense, dhist, [11, 0, 0], layers=(0, 1))
    fresh = jaxkv.LinearKVCache.create(2, B, H, S, D, jnp.float32, ring=True)
    err, ring = instantiate(fresh, dense.save(0, 11), jnp.asarray([1], jnp.int32))
    assert err is None, err
    want = History(2)
    want.kv[:, 1], want.lengths[:] = dhist.kv[:, 0], [0, 11, 0]
    for layer in range(2):
        assert_ring_equal(ring.layer(layer)[1:2], want.ring(layer, S)[1:2], want.lengths[1:2], S)


# --- 8-bit rings ---


def test_fp8_rings_quantize_attend_move_and_reuse():
    """An fp8 e4m3 ring scaled per token and head: its bytes and scales after appends of several
    laps are the reference's quantization of the last S tokens, bit for bit; prefill and decode
    over it equal the reference over the dequantized history; compaction moves the scales with
    the data; a prompt saved from it (its last S tokens, scales too) and a float prompt
    quantized on the way instantiate into another ring at their slots."""
    dtype = jnp.float8_e4m3fn
    cache = jaxkv.LinearKVCache.create(1, B, H, S, D, dtype, ring=True)
    assert cache.scaling == "per_token_head"
    cache = cache.reset(jnp.zeros((B,), jnp.int32))
    hist = History(1, dtype)
    cache = _prefill_steps(cache, hist, 8, WINDOW, qdtype=jnp.bfloat16, tol=3e-2)
    cache = _decode_steps(cache, hist, 4, WINDOW, qdtype=jnp.bfloat16, tol=3e-2)
    assert hist.lengths.min() > 2 * S

    def assert_like(got, want, rows, lengths):
        for x, y, what in zip((got.buffer[0], got.k_scales[0], got.v_scales[0]), want,
                              ("data", "k_scales", "v_scales")):
            assert_ring_equal(np.asarray(x)[rows], np.asarray(y)[rows], lengths[rows], S, what)

    assert_like(cache, hist.ring(0, S), slice(None), hist.lengths)
    cache = jax.jit(lambda c, m: c.compact(m), donate_argnums=0)(
        cache, jnp.asarray([1, 0, -1], jnp.int32))
    hist.kv[:, :2], hist.lengths = hist.kv[:, [1, 0]], np.asarray([*hist.lengths[[1, 0]], 0])
    assert_like(cache, hist.ring(0, S), slice(0, 2), hist.lengths)

    length = int(hist.lengths[0])
    saved = cache.save(0, length)
    assert saved.scaling == "per_token_head" and saved.k_scales[0].shape == (H, S)
    fresh = jaxkv.LinearKVCache.create(1, B, H, S, D, dtype, ring=True)
    into = jax.jit(lambda c, s: c.instantiate(s, 2))(fresh, saved)
    prompt = jaxkv.SavedKV((jnp.asarray(hist.kv[0, 0, :, :, :length]),),
                           jnp.asarray(length, jnp.int32))  # float: quantized on the way
    into = jax.jit(lambda c, s: c.instantiate(s, 1))(into, prompt)
    want = History(1, dtype)
    want.kv[0, 1:], want.lengths[:] = hist.kv[0, 0], [0, length, length]
    assert_like(into, want.ring(0, S), slice(1, 3), want.lengths)


# --- bad inputs ---


def test_bad_ring_arguments_are_refused_at_trace_time():
    with pytest.raises(TypeError, match=r"LinearKVCache.create: ring must be a bool"):
        jaxkv.LinearKVCache.create(1, B, H, S, D, jnp.float32, ring="yes")
    with pytest.raises(ValueError, match=r"LinearKVCache.create: max_seq_len is 1073741824, more "
                                         r"than a ring holds"):
        jaxkv.LinearKVCache.create(1, 1, 1, 2**30, 16, jnp.float32, ring=True)
    with pytest.raises(TypeError, match=r"KVCacheManager.create: layer_configs\[1\].ring must be"):
        jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(H, D), jaxkv.KVLayerConfig(H, D, S, 1)],
                                    B, 32)
    ring = jaxkv.LinearKVCache.create(1, B, H, S, D, jnp.float32, ring=True)
    k = jnp.zeros((B, H, S + 1, D), jnp.float32)
    with pytest.raises(ValueError, match=r"LinearKVCache.append: k has 9 tokens, more than the "
                                         r"ring's 8 slots"):
        ring.append(0, k, k)
    configs = [jaxkv.KVLayerConfig(H, D, S, ring=True), jaxkv.KVLayerConfig(H, D, 16)]
    manager = jaxkv.KVCacheManager.create(configs, B, 16)
    with pytest.raises(ValueError, match=r"KVCacheManager.save: seq_len 17 exceeds max_seq_len "
                                         r"16 of layers\[1\]"):
        manager.save(0, 17)
    assert manager.save(0, 16).layers[0].shape[2] == S  # the ring's last S of 16


def test_reads_past_the_ring_are_reported_and_never_another_tokens():
    """Reported through checkify: more than S tokens appended at once (the ring keeps the last
    S, as reference.ring_append_layer), full attention past S tokens and a window wider than
    the ring (each query reads only the ring: the reference over its last S positions), a decode
    at kv_lengths below a wrapped row's length (zeros), a save of tokens that left the ring, a
    prompt saved from a ring into a layer that needs all of it (nothing written), lengths past
    int32."""
    cache = jaxkv.LinearKVCache.create(1, B, H, S, D, jnp.float32, ring=True)
    cache = cache.reset(jnp.zeros((B,), jnp.int32))
    hist = History(1)
    cache = _fill(cache, hist, [13, 9, 4])
    before = np.array(cache.layer(0))

    # 10 tokens at once into 8 slots (rows 0 and 1; row 2 appends 3)
    k, v = normal((B, H, 12, D)), normal((B, H, 12, D))
    n = jnp.asarray([10, 12, 3], jnp.int32)
    err, wide = checked(lambda c, k, v, n: c.append(0, k, v, n).commit(n))(cache, k, v, n)
    assert "more than max_seq_len tokens appended at once into a ring" in err
    want = jax.jit(reference.ring_append_layer)(jnp.asarray(before), k, v, cache.lengths, 3, n)
    assert_bytes_equal(wide.layer(0), want)

    # full attention, and a prefill window wider than the ring: only the ring is read
    q1 = normal((B, HQ, D))
    err, out = checked(lambda c, q: attention.decode(q, c, 0))(cache, q1)
    assert "a read of positions that have left the ring" in err
    kv = hist.values(0)
    np.testing.assert_allclose(out, decode_ref(q1, kv[:, 0], kv[:, 1], jnp.asarray(hist.lengths),
                                               window=S), atol=2e-5, rtol=2e-5)
    q4, kn, vn = normal((B, CHUNK, HQ, D)), normal((B, H, CHUNK, D)), normal((B, H, CHUNK, D))
    full = jnp.full((B,), CHUNK, jnp.int32)
    err, out = checked(lambda c, q, w: attention.prefill(q, c.append(0, kn, vn), 0, full,
                                                         window=w))(cache, q4, jnp.int32(S))
    assert "a read of positions that have left the ring" in err
    hist.append(0, kn, vn, np.asarray(full))
    kv = hist.values(0)
    for t in range(CHUNK):  # query t sees keys [length + CHUNK - S, length + t]
        want = prefill_ref(q4, kv[:, 0], kv[:, 1], jnp.asarray(hist.lengths), full,
                           window=S - CHUNK + 1 + t)
        np.testing.assert_allclose(out[:, t], want[:, t], atol=2e-5, rtol=2e-5)

    # a decode below a wrapped row's length, whose window reaches overwritten slots, and one
    # past the token appended before commit: zeros
    err, out = checked(lambda c, q, kl: attention.decode(q, c, 0, kv_lengths=kl, window=4))(
        cache, q1, jnp.asarray([8, 9, 6], jnp.int32))
    assert "a read of positions that have left the ring" in err
    out = np.asarray(out)
    assert np.all(out[0] == 0) and np.any(out[1] != 0) and np.all(out[2] == 0)

    # saves and instantiates that would need tokens the ring no longer holds
    err, _ = checked(lambda c: c.save(0, 4))(cache)
    assert "tokens the save takes have left the ring" in err
    saved = cache.save(0, 13)  # the last 8 of 13 tokens
    dense = jaxkv.LinearKVCache.create(1, B, H, 16, D, jnp.float32)
    poison = random_array(dense.buffer.shape, jnp.float32)
    for into in (dataclasses.replace(dense, buffer=poison + 0),
                 dataclasses.replace(jaxkv.LinearKVCache.create(1, B, H, 12, D, jnp.float32,
                                                                ring=True),
                                     buffer=poison[:, :, :, :, :12] + 0)):
        err, out = checked(lambda c, s: c.instantiate(s, 1))(into, saved)
        assert "nothing is written" in err
        assert_bytes_equal(out.buffer, into.buffer, "an instantiate that was refused")

    # lengths of a ring stop at int32's end
    err, out = checked(lambda c: c.reset(jnp.asarray([2**31 - 3], jnp.int32)).commit(5))(cache)
    assert "passes the capacity" in err and int(out.lengths[0]) == 2**31 - 1


# --- in place ---


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_ring_steps_run_in_place(dtype):
    """Append, prefill over the ring and commit under donation: no copy of the cache (nor of an
    8-bit one's scales) in the compiled step, the same buffer after it; an instantiate into a
    ring too (its roll copies the saved prompt, never the cache)."""
    cache = jaxkv.LinearKVCache.create(2, B, H, S, D, dtype, ring=True)
    cache = cache.reset(jnp.asarray([5, 11, 30], jnp.int32))
    k = jnp.ones((B, H, CHUNK, D), jnp.bfloat16)
    q = jnp.ones((B, CHUNK, HQ, D), jnp.bfloat16)
    n = jnp.asarray([CHUNK, 2, 1], jnp.int32)

    def step(c, i):
        c = c.append(i, k, k, n)
        return c.commit(n), attention.prefill(q, c, i, n, window=WINDOW)

    step = jax.jit(step, donate_argnums=0)
    hlo = step.lower(cache, jnp.int32(1)).compile().as_text()
    leaves = [cache.buffer] + ([cache.k_scales] if cache.scaling else [])
    assert not any(copies_of(hlo, x) for x in leaves)
    pointer = cache.buffer.unsafe_buffer_pointer()
    cache, _ = step(cache, jnp.int32(1))
    assert cache.buffer.unsafe_buffer_pointer() == pointer
    saved = jaxkv.SavedKV((jnp.ones((2, H, 11, D), jnp.bfloat16),) * 2, jnp.asarray(11, jnp.int32))
    instantiate = jax.jit(lambda c, s: c.instantiate(s, 0), donate_argnums=0)
    assert not any(copies_of(instantiate.lower(cache, saved).compile().as_text(), x)
                   for x in leaves)
