"""Which MMAs of an fp8 prefill can run in e4m3 and keep the output error within 1.5x of today's
exact-query path (issue 68)? A host-side emulation, numpy float32, of the Hopper prefill over an
e4m3 cache scaled per token and head (jaxkv.reference.quantize: scale max|x| / 448 a vector),
against float32 attention over the unquantized K and V (jaxkv.reference.prefill_attention).

The data are the accuracy table's (tests/test_quantized.py::attention_error: gaussian, outlier key
channels x10-50, tokens of size e^+-3; q = 0.1 N(0, 1), in bfloat16) in a prefill's shape: 128 new
queries, causal, at the end of 512 keys, 4 rows x 2 KV heads x group 4, head_dim 64 and 128. The
emulation runs the kernel's online softmax over 128-key tiles (base 2, float32 sums of the
unrounded weights); e4m3 and f16 round to nearest even (e4m3 saturating at 448); MMAs are exact
products summed in float32 (Hopper's fp8 MMA accumulates with fewer bits: not modelled).

    A  today: Q as hi + lo e4m3 tiles (bf16's bits, but for values under ~2^-13 of the row's
       largest, as in the kernel), K's scale on each score; P V in f16:
       P = f16(p), V = f16(e4m3 value * f16(V scale / vref)), vref a power of two above the row's
       V scales, O * vref at the end
    B  Q as one e4m3 tile a row (a power of two: max |q| in [2^7, 2^8)); P V as A
    C  B with P V in e4m3: P * V scale / vref rounded to e4m3 under a power of two a row and
       tile (its max in (224, 448]), V's bytes as stored
    D  C with K H in the cache (H the normalized Hadamard matrix) and Q H at read
    E  B with K H in the cache and Q H at read (P V as A)
    F1 C with P's scale fixed at 448 (none found a tile)
    F2 A's exact Q with C's P V in e4m3
    F3 C with P as two e4m3 tiles, hi + lo (three fp8 MMAs where C has two)
    F4 A with K H in the cache and Q H at read (Q H as hi + lo)
Prints each variant's relative rms output error, mean over seeds, and its ratio to A's; first
the table's own decode shape (seed 0) as a check that A reproduces the table's e4m3 numbers.
--q-std 1 sharpens the attention beyond the table's data.

    python tools/probes/fp8_prefill_error.py [--seeds 8] [--q-std 0.1]
"""
import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv import reference

VARIANTS = {  # q_mode: Q as the S MMA reads it; rot: K and Q rotated by H; pv: P V's operands
    "A": dict(q_mode="hilo", rot=False, pv="f16"),
    "B": dict(q_mode="e4m3", rot=False, pv="f16"),
    "C": dict(q_mode="e4m3", rot=False, pv="e4m3"),
    "D": dict(q_mode="e4m3", rot=True, pv="e4m3"),
    "E": dict(q_mode="e4m3", rot=True, pv="f16"),
    "F1": dict(q_mode="e4m3", rot=False, pv="e4m3 x448"),
    "F2": dict(q_mode="hilo", rot=False, pv="e4m3"),
    "F3": dict(q_mode="e4m3", rot=False, pv="e4m3 hilo"),
    "F4": dict(q_mode="hilo", rot=True, pv="f16"),
}
KINDS = ("gaussian", "outlier channels", "token magnitudes")
TILE, LOG2E = 128, np.float32(np.log2(np.e))


def e4m3(x):
    x = np.clip(x, -448, 448)  # satfinite, as the kernel converts
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def f16(x):
    return x.astype(np.float16).astype(np.float32)


def pow2(x):  # 2^floor(log2 x), x > 0
    return np.exp2(np.floor(np.log2(x))).astype(np.float32)


def hadamard(d):
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def cached(x):  # the cache's e4m3 values (as float32) and per-token scales
    codes, scales = reference.quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    return np.asarray(codes).astype(np.float32), np.asarray(scales)


def query_operand(q, mode):
    """q [..., D] as the S MMA reads it, the row's power of two divided back out (exact)."""
    m = 128 / pow2(np.abs(q).max(-1, keepdims=True))  # the row's max |q m| in [2^7, 2^8)
    hi = e4m3(q * m)
    return (hi + e4m3(q * m - hi) if mode == "hilo" else hi) / m


