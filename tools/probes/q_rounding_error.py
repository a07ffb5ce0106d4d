"""What rounding a bfloat16 query to e4m3 would cost an fp8 prefill's accuracy (perf notes 54).

Host-side, in float32 by jaxkv.reference: attention over e4m3 K and V scaled per token and head,
with the query as it is and with the query rounded to e4m3 under a power of two a row (its
largest |q| in [2^7, 2^8), as the wgmma kernel's hi tile holds it), against exact attention over
the unquantized values.
Prints the relative rms output error, mean of 8 draws, for flat and sharp attention.

    python tools/probes/q_rounding_error.py
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv import reference

D, KEYS, QUERIES, DRAWS = 128, 2048, 64, 8


def cached(x, dtype=jnp.float8_e4m3fn):  # as the cache holds it, read back
    return reference.dequantize(*reference.quantize(jnp.asarray(x), dtype))


def rounded_query(q):  # the wgmma kernel's hi tile alone, its power of two divided out
    m = 2.0 ** (7 - np.floor(np.log2(np.abs(q).max(-1, keepdims=True))))
    return (q * m).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / m


def attention(q, k, v):  # the queries as the heads of one row over one KV head
    n = jnp.array([KEYS], jnp.int32)
    return np.asarray(reference.decode_attention(jnp.asarray(q)[None], k[None, None],
                                                 v[None, None], n))[0]


def main():
    rng = np.random.default_rng(0)
    for data in ("gaussian", "outlier channels"):
        for sharpness in (0.1, 1.0, 3.0):
            errors = {"q as is": [], "q in e4m3": []}
            for _ in range(DRAWS):
                k = rng.standard_normal((KEYS, D)).astype(np.float32)
                v = rng.standard_normal((KEYS, D)).astype(np.float32)
                if data == "outlier channels":  # a few key channels 10-50x the rest
                    k[:, :4] *= rng.uniform(10, 50, 4)
                q = (rng.standard_normal((QUERIES, D)) * sharpness).astype(ml_dtypes.bfloat16)
                q = q.astype(np.float32)
                exact = attention(q, jnp.asarray(k), jnp.asarray(v))
                kq, vq = cached(k), cached(v)
                for name, query in (("q as is", q), ("q in e4m3", rounded_query(q))):
                    got = attention(query, kq, vq)
                    errors[name].append(np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2)))
            cells = "  ".join(f"{name} {np.mean(e):.2e}" for name, e in errors.items())
            print(f"{data:17s} q x {sharpness:<4} {cells}")


if __name__ == "__main__":
    main()
