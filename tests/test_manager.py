"""KVCacheManager: heterogeneous layers, its lifecycle against the reference, prompt reuse."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import KVCacheManager, KVLayerConfig
from helpers import assert_bytes_equal, assert_launches, copies_of, random_array
from helpers import ref as reference


# Alternating 8 and 2 KV heads, a head_dim 512 layer, a layer with a shorter max_seq_len.
MIXED = [KVLayerConfig(8, 64), KVLayerConfig(2, 128), KVLayerConfig(8, 512),
         KVLayerConfig(2, 128, max_seq_len=10), KVLayerConfig(1, 80)]
UNIFORM = [KVLayerConfig(2, 64)] * 3

ref_append = reference.append_layer
ref_compact = reference.compact_kv_cache




def random_manager(configs=MIXED, max_batch=4, max_seq_len=16, dtype=jnp.bfloat16):
    """A cache whose every byte is random (poison: unwritten regions show)."""
    cache = KVCacheManager.create(configs, max_batch, max_seq_len, dtype)
    layers = tuple(random_array(x.shape, x.dtype) for x in cache.layers)
    return dataclasses.replace(cache, layers=layers)


def kv_for(cache, i, tokens):
    b, _, h, _, d = cache.layers[i].shape
    return tuple(random_array((b, h, tokens, d), cache.dtype) for _ in "kv")


def assert_live_equal(actual, expected, lengths, what=""):
    """Tokens [0, lengths[b]) of every row b of [B, 2, H, S, D] layers match bit for bit."""
    a, e = np.asarray(actual), np.asarray(expected)
    for b, n in enumerate(np.asarray(lengths)):
        n = min(int(n), a.shape[3])
        if n:  # (helpers.as_bytes cannot reshape an empty array)
            assert_bytes_equal(a[b, :, :, :n], e[b, :, :, :n], f"{what} row {b}")


def assert_in_place(fn, cache, *args):
    """fn(cache, *args) compiled with the cache donated: no copy of any layer, same buffers."""
    hlo = fn.lower(cache, *args).compile().as_text()
    for x in cache.layers:
        assert copies_of(hlo, x) == [], copies_of(hlo, x)
    pointers = [x.unsafe_buffer_pointer() for x in cache.layers]
    out = fn(cache, *args)
    assert [x.unsafe_buffer_pointer() for x in out.layers] == pointers
    return out, hlo


def test_create_and_views():
    cache = KVCacheManager.create(MIXED, max_batch=3, max_seq_len=16, dtype=jnp.float8_e4m3fn)
    assert cache.num_layers == 5 and cache.max_batch == 3 and cache.max_seq_len == 16
    assert cache.dtype == jnp.float8_e4m3fn and not cache.is_uniform
    assert cache.layer_config(3) == KVLayerConfig(2, 128, 10)
    assert cache.layer_config(0) == KVLayerConfig(8, 64, 16)
    assert cache.combined(2).shape == (3, 2, 8, 16, 512)
    assert cache.combined(3).shape == (3, 2, 2, 10, 128)
    cache = random_manager()
    k, v = cache.separate(4)
    assert k.shape == v.shape == (4, 1, 16, 80)
    assert_bytes_equal(k, np.asarray(cache.combined(4))[:, 0])
    assert_bytes_equal(v, np.asarray(cache.combined(4))[:, 1])
    assert KVCacheManager.create(UNIFORM, 2, 8).is_uniform
    shorter = [KVLayerConfig(2, 64), KVLayerConfig(2, 64, max_seq_len=4)]
    assert not KVCacheManager.create(shorter, 2, 8).is_uniform
    leaves, _ = jax.tree.flatten(cache)
    assert len(leaves) == 5 + 2  # layers, lengths, active batch size


def test_create_rejects_bad_configs():
    msg = r"layer_configs\[1\].max_seq_len must be in \[1, 16\], got 17"
    with pytest.raises(ValueError, match=msg):
        KVCacheManager.create([KVLayerConfig(2, 64), KVLayerConfig(2, 64, 17)], 2, 16)
    with pytest.raises(ValueError, match=r"layer_configs\[0\].num_kv_heads"):
        KVCacheManager.create([KVLayerConfig(0, 64)], 2, 16)
    with pytest.raises(TypeError, match=r"layer_configs\[0\] must be a KVLayerConfig"):
        KVCacheManager.create([(2, 64)], 2, 16)
    with pytest.raises(ValueError, match="1 to 256 layer configs"):
        KVCacheManager.create([], 2, 16)
    with pytest.raises(TypeError, match="unsupported dtype"):
        KVCacheManager.create(UNIFORM, 2, 16, jnp.int32)
    with pytest.raises(ValueError, match=r"KVCacheManager.combined: layer_idx must be in \[0, 2\]"):
        KVCacheManager.create(UNIFORM, 2, 16).combined(3)


def test_append_commit_matches_reference_in_place():
    cache = random_manager().reset(jnp.asarray([3, 0, 9], jnp.int32))  # 3 active, slot 3 idle
    new_lengths = jnp.asarray([4, 2, 4, 3], jnp.int32)  # slot 2 runs past the short layer
    kvs = [kv_for(cache, i, 4) for i in range(cache.num_layers)]

    def step(c, kvs):
        for i, (k, v) in enumerate(kvs):
            c = c.append(i, k, v, new_lengths)
        return c.commit(new_lengths)

    expected = [ref_append(x, k, v, cache.lengths, cache.active_batch_size, new_lengths)
                for x, (k, v) in zip(cache.layers, kvs)]
    out, _ = assert_in_place(jax.jit(step, donate_argnums=0), cache, kvs)
    for i, (o, e) in enumerate(zip(out.layers, expected)):
        assert_bytes_equal(o, e, f"layer {i}")  # whole layer: appends write only their tokens
    assert out.lengths.tolist() == [7, 2, 13, 0]
    assert int(out.active_batch_size) == 3


def test_append_rejects_bad_layer_and_shapes():
    cache = random_manager().reset(jnp.zeros((2,), jnp.int32))
    k, v = kv_for(cache, 1, 2)
    with pytest.raises(ValueError, match=r"KVCacheManager.append: layer_idx must be in \[0, 4\]"):
        cache.append(5, k, v)
    with pytest.raises(TypeError, match="KVCacheManager.append: layer_idx must be a Python int"):
        cache.append(jnp.asarray(1, jnp.int32), k, v)
    msg = r"KVCacheManager.append: k must have shape \(4, 8, T, 64\)"
    with pytest.raises(ValueError, match=msg):
        cache.append(0, k, v)


def test_compact_matches_reference_in_place_one_launch():
    cache = random_manager(max_batch=5)
    cache = dataclasses.replace(
        cache, lengths=jnp.asarray([3, 16, 7, 1, 9], jnp.int32), active_batch_size=jnp.asarray(5)
    )
    mapping = jnp.asarray([-1, 2, 0, -1, 1], jnp.int32)
    expected, lengths = ref_compact(list(cache.layers), cache.lengths, mapping)
    out, hlo = assert_in_place(jax.jit(KVCacheManager.compact, donate_argnums=0), cache, mapping)
    assert_launches(hlo, "jaxkv_compact")
    assert out.lengths.tolist() == lengths.tolist() == [7, 9, 16, 0, 0]
    assert int(out.active_batch_size) == 3
    for i, (o, e) in enumerate(zip(out.layers, expected)):
        assert_live_equal(o, e, lengths, f"layer {i}")


def test_save_instantiate_round_trip_in_place_one_launch():
    src = random_manager(dtype=jnp.float8_e5m2)
    saved = jax.jit(KVCacheManager.save, static_argnums=2)(src, jnp.asarray(1, jnp.int32), 10)
    assert saved.num_layers == 5 and saved.tokens == 10 and int(saved.length) == 10
    for i, (s, x) in enumerate(zip(saved.layers, src.layers)):
        assert_bytes_equal(s, np.asarray(x)[1, :, :, :10], f"saved layer {i}")

    dst = random_manager(dtype=jnp.float8_e5m2)
    slots = jnp.asarray([3, 0], jnp.int32)
    expected = reference.instantiate_kv_cache(list(dst.layers), list(saved.layers), slots)
    fn = jax.jit(KVCacheManager.instantiate, donate_argnums=0)
    out, hlo = assert_in_place(fn, dst, saved, slots)
    assert_launches(hlo, "jaxkv_copy_prefix")
    for i, (o, e) in enumerate(zip(out.layers, expected)):
        assert_bytes_equal(o, e, f"layer {i}")


def test_saved_must_match_the_layers():
    cache = random_manager()
    with pytest.raises(ValueError, match=r"seq_len 11 exceeds max_seq_len 10 of layers\[3\]"):
        cache.save(0, 11)
    saved = cache.save(0, 4)
    other = random_manager([KVLayerConfig(8, 64), KVLayerConfig(4, 128), KVLayerConfig(8, 512),
                            KVLayerConfig(2, 128), KVLayerConfig(1, 80)])
    msg = r"saved.layers\[1\] must have shape \(2, 4, T, 128\) to fit layers\[1\]"
    with pytest.raises(ValueError, match=msg):
        other.instantiate(saved, 0)
    msg = r"saved.layers\[0\] has dtype float32 but layers\[0\] holds bfloat16"
    with pytest.raises(TypeError, match=msg):
        random_manager().instantiate(random_manager(dtype=jnp.float32).save(0, 4), 0)
    with pytest.raises(ValueError, match="5 saved tensors for 3 cache layers"):
        random_manager(UNIFORM).instantiate(saved, 0)
    with pytest.raises(TypeError, match="saved must be a SavedKV"):
        cache.instantiate(list(saved.layers), 0)


def test_linear_conversions_and_saved_prompts_between_cache_classes():
    linear = jaxkv.LinearKVCache.create(3, 4, 2, 16, 64, jnp.bfloat16)
    linear = dataclasses.replace(
        linear, buffer=random_array(linear.buffer.shape, jnp.bfloat16),
        lengths=jnp.asarray([5, 2, 0, 0], jnp.int32), active_batch_size=jnp.asarray(2, jnp.int32),
    )
    cache = KVCacheManager.from_linear(linear)
    assert cache.is_uniform and cache.layer_config(2) == KVLayerConfig(2, 64, 16)
    for l in range(3):
        assert_bytes_equal(cache.layers[l], np.asarray(linear.buffer)[l])
    back = cache.to_linear()
    assert_bytes_equal(back.buffer, linear.buffer)
    assert back.lengths.tolist() == [5, 2, 0, 0] and int(back.active_batch_size) == 2
    with pytest.raises(ValueError, match="to_linear: layers differ"):
        random_manager().to_linear()

    # A prompt saved from one class instantiates into the other.
    saved = linear.save(0, 5)
    into_manager = random_manager(UNIFORM).instantiate(saved, 2)
    into_linear = linear.instantiate(cache.save(1, 3), 3)
    for l in range(3):
        assert_bytes_equal(np.asarray(into_manager.layers[l])[2, :, :, :5],
                           np.asarray(linear.buffer)[l, 0, :, :, :5])
        assert_bytes_equal(np.asarray(into_linear.buffer)[l, 3, :, :, :3],
                           np.asarray(linear.buffer)[l, 1, :, :, :3])


def test_prompt_reuse_flow_equals_recomputing_everything():
    prompt, turn = 5, 4
    sys_kv = [kv_for(random_manager(max_batch=1), i, prompt) for i in range(len(MIXED))]
    user_kv = [kv_for(random_manager(), i, turn) for i in range(len(MIXED))]
    user_lengths = jnp.asarray([4, 1, 3, 0], jnp.int32)  # three new requests, slot 3 idle

    # Prefill the system prompt once into a one-row cache and save it.
    system = random_manager(max_batch=1).reset(jnp.zeros((1,), jnp.int32))
    for i, (k, v) in enumerate(sys_kv):
        system = system.append(i, k, v)
    saved = system.commit(prompt).save(0, prompt)

    @jax.jit
    def serve(cache, saved):
        cache = cache.reset(jnp.full((3,), saved.length, jnp.int32))
        cache = cache.instantiate(saved, jnp.arange(3, dtype=jnp.int32))
        for i, (k, v) in enumerate(user_kv):
            cache = cache.append(i, k, v, user_lengths)
        return cache.commit(user_lengths)

    out = serve(random_manager(), saved)

    # Reference: every request recomputes its system prompt, then its turn.
    fresh = random_manager()
    zeros, active = jnp.zeros((4,), jnp.int32), jnp.asarray(3, jnp.int32)
    for i, (x, (sk, sv), (uk, uv)) in enumerate(zip(fresh.layers, sys_kv, user_kv)):
        sk, sv = (jnp.broadcast_to(a, (4,) + a.shape[1:]) for a in (sk, sv))
        x = ref_append(x, sk, sv, zeros, active, None)
        x = ref_append(x, uk, uv, jnp.full((4,), prompt, jnp.int32), active, user_lengths)
        assert_live_equal(out.layers[i], x, out.lengths, f"layer {i}")
    assert out.lengths.tolist() == [9, 6, 8, 0]
    assert int(out.active_batch_size) == 3


def test_all_empty_and_active_batch_size():
    cache = KVCacheManager.create(UNIFORM, 3, 8)
    assert bool(cache.all_empty)
    cache = cache.reset(jnp.asarray([0, 2], jnp.int32))
    assert not bool(cache.all_empty)
    cache = cache.set_active_batch_size(1)
    assert bool(cache.all_empty) and int(cache.active_batch_size) == 1
    with pytest.raises(ValueError, match="set_active_batch_size: n must be in"):
        cache.set_active_batch_size(4)
    with pytest.raises(ValueError, match="reuse_lengths has 4 entries, max_batch is 3"):
        cache.reset(jnp.zeros((4,), jnp.int32))


def test_a_traced_layer_index_is_refused_with_why():
    cache = jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(2, 16)] * 2, 2, 8, jnp.float32)
    k = jnp.ones((2, 2, 1, 16), jnp.float32)
    q = jnp.ones((2, 4, 16), jnp.float32)
    for op, call in (("KVCacheManager.append", lambda i: cache.append(i, k, k)),
                     ("KVCacheManager.separate", lambda i: cache.separate(i)),
                     ("attention.decode", lambda i: jaxkv.attention.decode(q, cache, i))):
        with pytest.raises(TypeError, match=rf"{op}: layer_idx must be a Python int for a "
                           r"KVCacheManager \(its layers differ in shape: unroll them\)"):
            jax.jit(call)(jnp.int32(0))
