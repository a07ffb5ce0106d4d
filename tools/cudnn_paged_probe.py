"""Can jaxkv's NHD pool be read by jax's cuDNN paged attention in place, and how fast is it?

GPU probe, not part of the suite. jax's public-private wrapper
(``jax._src.cudnn.fused_attention_stablehlo.paged_attention``) refuses a pool whose page count is
not ``batch x table width``; this calls the function under it with the whole stacked pool seen as
``[L * P, S, H, D]`` (a bitcast) and the page table offset by ``layer * P``. Prints, per case,
the max error against jaxkv.attention.decode, copies of the pool in the compiled HLO, and the
time per call of both (a jitted loop of 20 calls, wall clock, median of 5).

    python tools/cudnn_paged_probe.py
"""

import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jax._src.cudnn import fused_attention_stablehlo as fa


def cudnn_decode(q, cache, layer, kv_lengths, scale):
    L, P, S, H, D = cache.k_pages.shape
    B = q.shape[0]
    pool = lambda x: x.reshape(L * P, S, H, D)
    table = (jnp.clip(cache.page_table, 0, P - 1) + layer * P)[:, None, :, None]
    q4 = q[:, None]  # [B, 1, Hq, D]: BTNH
    empty = jnp.zeros(0, q.dtype)
    out = fa._dot_product_attention(
        q4, pool(cache.k_pages), pool(cache.v_pages), empty, jnp.ones((B,), jnp.int32),
        kv_lengths, empty, empty, table, table, scale, 42, 0.0, (False, False),
        fa.MaskType.PADDING, fa._normalize_layout("BTNH").value, None, fa.check_cudnn_version(),
        False)
    out = out[:, 0]
    return jnp.where((kv_lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def pools(L, B, W, S, H, D, spare, seed):
    P = B * W + spare
    rng = np.random.default_rng(seed)
    shape = (L, P, S, H, D)
    k = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(seed + 1), shape, jnp.bfloat16)
    table = rng.permutation(P)[: B * W].reshape(B, W).astype(np.int32)
    return k, v, table


def timed(fn, *args, n=20, reps=5):
    loop = jax.jit(lambda q, c: jax.lax.fori_loop(0, n, lambda i, q: fn(q, c, i % 2), q))
    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times), loop


def case(B, N, Hq, H, D, S, spare=17, ragged=False):
    W = -(-N // S)
    k, v, table = pools(2, B, W, S, H, D, spare, 5)
    lengths = np.full(B, N, np.int32)
    if ragged:
        lengths = np.random.default_rng(3).integers(0, N + 1, B).astype(np.int32)
        lengths[0], lengths[-1] = 0, N
    P = k.shape[1]
    cache = jaxkv.PagedKVCache(
        k_pages=k, v_pages=v, page_table=jnp.asarray(table), lengths=jnp.asarray(lengths),
        ref_counts=jnp.ones((P,), jnp.int32), new_tokens=jnp.zeros((B,), jnp.int32), layout="NHD")
    q = jax.random.normal(jax.random.key(9), (B, Hq, D), jnp.bfloat16)
    scale = 1 / D**0.5
    ours = lambda q, c, l: jaxkv.attention.decode(q, c, l)
    theirs = lambda q, c, l: cudnn_decode(q, c, l, c.lengths, scale)
    name = f"B{B} N{N} {Hq}/{H} D{D} page {S}{' ragged' if ragged else ''}"
    try:
        for layer in (0, 1):
            a = jax.jit(ours, static_argnums=2)(q, cache, layer).astype(jnp.float32)
            b = jax.jit(theirs, static_argnums=2)(q, cache, layer).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(a - b)))
        t_ours, _ = timed(ours, q, cache)
        t_cudnn, loop = timed(theirs, q, cache)
        hlo = loop.lower(q, cache).compile().as_text()
        copies = re.findall(r"= (bf16\[[^\]]*\])\{[^}]*\} copy\(", hlo)
        kv = 2 * int(lengths.sum()) * H * D * 2
        print(f"{name}: max |cudnn - jaxkv| {err:.2e}; jaxkv {t_ours * 1e6:.1f} us, cudnn "
              f"{t_cudnn * 1e6:.1f} us ({kv / t_cudnn / 1e9:.0f} GB/s); bf16 copies in HLO: {copies or 'none'}",
              flush=True)
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    case(64, 4096, 32, 8, 128, 16)
    case(64, 4096, 32, 8, 128, 16, ragged=True)
    case(64, 4096, 32, 8, 128, 128)
    case(64, 4096, 32, 8, 64, 16)
    case(8, 1000, 8, 8, 128, 1)
    case(8, 1000, 32, 4, 128, 32, ragged=True)
    case(8, 1000, 16, 16, 128, 64)
