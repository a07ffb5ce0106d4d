"""Which formulations of a page transfer between a device pool and a pinned-host pool XLA:GPU
compiles into plain copies (no host computation, no copy of the host pool), and how fast.

Each candidate moves M pages of every layer (K only: one pool) from a device pool to a host pool
and back under ``jit`` with the pools donated; it is checked byte for byte, timed (median), and
its compiled HLO searched for copies of a pool-sized buffer. Run on the GPU machine:

    python3 tools/probes/host_transfer_probe.py [--pages M] [--overlap-only]

Measured 2026-11-25 (1 GiB in pages of 1 MiB; the contiguous copy 53-54 GB/s each way): a host
pool written or read at one contiguous place (B, D) 49-50 GB/s out, 41-42 GB/s in, but that needs
contiguous host allocations; one copy per page at scattered host pages, 32 per loop iteration, no
staging array (E direct) 48 GB/s out, 37 GB/s in (H100), which jaxkv.host_tier uses. No
candidate overlapped a chain of matmuls in the same jit (the copies run on the compute stream);
``compute_on("gpu_stream:1")`` around the loop fails to compile under jax 0.11.2 ("No
ExecutionStreamId found for call-start").
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import inspect
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
# layers (PROBE_LAYERS, 32), tokens per page, heads, head_dim: bf16 pages of 1 MiB
L, T, H, D = int(os.environ.get("PROBE_LAYERS", 32)), 16, 8, 128


def timed(fn, state, *args, reps=5):
    """``state = fn(state, *args)`` (``state`` donated) ``reps`` times after a warm-up; returns
    the last state and the median seconds."""
    state = jax.block_until_ready(fn(state, *args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(fn(state, *args))
        ts.append(time.perf_counter() - t)
    return state, statistics.median(ts)


def pool_copies(fn, *args):
    hlo = fn.lower(*args).compile().as_text()
    big = [ln.strip()[:140] for ln in hlo.splitlines()
           if re.search(r"= \S+\[[^\]]*\]\S* copy\(", ln) and any(
               f"[{','.join(map(str, a.shape))}]" in ln for a in args if a.ndim >= 4)]
    host_compute = "host" in hlo and "_xla_compute_type" in hlo
    return big, host_compute


def report(name, seconds, nbytes, ok, copies, host_compute):
    print(f"{name:48s} {nbytes / seconds / 1e9:7.1f} GB/s  {seconds * 1e3:8.2f} ms  "
          f"bytes {'equal' if ok else 'DIFFER'}  pool copies {len(copies)}  "
          f"host compute {host_compute}", flush=True)
    for c in copies[:2]:
        print("    ", c)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=1024)
    p.add_argument("--device-pages", type=int, default=4096)
    p.add_argument("--overlap-only", action="store_true", help="only the overlap candidates")
    args = p.parse_args()
    m, pool_pages = args.pages, args.device_pages
    hp = 2 * m  # host pages
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, (L, pool_pages, T, H, D), dtype=np.uint16)
    dev = jax.device_put(bits.view(jnp.bfloat16))
    src = jnp.asarray(rng.permutation(pool_pages)[:m], jnp.int32)
    nbytes = m * L * T * H * D * 2
    want = np.asarray(jnp.take(dev, src, axis=1))  # [L, M, ...]
    print(f"{m} pages of {L * T * H * D * 2 >> 10} KiB, {nbytes / 2**30:.2f} GiB per direction",
          flush=True)

    def attempt(name, fn):
        try:
            fn()
        except Exception as e:  # a candidate XLA refuses: say why, try the next
            print(f"{name:48s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=1)

    # Overlap: the direct loop out and in beside a chain of matmuls in one jit.
    def overlapped():
        k = 8192 if jax.default_backend() == "gpu" else 256
        a = jax.random.normal(jax.random.key(0), (k, k), jnp.bfloat16)

        def work(a):
            return jax.lax.fori_loop(0, 40, lambda i, x: (x @ a) * 0.01, a)
        w = jax.jit(work)
        _, t_work = timed(lambda _: w(a), None)
        host = jax.device_put(jnp.zeros((hp, L, T, H, D), jnp.bfloat16), HOST)
        dst = jnp.asarray(rng.permutation(hp)[:m], jnp.int32)

        def out(host, dev, src, dst):
            def chunk(c, h):
                for j in range(8):
                    i = c * 8 + j
                    page = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(dev, src[i], 1, 1), 0, 1)
                    h = jax.lax.dynamic_update_slice(h, jax.device_put(page, HOST),
                                                     (dst[i], 0, 0, 0, 0))
                return h
            return jax.lax.fori_loop(0, m // 8, chunk, host)
        f = jax.jit(out, donate_argnums=0)
        host, t_swap = timed(f, host, dev, src, dst)
        for stream in (None, "gpu_stream:1"):
            def swap(h, d, s, t):
                if stream is None:
                    return out(h, d, s, t)
                from jax.experimental.compute_on import compute_on
                if next(iter(inspect.signature(compute_on).parameters)) == "f":  # jax >= 0.11
                    return compute_on(out, compute_type=stream,
                                      out_memory_spaces=jax.memory.Space.Host)(h, d, s, t)
                return compute_on(stream)(out)(h, d, s, t)
            both = jax.jit(lambda h, d, s, t, a: (swap(h, d, s, t), work(a)), donate_argnums=0)
            (host, _), t_both = timed(lambda st, *r: both(st[0], *r), (host, None), dev, src,
                                      dst, a)
            print(f"overlap ({stream or 'one stream'}): matmuls {t_work * 1e3:.2f} ms, swap out "
                  f"{t_swap * 1e3:.2f} ms, both in one jit {t_both * 1e3:.2f} ms (sum "
                  f"{(t_work + t_swap) * 1e3:.2f})", flush=True)
    attempt("overlap", overlapped)
    if args.overlap_only:
        return

    # Plain copies: the roofline.
    x = jnp.asarray(want)

    def roofline():
        f = jax.jit(lambda a: jax.device_put(a, HOST))
        h, s = timed(lambda _: f(x), None)
        report("roofline d2h (device_put of a fresh array)", s, nbytes, True, [], False)
        g = jax.jit(lambda a: jax.device_put(a, DEVICE))
        _, s = timed(lambda _: g(h), None)
        report("roofline h2d", s, nbytes, True, [], False)
    attempt("roofline", roofline)

    def into_device(name, back, *args):
        """``back(device pool, *args)`` (donated) fills the pages ``src`` of a zero pool: timed,
        checked against ``want``, its HLO searched for copies."""
        f = jax.jit(back, donate_argnums=0)
        pool = jnp.zeros_like(dev)
        copies, hc = pool_copies(f, pool, *args)
        pool, s = timed(f, pool, *args)
        ok = np.array_equal(np.asarray(jnp.take(pool, src, axis=1)).view(np.uint16),
                            want.view(np.uint16))
        report(name, s, nbytes, ok, copies, hc)

    # B: page-major host pool [HP, L, T, H, D], the transfer's pages contiguous at `start`.
    def page_major_contiguous():
        host = jax.device_put(jnp.zeros((hp, L, T, H, D), jnp.bfloat16), HOST)
        start = jnp.int32(m // 2)

        def out(host, dev, src, start):
            staging = jnp.swapaxes(jnp.take(dev, src, axis=1), 0, 1)  # [M, L, ...]
            staging = jax.device_put(staging, HOST)
            return jax.lax.dynamic_update_slice(host, staging, (start, 0, 0, 0, 0))
        out = jax.jit(out, donate_argnums=0)
        copies, hc = pool_copies(out, host, dev, src, start)
        host, s = timed(out, host, dev, src, start, reps=5)
        got = np.asarray(jax.device_put(host, DEVICE)[m // 2:m // 2 + m]).swapaxes(0, 1)
        report("B out: page-major host, contiguous DUS", s, nbytes, np.array_equal(
            got.view(np.uint16), want.view(np.uint16)), copies, hc)

        def back(dev, host, dst, start):
            staging = jax.lax.dynamic_slice(host, (start, 0, 0, 0, 0), (m, L, T, H, D))
            staging = jnp.swapaxes(jax.device_put(staging, DEVICE), 0, 1)
            return dev.at[:, dst].set(staging)
        into_device("B in: page-major host, contiguous DS", back, host, src, start)
    attempt("B", page_major_contiguous)

    # D: layer-major host pool [L, HP, ...] (the device layout), contiguous along axis 1.
    def layer_major_contiguous():
        host = jax.device_put(jnp.zeros((L, hp, T, H, D), jnp.bfloat16), HOST)
        start = jnp.int32(m // 2)

        def out(host, dev, src, start):
            staging = jax.device_put(jnp.take(dev, src, axis=1), HOST)
            return jax.lax.dynamic_update_slice(host, staging, (0, start, 0, 0, 0))
        out = jax.jit(out, donate_argnums=0)
        copies, hc = pool_copies(out, host, dev, src, start)
        host, s = timed(out, host, dev, src, start)
        got = np.asarray(jax.device_put(host, DEVICE)[:, m // 2:m // 2 + m])
        report("D out: layer-major host, DUS along pages", s, nbytes,
               np.array_equal(got.view(np.uint16), want.view(np.uint16)), copies, hc)

        def back(dev, host, dst, start):
            staging = jax.lax.dynamic_slice(host, (0, start, 0, 0, 0), (L, m, T, H, D))
            return dev.at[:, dst].set(jax.device_put(staging, DEVICE))
        into_device("D in: layer-major host, DS along pages", back, host, src, start)
    attempt("D", layer_major_contiguous)

    # C: page-major host pool, one DUS per page at scattered host pages (a loop of copies).
    def per_page(unroll):
        host = jax.device_put(jnp.zeros((hp, L, T, H, D), jnp.bfloat16), HOST)
        dst = jnp.asarray(rng.permutation(hp)[:m], jnp.int32)

        def out(host, dev, src, dst):
            staging = jnp.swapaxes(jnp.take(dev, src, axis=1), 0, 1)

            def body(i, h):
                page = jax.lax.dynamic_slice_in_dim(staging, i, 1, 0)
                return jax.lax.dynamic_update_slice(h, jax.device_put(page, HOST),
                                                    (dst[i], 0, 0, 0, 0))
            return jax.lax.fori_loop(0, m, body, host, unroll=unroll)
        out = jax.jit(out, donate_argnums=0)
        copies, hc = pool_copies(out, host, dev, src, dst)
        host, s = timed(out, host, dev, src, dst, reps=3)
        got = np.asarray(jax.device_put(host, DEVICE))[np.asarray(dst)].swapaxes(0, 1)
        report(f"C out: one DUS per page, unroll={unroll}", s, nbytes,
               np.array_equal(got.view(np.uint16), want.view(np.uint16)), copies, hc)
    attempt("C1", lambda: per_page(1))
    attempt("C8", lambda: per_page(8))

    # E: the loop the host tier uses: page-major host pool, pages in chunks of `unroll`, a
    # dynamic count (the tail of the last chunk repeats the last pair), with or without a
    # staging array on the device.
    def looped(unroll, staged, direction):
        host = jax.device_put(jnp.zeros((hp, L, T, H, D), jnp.bfloat16), HOST)
        dst = jnp.asarray(rng.permutation(hp)[:m], jnp.int32)
        n = jnp.int32(m)

        def pairs(body, carry, n):
            def chunk(c, carry):
                for j in range(unroll):
                    carry = body(jnp.minimum(c * unroll + j, n - 1), carry)
                return carry
            return jax.lax.fori_loop(0, (n + unroll - 1) // unroll, chunk, carry)

        def out(host, dev, src, dst, n):
            if staged:
                staging = jnp.swapaxes(jnp.take(dev, src, axis=1), 0, 1)
                page = lambda i: jax.lax.dynamic_slice_in_dim(staging, i, 1, 0)  # noqa: E731
            else:
                page = lambda i: jnp.swapaxes(  # noqa: E731
                    jax.lax.dynamic_slice_in_dim(dev, src[i], 1, 1), 0, 1)
            return pairs(lambda i, h: jax.lax.dynamic_update_slice(
                h, jax.device_put(page(i), HOST), (dst[i], 0, 0, 0, 0)), host, n)

        def back(dev, host, src, dst, n):
            fetch = lambda i: jax.device_put(  # noqa: E731
                jax.lax.dynamic_slice_in_dim(host, dst[i], 1, 0), DEVICE)
            if staged:
                staging = pairs(lambda i, st: jax.lax.dynamic_update_slice_in_dim(
                    st, fetch(i), i, 0), jnp.zeros((m, L, T, H, D), dev.dtype), n)
                return dev.at[:, src].set(jnp.swapaxes(staging, 0, 1))
            return pairs(lambda i, d: jax.lax.dynamic_update_slice_in_dim(
                d, jnp.swapaxes(fetch(i), 0, 1), src[i], 1), dev, n)

        name = f"E {'staged' if staged else 'direct'} unroll={unroll}"
        if direction == "out":
            f = jax.jit(out, donate_argnums=0)
            copies, hc = pool_copies(f, host, dev, src, dst, n)
            host, s = timed(f, host, dev, src, dst, n)
            got = np.asarray(jax.device_put(host, DEVICE))[np.asarray(dst)].swapaxes(0, 1)
            ok = np.array_equal(got.view(np.uint16), want.view(np.uint16))
            report(f"{name} out", s, nbytes, ok, copies, hc)
        else:
            h = np.zeros((hp, L, T, H, D), np.uint16)
            h[np.asarray(dst)] = want.view(np.uint16).swapaxes(0, 1)
            host = jax.device_put(jnp.asarray(h.view(jnp.bfloat16)), HOST)
            into_device(f"{name} in", back, host, src, dst, n)

    for unroll in (8, 32):
        for staged in (True, False):
            for direction in ("out", "in"):
                attempt("E", lambda: looped(unroll, staged, direction))


    # F: a jaxkv custom call with host-memory operands (the GPU kernel reading and writing
    # pinned host memory through unified addressing).
    def custom_call_on_host():
        from jaxkv import _ffi
        host_k = jax.device_put(jnp.asarray(want), HOST)  # [L, M, T, H, D]
        host_v = jax.device_put(jnp.asarray(want), HOST)
        n = m // 2
        a = jnp.arange(n, dtype=jnp.int32)

        def copy(k, v, s, d):
            return tuple(_ffi.call("jaxkv_paged_copy",
                                   (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, s, d, k, v,
                                   input_output_aliases={2: 0, 3: 1}, nhd=True))
        f = jax.jit(copy, donate_argnums=(0, 1))
        copies, hc = pool_copies(f, host_k, host_v, a, a + n)  # before donation
        (k, v), s = timed(lambda kv, *r: f(*kv, *r), (host_k, host_v), a, a + n, reps=3)
        got = np.asarray(jax.device_put(k, DEVICE))
        ok = np.array_equal(got[:, n:].view(np.uint16), want[:, :n].view(np.uint16))
        print("    F result memory kind:", k.sharding.memory_kind)
        report("F: jaxkv_paged_copy within host pools (K+V)", s, 2 * n * L * T * H * D * 2,
               ok, copies, hc)
    attempt("F", custom_call_on_host)


if __name__ == "__main__":
    main()
