"""Can a jaxkv custom call take operands in pinned host memory on XLA:GPU (its kernel then reads
and writes them through unified addressing), and how fast is that? ``jaxkv_paged_copy`` copies
pages within its pools: K in host memory and V on the device, or both on the host.

    python3 tools/probes/host_kernel_probe.py
"""
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxkv import _ffi

L, T, H, D = (32, 16, 8, 128) if jax.default_backend() == "gpu" else (2, 4, 2, 8)
M = 1024 if jax.default_backend() == "gpu" else 8
dev = jax.devices()[0]
on = {"host": SingleDeviceSharding(dev, memory_kind="pinned_host"),
      "device": SingleDeviceSharding(dev, memory_kind="device")}


def copy(k, v, s, d):
    return tuple(_ffi.call("jaxkv_paged_copy", (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2,
                           s, d, k, v, input_output_aliases={2: 0, 3: 1}, nhd=True))


def run(k_kind, v_kind):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, (L, 2 * M, T, H, D), dtype=np.uint16).view(jnp.bfloat16)
    k = jax.device_put(bits, on[k_kind])
    v = jax.device_put(bits, on[v_kind])
    src = jnp.asarray(rng.permutation(M), jnp.int32)
    dst = jnp.asarray(M + rng.permutation(M), jnp.int32)
    f = jax.jit(copy, donate_argnums=(0, 1), out_shardings=(on[k_kind], on[v_kind]))
    hlo = f.lower(k, v, src, dst).compile().as_text()
    print("  copies in HLO:", sum(" copy(" in ln for ln in hlo.splitlines()))
    ts = []
    for i in range(6):
        t = time.perf_counter()
        k, v = jax.block_until_ready(f(k, v, src, dst))
        ts.append(time.perf_counter() - t)
    want = bits[:, np.asarray(src)]
    ok = [np.array_equal(np.asarray(jax.device_put(a, on["device"]))[:, np.asarray(dst)].view(
        np.uint16), want.view(np.uint16)) for a in (k, v)]
    s = statistics.median(ts[1:])
    nbytes = M * L * T * H * D * 2
    print(f"  K on {k_kind}, V on {v_kind}: {s * 1e3:.2f} ms for 2 x {nbytes / 2**30:.2f} GiB "
          f"page copies; bytes equal {ok}; result kinds {k.sharding.memory_kind}, "
          f"{v.sharding.memory_kind}", flush=True)


for kinds in (("host", "device"), ("host", "host")):
    print("probe", kinds, flush=True)
    try:
        run(*kinds)
    except Exception as e:
        print(f"  FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
        traceback.print_exc(limit=2)
