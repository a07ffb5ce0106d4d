"""The Hopper prefill's item order on the benchmark's serving-step row (64 rows of 1 to 512 new
tokens, 5000 in all, on cached prefixes of 0 to 4096; 32 q / 8 KV heads, D128, page 16): kernel
time and a hash of the output's bytes, to run with and without the static order (the two must
agree bit for bit: the order changes which block runs an item, not its arithmetic).

    python3 tools/probes/prefill_order_probe.py                           # items by the counter
    JAXKV_PREFILL_STATIC=1 python3 tools/probes/prefill_order_probe.py    # the static snake

tools/probes/prefill_schedule_model.py models the same row on the CPU.
"""
import hashlib
import os

import jax
import numpy as np

from jaxkv._bench import cases as C
from jaxkv._bench import timing as T

case = C.attention_prefill_ragged(64, 5000, 512, 4096, 32, 8, 128, 16, 3)
q, cache, kernel, _ = case.build()
out = jax.jit(kernel)(0, q, cache)
digest = hashlib.sha1(np.asarray(out).tobytes()).hexdigest()[:10]
_, sec, launches, _ = T.kernel_seconds(kernel, q + 0, cache, n=10)
sec = sec or float("nan")
order = "static" if "JAXKV_PREFILL_STATIC" in os.environ else "counter"
print(f"serving step ({order}) {sec * 1e6:7.1f} us {case.flops / sec / 1e12:5.0f} TFLOP/s "
      f"out {digest} ({launches} launches)", flush=True)
