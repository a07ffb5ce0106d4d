"""jaxkv.attention on sharded caches: each device attends with its own rows and KV heads, equal to
the unsharded result, with no collective of cache data."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxkv
from helpers import random_array

DEVICES = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")
COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
B, H, HQ, S, D = 4, 4, 8, 16, 16
F32 = jnp.float32


@pytest.fixture(scope="module", params=["Auto", "Explicit"])
def mesh(request):
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(getattr(AxisType, request.param),) * 2,
                         devices=DEVICES[:8])


PREFIX = jnp.asarray([2, 0, 6, 13], jnp.int32)
NEW = jnp.asarray([3, 0, 3, 3], jnp.int32)  # appended, not yet committed: what prefill reads


def filled(kind, sharding, k, v):
    """A cache of each kind holding PREFIX committed tokens and NEW appended ones (one row
    empty) of ``k``, ``v`` ``[B, H, S, D]``."""
    if kind == "paged":
        c = jaxkv.PagedKVCache.create(2, 16, 4, H, D, B, 4, F32, layout="NHD", sharding=sharding)
        c, _ = c.reserve(PREFIX + NEW)
    elif kind == "linear":
        c = jaxkv.LinearKVCache.create(2, B, H, S, D, F32, sharding=sharding)
        c = c.reset(jnp.zeros((B,), jnp.int32))
    else:
        c = jaxkv.KVCacheManager.create([jaxkv.KVLayerConfig(H, D)] * 2, B, S, F32,
                                        sharding=sharding)
        c = c.reset(jnp.zeros((B,), jnp.int32))
    c = c.append(1, k, v, PREFIX).commit(PREFIX)
    return c.append(1, v, k, NEW)


@pytest.mark.parametrize("kind", ["linear", "manager", "paged"])
def test_prefill_and_decode_per_shard_equal_unsharded(mesh, kind):
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    with jax.default_device(DEVICES[0]), jax.default_matmul_precision("highest"):
        k, v = random_array((B, H, S, D), F32), random_array((B, H, S, D), F32)
        sharded, plain = filled(kind, s, k, v), filled(kind, None, k, v)
        qp = random_array((B, 3, HQ, D), F32)
        prefill = jax.jit(lambda c, q: jaxkv.attention.prefill(q, c, 1, NEW))
        np.testing.assert_allclose(prefill(sharded, qp), prefill(plain, qp), rtol=1e-5, atol=1e-6)
        sharded, plain = sharded.commit(NEW), plain.commit(NEW)
        q = random_array((B, HQ, D), F32)
        decode = jax.jit(lambda c, q: jaxkv.attention.decode(q, c, 1))
        np.testing.assert_allclose(decode(sharded, q), decode(plain, q), rtol=1e-5, atol=1e-6)
        for fn, x in ((decode, q), (prefill, qp)):
            hlo = fn.lower(sharded, x).compile().as_text()
            assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
