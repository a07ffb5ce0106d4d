"""The XLA fallback (``JAXKV_KERNELS=xla``, jaxkv._fallback) computes what the kernels compute:
the same cache lifecycles run both ways on fresh random data, the tokens each cache holds equal
byte for byte, attention (windows, soft caps, sinks, 8-bit scales) within float32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import reference

from helpers import assert_bytes_equal, copies_of, random_array


def both(monkeypatch, fn):
    """``fn()`` with jaxkv's kernels, then with every op's XLA formulation (each traced anew)."""
    monkeypatch.setenv("JAXKV_KERNELS", "auto")
    kernels = jax.jit(lambda: fn())()
    monkeypatch.setenv("JAXKV_KERNELS", "xla")
    xla = jax.jit(lambda: fn())()
    return kernels, xla


def live_tokens(cache, layer, max_len):
    """Each row's tokens below its length (zeros after): what a cache's contract specifies."""
    if isinstance(cache, jaxkv.PagedKVCache):
        return cache.gather(layer, max_len)
    kv = cache.layer(layer) if isinstance(cache, jaxkv.LinearKVCache) else cache.combined(layer)
    t = jnp.arange(kv.shape[-2])[None, :]
    keep = (t < cache.lengths[:, None])[:, None, None, :, None]
    return jnp.where(keep, kv, jnp.zeros((), kv.dtype))


B, H, D, S, Q = 4, 2, 16, 32, 4  # rows, KV heads, head_dim, tokens a row holds, q heads


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8],
                         ids=["bf16", "fp8", "int8"])
@pytest.mark.parametrize("kind", ["linear", "manager-ring", "paged-NHD", "paged-HND"])
def test_a_lifecycle_equals_the_kernels(monkeypatch, kind, dtype):
    k1, v1 = random_array((B, H, 9, D), jnp.bfloat16), random_array((B, H, 9, D), jnp.bfloat16)
    k2, v2 = random_array((B, H, 1, D), jnp.bfloat16), random_array((B, H, 1, D), jnp.bfloat16)
    q = random_array((B, 1, 2 * H, D), jnp.bfloat16)
    sinks = random_array((2 * H,), jnp.float32)
    prompt = jnp.asarray([9, 3, 7, 0], jnp.int32)
    mapping = jnp.asarray([1, -1, 0, -1], jnp.int32)

    def run():
        if kind == "linear":
            c = jaxkv.LinearKVCache.create(2, B, H, S, D, dtype).reset(jnp.zeros((B,), jnp.int32))
        elif kind == "manager-ring":
            layers = [jaxkv.KVLayerConfig(H, D), jaxkv.KVLayerConfig(H, D, 12, ring=True)]
            c = jaxkv.KVCacheManager.create(layers, B, S, dtype).reset(
                jnp.zeros((B,), jnp.int32))
        else:
            c = jaxkv.PagedKVCache.create(2, 40, 4, H, D, B, 8, dtype, kind.split("-")[1])
            c, _ = c.reserve(prompt)
        for i in range(2):
            c = c.append(i, k1, v1, prompt)
        c = c.commit(prompt)
        if isinstance(c, jaxkv.PagedKVCache):
            c, _ = c.fork(0, jnp.asarray([3], jnp.int32))  # copy-on-write of a partial page
            c, _ = c.reserve(jnp.ones((B,), jnp.int32))
        for i in range(2):
            c = c.append(i, k2, v2, jnp.ones((B,), jnp.int32))
        outs = [jaxkv.attention.prefill(q, c, i, jnp.ones((B,), jnp.int32), window=6,
                                        soft_cap=5.0, sinks=sinks) for i in range(2)]
        c = c.commit(1)
        if not isinstance(c, jaxkv.PagedKVCache):
            saved = c.save(0, 8)
            c = c.instantiate(saved, jnp.asarray([3], jnp.int32))
        c = c.compact(mapping)
        return c, outs, [live_tokens(c, i, S) for i in range(2)]

    (ck, ok, tk), (cx, ox, tx) = both(monkeypatch, run)
    np.testing.assert_array_equal(cx.lengths, ck.lengths)
    for i in range(2):
        assert_bytes_equal(tx[i], tk[i], f"layer {i}'s tokens")
        np.testing.assert_allclose(np.asarray(ox[i], np.float32), np.asarray(ok[i], np.float32),
                                   rtol=2e-2, atol=2e-2)
    for name in ("k_scales", "v_scales"):
        if getattr(ck, name, None) is not None and getattr(ck, "scaling", None) == "per_tensor":
            np.testing.assert_array_equal(getattr(cx, name), getattr(ck, name))


def test_the_host_tier_needs_the_kernels(monkeypatch):
    """No XLA formulation of the host tier's transfers yet: a clear error, not a wrong answer."""
    monkeypatch.setenv("JAXKV_KERNELS", "xla")
    cache = jaxkv.PagedKVCache.create(1, 8, 4, 1, 16, 2, 4, jnp.float32, host_pages=4)
    cache, _ = cache.reserve(jnp.asarray([4, 0], jnp.int32))
    with pytest.raises(NotImplementedError,
                       match=r"jaxkv_(pages_to_host|host_fence)\).*no XLA formulation"):
        cache.swap_out(jnp.asarray([True, False]))


def test_compaction_moves_rows_in_place_through_chains_and_cycles(monkeypatch):
    """Any mapping (survivors to the front, permutations with cycles, rows moved past the
    batch): the fallback's rows equal reference.compact_tensor_batch's, moved in place."""
    monkeypatch.setenv("JAXKV_KERNELS", "xla")
    rows = 8
    run = jax.jit(lambda layers, lengths, m: jaxkv.compact_kv_cache(layers, lengths, m),
                  donate_argnums=0)
    rng = np.random.default_rng()
    layers = [random_array((rows, 2, 2, 4, 8), jnp.bfloat16), random_array((rows, 2, 1, 4, 8),
                                                                            jnp.float32)]
    lengths = jnp.full((rows,), 4, jnp.int32)
    hlo = run.lower(layers, lengths, lengths).compile().as_text()
    assert not any(copies_of(hlo, x) for x in layers)
    for trial in range(24):
        if trial % 3 == 0:  # survivors to the front, in order
            keep = rng.random(rows) < 0.6
            m = np.where(keep, np.cumsum(keep) - 1, -1)
        elif trial % 3 == 1:  # a permutation (cycles), some rows evicted
            m = np.where(rng.random(rows) < 0.3, -1, rng.permutation(rows))
        else:  # distinct rows, some out of range
            m = rng.permutation(rows + 2)[:rows] - 1
        m = jnp.asarray(m, jnp.int32)
        want = [reference.compact_tensor_batch(x, m) for x in layers]
        out, _ = run([jnp.copy(x) for x in layers], lengths, m)
        for o, w in zip(out, want):
            assert_bytes_equal(o, w, f"mapping {np.asarray(m).tolist()}")
