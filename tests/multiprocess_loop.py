"""A sharded decode loop (append, commit, compact; paged reserve / append / release) on a mesh of
8 devices, run by tests/test_multiprocess.py in one process and across two.

As a script: ``python multiprocess_loop.py PORT PROCESS_ID SEED OUT``: one of 2 processes with
4 CPU devices each; process 0 writes the final caches to OUT (.npz).
"""

from __future__ import annotations

import os
import sys

import numpy as np

L, B, H, S, D = 2, 4, 4, 16, 8
PAGES, PAGE, STEPS = 16, 4, 5


def run(seed: int, devices=None) -> dict[str, np.ndarray]:
    """The loop on ``devices`` (8 of them, in one process or across several; default: all)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxkv

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices or jax.devices())
    s = jaxkv.CacheSharding(mesh, heads="tp", batch="dp")
    rng = np.random.default_rng(seed)

    def placed(x, spec):  # every process holds the same numpy array: place its shards
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    tokens = rng.standard_normal((STEPS, B, H, 1, D)).astype(np.float32)
    cache = jaxkv.LinearKVCache.create(L, B, H, S, D, jnp.float32, sharding=s)
    cache = cache.reset(placed(rng.integers(0, 4, B).astype(np.int32), P("dp")))
    paged = jaxkv.PagedKVCache.create(L, PAGES, PAGE, H, D, B, 4, jnp.float32, sharding=s)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(cache, paged, k):
        for layer in range(L):
            cache = cache.append(layer, k, k)
        paged, _ = paged.reserve(jnp.ones((B,), jnp.int32))
        paged = paged.append_layers(jnp.stack([k] * L), jnp.stack([k] * L)).commit(1)
        return cache.commit(1), paged

    for t in range(STEPS):
        cache, paged = step(cache, paged, placed(tokens[t], P("dp", "tp")))
    evict = jax.jit(lambda c, p, m, r: (c.compact(m), p.release(r)), donate_argnums=(0, 1))
    cache, paged = evict(cache, paged, placed(np.asarray([-1, 0, 2, -1], np.int32), P("dp")),
                         placed(np.asarray([True, False, False, True]), P("dp")))
    leaves = dict(buffer=cache.buffer, lengths=cache.lengths, active=cache.active_batch_size,
                  k_pages=paged.k_pages, v_pages=paged.v_pages, page_table=paged.page_table,
                  paged_lengths=paged.lengths, ref_counts=paged.ref_counts)
    for name, x in leaves.items():
        assert x.sharding.is_equivalent_to(
            {"buffer": cache.buffer, "k_pages": paged.k_pages}.get(name, x).sharding, x.ndim)
    return {name: np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for name, x in leaves.items()}


def main(port: str, process_id: str, seed: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(process_id), initialization_timeout=60)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    result = run(int(seed))
    if int(process_id) == 0:
        np.savez(out, **result)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
