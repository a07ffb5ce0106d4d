"""Device time of the prefix cache's lookups at the 8B serving sizes (16 GiB of bf16 KV in pages
of 16: 8192 pages; 257 rows of 256 pages): one prefill chunk's match_prefix (8 lanes asking) and
insert_prefix (8 lanes), the way the paged-prefix engine calls them, 20 calls inside one jit, wall
time per call. Compare with the engine's iteration time (docs/serving.md). With
``--namespaces N`` the same calls run a second time with each lane in namespace ``lane % N``
(the prompts indexed under those namespaces), and both times are printed: a namespace must cost
nothing measurable (issue: prefix-cache namespaces, within 1.1x).

    python3 tools/prefix_cost.py [--pages 8192] [--lanes 8] [--tokens 4096] [--namespaces 2]
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=8192)
    p.add_argument("--rows", type=int, default=257)
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--namespaces", type=int, default=0)
    a = p.parse_args()
    plain = measure(a, None)
    if a.namespaces:
        spaced = measure(a, a.namespaces)
        print(f"namespaced / plain: {spaced / plain:.3f}")


def measure(a, namespaces):
    """Median time per call of match + insert (+ release) with no namespace argument (None), or
    each lane in namespace ``lane % namespaces``."""
    size, per_seq = a.page_size, a.tokens // a.page_size
    cache = jaxkv.PagedKVCache.create(num_layers=1, num_pages=a.pages, page_size=size,
                                      num_kv_heads=1, head_dim=8, max_batch=a.rows,
                                      max_pages_per_seq=per_seq, dtype=jnp.bfloat16,
                                      prefix_cache=True)
    rng = np.random.default_rng(0)
    # Fill the index: 24 prompts of 2048 tokens inserted and released (their pages stay cached).
    prompts = rng.integers(0, 32000, (24, a.tokens), dtype=np.int32)
    space = (lambda rows: {}) if namespaces is None else (
        lambda rows: dict(namespace=jnp.asarray(np.arange(rows) % namespaces, jnp.int32)))
    for i in range(0, 24, 8):
        tok = np.zeros((a.rows, a.tokens), np.int32)
        tok[:8] = prompts[i:i + 8]
        n = np.zeros((a.rows,), np.int32)
        n[:8] = 2048
        cache, _ = cache.reserve(jnp.asarray(n))
        cache = cache.commit(jnp.asarray(n)).insert_prefix(jnp.asarray(tok), jnp.asarray(n),
                                                           **space(a.rows))
        cache = cache.release(jnp.arange(a.rows) < 8)
    print(f"indexed pages: {int(jnp.sum(cache.prefix_cache.depth >= 0))}")
    lanes = jnp.arange(a.lanes, dtype=jnp.int32)
    seq = jnp.asarray(prompts[:a.lanes])
    total = jnp.full((a.lanes,), 2100, jnp.int32)

    def on_rows(c, method, n):
        view = dataclasses.replace(c, page_table=c.page_table[lanes], lengths=c.lengths[lanes],
                                   new_tokens=c.new_tokens[lanes])
        out = getattr(view, method)(seq, n, **space(a.lanes))
        view = out if method == "insert_prefix" else out[0]
        return dataclasses.replace(view, page_table=c.page_table.at[lanes].set(view.page_table),
                                   lengths=c.lengths.at[lanes].set(view.lengths),
                                   new_tokens=c.new_tokens)

    def step(c, _):
        c = on_rows(c, "match_prefix", total)
        c = on_rows(c, "insert_prefix", c.lengths[lanes])
        return c.release(jnp.arange(a.rows) < a.lanes), None

    loop = jax.jit(lambda c: jax.lax.scan(step, c, length=20)[0], donate_argnums=0)
    cache = loop(cache)
    jax.block_until_ready(cache)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        cache = loop(cache)
        jax.block_until_ready(cache)
        times.append((time.perf_counter() - t) / 20)
    what = "no namespace" if namespaces is None else f"lane % {namespaces} namespaces"
    print(f"match_prefix + insert_prefix of {a.lanes} lanes ({a.pages} pages, rows of "
          f"{per_seq} pages), plus a release, {what}: {np.median(times) * 1e6:.0f} us per call "
          f"(min {min(times) * 1e6:.0f}) on {jax.devices()[0].device_kind}")
    return float(np.median(times))


if __name__ == "__main__":
    main()
