"""What ``python -m jaxkv serve`` reports of a run: the summary of one engine's requests and
counters, and the GPU's busy time and kernel shares from a profiler trace."""

from __future__ import annotations

import collections
import glob

import jax
import numpy as np

from .stream import ServeRequest


def percentile(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(requests: list[ServeRequest], m: dict, per_token: int, allocated: int,
              oracle: dict | None = None, reserved_per_token: float | None = None) -> dict:
    """The report of one engine's run (times in seconds, memory in bytes). ``oracle``: request id
    -> the tokens an unbounded prefix cache could give it (``oracle_reuse``).
    ``reserved_per_token``: the bytes of a token of reserved memory where it differs from a
    token's (a paged cache with windows: a page holds one layer group's layers)."""
    unit = per_token if reserved_per_token is None else reserved_per_token
    started = [r for r in requests if r.started]
    best = sum(oracle[r.id] for r in started) if oracle else 0
    wall = m["wall"]
    out_tokens = sum(len(r.output) for r in requests)  # also of requests cut by a duration
    done = [r for r in requests if r.finish_time is not None]
    ttft = [r.first_time - r.arrival for r in requests if r.first_time is not None]
    tpot = [(r.finish_time - r.first_time) / (len(r.output) - 1)
            for r in done if len(r.output) > 1]
    usage = m["usage"]
    return dict(
        requests=len(done), output_tokens=out_tokens, wall_s=wall,
        tokens_per_s=out_tokens / wall, requests_per_s=len(done) / wall,
        # Until the drain, where only the longest requests are left (its length is set by the
        # stream's longest outputs, whatever the engine): the loaded phase.
        loaded_tokens_per_s=(m["drained_tokens"] / m["drained_at"]
                             if m.get("drained_at") else None),
        loaded_s=m.get("drained_at"),
        # The second half of a run of fixed length: past the ramp, where each engine's first
        # rows are all prefilling (an engine that holds more rows ramps longer).
        second_half_tokens_per_s=((out_tokens - m["half_tokens"]) / (wall - m["half_at"])
                                  if m.get("half_at") and wall > m["half_at"] else None),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        peak_concurrent=m["peak_live"], peak_decoding=m["peak_decoding"],
        kv_allocated_bytes=allocated,
        kv_reserved_mean_bytes=float(np.mean(usage[:, 2])) * unit if len(usage) else 0.0,
        kv_live_mean_bytes=float(np.mean(usage[:, 1])) * per_token if len(usage) else 0.0,
        kv_reserved_peak_bytes=int(np.max(usage[:, 2], initial=0) * unit),
        # what a live sequence holds, on average over the decode calls that had one
        kv_per_sequence_mean_bytes=(float(np.mean(usage[busy, 2] / usage[busy, 0])) * unit
                                    if np.any(busy := usage[:, 0] > 0) else None),
        mean_concurrent=float(np.mean(usage[:, 0])) if len(usage) else 0.0,
        iterations=m["iterations"], decode_calls=m["decode_calls"],
        prefill_calls=m["prefill_calls"], evict_calls=m["evict_calls"],
        decode_steps=m["decode_steps"], preemptions=m["preemptions"],
        swaps_out=m["swaps_out"], swaps_in=m["swaps_in"],
        spilled_pages=m["spilled_pages"],
        swap_bytes=(m["swap_pages_out"] + m["swap_pages_in"] + m["spilled_pages"]) * per_token
        * m["page_size"],
        host_s=m["busy_host"], compile_s=m["compile_s"], profile=m["profile"],
        prefill_requested=m["prefill_requested"], prefill_computed=m["prefill_computed"],
        prefill_matched=m["prefill_matched"], oracle_reuse=best,
        miscounted_pages=m.get("miscounted_pages"),
        reuse_of_oracle=(sum(r.matched for r in started) / best) if best else None,
        tenants=per_tenant(requests, oracle),
        cross_tenant_pages=m.get("cross_tenant_pages"),
    )


def per_tenant(requests: list[ServeRequest], oracle: dict | None = None) -> list[dict]:
    """Per tenant (a prefix cache shares pages within a tenant only): its requests started,
    the prompt tokens they requested, found cached (first admissions) and computed, and its
    oracle's best (``oracle_reuse``: what its own earlier requests could give them)."""
    out: dict[int, dict] = {}
    for r in requests:
        t = out.setdefault(r.tenant, dict(tenant=r.tenant, requests=0, requested=0, reused=0,
                                          computed=0, oracle=0))
        if not r.started:
            continue
        t["requests"] += 1
        t["requested"] += r.requested
        t["reused"] += r.matched
        t["computed"] += r.computed
        t["oracle"] += oracle[r.id] if oracle else 0
    return [out[k] for k in sorted(out)]


def classify(name: str) -> str:
    """A GPU kernel's share: "attention", "cache" (writes, moves, page and slot bookkeeping) or
    "other" (the model's matmuls and fusions). jaxkv's kernels are recognised by their mangled
    names; XLA's cache ops by the scatter / dynamic-update-slice / gather in their fusion's name
    (a heuristic: XLA's attention is fused with the model's other ops and counts as "other")."""
    low = name.lower()
    if "jaxkv" in low:
        return "attention" if ("attention" in low or "prefill_tc" in low or "combine" in low) \
            else "cache"
    if low.startswith("nccl"):  # the model's collectives (NCCL's AllGather, ReduceScatter)
        return "other"
    if any(w in low for w in ("scatter", "dynamic_update_slice", "dynamic-update-slice",
                              "gather")):
        return "cache"
    return "other"


def family(name: str) -> str:
    """The model's share of a kernel split further, for a mesh's accounts: "gemm" (cuBLAS's
    nvjet / cutlass kernels and XLA's Triton GEMM fusions), "collective" (NCCL) or "elementwise"
    (every other XLA fusion and copy); jaxkv's and XLA's cache kernels as ``classify`` says."""
    kind = classify(name)
    if kind != "other":
        return kind
    low = name.lower()
    if low.startswith("nccl"):
        return "collective"
    if any(w in low for w in ("nvjet", "gemm", "cutlass", "cublas", "sm90_xmma")):
        return "gemm"
    return "elementwise"


def profile_summary(trace_dir: str, window) -> dict | None:
    """GPU busy time (the union of kernel intervals) over the window's wall time, and the share of
    kernel time by ``classify``, per device (``per_device``); None on a machine without GPU planes
    in the trace (the CPU)."""
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return None
    try:
        data = jax.profiler.ProfileData.from_file(paths[0])
    except Exception as e:  # a profiler without the reader: say so, keep the run's results
        print(f"profile: cannot read {paths[0]}: {e}")
        return None
    by_device = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or [
            ln for ln in plane.lines if "XLA" not in ln.name]
        by_device[plane.name] = [(e.name, e.start_ns, e.duration_ns) for line in lines
                                 for e in line.events]
    return per_device(by_device, window[1] - window[0])


def per_device(by_device: dict, wall: float) -> dict | None:
    """``kernel_summary`` of the least busy device (a mesh runs as fast as its slowest), with
    every device's busy share in ``gpu_busy_per_device`` (sorted by name)."""
    summaries = [kernel_summary(events, wall) for _, events in sorted(by_device.items())
                 if events]
    if not summaries:
        return None
    least = min(summaries, key=lambda s: s["gpu_busy_share"])
    return dict(least, gpu_busy_per_device=[s["gpu_busy_share"] for s in summaries])


def kernel_summary(events, wall: float) -> dict:
    """``events``: (kernel name, start ns, duration ns). GPU busy = the union of the intervals
    (kernels of several streams may overlap), shares of the summed kernel time by ``classify``.
    ``idle``: the GPU's idle time between its first and last kernel, split into gaps under 20 us
    (launch latency within a call) and longer ones, the longest named by the kernels around them
    (where the host made the GPU wait)."""
    by_kind, by_family, by_name = (collections.Counter() for _ in range(3))
    short, long_gaps = 0, collections.Counter()
    busy, end, last = 0, -1, None
    for name, start, duration in sorted(events, key=lambda e: e[1]):
        by_kind[classify(name)] += duration
        by_family[family(name)] += duration
        by_name[name] += duration
        if last is not None and start > end:
            if start - end < 20_000:
                short += start - end
            else:
                long_gaps[(last[:60], name[:60])] += start - end
        if start + duration > end:
            busy += start + duration - max(start, end)
            end, last = start + duration, name
    kernels = sum(by_kind.values()) or 1
    ms = 1e-6
    return dict(window_s=wall, gpu_busy_s=busy * 1e-9, gpu_busy_share=busy * 1e-9 / wall,
                kernels=len(events),
                **{f"{k}_share": by_kind[k] / kernels for k in ("cache", "attention", "other")},
                families={k: t / kernels for k, t in by_family.items()},
                top=[(name[:120], t / kernels) for name, t in by_name.most_common(30)],
                idle=dict(short_gaps_ms=short * ms, long_gaps_ms=sum(long_gaps.values()) * ms,
                          longest=[(f"after {a} / before {b}", t * ms)
                                   for (a, b), t in long_gaps.most_common(6)]))
