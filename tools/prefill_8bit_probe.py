"""8-bit prefill attention (batch 8, 2048 new tokens on 2048 cached, 32 q / 8 KV heads, D128, page
16; fp8 e4m3 scaled per token and head) beside the bf16 one, one call each: the wgmma kernels for
ncu to compare (why the 8-bit cache's is slower), e.g.

    ncu --clock-control none --kernel-name regex:prefill_wgmma --section WarpStateStats \
        --section InstructionStats python3 tools/prefill_8bit_probe.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv._bench import cases as C

B, prefix, T, Hq, H, D, page = 8, 2048, 2048, 32, 8, 128, 16
pages = -(-(prefix + T) // page)
q = C.rand((B, T, Hq, D), C.BF16, 132)
new = C.i32(np.full(B, T))
for dtype in (None, jnp.float8_e4m3fn):
    cache = C.quantized(C._paged_pools(2, B, pages, page, H, D, np.full(B, prefix), "NHD", 130), dtype)
    out = jax.jit(lambda q, c: jaxkv.attention.prefill(q, c, 0, new))(q, cache)
    jax.block_until_ready(out)
    print("bf16" if dtype is None else jnp.dtype(dtype).name, "done")
