"""Kernel times of issue 22's quantizing-append rows beside their bf16 rows (page 16 NHD: the
5000-token ragged prefill, the one-layer decode step of 256 rows, 32 layers in one launch),
without the benchmark's XLA formulations, so that several builds fit one device call:

    python3 tools/probes/append_8bit_probe.py [--runs 2]

Each line: case, dtype, median kernel time (us) of each run, its ratio to the bf16 row.
"""
import argparse

import jax.numpy as jnp

from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=2)
args = p.parse_args()

SHAPES = {
    "prefill 5000 ragged": lambda dt: C.paged_append(8, 1024, 5000, 8, 128, 16, 4, 10, None, "NHD",
                                                     dtype=dt),
    "decode one layer": lambda dt: C.paged_decode_append(256, 8, 128, 16, "NHD", 8, 250, dtype=dt),
    "decode 32 layers, a layer": lambda dt: C.paged_decode_append(256, 8, 128, 16, "NHD", 1, 10,
                                                                  layers=32, dtype=dt),
}
for shape, make in SHAPES.items():
    base = None
    for dt in (None, jnp.float8_e4m3fn, jnp.int8):
        case = make(dt)
        carry, consts, kernel, _ = case.build()
        times = []
        for _ in range(args.runs):
            carry, t, _, _ = T.kernel_seconds(kernel, carry, consts, case.per_step // case.per_launch,
                                              n=10)
            times.append(float("nan") if t is None else t / case.per_launch * 1e6)  # CPU: none
        del carry, consts
        best = min(times)
        if dt is None:  # the bf16 row, which the 8-bit rows after it are compared with
            base = best
        name = "bfloat16" if dt is None else jnp.dtype(dt).name
        print(f"{shape:28s} {name:14s} " + " ".join(f"{x:7.3f}" for x in times)
              + f"  x{best / base:.3f}", flush=True)
