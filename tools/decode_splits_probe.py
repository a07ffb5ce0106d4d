"""How does jaxkv's own decode kernel's time follow the split-KV grid, beside cuDNN's?

    python3 tools/decode_splits_probe.py [target_blocks ...]

The benchmark's decode case (B64 x 4096 tokens, 32 q / 8 KV heads, D128, page 16, bf16, paged NHD
and HND, and the linear cache), timed from the profiler (kernel time, the split-KV kernel and its
combine) for each ``jaxkv.attention._TARGET_BLOCKS`` given (the grid the splits aim at: 2048 by
default, 512 pairs of (row, KV head) -> 4 splits), and cuDNN's bf16 kernel in the same process.
Outputs are checked against the default grid's before any time is printed.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import attention
from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

B, N, HQ, H, D, PAGE = 64, 4096, 32, 8, 128, 16
COPY_BYTES = 2 * B * N * H * D * 2  # K and V read once
targets = [int(x) for x in sys.argv[1:]] or [1024, 1536, 2048, 2560, 3072, 4096]


def caches():
    lengths = np.full(B, N)
    for layout in ("NHD", "HND"):
        yield f"paged {layout}", C._paged_pools(2, B, N // PAGE, PAGE, H, D, lengths, layout, 110)
    yield "linear", jaxkv.LinearKVCache(buffer=C.rand((2, B, 2, H, N, D), C.BF16, 120),
                                        lengths=C.i32(lengths),
                                        active_batch_size=jnp.asarray(B, jnp.int32))


def step_for(impl):
    def step(i, q, c):
        return attention.decode(q, c, i % 2, implementation=impl).astype(q.dtype)
    return step


q0 = C.rand((B, HQ, D), C.BF16, 112)
for name, cache in caches():
    impls = [("jaxkv", t) for t in targets]
    if name.startswith("paged"):
        impls.append(("cudnn", None))
    want = np.asarray(jax.jit(lambda q, c: attention.decode(q, c, 0, implementation="jaxkv"))(q0, cache),
                      np.float32)
    for impl, target in impls:
        if target:
            attention._TARGET_BLOCKS = target
        splits = attention._splits(B, attention._source("probe", cache, 0), HQ) if impl == "jaxkv" else "-"
        got = np.asarray(jax.jit(lambda q, c: attention.decode(q, c, 0, implementation=impl))(q0, cache),
                         np.float32)
        err = float(np.max(np.abs(got - want)))
        _, sec, launches, ops = T.kernel_seconds(step_for(impl), q0 + 0, cache, n=20)  # donated
        us = sec * 1e6 if sec else float("nan")
        print(f"{name:10s} {impl:6s} target {target or '-':>5} splits {splits:>3} "
              f"{us:7.1f} us  {COPY_BYTES / (sec or np.nan) / 1e9:6.0f} GB/s  max|diff| {err:.2e} "
              f"({launches} launches / {ops} ops)", flush=True)
    attention._TARGET_BLOCKS = 2048
print("copy bandwidth (read + write of", C.mib(COPY_BYTES), "):",
      T.copy_bandwidth(COPY_BYTES, 10, 3), flush=True)
