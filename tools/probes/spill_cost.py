"""What a reserve pays for spilling its evictions to the host tier, at the 8B serving sizes
(16 GiB of bf16 KV in pages of 16: 8192 pages, 32 layers, 8 KV heads, head_dim 128; 256 rows
asking a page each, as a decode step at a page boundary does), with a prefix index: the same
reserve without a host tier, with one that has nothing to spill (never-cached pages suffice: an
empty transfer), and, with every free page cached, evicting each page it takes without a host
tier and spilling each to the host with one (each call indexes its pages again, under new
tokens, so that the next evicts them). Wall time per call, 8 calls inside one jit.

    python3 tools/probes/spill_cost.py [--layout HND|NHD] [--small]    (--small: a CPU check of the probe)
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="HND")
    p.add_argument("--host-pages", type=int, default=4096)  # 16 calls x 256 pages spilled
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    rows, size, pages = (16, 4, 256) if a.small else (256, 16, 8192)
    layers, heads, dim = (2, 1, 16) if a.small else (32, 8, 128)
    host_pages = 16 * rows if a.small else a.host_pages
    calls = 8
    for cached, host in ((False, None), (False, host_pages), (True, None), (True, host_pages)):
        extra = dict(host_pages=host) if host else {}
        cache = jaxkv.PagedKVCache.create(
            num_layers=layers, num_pages=pages, page_size=size, num_kv_heads=heads, head_dim=dim,
            max_batch=rows, max_pages_per_seq=pages // rows, dtype=jnp.bfloat16,
            layout=a.layout, prefix_cache=True, **extra)
        ask = jnp.full((rows,), size, jnp.int32)
        everyone = jnp.ones((rows,), bool)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32000, (rows, size)), jnp.int32)

        @functools.partial(jax.jit, donate_argnums=0)
        def fill_index(cache, salt):  # every row's one page indexed, then released: cached free
            cache, _ = cache.reserve(ask)
            cache = cache.commit(ask).insert_prefix(tokens + salt, ask)
            return cache.release(everyone)

        if cached:  # the whole pool cached and free: each reserve below must evict (and spill)
            for salt in range(pages // rows):
                cache = fill_index(cache, salt * 32000)

        @functools.partial(jax.jit, donate_argnums=0)
        def steps(cache, first):
            def body(c, i):
                c, served = c.reserve(ask)
                if cached:  # index the pages taken again, so that the next reserve evicts
                    c = c.commit(ask).insert_prefix(tokens + (first + i) * 32000, ask)
                return c.release(everyone), jnp.sum(served)
            return jax.lax.scan(body, cache, jnp.arange(calls))

        cache, served = jax.block_until_ready(steps(cache, 100))
        t = time.perf_counter()
        cache, served = jax.block_until_ready(steps(cache, 100 + calls))
        per = (time.perf_counter() - t) / calls
        kind = ("evicting" if cached else "nothing to evict") + (
            ", no host tier" if host is None else (", spilling" if cached else ", host tier"))
        print(f"{a.layout} reserve of {rows} pages, {kind:28s}: {per * 1e6:8.1f} us a call "
              f"(served {int(served[-1])} rows; host pages cached "
              f"{int(jnp.sum(cache.prefix_cache.indexed[pages:])) if host else 0})")


if __name__ == "__main__":
    main()
