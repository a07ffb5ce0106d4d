"""Builds FlashInfer's JIT modules that the benchmark's `--peers` attention rows load (bf16,
paged NHD: at head_dim 128 batch decode and fa2 batch prefill, each plain, with a window and with
a soft cap; plain fa2 prefill at head_dim 256; where the wheel has FA3's sources
(tools/flashinfer_fa3_wheel.py), fa3 prefill the same way), one process a module, so that the
benchmark only loads them. Each module is nvcc's work of 80-110 s on the GPU machine (fa3's
about 210 s, all nine at once on an H100's 16 cores, 2026-12-07); built one after another inside
the benchmark they took most of a device call. tools/gpu_check.sh runs this beside the tests when
PEER_WHEELS is given.

    python3 tools/flashinfer_warm.py        # after: eval "$(bash setup_on_gpu.sh PEER_WHEELS)"
"""

import multiprocessing
import sys
import time

VARIANTS = {"plain": {}, "window": {"window_left": 1023}, "soft cap": {"logits_soft_cap": 50.0}}


def build(op: str, variant: str, d: int = 128, backend: str = "fa2") -> str:
    """Plans and runs ``op`` ("decode" or "prefill", on FlashInfer's prefill ``backend``) once on
    a one-row cache of 4 pages at head_dim ``d``."""
    import flashinfer
    import torch

    t0 = time.time()
    hq, h, page = 32 if d == 128 else 16, 8, 16  # the benchmark's GPU attention shapes
    cuda = dict(dtype=torch.int32, device="cuda")
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    pool = torch.zeros(4, page, h, d, dtype=torch.bfloat16, device="cuda")
    indptr, indices, last = (torch.tensor([0, 4], **cuda), torch.arange(4, **cuda),
                             torch.tensor([page], **cuda))
    kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **VARIANTS[variant])
    if op == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, hq, h, d, page, **kw)
        w.run(torch.zeros(1, hq, d, dtype=torch.bfloat16, device="cuda"), (pool, pool))
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(torch.tensor([0, page], **cuda), indptr, indices, last, hq, h, d, page,
               causal=True, **kw)
        w.run(torch.zeros(page, hq, d, dtype=torch.bfloat16, device="cuda"), (pool, pool))
    torch.cuda.synchronize()
    return f"{op} ({backend}), {variant}, head_dim {d}: {time.time() - t0:.0f} s"


def main() -> int:
    jobs = [(op, v, 128) for op in ("decode", "prefill") for v in VARIANTS]
    jobs.append(("prefill", "plain", 256))
    from jaxkv._bench.peers_flashinfer import has_fa3_sources

    if has_fa3_sources():
        jobs += [("prefill", v, 128, "fa3") for v in VARIANTS]  # the window and cap rows' peers too
        jobs.append(("prefill", "plain", 256, "fa3"))
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        results = [pool.apply_async(build, job) for job in jobs]
        failed = 0
        for job, r in zip(jobs, results):
            try:
                print("flashinfer module built:", r.get(), flush=True)
            except Exception as e:  # noqa: BLE001 -- reported; the benchmark says the rest
                print(f"flashinfer module {job}: {type(e).__name__}: {e}", flush=True)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
