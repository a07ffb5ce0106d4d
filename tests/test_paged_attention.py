"""A real reader: JAX's Pallas paged_attention on a jaxkv HND cache equals dense attention.

The pools are passed as they are (``cache.k_pages[layer]`` is ``[H, P, S, D]``, the layout that
kernel takes); on CPU the kernel runs with ``interpret=True``, on the GPU natively (Triton).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Deprecated in jax 0.11, gone from jax 0.12.1: this reader is tested where jax still ships it.
pa = pytest.importorskip("jax.experimental.pallas.ops.gpu.paged_attention",
                         reason="this jax no longer ships Pallas paged_attention")

from jaxkv import PagedKVCache

from helpers import on_gpu, random_array


B, HKV, HQ, D, S, MAX_PAGES = 3, 2, 4, 32, 16, 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_paged_attention_reads_a_jaxkv_cache(dtype):
    # Powers of two throughout: Triton block shapes (the whole pool of a head is one block).
    cache = PagedKVCache.create(num_layers=2, num_pages=16, page_size=S,
                                num_kv_heads=HKV, head_dim=D, max_batch=B,
                                max_pages_per_seq=MAX_PAGES, dtype=dtype, layout="HND")
    dense_k = np.zeros((2, B, S * MAX_PAGES, HKV, D), np.dtype(dtype))  # the reference cache
    dense_v = np.zeros_like(dense_k)
    lengths = np.zeros(B, np.int32)
    # Jitted (eagerly, every op of the allocator would compile on its own).
    reserve, commit = jax.jit(PagedKVCache.reserve), jax.jit(PagedKVCache.commit)
    append = jax.jit(PagedKVCache.append, static_argnums=1)  # layer
    # A ragged prefill, then decode steps (one sequence idles in the second).
    for n in ([20, 5, 33], [1, 1, 1], [1, 0, 1], [1, 1, 1]):
        n = np.asarray(n, np.int32)
        t = int(n.max())
        cache, served = reserve(cache, jnp.asarray(n))
        assert np.all(served)
        for layer in range(2):
            k, v = random_array((B, HKV, t, D), dtype), random_array((B, HKV, t, D), dtype)
            cache = append(cache, layer, k, v, jnp.asarray(n))
            for b in range(B):
                span = slice(lengths[b], lengths[b] + n[b])
                dense_k[layer, b, span] = np.asarray(k[b, :, : n[b]]).transpose(1, 0, 2)
                dense_v[layer, b, span] = np.asarray(v[b, :, : n[b]]).transpose(1, 0, 2)
        cache = commit(cache, jnp.asarray(n))
        lengths += n
    np.testing.assert_array_equal(cache.lengths, lengths)

    tol = 2e-2 if dtype == jnp.bfloat16 or on_gpu() else 1e-4
    for layer in range(2):
        q = random_array((B, HQ, D), dtype) / 4
        out = pa.paged_attention(
            q, cache.k_pages[layer], cache.v_pages[layer], cache.block_tables, cache.lengths,
            k_splits=2, pages_per_compute_block=2, interpret=not on_gpu(),
        )
        want = pa.paged_attention_reference(
            q, jnp.asarray(dense_k[layer]), jnp.asarray(dense_v[layer]), cache.lengths
        )
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)
