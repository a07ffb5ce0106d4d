"""Scratch timing of the foundation kernels (superseded by jaxkv.bench)."""
import time, sys
import jax, jax.numpy as jnp, numpy as np
import jaxkv

def timeit(f, x, n=5):
    x = f(x); jax.block_until_ready(x)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); x = f(x); jax.block_until_ready(x); ts.append(time.perf_counter() - t)
    return float(np.median(ts)), x

N = 20
x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
cp = jax.jit(lambda x: jax.lax.fori_loop(0, N, lambda i, c: jnp.roll(c, 1), x), donate_argnums=0)
t, x = timeit(cp, x)
copy_bw = 2 * x.nbytes * N / t
print(f"copy (roll) {copy_bw/1e12:.2f} TB/s")
del x

L, B, H, S, D = 8, 32, 8, 4096, 128
cache = jnp.ones((L, B, 2, H, S, D), jnp.bfloat16)
rng = np.random.default_rng(0)
lengths = jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)
perm = np.full(B, -1, np.int32); perm[1::2] = np.arange(B // 2)  # half evicted, survivors move
mapping = jnp.asarray(perm)
live = sum(int(lengths[i]) for i in range(B) if perm[i] >= 0 and perm[i] != i)
moved = 2 * live * L * 2 * H * D * 2
def body(i, c):
    return jaxkv.LinearKVCache(c, lengths, jnp.int32(B)).compact(mapping).buffer
f = jax.jit(lambda c: jax.lax.fori_loop(0, N, body, c), donate_argnums=0)
t, cache = timeit(f, cache)
print(f"compact L={L}: {t/N*1e3:.3f} ms, {moved/(t/N)/1e12:.2f} TB/s = {moved/(t/N)/copy_bw:.0%} of copy")
k = jnp.ones((256, 8, 1, 128), jnp.bfloat16)
c1 = jaxkv.LinearKVCache.create(1, 256, 8, 4096, 128).reset(jnp.full((256,), 100, jnp.int32))
ap = jax.jit(lambda c: jax.lax.fori_loop(0, 200, lambda i, c: c.append(0, k, k), c), donate_argnums=0)
t, c1 = timeit(ap, c1)
print(f"append decode B=256: {t/200*1e6:.2f} us/step")
src = np.arange(B, dtype=np.int32)
for i, t in enumerate(perm):
    if t >= 0: src[t] = i
srcj = jnp.asarray(src)
tk = jax.jit(lambda c: jax.lax.fori_loop(0, N, lambda i, c: jnp.take(c, srcj, axis=1), c), donate_argnums=0)
cache = jnp.ones((L, B, 2, H, S, D), jnp.bfloat16)
t2, cache = timeit(tk, cache)
print(f"jnp.take L={L}: {t2/N*1e3:.3f} ms -> jaxkv speed-up {t2/t:.1f}x")
