"""save_kv_cache / instantiate_kv_cache against the pure-jnp reference, bit for bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from jaxkv import reference
from helpers import DTYPE_IDS, DTYPES, assert_bytes_equal, assert_launches, copies_of, random_array

HEAD_DIMS = [64, 80, 128, 256, 512, 576]




# The references, jitted: one compilation each instead of one per eager op.
ref_save = jax.jit(reference.save_kv_cache, static_argnums=2)
ref_instantiate = jax.jit(reference.instantiate_kv_cache)


def layer(max_batch, heads, seq, head_dim, dtype=jnp.bfloat16):
    return random_array((max_batch, 2, heads, seq, head_dim), dtype)


def saved_like(layer_, tokens):
    _, _, h, _, d = layer_.shape
    return random_array((2, h, tokens, d), layer_.dtype)


def mixed_layers(dtype, max_batch=3, seq=12):
    """Alternating 8 and 2 KV heads, a head_dim 512 layer, a shorter layer, head_dim 80 and 576."""
    shapes = [(8, seq, 64), (2, seq, 128), (8, seq, 512), (2, seq // 2, 128), (1, seq, 80),
              (2, seq, 576)]
    return [layer(max_batch, h, s, d, dtype) for h, s, d in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_round_trip_every_dtype_and_head_dim(dtype):
    # One layer per head dim, all in one call; the destination is poisoned (every byte random).
    src = [layer(3, 2, 8, d, dtype) for d in HEAD_DIMS]
    dst = [layer(3, 2, 10, d, dtype) for d in HEAD_DIMS]
    saved = jaxkv.save_kv_cache(src, 1, 5)
    out = jaxkv.instantiate_kv_cache(dst, saved, 2)
    expected_saved = ref_save(src, 1, 5)
    expected = ref_instantiate(dst, saved, 2)
    for d, s, e_s, x, o, e, y in zip(HEAD_DIMS, saved, expected_saved, src, out, expected, dst):
        x, o, y = np.asarray(x), np.asarray(o), np.asarray(y)
        assert s.shape == (2, 2, 5, d) and s.dtype == x.dtype
        assert_bytes_equal(s, e_s, f"save, head_dim {d}")
        assert_bytes_equal(s, x[1, :, :, :5], f"save, head_dim {d}")
        assert_bytes_equal(o, e, f"instantiate, head_dim {d}")
        # Only tokens [0, T) of the target row changed.
        assert_bytes_equal(o[2, :, :, :5], x[1, :, :, :5], f"written prefix, head_dim {d}")
        assert_bytes_equal(o[2, :, :, 5:], y[2, :, :, 5:], f"rest of the target row, head_dim {d}")
        assert_bytes_equal(o[:2], y[:2], f"other rows, head_dim {d}")


def test_single_array_round_trip():
    src, dst = layer(3, 4, 8, 128), layer(5, 4, 8, 128)
    saved = jaxkv.save_kv_cache(src, 0, 8)
    assert_bytes_equal(saved, np.asarray(src)[0])
    out = jaxkv.instantiate_kv_cache(dst, saved, 4)
    assert_bytes_equal(out, ref_instantiate(dst, saved, 4))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "f8e4m3fn"])
def test_mixed_layers_one_call(dtype):
    src = mixed_layers(dtype)
    dst = mixed_layers(dtype, max_batch=3)
    batch_idx = jnp.asarray(2, jnp.int32)
    saved = jax.jit(jaxkv.save_kv_cache, static_argnums=2)(src, batch_idx, 6)
    assert isinstance(saved, list) and len(saved) == len(src)
    for i, (s, e) in enumerate(zip(saved, ref_save(src, batch_idx, 6))):
        assert_bytes_equal(s, e, f"save layer {i}")
    out = jax.jit(jaxkv.instantiate_kv_cache)(tuple(dst), tuple(saved), jnp.asarray(0, jnp.int32))
    assert isinstance(out, tuple)
    for i, (o, e) in enumerate(zip(out, ref_instantiate(dst, saved, 0))):
        assert_bytes_equal(o, e, f"instantiate layer {i}")


def test_mixed_dtypes_across_layers():
    src = [layer(2, 2, 8, 64, jnp.float32), layer(2, 1, 8, 576, jnp.float8_e5m2),
           layer(2, 4, 8, 80, jnp.bfloat16)]
    dst = [layer(2, 2, 8, 64, jnp.float32), layer(2, 1, 8, 576, jnp.float8_e5m2),
           layer(2, 4, 8, 80, jnp.bfloat16)]
    saved = jaxkv.save_kv_cache(src, 0, 7)
    out = jaxkv.instantiate_kv_cache(dst, saved, 1)
    for i, (o, e) in enumerate(zip(out, ref_instantiate(dst, saved, 1))):
        assert_bytes_equal(o, e, f"layer {i}")
        prefix = np.asarray(src[i])[0, :, :, :7]
        assert_bytes_equal(np.asarray(o)[1, :, :, :7], prefix, f"layer {i} prefix")


@pytest.mark.parametrize("tokens", [0, 1, 12])
def test_empty_and_full_length(tokens):
    src, dst = mixed_layers(jnp.float16), mixed_layers(jnp.float16)
    src[3] = layer(3, 2, 12, 128, jnp.float16)  # every layer holds 12 tokens here
    dst[3] = layer(3, 2, 12, 128, jnp.float16)
    saved = jaxkv.save_kv_cache(src, 0, tokens)
    assert all(s.shape[2] == tokens for s in saved)
    out = jaxkv.instantiate_kv_cache(dst, saved, 2)
    for o, e in zip(out, ref_instantiate(dst, saved, 2)):
        assert_bytes_equal(o, e)


@pytest.mark.parametrize("tokens", [5, 160])
def test_odd_head_dims_long_spans_and_many_units(tokens):
    # head_dim 7 and 3 with an odd T force 1- and 2-byte accesses on CUDA; T = 160 tokens of
    # 128 x bf16 spans several chunks; 8 layers x 4 slots x 16 head spans exceed one wave of a
    # persistent grid on an H200.
    shapes = [(8, 128, jnp.bfloat16), (1, 7, jnp.float8_e4m3fn), (2, 3, jnp.bfloat16)] + [
        (8, 128, jnp.bfloat16)] * 5
    dst = [layer(5, h, 192, d, dt) for h, d, dt in shapes]
    saved = [saved_like(x, tokens) for x in dst]
    slots = jnp.asarray([1, 4, 0, 3], jnp.int32)
    out = jax.jit(jaxkv.instantiate_kv_cache)(dst, saved, slots)
    for i, (o, e) in enumerate(zip(out, ref_instantiate(dst, saved, slots))):
        assert_bytes_equal(o, e, f"instantiate layer {i}")
    back = jax.jit(jaxkv.save_kv_cache, static_argnums=2)(out, jnp.asarray(3, jnp.int32), tokens)
    for i, (b, s) in enumerate(zip(back, saved)):
        assert_bytes_equal(b, s, f"save layer {i}")


def test_one_prefix_into_many_slots_equals_slot_by_slot():
    dst = mixed_layers(jnp.bfloat16, max_batch=6)
    saved = [saved_like(x, 5) for x in dst]
    slots = jnp.asarray([4, 0, 5, 2], jnp.int32)
    many = jaxkv.instantiate_kv_cache(dst, saved, slots)
    one_by_one = dst
    for s in [4, 0, 5, 2]:
        one_by_one = jaxkv.instantiate_kv_cache(one_by_one, saved, s)
    for i, (a, b) in enumerate(zip(many, one_by_one)):
        assert_bytes_equal(a, b, f"layer {i}")
    for i, (a, e) in enumerate(zip(many, ref_instantiate(dst, saved, slots))):
        assert_bytes_equal(a, e, f"layer {i} vs reference")
    untouched = np.asarray(many[0])[[1, 3]]
    assert_bytes_equal(untouched, np.asarray(dst[0])[[1, 3]], "rows not listed")


def test_duplicate_and_out_of_range_slots_in_a_list():
    dst = layer(4, 2, 8, 128)
    saved = saved_like(dst, 3)
    slots = jnp.asarray([1, -1, 4, 1, 99, 3], jnp.int32)
    out = jaxkv.instantiate_kv_cache(dst, saved, slots)
    assert_bytes_equal(out, ref_instantiate(dst, saved, slots))
    expected = jaxkv.instantiate_kv_cache(jaxkv.instantiate_kv_cache(dst, saved, 1), saved, 3)
    assert_bytes_equal(out, expected)


@pytest.mark.parametrize("bad", [-1, 4, 1000])
def test_out_of_range_index_writes_nothing_and_is_reported(bad):
    dst, src = mixed_layers(jnp.bfloat16, max_batch=4), mixed_layers(jnp.bfloat16, max_batch=4)
    saved = [saved_like(x, 4) for x in dst]
    idx = jnp.asarray(bad, jnp.int32)
    out = jax.jit(jaxkv.instantiate_kv_cache)(dst, saved, idx)
    for o, d in zip(out, dst):
        assert_bytes_equal(o, d, "nothing written")
    many = jax.jit(jaxkv.instantiate_kv_cache)(dst, saved, jnp.asarray([bad, bad], jnp.int32))
    for o, d in zip(many, dst):
        assert_bytes_equal(o, d, "nothing written (list)")
    got = jax.jit(jaxkv.save_kv_cache, static_argnums=2)(src, idx, 4)
    for g, e in zip(got, ref_save(src, idx, 4)):
        assert_bytes_equal(g, e, "save from an invalid row: zeros")
        assert not np.any(np.asarray(g, np.float32))

    err, _ = checkify.checkify(jax.jit(jaxkv.instantiate_kv_cache))(dst, saved, idx)
    with pytest.raises(checkify.JaxRuntimeError, match="batch_idx outside"):
        err.throw()
    save = functools.partial(jaxkv.save_kv_cache, seq_len=4)
    err, _ = checkify.checkify(jax.jit(save))(src, idx)
    with pytest.raises(checkify.JaxRuntimeError, match="batch_idx outside"):
        err.throw()
    err, _ = checkify.checkify(jax.jit(save))(src, jnp.asarray(3, jnp.int32))
    err.throw()  # a valid index reports nothing


def test_static_out_of_range_index_is_a_trace_time_error():
    x = layer(2, 1, 4, 64)
    with pytest.raises(ValueError, match=r"save_kv_cache: batch_idx must be in \[0, 1\], got 2"):
        jaxkv.save_kv_cache(x, 2, 3)
    with pytest.raises(ValueError, match="instantiate_kv_cache: batch_idx"):
        jaxkv.instantiate_kv_cache(x, saved_like(x, 3), -1)


def test_saved_that_does_not_fit_is_a_trace_time_error_naming_the_layer():
    dst = mixed_layers(jnp.bfloat16)  # layer 3 holds 6 tokens
    saved = [saved_like(x, 6) for x in dst]
    long = list(saved)
    long[3] = random_array((2, 2, 7, 128), jnp.bfloat16)
    msg = r"saved\[3\] holds 7 tokens, more than max_seq_len 6 of layers\[3\]"
    with pytest.raises(ValueError, match=msg):
        jaxkv.instantiate_kv_cache(dst, long, 0)
    heads = list(saved)
    heads[1] = random_array((2, 8, 6, 128), jnp.bfloat16)
    msg = r"saved\[1\] must have shape \(2, 2, T, 128\) to fit layers\[1\]"
    with pytest.raises(ValueError, match=msg):
        jaxkv.instantiate_kv_cache(dst, heads, 0)
    dims = list(saved)
    dims[4] = random_array((2, 1, 6, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"saved\[4\].*layers\[4\]"):
        jaxkv.instantiate_kv_cache(dst, dims, 0)
    dtypes = list(saved)
    dtypes[2] = saved[2].astype(jnp.float16)
    msg = r"saved\[2\] has dtype float16 but layers\[2\] holds bfloat16"
    with pytest.raises(TypeError, match=msg):
        jaxkv.instantiate_kv_cache(dst, dtypes, 0)
    with pytest.raises(ValueError, match="5 saved tensors for 6 cache layers"):
        jaxkv.instantiate_kv_cache(dst, saved[:5], 0)
    with pytest.raises(TypeError, match="saved must be one too"):
        jaxkv.instantiate_kv_cache(dst, saved[0], 0)
    with pytest.raises(ValueError, match=r"seq_len 7 exceeds max_seq_len 6 of layers\[3\]"):
        jaxkv.save_kv_cache(dst, 0, 7)


def test_bad_arguments():
    x = layer(2, 1, 4, 64)
    s = saved_like(x, 2)
    with pytest.raises(TypeError, match="batch_idx must be int32"):
        jaxkv.save_kv_cache(x, jnp.asarray(0, jnp.int16), 2)
    with pytest.raises(ValueError, match=r"save_kv_cache: batch_idx must have shape \[\]"):
        jaxkv.save_kv_cache(x, jnp.zeros((2,), jnp.int32), 2)
    with pytest.raises(ValueError, match=r"batch_idx must have shape \[\] or \[n\]"):
        jaxkv.instantiate_kv_cache(x, s, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(TypeError, match="seq_len must be a Python int"):
        jaxkv.save_kv_cache(x, 0, 2.0)
    with pytest.raises(TypeError, match="batch_idx must be an int or an int32 array, got bool"):
        jaxkv.instantiate_kv_cache(x, s, True)
    with pytest.raises(ValueError, match=r"layers\[1\] has max_batch 3, layers\[0\] has 2"):
        jaxkv.save_kv_cache([x, layer(3, 1, 4, 64)], 0, 2)
    with pytest.raises(ValueError, match="saved must have rank 4"):
        jaxkv.instantiate_kv_cache(x, s[0], 0)


def test_scan_over_slots_in_place():
    dst = mixed_layers(jnp.bfloat16, max_batch=4)
    saved = [saved_like(x, 3) for x in dst]

    def step(layers, slot):
        return jaxkv.instantiate_kv_cache(layers, saved, slot), None

    slots = jnp.asarray([3, 1], jnp.int32)
    expected = ref_instantiate(dst, saved, slots)
    fn = jax.jit(lambda d: jax.lax.scan(step, d, slots), donate_argnums=0)
    hlo = fn.lower(tuple(dst)).compile().as_text()
    for x in dst:
        assert copies_of(hlo, x) == [], copies_of(hlo, x)
    before = [x.unsafe_buffer_pointer() for x in dst]
    out, _ = fn(tuple(dst))
    assert [o.unsafe_buffer_pointer() for o in out] == before
    assert all(x.is_deleted() for x in dst)
    for o, e in zip(out, expected):
        assert_bytes_equal(o, e)


def test_instantiate_in_place_under_donation():
    dst = mixed_layers(jnp.bfloat16, max_batch=4)
    saved = [saved_like(x, 5) for x in dst]
    fn = jax.jit(jaxkv.instantiate_kv_cache, donate_argnums=0)
    hlo = fn.lower(dst, saved, jnp.asarray([0, 2], jnp.int32)).compile().as_text()
    for x in dst:
        assert copies_of(hlo, x) == []
    assert_launches(hlo, "jaxkv_copy_prefix")
    expected = ref_instantiate(dst, saved, jnp.asarray([0, 2], jnp.int32))
    pointers = [x.unsafe_buffer_pointer() for x in dst]
    out = fn(dst, saved, jnp.asarray([0, 2], jnp.int32))
    assert [x.unsafe_buffer_pointer() for x in out] == pointers
    for o, e in zip(out, expected):
        assert_bytes_equal(o, e)


def test_one_launch_for_every_layer():
    src = mixed_layers(jnp.bfloat16)
    hlo = jax.jit(jaxkv.save_kv_cache, static_argnums=2).lower(src, 0, 4).compile().as_text()
    assert_launches(hlo, "jaxkv_copy_prefix")
    saved = [saved_like(x, 4) for x in src]
    hlo = jax.jit(jaxkv.instantiate_kv_cache).lower(src, saved, 0).compile().as_text()
    assert_launches(hlo, "jaxkv_copy_prefix")


def random_linear_cache(num_layers, max_batch, heads, seq, head_dim, dtype):
    cache = jaxkv.LinearKVCache.create(num_layers, max_batch, heads, seq, head_dim, dtype)
    return dataclasses.replace(cache, buffer=random_array(cache.buffer.shape, dtype))


def test_linear_cache_save_instantiate_in_place():
    cache = random_linear_cache(3, 4, 2, 8, 80, jnp.float16)
    saved = cache.save(2, 6)
    assert isinstance(saved, jaxkv.SavedKV) and saved.num_layers == 3 and saved.tokens == 6
    assert int(saved.length) == 6
    for l in range(3):
        assert_bytes_equal(saved.layers[l], np.asarray(cache.buffer)[l, 2, :, :, :6], f"layer {l}")

    target = random_linear_cache(3, 4, 2, 8, 80, jnp.float16)
    slots = jnp.asarray([0, 3], jnp.int32)
    fn = jax.jit(lambda c, s: c.instantiate(s, slots), donate_argnums=0)
    expected = ref_instantiate(list(target.buffer), list(saved.layers), slots)
    hlo = fn.lower(target, saved).compile().as_text()
    assert copies_of(hlo, target.buffer) == []
    pointer = target.buffer.unsafe_buffer_pointer()
    out = fn(target, saved)
    assert out.buffer.unsafe_buffer_pointer() == pointer
    assert_bytes_equal(out.buffer, np.stack(expected))
