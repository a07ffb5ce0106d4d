"""Smoke test of an installed jaxkv wheel: import, one op of each cache kind, against the
reference. CI runs it under the oldest jax the package claims, with a wheel built under the newest."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((4, 2, 2, 8, 16)), jnp.float32)
lengths = jnp.array([3, 5, 2, 0], jnp.int32)
mapping = jnp.array([-1, 0, 1, -1], jnp.int32)
got = jaxkv.compact_kv_cache(x, lengths, mapping)
want = jaxkv.reference.compact_kv_cache(x, lengths, mapping)
np.testing.assert_array_equal(got[1], want[1])
for row in range(2):  # live tokens of each survivor
    n = int(want[1][row])
    np.testing.assert_array_equal(got[0][row, :, :, :n], want[0][row, :, :, :n])

cache = jaxkv.LinearKVCache.create(2, 2, 2, 8, 16, dtype=jnp.float32)
cache = cache.reset(jnp.zeros((2,), jnp.int32))
k = jnp.asarray(rng.standard_normal((2, 2, 3, 16)), jnp.float32)
cache = jax.jit(lambda c: c.append(1, k, k).commit(3), donate_argnums=0)(cache)
np.testing.assert_array_equal(cache.keys(1)[:, :, :3], k)

paged = jaxkv.PagedKVCache.create(2, 8, 4, 2, 16, max_batch=2, max_pages_per_seq=4,
                                  dtype=jnp.float32)
paged, served = paged.reserve(jnp.array([3, 2], jnp.int32))
paged = paged.append(0, k, k, jnp.array([3, 2], jnp.int32)).commit(jnp.array([3, 2], jnp.int32))
dense = paged.gather(0, 4, split=True)[0]
np.testing.assert_array_equal(dense[0, :, :3], k[0])
np.testing.assert_array_equal(dense[1, :, :2], k[1, :, :2])
print(f"smoke test passed: jaxkv under jax {jax.__version__} (jaxlib {jax.lib.__version__})")