def emulate(q, k, v, pos, q_mode, rot, pv):
    """q [B, Hkv, R, D] (bf16 values; row r at position pos[r], causal), k, v [B, Hkv, S, D]
    float32: the output [B, Hkv, R, D]."""
    d = q.shape[-1]
    if rot:
        h = hadamard(d)
        q, k = q @ h, k @ h
    (kc, ks), (vc, vs) = cached(k), cached(v)
    vref = np.exp2(np.floor(np.log2(vs.max(-1))) + 1).astype(np.float32)[..., None, None]
    vfac = vs[:, :, None, :] / vref  # each key's V scale over vref, [B, Hkv, 1, S]
    s = query_operand(q, q_mode) @ kc.swapaxes(-1, -2)  # [B, Hkv, R, S]
    s = s * ks[:, :, None, :] * np.float32(d**-0.5 * LOG2E)
    s = np.where(np.arange(k.shape[-2]) <= pos[:, None], s, -np.inf)
    m = np.full(s.shape[:-1] + (1,), -np.inf, np.float32)
    l, o = np.zeros_like(m), np.zeros(q.shape, np.float32)
    for j in range(0, k.shape[-2], TILE):  # the online softmax, a tile of keys at a time
        st, fac, vt = s[..., j:j + TILE], vfac[..., j:j + TILE], vc[:, :, j:j + TILE]
        top = np.maximum(m, st.max(-1, keepdims=True))
        alpha, p = np.exp2(m - top), np.exp2(st - top)
        l, m = l * alpha + p.sum(-1, keepdims=True), top
        if pv == "f16":  # V converted to f16 times its f16 factor; P in f16
            pv_out = f16(p) @ f16(vt * f16(fac).swapaxes(-1, -2))
        else:  # P times V's factor, in e4m3 under a scale c; V's bytes as stored
            pf = p * fac
            c = np.float32(448) if pv == "e4m3 x448" else pow2(448 / np.maximum(
                pf.max(-1, keepdims=True), 1e-30))  # the max of P c in (224, 448]
            hi = e4m3(pf * c)
            p8 = hi + e4m3(pf * c - hi) if pv == "e4m3 hilo" else hi
            pv_out = (p8 @ vt) / c
        o = o * alpha + pv_out
    return o * vref / l


def kv_data(rng, kind, shape):  # the draws of tests/test_quantized.py::attention_error, in order
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    if kind == "outlier channels":
        k[..., :4] *= rng.uniform(10, 50, 4).astype(np.float32)
    if kind == "token magnitudes":
        k *= np.exp(rng.uniform(-3, 3, shape[:3] + (1,))).astype(np.float32)
        v *= np.exp(rng.uniform(-3, 3, shape[:3] + (1,))).astype(np.float32)
    return k, v


def bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def errors(q, k, v, exact):
    """Each variant's relative rms error; q [B, T, Hq, D], exact [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    heads, keys = k.shape[1], k.shape[2]
    g = hq // heads  # row r of a KV head: its group's query head r // t, token r % t
    qg = q.reshape(b, t, heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, heads, g * t, d)
    pos = keys - t + np.arange(g * t) % t
    out = {}
    for name, cfg in VARIANTS.items():
        got = emulate(qg, k, v, pos, **cfg).reshape(b, heads, g, t, d).transpose(0, 3, 1, 2, 4)
        got = got.reshape(q.shape)
        out[name] = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2))
    return out


def table_check():
    """The accuracy table's decode shape and data (seed 0); its own figure by jaxkv.reference."""
    d = 64
    print(f"decode, the accuracy table's shape (4 rows x 2 KV heads x 128 keys, 4 q heads, D {d}, "
          "seed 0):")
    for kind in KINDS:
        rng = np.random.default_rng(0)
        k, v = kv_data(rng, kind, (4, 2, 128, d))
        q = rng.standard_normal((4, 4, d)).astype(np.float32) * 0.1
        n = jnp.full((4,), 128, jnp.int32)
        exact = np.asarray(reference.decode_attention(*map(jnp.asarray, (q, k, v)), n))
        deq = [jnp.asarray(c * s[..., None]) for c, s in map(cached, (k, v))]
        table = np.asarray(reference.decode_attention(jnp.asarray(q), *deq, n))
        table = np.sqrt(np.mean((table - exact) ** 2) / np.mean(exact**2))
        e = errors(bf16(q)[:, None], k, v, exact[:, None])  # the kernel's q is bf16
        cells = "  ".join(f"{name} {x:.2e}" for name, x in e.items())
        print(f"  {kind:17s} table {table:.2e} | {cells}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--q-std", type=float, default=0.1, help="q's spread (0.1: the table's)")
    args = parser.parse_args()
    with jax.default_device(jax.devices("cpu")[0]):
        table_check()
        within = {name: True for name in VARIANTS}
        for d in (64, 128):
            print(f"\nprefill: 128 causal queries at the end of 512 keys, 4 rows x 2 KV heads x "
                  f"group 4, D {d}, q x {args.q_std}; mean of {args.seeds} seeds (ratio to A)")
            print(f"  {'':17s}" + "".join(f"{name:>16s}" for name in VARIANTS))
            for kind in KINDS:
                runs = []
                for seed in range(args.seeds):
                    rng = np.random.default_rng(seed)
                    k, v = kv_data(rng, kind, (4, 2, 512, d))
                    q = bf16(rng.standard_normal((4, 128, 8, d)).astype(np.float32) * args.q_std)
                    exact = np.asarray(reference.prefill_attention(
                        *map(jnp.asarray, (q, k, v)), jnp.full((4,), 384, jnp.int32),
                        jnp.full((4,), 128, jnp.int32)))
                    runs.append(errors(q, k, v, exact))
                mean = {name: np.mean([r[name] for r in runs]) for name in VARIANTS}
                for name in VARIANTS:
                    within[name] &= bool(mean[name] <= 1.5 * mean["A"])
                print(f"  {kind:17s}" + "".join(
                    f"{mean[n]:9.2e} {mean[n] / mean['A']:4.2f}x" for n in VARIANTS))
        print("\nwithin 1.5x of A on every kind and D: " + ", ".join(
            f"{n} {'yes' if ok else 'NO'}" for n, ok in within.items()))


if __name__ == "__main__":
    main()
