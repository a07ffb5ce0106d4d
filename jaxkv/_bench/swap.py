"""``python -m jaxkv.bench --swap``: the host tier's swaps against the pinned copy bandwidth.

In one run: the roofline, an array of the swap's size copied device -> pinned host and back (one
``jit`` with an output, or an input, in ``pinned_host`` memory); then ``PagedKVCache.swap_out`` and
``swap_in`` of whole rows whose pages are scattered over the pool (every layer, K and V), each
direction the same bytes. Wall time per call, median of ``reps`` calls; each swap is checked
byte for byte against the pages it moved before any time is reported.

Then the overlap: a decode workload (``steps`` decode steps over every layer of a second cache,
longer than a swap) alone, and beside each swap: in one ``jit`` (the copies on the compute
stream), and as ``swap_*(overlap=True)``, then the decode, then ``settle_swaps`` (the copies on
jaxkv's side stream). Overlapped, the pair takes the decode's time; ``decode_kept`` is the
decode's time alone over the pair's, the share of the GPU's decode work kept while a swap runs
(the issue's "GPU busy while swapping").
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import PagedKVCache, attention

SIZES = {  # rows x pages per row, page, heads, head_dim, layers: the bytes swapped per direction
    "gpu": dict(rows=16, pages_per_row=64, page_size=16, heads=8, head_dim=128, layers=32,
                num_pages=4096, reps=5,  # 16 x 64 pages of 2 MiB (32 layers, K and V) = 2 GiB
                # the decode beside it: 32 rows of 1024 tokens, 32 query heads, ~1.9 ms a step
                # on an H100: 40 steps outlast a swap
                decode_rows=32, decode_pages_per_row=64, q_heads=32, steps=40),
    "cpu": dict(rows=4, pages_per_row=8, page_size=16, heads=2, head_dim=64, layers=2,
                num_pages=96, reps=3, decode_rows=2, decode_pages_per_row=4, q_heads=4, steps=2),
}


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_roofline(nbytes: int, reps: int) -> dict:
    """GB/s of one contiguous array copied device -> pinned host and back, each in a ``jit``."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    to_host = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))
    to_device = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device))
    host = jax.block_until_ready(to_host(x))
    jax.block_until_ready(to_device(host))
    d2h = _median_s(lambda: to_host(x), reps)
    h2d = _median_s(lambda: to_device(host), reps)
    return dict(d2h_gbps=nbytes / d2h / 1e9, h2d_gbps=nbytes / h2d / 1e9)


def scattered(s: dict, rows: int, per_row: int, num_pages: int, host_pages: int,
              seed: int) -> PagedKVCache:
    """A bf16 NHD cache whose ``rows`` full rows hold ``per_row`` pages each, a random
    permutation of the pool, random bytes in every page."""
    cache = PagedKVCache.create(
        num_layers=s["layers"], num_pages=num_pages, page_size=s["page_size"],
        num_kv_heads=s["heads"], head_dim=s["head_dim"], max_batch=rows,
        max_pages_per_seq=per_row, dtype=jnp.bfloat16, layout="NHD", host_pages=host_pages)
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages)[:rows * per_row].reshape(rows, per_row)
    bits = rng.integers(0, 2**16, cache.k_pages.shape, dtype=np.uint16)
    ref_counts = np.zeros(num_pages, np.int32)
    ref_counts[table.ravel()] = 1
    return dataclasses.replace(
        cache, k_pages=jax.device_put(bits.view(jnp.bfloat16)),
        v_pages=jax.device_put(np.roll(bits, 1).view(jnp.bfloat16)),
        page_table=jnp.asarray(table, jnp.int32),
        lengths=jnp.full((rows,), per_row * s["page_size"], jnp.int32),
        ref_counts=jnp.asarray(ref_counts))


def decode_workload(s: dict):
    """``(reader, work)``: a second cache and ``work(reader)``, ``steps`` decode steps over its
    every layer (each step's output the next step's query)."""
    d_rows, d_per_row = s["decode_rows"], s["decode_pages_per_row"]
    reader = scattered(s, d_rows, d_per_row, d_rows * d_per_row, 0, seed=1)
    q = jax.random.normal(jax.random.key(2), (d_rows, s["q_heads"], s["head_dim"]),
                          jnp.bfloat16)
    layers = s["layers"]

    def work(reader):
        def layer(i, x):
            return attention.decode(x, reader, i % layers)
        return jax.lax.fori_loop(0, s["steps"] * layers, layer, q)
    return reader, work


