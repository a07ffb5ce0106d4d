"""8-bit prefill attention (batch 8, 2048 new tokens on 2048 cached, 32 q / 8 KV heads, D128, page
16; fp8 e4m3 and int8 scaled per token and head) beside the bf16 one, on the same values
(`--head-dim 256`: 16 q / 8 KV heads of 256, the shape of issue 68's Gemma 3 row; `--window`,
`--soft-cap`: issue 65's hybrid rows; the TFLOP/s count the causal prefill's FLOPs either way).

    python3 tools/probes/prefill_8bit_probe.py --time   # kernel times of 10 calls in one jit, and each
                                                  # 8-bit output's distance from the bf16 one's
        [--e5m2] [--per-tensor]                   # also fp8 e5m2 (converted by a byte permute),
                                                  # fp8 e4m3 scaled per tensor (no scales to apply)
    ncu --clock-control none --kernel-name regex:prefill_wgmma --section WarpStateStats \
        --section InstructionStats python3 tools/probes/prefill_8bit_probe.py   # one call each

The distance (max and mean |out - bf16 out|) compares builds whose arithmetic differs; a hash
of the output's bytes tells builds that should agree bit for bit.
"""
import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

parser = argparse.ArgumentParser()
parser.add_argument("--time", action="store_true", help="kernel times (else: one call each)")
parser.add_argument("--runs", type=int, default=1)
parser.add_argument("--e5m2", action="store_true", help="fp8 e5m2 too (converted by a byte permute)")
parser.add_argument("--per-tensor", action="store_true", help="fp8 e4m3 scaled per tensor too")
parser.add_argument("--head-dim", type=int, choices=(128, 256), default=128,
                    help="256: Gemma 3's heads (16 q / 8 KV), the 8-bit caches on mma.sync there")
parser.add_argument("--window", type=int, default=None, help="a sliding window of this many keys")
parser.add_argument("--soft-cap", type=float, default=None, help="scores soft-capped at this")
parser.add_argument("--bf16-only", action="store_true", help="the bf16 cache alone")
args = parser.parse_args()
hybrid = dict(window=args.window, soft_cap=args.soft_cap)

B, prefix, T_NEW, H, page = 8, 2048, 2048, 8, 16
D, Hq = args.head_dim, 32 if args.head_dim == 128 else 16
pages = -(-(prefix + T_NEW) // page)
q = C.rand((B, T_NEW, Hq, D), C.BF16, 132)
new = C.i32(np.full(B, T_NEW))
flops = 4 * B * Hq * D * T_NEW * (prefix + (T_NEW + 1) / 2)  # QK^T and PV, causal on the new tokens
kinds = [(None, None), (jnp.float8_e4m3fn, "per_token_head"), (jnp.int8, "per_token_head")]
kinds = kinds[:1] if args.bf16_only else kinds
kinds += [(jnp.float8_e5m2, "per_token_head")] if args.e5m2 else []
kinds += [(jnp.float8_e4m3fn, "per_tensor")] if args.per_tensor else []
bf16_out = None
for run in range(args.runs):
    for dtype, scaling in kinds:
        name = "bf16" if dtype is None else jnp.dtype(dtype).name
        name += " per tensor" if scaling == "per_tensor" else ""
        if not args.time and (dtype, scaling) not in kinds[:2]:  # ncu: bf16 and fp8 e4m3 only
            continue
        pools = C._paged_pools(2, B, pages, page, H, D, np.full(B, prefix), "NHD", 130)
        cache = C.quantized(pools, dtype, scaling or "per_token_head")
        out = jax.jit(lambda q, c: jaxkv.attention.prefill(q, c, 0, new, **hybrid))(q, cache)
        jax.block_until_ready(out)
        if not args.time:
            print(name, "done", flush=True)
            continue
        x = np.asarray(out, np.float32)
        if dtype is None:
            bf16_out = x
        diff = np.abs(x - bf16_out)
        digest = hashlib.sha1(np.asarray(out).tobytes()).hexdigest()[:10]

        def step(i, q, c):
            return jaxkv.attention.prefill(q, c, i % 2, new, **hybrid).astype(q.dtype)

        _, sec, launches, _ = T.kernel_seconds(step, q + 0, cache, n=10)
        sec = sec or float("nan")
        print(f"run {run} prefill {name:24s} {sec * 1e3:6.3f} ms {flops / sec / 1e12:5.0f} TFLOP/s "
              f"vs bf16 max {diff.max():.4f} mean {diff.mean():.6f} out {digest} "
              f"({launches} launches)", flush=True)
