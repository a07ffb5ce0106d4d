"""Device time of each jaxkv kernel, read from the profiler (no loop or dispatch cost in it).

Runs the jaxkv step of every target case of the GPU benchmark a few times under
``jax.profiler.trace`` and reads the durations of the kernels whose names contain ``jaxkv`` from the
trace (CUPTI's timestamps). Complements ``python -m jaxkv.bench``, whose loop times include the
loop's own cost.

    python tools/kernel_times.py [--json PATH] [--all] [--op OP ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import tempfile

import jax

from jaxkv._bench import cases as C


def kernel_durations(trace_dir: str) -> list[tuple[str, float]]:
    """(kernel name, seconds) of every jaxkv kernel on the GPU, in start order."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                if "jaxkv" in e.name:
                    events.append((e.start_ns, e.name, e.duration_ns * 1e-9))
    return [(name, d) for _, name, d in sorted(events)]


def measure(case: C.Case, calls: int = 3) -> dict:
    carry, consts, kernel, _ = case.build()
    n = 2
    run = jax.jit(lambda c, k: jax.lax.fori_loop(0, n, lambda i, x: kernel(i, x, k), c),
                  donate_argnums=0)
    carry = run(carry, consts)  # compile and warm up outside the trace
    jax.block_until_ready(carry)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                carry = run(carry, consts)
            jax.block_until_ready(carry)
        durations = kernel_durations(d)
    del carry, consts
    expected = calls * n * case.per_step
    seconds = [s for _, s in durations]
    t = statistics.median(seconds) if seconds else float("nan")
    return dict(op=case.op, case=case.name, kernels=len(seconds), expected_kernels=expected,
                names=sorted({name.split("(")[0] for name, _ in durations}),
                time_s=t, min_bytes=case.min_bytes, gbps=case.min_bytes / t / 1e9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--all", action="store_true", help="the plot's sweep points too")
    p.add_argument("--op", action="append", help="only this op (repeatable)")
    args = p.parse_args(argv)
    size = "gpu" if jax.default_backend() == "gpu" else "cpu"
    rows = []
    for case in (C.gpu_cases() if size == "gpu" else C.cases("cpu")):
        if (case.sweep and not args.all) or case.missing() or case.min_bytes == 0 or (
                args.op and case.op not in args.op):
            continue
        row = measure(case)
        rows.append(row)
        print(f"{row['op']:21s} {row['case']:58s} {row['time_s'] * 1e6:9.2f} us "
              f"{row['gbps']:7.0f} GB/s  kernels {row['kernels']}/{row['expected_kernels']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
