"""LinearKVCache: the whole lifecycle against the reference, in place under donation and scan."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from helpers import DTYPE_IDS, DTYPES, assert_bytes_equal, copies_of, random_array
from helpers import ref as reference

L, B, H, S, D = 3, 5, 2, 16, 24


def filled_cache(dtype=jnp.bfloat16, head_dim=D, active=4):
    """A cache whose buffer is random (poison: unwritten tokens show) with random lengths."""
    cache = jaxkv.LinearKVCache.create(L, B, H, S, head_dim, dtype)
    lengths = jnp.asarray(np.random.default_rng().integers(0, S // 2, active), jnp.int32)
    cache = cache.reset(lengths)
    return jaxkv.LinearKVCache(random_array(cache.buffer.shape, dtype), cache.lengths,
                               cache.active_batch_size)


def reference_append(cache, layer_idx, k, v, new_lengths=None):
    layer = reference.append_layer(cache.layer(layer_idx), k, v, cache.lengths,
                                   cache.active_batch_size, new_lengths)
    return cache.buffer.at[layer_idx].set(layer)


def test_create_and_views():
    cache = jaxkv.LinearKVCache.create(L, B, H, S, D, jnp.float16)
    assert cache.buffer.shape == (L, B, 2, H, S, D) and cache.dtype == jnp.float16
    assert (cache.num_layers, cache.max_batch, cache.num_kv_heads, cache.max_seq_len,
            cache.head_dim) == (L, B, H, S, D)
    cache = jaxkv.LinearKVCache(random_array(cache.buffer.shape, jnp.float16), cache.lengths,
                                cache.active_batch_size)
    assert_bytes_equal(cache.layer(1), cache.buffer[1])
    assert_bytes_equal(cache.keys(2), cache.buffer[2, :, 0])
    assert_bytes_equal(cache.values(0), cache.buffer[0, :, 1])
    assert cache.keys(0).shape == (B, H, S, D)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 576, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_matches_reference(dtype, head_dim):
    cache = filled_cache(dtype, head_dim)
    k, v = (random_array((B, H, 3, head_dim), dtype) for _ in range(2))
    out = jax.jit(lambda c, i: c.append(i, k, v))(cache, jnp.int32(1))  # traced layer index
    assert_bytes_equal(out.buffer, reference_append(cache, 1, k, v))
    np.testing.assert_array_equal(out.lengths, cache.lengths)  # append does not commit


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=str)
def test_ragged_prefill(dtype):
    cache = filled_cache(dtype).reset(jnp.asarray([0, 3, 0, 5], jnp.int32))
    k, v = (random_array((B, H, 8, D), dtype) for _ in range(2))
    new_lengths = jnp.asarray([8, 0, 5, 1, 7], jnp.int32)  # slot 4 is inactive
    out = cache.append(2, k, v, new_lengths).commit(new_lengths)
    assert_bytes_equal(out.buffer, reference_append(cache, 2, k, v, new_lengths))
    np.testing.assert_array_equal(out.lengths, [8, 3, 5, 6, 0])


def test_tokens_past_capacity_are_dropped_and_reported():
    cache = filled_cache(jnp.float32).reset(jnp.asarray([S - 2, 1], jnp.int32))
    k, v = (random_array((B, H, 4, D), jnp.float32) for _ in range(2))
    append = checkify.checkify(lambda c: c.append(0, k, v).commit(4))
    err, out = jax.jit(append)(cache)
    assert "past max_seq_len" in err.get()
    assert_bytes_equal(out.buffer, reference_append(cache, 0, k, v))  # row 0 keeps 2 of 4
    assert_bytes_equal(out.buffer[1:], cache.buffer[1:])  # other layers untouched
    np.testing.assert_array_equal(out.lengths[:2], [S, 5])


def test_out_of_range_layer_writes_nothing_and_is_reported():
    cache = filled_cache()
    k, v = (random_array((B, H, 1, D), jnp.bfloat16) for _ in range(2))
    err, out = jax.jit(checkify.checkify(lambda c, i: c.append(i, k, v)))(cache, jnp.int32(L))
    assert "layer_idx out of range" in err.get()
    assert_bytes_equal(out.buffer, cache.buffer)


def test_commit_reset_active_and_all_empty():
    cache = jaxkv.LinearKVCache.create(L, B, H, S, D).reset(jnp.zeros((3,), jnp.int32))
    assert bool(cache.all_empty) and int(cache.active_batch_size) == 3
    cache = cache.commit(2)
    np.testing.assert_array_equal(cache.lengths, [2, 2, 2, 0, 0])
    assert not bool(cache.all_empty)
    cache = cache.commit(jnp.asarray([1, 0, 3, 9, 9], jnp.int32))  # inactive slots ignored
    np.testing.assert_array_equal(cache.lengths, [3, 2, 5, 0, 0])
    cache = cache.set_active_batch_size(1)
    np.testing.assert_array_equal(cache.commit(1).lengths, [4, 2, 5, 0, 0])
    with pytest.raises(ValueError, match="reuse_lengths has 6 entries"):
        cache.reset(jnp.zeros((6,), jnp.int32))
    with pytest.raises(ValueError, match=r"n must be in \[0, 5\]"):
        cache.set_active_batch_size(6)
    with pytest.raises(TypeError, match="new_lengths must be int32"):
        cache.commit(jnp.ones((B,), jnp.float32))


def test_compact_moves_sequences_and_lengths():
    cache = filled_cache(active=5)
    mapping = jnp.asarray([-1, 0, -1, 1, 2], jnp.int32)
    out = jax.jit(lambda c, m: c.compact(m))(cache, mapping)
    assert int(out.active_batch_size) == 3
    np.testing.assert_array_equal(out.lengths, reference.compact_lengths(cache.lengths, mapping))
    for old, new in ((1, 0), (3, 1), (4, 2)):
        n = int(cache.lengths[old])
        assert_bytes_equal(out.buffer[:, new, :, :, :n], cache.buffer[:, old, :, :, :n])


def test_compact_reports_survivors_past_the_front():
    cache = filled_cache(active=3)
    err, _ = checkify.checkify(lambda c: c.compact(jnp.asarray([3, -1, 0, -1, -1], jnp.int32)))(cache)
    assert "survivors must land" in err.get()


def test_bad_append_arguments():
    cache = filled_cache()
    k = random_array((B, H, 1, D), jnp.bfloat16)
    with pytest.raises(TypeError, match="LinearKVCache.append: k has dtype float32"):
        cache.append(0, k.astype(jnp.float32), k)
    with pytest.raises(ValueError, match=r"LinearKVCache.append: v must have shape"):
        cache.append(0, k, k[:, :1])
    with pytest.raises(ValueError, match="k must have rank 4"):
        cache.append(0, k[0], k)
    with pytest.raises(TypeError, match="layer_idx must be an int or an int32 scalar"):
        cache.append(True, k, k)


def test_append_and_compact_in_place_under_donation():
    cache = filled_cache()
    k, v = (random_array((B, H, 1, D), jnp.bfloat16) for _ in range(2))
    step = jax.jit(lambda c, i: c.append(i, k, v).commit(1), donate_argnums=0)
    assert not copies_of(step.lower(cache, jnp.int32(0)).compile().as_text(), cache.buffer)
    before = cache.buffer.unsafe_buffer_pointer()
    cache = step(cache, jnp.int32(0))
    assert cache.buffer.unsafe_buffer_pointer() == before

    compact = jax.jit(lambda c, m: c.compact(m), donate_argnums=0)
    mapping = jnp.asarray([1, 0, -1, 2, -1], jnp.int32)
    assert not copies_of(compact.lower(cache, mapping).compile().as_text(), cache.buffer)
    assert compact(cache, mapping).buffer.unsafe_buffer_pointer() == before


def test_scan_of_64_decode_steps_stays_in_place():
    cache = jaxkv.LinearKVCache.create(2, 4, 2, 80, 32, jnp.bfloat16).reset(
        jnp.zeros((4,), jnp.int32))
    tokens = random_array((64, 2, 2, 4, 2, 1, 32), jnp.bfloat16)  # [step, K/V, layer, B, H, 1, D]

    def decode(cache, kv_step):
        def layer_step(cache, i):
            return cache.append(i, kv_step[0, i], kv_step[1, i]), None
        cache, _ = jax.lax.scan(layer_step, cache, jnp.arange(2, dtype=jnp.int32))
        return cache.commit(1), None

    run = jax.jit(lambda c, t: jax.lax.scan(decode, c, t)[0], donate_argnums=0)
    assert not copies_of(run.lower(cache, tokens).compile().as_text(), cache.buffer)
    before = cache.buffer.unsafe_buffer_pointer()
    out = run(cache, tokens)
    assert out.buffer.unsafe_buffer_pointer() == before
    np.testing.assert_array_equal(out.lengths, [64] * 4)
    for kv in (0, 1):
        expected = jnp.moveaxis(tokens[:, kv, :, :, :, 0], 0, 3)  # [layer, B, H, step, D]
        assert_bytes_equal(out.buffer[:, :, kv, :, :64], expected)


def test_decode_loop_with_evictions_matches_reference_loop():
    """append/commit, compact with evictions, admissions, more appends: live tokens match a
    reference loop built from reference.py ops on plain arrays."""
    dtype = jnp.float16
    cache = jaxkv.LinearKVCache.create(L, B, H, S, D, dtype).reset(
        jnp.asarray([0, 0, 0, 0], jnp.int32))
    ref_buf, ref_len, ref_active = jnp.zeros_like(cache.buffer), jnp.zeros((B,), jnp.int32), 4

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, k, v):
        for i in range(L):
            cache = cache.append(i, k[i], v[i])
        return cache.commit(1)

    def ref_step(buf, lengths, active, k, v):
        for i in range(L):
            buf = buf.at[i].set(reference.append_layer(buf[i], k[i], v[i], lengths, active))
        return buf, jnp.where(jnp.arange(B) < active, lengths + 1, lengths)

    evictions = {3: [0, -1, 1, 2, -1], 6: [-1, 0, -1, -1, -1]}
    for t in range(10):
        k, v = (random_array((L, B, H, 1, D), dtype) for _ in range(2))
        cache = step(cache, k, v)
        ref_buf, ref_len = ref_step(ref_buf, ref_len, ref_active, k, v)
        if t in evictions:
            mapping = jnp.asarray(evictions[t], jnp.int32)
            cache = cache.compact(mapping)
            (ref_layers, ref_len) = reference.compact_kv_cache(list(ref_buf), ref_len, mapping)
            ref_buf, ref_active = jnp.stack(ref_layers), int((mapping >= 0).sum())
            # admit new sequences into the freed slots
            cache = cache.set_active_batch_size(ref_active + 1)
            ref_active += 1
        assert int(cache.active_batch_size) == ref_active
        np.testing.assert_array_equal(cache.lengths, ref_len)
    for b in range(ref_active):
        n = int(ref_len[b])
        assert_bytes_equal(cache.buffer[:, b, :, :, :n], ref_buf[:, b, :, :, :n], f"seq {b}")
