"""One-layer decode append (256 rows, H8 D128, page 16 NHD), bf16 against fp8 / int8, three calls
each: the kernels for ncu to profile (perf notes item 32), e.g.

    ncu --clock-control none --kernel-name regex:"append|quantize" --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats python3 tools/probes/decode_append_probe.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._bench import cases as C

B, H, D, page = 256, 8, 128, 16
lengths = np.random.default_rng(12).integers(0, 2 * page, B)
for dt in (None, jnp.float8_e4m3fn, jnp.int8):
    cache = C.quantized(C._paged_pools(1, B, 2, page, H, D, lengths, "NHD", 60), dt)
    k = C.rand((B, H, 1, D), C.BF16, 71)
    f = jax.jit(lambda c, k: c.append(0, k, k))
    for _ in range(3):
        out = f(cache, k)
    jax.block_until_ready(out)
    print(dt, "done")
