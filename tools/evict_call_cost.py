"""Wall time per call of the demo's evict step, jaxkv vs XLA, on the demo's small cache: what a
Python loop that calls one jitted step at a time pays (dispatch included).

    python3 tools/evict_call_cost.py    (from outside the checkout, as tools/gpu_check.sh runs it)
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.demo import cli

for cache_kind in ("linear", "paged"):
    stream = cli.Stream(cli.parse_args(["--cache", cache_kind]))
    for ops in ("jaxkv", "xla"):
        eng = stream.engine(ops)
        evict = eng.compile()["evict"]
        cache = eng.kind.create(eng.max_batch, eng.max_seq_len)
        tokens = jnp.zeros((eng.max_batch,), jnp.int32)
        mapping = np.arange(eng.max_batch, dtype=np.int32)
        for fresh in (True, False):
            m = jnp.asarray(mapping)
            times = []
            for i in range(300):
                if fresh:
                    m = jnp.asarray(mapping)
                t = time.perf_counter()
                cache, tokens = jax.block_until_ready(evict(cache, tokens, m))
                times.append(time.perf_counter() - t)
            print(f"{cache_kind:7s} {ops:6s} {'fresh' if fresh else 'same '} mapping: "
                  f"{np.median(times[50:]) * 1e6:7.1f} us/call")
