"""8-bit decode attention (B64 x 4096 tokens, 32 q / 8 KV heads, D128, page 16, fp8 e4m3 per
token and head), paged NHD against HND, three calls each: the kernels for ncu to compare (why NHD
reads slower), e.g.

    ncu --clock-control none --kernel-name regex:attention --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \
        python3 tools/decode_8bit_probe.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv._bench import cases as C

B, N, Hq, H, D, page = 64, 4096, 32, 8, 128, 16
lengths = np.full(B, N)
q = C.rand((B, Hq, D), C.BF16, 112)
for layout in ("NHD", "HND"):
    cache = C.quantized(C._paged_pools(2, B, N // page, page, H, D, lengths, layout, 110),
                        jnp.float8_e4m3fn)
    f = jax.jit(lambda q, c: jaxkv.attention.decode(q, c, 0))
    for _ in range(3):
        out = f(q, cache)
    jax.block_until_ready(out)
    print(layout, "done")
