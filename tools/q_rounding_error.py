"""What rounding a bfloat16 query to e4m3 would cost an fp8 prefill's accuracy (perf notes 54).

Host-side, float32: attention over e4m3 K and V scaled per token and head, with the query as it
is and with the query rounded to e4m3 under a power of two a row (its largest |q| in [2^7, 2^8),
as the wgmma kernel's hi tile holds it), against exact attention over the unquantized values.
Prints the relative rms output error, mean of 8 draws, for flat and sharp attention.

    python tools/q_rounding_error.py
"""

import ml_dtypes
import numpy as np

D, KEYS, QUERIES, DRAWS = 128, 2048, 64, 8


def e4m3(x):
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def per_token(x):  # the cache's quantization: scale max |x| / 448 per vector
    s = np.abs(x).max(-1, keepdims=True) / 448
    return e4m3(x / s) * s


def rounded_query(q):
    m = 2.0 ** (7 - np.floor(np.log2(np.abs(q).max(-1, keepdims=True))))
    return e4m3(q * m) / m


def attention(q, k, v):
    s = q @ k.T / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


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
                exact, kq, vq = attention(q, k, v), per_token(k), per_token(v)
                for name, query in (("q as is", q), ("q in e4m3", rounded_query(q))):
                    got = attention(query, kq, vq)
                    errors[name].append(np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2)))
            cells = "  ".join(f"{name} {np.mean(e):.2e}" for name, e in errors.items())
            print(f"{data:17s} q x {sharpness:<4} {cells}")


if __name__ == "__main__":
    main()
