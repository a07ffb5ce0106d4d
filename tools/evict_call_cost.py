"""Wall time per call of the demo's evict step, jaxkv vs XLA, on the demo's small cache: what a
Python loop that calls one jitted step at a time pays (dispatch included).

    python3 tools/evict_call_cost.py    (from outside the checkout, as tools/gpu_check.sh runs it)
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.demo import caches, cli, loop

cfg, params, _ = cli.load_model(cli.parse_args([]))
for cache_kind in ("linear", "paged"):
    for ops in ("jaxkv", "xla"):
        kind = caches.make_kind(cache_kind, cfg, dtype="float32", ops=ops)
        eng = loop.Engine(cfg, params, kind, max_batch=16, system_prompt=np.arange(32, dtype=np.int32),
                          max_prompt_len=24, max_new_tokens=48)
        evict = eng.compile()["evict"]
        cache, tokens = kind.create(16, eng.max_seq_len), jnp.zeros((16,), jnp.int32)
        mapping = np.arange(16, dtype=np.int32)
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
