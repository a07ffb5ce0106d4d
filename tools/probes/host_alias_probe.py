"""On a GPU: do the serving engine's cache functions stay in place with a host tier? Compiles
``compact``, ``release`` and ``reserve`` of a cache with ``host_pages`` under donation and prints
the copies of a pool in the HLO and XLA's memory analysis (an in-place function allocates no
output or temporary of a pool's size).

    python3 tools/probes/host_alias_probe.py
"""
import sys

import jax
import jax.numpy as jnp

from jaxkv import PagedKVCache

L, P, T, H, D = (32, 2048, 16, 8, 128) if jax.default_backend() == "gpu" else (2, 16, 4, 2, 16)
cache = PagedKVCache.create(num_layers=L, num_pages=P, page_size=T, num_kv_heads=H, head_dim=D,
                            max_batch=8, max_pages_per_seq=64, dtype=jnp.bfloat16,
                            host_pages=P // 2)
rows = jnp.arange(8) % 2 == 0
mib = 2**20
print(f"device pool {cache.k_pages.nbytes // mib} MiB each, host pool "
      f"{cache.host.pages.nbytes // mib} MiB", flush=True)
for name, fn, args in (
        ("compact", lambda c, m: c.compact(m), (jnp.arange(8, dtype=jnp.int32),)),
        ("release", lambda c, r: c.release(r), (rows,)),
        ("reserve", lambda c, n: c.reserve(n)[0], (jnp.full((8,), 16, jnp.int32),)),
        ("swap_out", lambda c, r: c.swap_out(r)[0], (rows,))):
    try:
        compiled = jax.jit(fn, donate_argnums=0).lower(cache, *args).compile()
        hlo = compiled.as_text()
        copies = [ln.strip()[:160] for ln in hlo.splitlines() if " copy(" in ln and "[" in ln
                  and any(s in ln for s in (f"{L},{P}", f"{P // 2},2"))]
        m = compiled.memory_analysis()
        print(f"{name}: pool copies {len(copies)}; output {m.output_size_in_bytes // mib} MiB, "
              f"temp {m.temp_size_in_bytes // mib} MiB, alias {m.alias_size_in_bytes // mib} MiB, "
              f"host output {getattr(m, 'host_output_size_in_bytes', 0) // mib} MiB", flush=True)
        for c in copies[:3]:
            print("   ", c)
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
