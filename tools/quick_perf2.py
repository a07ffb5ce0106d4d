import time
import jax, jax.numpy as jnp, numpy as np
import jaxkv

def timeit(f, x, n=5):
    x = f(x); jax.block_until_ready(x)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); x = f(x); jax.block_until_ready(x); ts.append(time.perf_counter() - t)
    return float(np.median(ts)), x

def unrolled(op, n):
    def f(c):
        for _ in range(n):
            c = op(c)
        return c
    return jax.jit(f, donate_argnums=0)

x = jnp.ones((1 << 29,), jnp.uint32)  # 2 GiB
t, x = timeit(unrolled(lambda c: ~c, 20), x)
copy_bw = 2 * x.nbytes * 20 / t
print(f"copy (bitwise not, unrolled) {copy_bw/1e12:.2f} TB/s")
t, x = timeit(jax.jit(lambda x: jax.lax.fori_loop(0, 20, lambda i, c: ~c, x), donate_argnums=0), x)
print(f"copy (bitwise not, fori) {2 * x.nbytes * 20 / t/1e12:.2f} TB/s")
del x
k = jnp.ones((256, 8, 1, 128), jnp.bfloat16)
for n in (1, 50, 200):
    c1 = jaxkv.LinearKVCache.create(1, 256, 8, 4096, 128).reset(jnp.full((256,), 100, jnp.int32))
    t, c1 = timeit(unrolled(lambda c: c.append(0, k, k), n), c1)
    print(f"append decode B=256 unrolled x{n}: {t/n*1e6:.2f} us/step")
c1 = jaxkv.LinearKVCache.create(1, 256, 8, 4096, 128).reset(jnp.full((256,), 100, jnp.int32))
t, c1 = timeit(unrolled(lambda c: c.commit(0), 200), c1)
print(f"empty-ish step (commit 0) unrolled: {t/200*1e6:.2f} us/step")
buf = c1.buffer
t, buf = timeit(unrolled(lambda b: b.at[0, :, 0, :, 100].set(k[:, :, 0]), 200), buf)
print(f"XLA .at[].set decode: {t/200*1e6:.2f} us/step")
