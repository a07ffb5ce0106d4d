"""Does a page transfer started on jaxkv's side stream (``overlap=True``) run beside a decode
workload, and at what bandwidth do the one-launch transfers run for a given grid?

    python3 tools/probes/host_overlap_probe.py

Separate dispatches, in order: the transfer (returns at once), the decode workload of
``jaxkv.bench --swap``, and the fence; against each alone. Bytes are checked after the fence.
``PROBE_STEPS``: decode steps; ``PROBE_DECODE_ROWS``: the decode's rows (32; a serving engine
decodes 256), over a reader drawn on the device.
"""
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import host_tier
from jaxkv._bench import swap as bench

size = "gpu" if jax.default_backend() == "gpu" else "cpu"
s = dict(bench.SIZES[size])
s["steps"] = int(os.environ.get("PROBE_STEPS", s["steps"]))  # decode steps beside the swap
L, S, H, D = s["layers"], s["page_size"], s["heads"], s["head_dim"]
M = s["rows"] * s["pages_per_row"]
P = 2 * M
rng = np.random.default_rng(0)
bits = rng.integers(0, 2**16, (L, P, S, H, D), dtype=np.uint16)
k = jax.device_put(bits.view(jnp.bfloat16))
v = jax.device_put(np.roll(bits, 1).view(jnp.bfloat16))
host = jax.device_put(np.zeros((M, 2, L, S, H, D), jnp.bfloat16),
                      k.sharding.with_memory_kind("pinned_host"))
src = jnp.asarray(rng.permutation(P)[:M], jnp.int32)
dst = jnp.asarray(rng.permutation(M), jnp.int32)
nbytes = M * 2 * L * S * H * D * 2


def decode_on_device(s):
    """``bench.decode_workload``'s decode over a reader whose random bytes are drawn on the
    device (the host's generator takes minutes for a pool of tens of GiB)."""
    from jaxkv import PagedKVCache, attention
    rows, per_row = s["decode_rows"], s["decode_pages_per_row"]
    pages = rows * per_row
    cache = PagedKVCache.create(
        num_layers=L, num_pages=pages, page_size=S, num_kv_heads=H, head_dim=D, max_batch=rows,
        max_pages_per_seq=per_row, dtype=jnp.bfloat16, layout="NHD")
    draw = jax.jit(lambda key: jax.lax.bitcast_convert_type(
        jax.random.bits(key, cache.k_pages.shape, jnp.uint16), jnp.bfloat16) * 0.01)
    table = np.random.default_rng(1).permutation(pages).reshape(rows, per_row)
    cache = dataclasses.replace(
        cache, k_pages=draw(jax.random.key(3)), v_pages=draw(jax.random.key(4)),
        page_table=jnp.asarray(table, jnp.int32),
        lengths=jnp.full((rows,), per_row * S, jnp.int32),
        ref_counts=jnp.ones((pages,), jnp.int32))
    q = jax.random.normal(jax.random.key(2), (rows, s["q_heads"], D), jnp.bfloat16)

    def work(reader):
        return jax.lax.fori_loop(0, s["steps"] * L,
                                 lambda i, x: attention.decode(x, reader, i % L), q)
    return cache, work


if "PROBE_DECODE_ROWS" in os.environ:  # a decode of another size (a serving engine's 256 rows)
    s["decode_rows"] = int(os.environ["PROBE_DECODE_ROWS"])
    reader, work = decode_on_device(s)
else:
    reader, work = bench.decode_workload(s)
decode = jax.jit(work)


def timed(fn, reps=5):
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:])


state = {"host": host, "k": k, "v": v}
out_sync = jax.jit(lambda h, k, v: host_tier._to_host(1, h, k, v, src, dst), donate_argnums=0)
out_async = jax.jit(lambda h, k, v: host_tier._to_host(1, h, k, v, src, dst, overlap=True),
                    donate_argnums=0)
in_sync = jax.jit(lambda k, v, h: host_tier._from_host(1, k, v, h, dst, src), donate_argnums=(0, 1))
in_async = jax.jit(lambda k, v, h: host_tier._from_host(1, k, v, h, dst, src, overlap=True),
                   donate_argnums=(0, 1))
fence = jax.jit(lambda k, v, h: host_tier._fence((jnp.zeros((), jnp.int32),), (k, v, h))[0])
print("HLO copies (out, in):",
      [sum(" copy(" in ln or "copy-start" in ln for ln in f.lower(*a).compile().as_text().splitlines())
       for f, a in ((out_sync, (host, k, v)), (in_sync, (k, v, host)))], flush=True)


def run_out(overlap, with_decode):
    f = out_async if overlap else out_sync
    state["host"] = f(state["host"], state["k"], state["v"])
    x = decode(reader) if with_decode else None
    done = fence(state["k"], state["v"], state["host"]) if overlap else None
    return (state["host"], state["k"], x, done)


def run_in(overlap, with_decode):
    f = in_async if overlap else in_sync
    state["k"], state["v"] = f(state["k"], state["v"], state["host"])
    x = decode(reader) if with_decode else None
    done = fence(state["k"], state["v"], state["host"]) if overlap else None
    return (state["k"], x, done)


t_decode = timed(lambda: decode(reader))
print(f"decode alone {t_decode * 1e3:.2f} ms; {nbytes / 2**30:.2f} GiB per direction; "
      f"JAXKV_HOST_COPY_BLOCKS={os.environ.get('JAXKV_HOST_COPY_BLOCKS')}", flush=True)
for name, fn in (("out", run_out), ("in", run_in)):
    for overlap in (False, True):
        alone = timed(lambda: fn(overlap, False))
        both = timed(lambda: fn(overlap, True))
        print(f"  {name} overlap={overlap}: alone {alone * 1e3:.2f} ms "
              f"({nbytes / alone / 1e9:.1f} GB/s), with decode {both * 1e3:.2f} ms "
              f"(decode kept {t_decode / both:.0%}, hidden "
              f"{(alone + t_decode - both) / min(alone, t_decode):.0%})", flush=True)
got = np.asarray(jax.device_put(state["host"], jax.memory.Space.Device)).view(np.uint16)
want = np.stack([bits, np.roll(bits, 1)], 0)[:, :, np.asarray(src)].transpose(2, 0, 1, 3, 4, 5)
print("host bytes equal:", np.array_equal(got[np.asarray(dst)], want), flush=True)
kk = np.asarray(state["k"]).view(np.uint16)
print("device bytes equal after the round trips:", np.array_equal(kk, bits), flush=True)
