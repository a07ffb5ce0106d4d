"""jaxkv's own decode kernels over every cache kind, kernel times, for comparing builds and grids.

    python3 tools/probes/decode_kinds_probe.py [--runs N] [--targets 1024,2048] [--dtypes bf16,f16,int8]
    ncu ... python3 tools/probes/decode_kinds_probe.py --plain --dtypes bf16  # three calls a case, untimed

The benchmark's decode case (B64 x 4096 tokens, 32 q / 8 KV heads, D128, page 16; a toy size off
the GPU; ``--shape`` for others): bf16 and f16 paged NHD / HND and linear on jaxkv's kernel and
paged on cuDNN's; fp8 e4m3 and int8 per token and head, paged NHD / HND and linear;
``fp8-tensor``: e4m3 scaled per tensor, paged only. Each line: the split-KV grid (the blocks it
aims at, ``jaxkv.attention._TARGET_BLOCKS``, or ``default``: the rule of
``jaxkv.attention._splits``, and the splits that gives), kernel time of 20 steps in one ``jit``
(the split-KV kernel and its combine), GB/s of the bytes read, and a hash of the output's bytes,
so that two builds whose arithmetic should agree bit for bit can be checked to.
"""
import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import attention
from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

ON_GPU = jax.default_backend() == "gpu"
DTYPES = {"bf16": None, "f16": None, "float8_e4m3fn": jnp.float8_e4m3fn, "int8": jnp.int8,
          "fp8-tensor": jnp.float8_e4m3fn}  # the last: e4m3 scaled per tensor (paged caches)

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="64,4096,32,8,128" if ON_GPU else "2,64,8,2,128",
                    help="rows, tokens a row, q heads, KV heads, head_dim")
parser.add_argument("--runs", type=int, default=1)
parser.add_argument("--targets", default="0", help="blocks the grid aims at (0: the default)")
parser.add_argument("--min-keys", default="0",
                    help="least keys a split (jaxkv.attention._MIN_KEYS_PER_SPLIT; 0: the default)")
parser.add_argument("--dtypes", default=",".join(DTYPES))
parser.add_argument("--plain", action="store_true", help="calls only, for a profiler outside")
args = parser.parse_args()
B, N, HQ, H, D = (int(x) for x in args.shape.split(","))
PAGE = 16
targets = [int(x) for x in args.targets.split(",")]
DEFAULT_TARGETS = dict(attention._TARGET_BLOCKS)
KERNELS = set(DEFAULT_TARGETS) | set(attention._RESIDENT_PER_SM)  # every kernel a rule names
DEFAULT_RESIDENT = dict(attention._RESIDENT_PER_SM)
min_keys = [int(x) or attention._MIN_KEYS_PER_SPLIT for x in args.min_keys.split(",")]
dtypes = args.dtypes.split(",")
lengths = np.full(B, N)


def caches():
    pools = {lay: C._paged_pools(2, B, N // PAGE, PAGE, H, D, lengths, lay, 110)
             for lay in ("NHD", "HND")}
    linear = jaxkv.LinearKVCache(buffer=C.rand((2, B, 2, H, N, D), C.BF16, 120),
                                 lengths=C.i32(lengths),
                                 active_batch_size=jnp.asarray(B, jnp.int32))
    for dtype in dtypes:
        for name, cache in [("paged NHD", pools["NHD"]), ("paged HND", pools["HND"]),
                            ("linear", linear)]:
            if dtype == "fp8-tensor":
                if name != "linear":
                    yield name, dtype, C.quantized(cache, DTYPES[dtype], scaling="per_tensor")
                continue
            yield name, dtype, (as_f16(cache) if dtype == "f16"
                                else C.quantized(cache, DTYPES[dtype]))


def as_f16(cache):
    """The bf16 cache's values in float16."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float16) if x.dtype == jnp.bfloat16 else x, cache)


def read_bytes(cache) -> int:
    data = cache.buffer if isinstance(cache, jaxkv.LinearKVCache) else cache.k_pages
    per_value = data.dtype.itemsize
    scales = 0 if getattr(cache, "scaling", None) != "per_token_head" else 2 * B * N * H * 4
    return 2 * B * N * H * D * per_value + scales


q0 = C.rand((B, HQ, D), C.BF16, 112)
for run in range(args.runs):
    for name, dtype, cache in caches():
        q = q0.astype(jnp.float16) if dtype == "f16" else q0  # a 16-bit cache's own dtype
        impls = [("jaxkv", t, k) for t in targets for k in min_keys]
        if ON_GPU and dtype in ("bf16", "f16") and name.startswith("paged"):
            impls.append(("cudnn", None, min_keys[0]))
        for impl, target, keys in impls:  # target None: cuDNN's call; 0: the default grid
            attention._TARGET_BLOCKS = (dict.fromkeys(KERNELS, target) if target
                                        else DEFAULT_TARGETS)
            attention._RESIDENT_PER_SM = {} if target else DEFAULT_RESIDENT  # a target alone
            attention._MIN_KEYS_PER_SPLIT = keys
            src = attention._source("probe", cache, 0)
            splits = attention._splits(B, src, HQ) if impl == "jaxkv" else "-"
            label = "-" if target is None else target or "default"
            f = jax.jit(lambda q, c: attention.decode(q, c, 0, implementation=impl))
            out = f(q, cache)
            if args.plain:
                jax.block_until_ready([f(q, cache) for _ in range(2)])
                print(name, dtype, impl, "done", flush=True)
                continue
            digest = hashlib.sha1(np.asarray(out).tobytes()).hexdigest()[:10]

            def step(i, q, c, impl=impl):
                return attention.decode(q, c, i % 2, implementation=impl).astype(q.dtype)

            _, sec, launches, _ = T.kernel_seconds(step, q + 0, cache, n=20)
            sec = sec or float("nan")  # no profiler's kernel times off the GPU
            print(f"run {run} B{B} N{N} {HQ}/{H} D{D} {name:9s} {dtype:13s} {impl:5s} "
                  f"target {label:>7} keys {keys:>3} splits {splits:>3} {sec * 1e6:7.1f} us "
                  f"{read_bytes(cache) / sec / 1e9:6.0f} GB/s  "
                  f"out {digest} ({launches} launches)", flush=True)