def measure(size: str) -> dict:
    s = SIZES[size]
    rows, per_row, reps = s["rows"], s["pages_per_row"], s["reps"]
    cache = scattered(s, rows, per_row, s["num_pages"], rows * per_row, seed=0)
    page_bytes = 2 * s["layers"] * s["page_size"] * s["heads"] * s["head_dim"] * 2
    nbytes = rows * per_row * page_bytes
    everyone = jnp.ones((rows,), bool)
    budget = rows * per_row
    out = jax.jit(lambda c: c.swap_out(everyone, budget), donate_argnums=0)
    back = jax.jit(lambda c: c.swap_in(everyone, budget), donate_argnums=0)
    bits_of = lambda pool, ids: jax.lax.bitcast_convert_type(  # noqa: E731
        jnp.take(pool, ids, axis=1), jnp.uint16)
    ids = cache.page_table.ravel()
    want = (bits_of(cache.k_pages, ids), bits_of(cache.v_pages, ids))
    reader, work = decode_workload(s)
    decode = jax.jit(work)
    jax.block_until_ready(decode(reader))
    t = {"decode_s": _median_s(lambda: decode(reader), reps)}

    # Each swap alone, then each in one jit with the decode workload; out and in in turn, so that
    # each call finds the rows where it needs them.
    settle = jax.jit(lambda c: c.settle_swaps(), donate_argnums=0)

    def overlapped(direction):
        start = jax.jit(lambda c: getattr(c, f"swap_{direction}")(everyone, budget, overlap=True),
                        donate_argnums=0)

        def run(c, r):
            c, moved = start(c)
            x = decode(r)
            return (settle(c), moved), x
        return run

    calls = (("swap_out_s", out), ("swap_in_s", back),
             ("out_with_decode_s", jax.jit(lambda c, r: (out(c), work(r)), donate_argnums=0)),
             ("in_with_decode_s", jax.jit(lambda c, r: (back(c), work(r)), donate_argnums=0)),
             ("out_overlapped_s", overlapped("out")), ("in_overlapped_s", overlapped("in")))
    samples: dict = {key: [] for key, _ in calls}
    for i in range(reps + 1):  # the first round compiles
        for key, fn in calls:
            start = time.perf_counter()
            if key.endswith(("with_decode_s", "overlapped_s")):
                (cache, moved), x = fn(cache, reader)
                jax.block_until_ready(x)
            else:
                cache, moved = fn(cache)
            jax.block_until_ready(cache)
            if i:
                samples[key].append(time.perf_counter() - start)
            if not bool(jnp.all(moved)):
                raise RuntimeError(f"{key}: not every row moved")
        ids = cache.page_table.ravel()
        if not all(bool(jnp.all(bits_of(pool, ids) == w))
                   for pool, w in zip((cache.k_pages, cache.v_pages), want)):
            raise RuntimeError("a page came back different")
    t.update({key: statistics.median(v) for key, v in samples.items()})

    roof = copy_roofline(nbytes, reps)
    result = dict(size=size, bytes=nbytes, pages=rows * per_row, page_bytes=page_bytes, **roof,
                  **t)
    for name, copy in (("out", "d2h_gbps"), ("in", "h2d_gbps")):
        gbps = nbytes / t[f"swap_{name}_s"] / 1e9
        result[f"swap_{name}_gbps"] = gbps
        result[f"swap_{name}_of_copy"] = gbps / roof[copy]
        swap_s, pair_s = t[f"swap_{name}_s"], t[f"{name}_with_decode_s"]
        # 1: the shorter of the two hidden entirely under the longer; 0: run one after the other
        result[f"{name}_overlap"] = (swap_s + t["decode_s"] - pair_s) / min(swap_s, t["decode_s"])
        result[f"{name}_decode_kept"] = t["decode_s"] / pair_s
        result[f"{name}_overlapped_decode_kept"] = t["decode_s"] / t[f"{name}_overlapped_s"]
    return result


def report(r: dict) -> str:
    gib = r["bytes"] / 2**30
    return "\n".join([
        f"host tier: {r['pages']} pages of {r['page_bytes'] >> 10} KiB ({gib:.3g} GiB) per "
        "direction, scattered over the pool",
        f"  pinned copy roofline: device -> host {r['d2h_gbps']:.1f} GB/s, "
        f"host -> device {r['h2d_gbps']:.1f} GB/s",
        f"  swap_out {r['swap_out_gbps']:.1f} GB/s ({r['swap_out_of_copy']:.0%} of the copy), "
        f"swap_in {r['swap_in_gbps']:.1f} GB/s ({r['swap_in_of_copy']:.0%}); target >= 90%",
        f"  overlap with a decode workload of {r['decode_s'] * 1e3:.2f} ms in the same jit: "
        + ", ".join(f"swap_{d} {r[f'swap_{d}_s'] * 1e3:.2f} ms alone, "
                    f"{r[f'{d}_with_decode_s'] * 1e3:.2f} ms with the decode (overlap "
                    f"{r[f'{d}_overlap']:.0%}, decode kept {r[f'{d}_decode_kept']:.0%})"
                    for d in ("out", "in")),
        "  overlapped (swap_*(overlap=True), the decode, settle_swaps): "
        + ", ".join(f"swap_{d} {r[f'{d}_overlapped_s'] * 1e3:.2f} ms with the decode (decode "
                    f"kept {r[f'{d}_overlapped_decode_kept']:.0%}); target >= 90%"
                    for d in ("out", "in"))])
