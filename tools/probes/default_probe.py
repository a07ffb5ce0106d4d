"""Paged 16-bit attention, jaxkv's kernel against the cuDNN path, at the shapes a server runs: which
should be the default (``jaxkv.attention._implementation``). Each line: kernel time (the op's
kernels from the profiler; XLA's own ops around the cuDNN path, such as the merge of its two
prefill calls, are not in it) and time a call in a timed loop of 10 (everything), then the two
outputs' largest difference.

    python3 tools/probes/default_probe.py --op decode [--shapes 64,4096 ...] [--layouts NHD,HND]
    python3 tools/probes/default_probe.py --op prefill [--shapes 8,2048,2048 ...] [--dtype float16]

decode shapes: rows, tokens a row; prefill: rows, cached tokens a row, new tokens a row.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

ON_GPU = jax.default_backend() == "gpu"
SHAPES = {
    "decode": "1,4096 4,4096 8,4096 16,4096 32,4096 48,4096 64,4096 128,2048 256,512"
    if ON_GPU else "2,64",
    "prefill": "8,2048,2048 1,0,512 1,0,4096 4,0,2048 16,1024,128 32,4096,16 64,2048,4 2,8192,1024"
    if ON_GPU else "2,32,32",
}
parser = argparse.ArgumentParser()
parser.add_argument("--op", choices=tuple(SHAPES), default="prefill")
parser.add_argument("--shapes", nargs="*")
parser.add_argument("--heads", default="32,8,128" if ON_GPU else "8,2,64",
                    help="q heads, KV heads, head_dim")
parser.add_argument("--layouts", default="NHD")
parser.add_argument("--page", type=int, default=16)
parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
args = parser.parse_args()
HQ, H, D = (int(x) for x in args.heads.split(","))
DTYPE = jnp.dtype(args.dtype)


def case(shape: str, layout: str):
    """(label, q, cache, op(q, cache, layer, implementation))."""
    dims = [int(x) for x in shape.split(",")]
    if args.op == "decode":
        (B, n), new_tokens = dims, 0
        q = C.rand((B, HQ, D), C.BF16, 132)
        label = f"decode {layout} B{B} N{n}"

        def op(q, c, layer, impl):
            return jaxkv.attention.decode(q, c, layer, implementation=impl)
    else:
        B, n, new_tokens = dims
        q = C.rand((B, new_tokens, HQ, D), C.BF16, 132)
        new = C.i32(np.full(B, new_tokens))
        label = f"prefill {layout} B{B} {new_tokens} new on {n}"

        def op(q, c, layer, impl):
            return jaxkv.attention.prefill(q, c, layer, new, implementation=impl)
    pages = -(-(n + new_tokens) // args.page)
    cache = C._paged_pools(2, B, pages, args.page, H, D, np.full(B, n), layout, 130)
    cache = jax.tree_util.tree_map(lambda x: x.astype(DTYPE) if x.dtype == C.BF16 else x, cache)
    return f"{label} {HQ}/{H} D{D} {DTYPE.name}", q.astype(DTYPE), cache, op


for layout in args.layouts.split(","):
    for shape in args.shapes or SHAPES[args.op].split():
        label, q, cache, op = case(shape, layout)
        outs = {}
        for impl in ("jaxkv", "cudnn") if ON_GPU else ("jaxkv",):
            outs[impl] = jax.jit(lambda q, c, impl=impl: op(q, c, 0, impl))(q, cache)

            def step(i, q, c, impl=impl):
                return op(q, c, i % 2, impl).astype(q.dtype)

            _, kernel, _, _ = T.kernel_seconds(step, q + 0, cache, n=10)
            _, loop, _, _ = T.time_loop(step, q + 0, cache, n=10, reps=5)
            kernel = kernel or float("nan")
            print(f"{label} {impl:5s} kernel {kernel * 1e6:8.1f} us  loop "
                  f"{np.median(loop) * 1e6:8.1f} us", flush=True)
        if len(outs) == 2:
            diff = jnp.max(jnp.abs(outs["jaxkv"].astype(jnp.float32)
                                   - outs["cudnn"].astype(jnp.float32)))
            print(f"{label}: max |jaxkv - cudnn| {float(diff):.3g}", flush=True)
