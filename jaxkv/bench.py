"""Benchmarks every jaxkv op against its XLA-native formulation and the device's copy bandwidth.

    python -m jaxkv.bench                         # the GPU sizes on a GPU, tiny ones elsewhere
    python -m jaxkv.bench --op append --op compact_kv_cache --size cpu
    python -m jaxkv.bench --json out.json --markdown docs/benchmarks.md --plot docs/benchmarks.png
    python -m jaxkv.bench --op paged_append --peers   # beside FlashInfer and PyTorch (GPU)
    python -m jaxkv.bench --op attention_decode --op attention_prefill --peers \
        --match window --match 'soft cap' --match sinks   # hybrid attention, and its full rows

For each case: the bytes the op must move at least, the device time per op (the op repeated inside
one jitted loop, donated carry, median of several calls), the achieved bandwidth and its ratio to
the copy bandwidth measured in the same run (on compute-bound prefill rows also TFLOP/s), the XLA
formulations of the same op under the same loop and donation, the extra device memory of one op,
and the issue's target. See docs/perf-notes.md for the method. ``--peers`` adds FlashInfer and
PyTorch-native formulations of the same work on the same inputs (jaxkv/_bench/peers.py),
cross-checked before they are timed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import traceback

import jax

import jaxkv
from jaxkv import _ffi
from jaxkv._bench import cases as C
from jaxkv._bench import peers as P
from jaxkv._bench import report as R
from jaxkv._bench import timing as T

CALIBRATION = {  # copy bytes, copy iterations, loop-overhead and increment_lengths iterations
    "cpu": dict(copy_bytes=64 << 20, copy_iters=5, loop_iters=200, max_batch=256),
    "gpu": dict(copy_bytes=2 << 30, copy_iters=20, loop_iters=2000, max_batch=256),
}


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxkv.bench", description=__doc__.split("\n")[0])
    p.add_argument("--op", action="append", choices=C.OPS,
                   help="only this op (repeatable; default: all)")
    p.add_argument("--match", action="append", metavar="TEXT",
                   help="only the cases whose name contains TEXT (repeatable: any of them), and "
                        "the rows their targets compare with")
    p.add_argument("--size", choices=("cpu", "gpu"),
                   help="cpu: tiny shapes; gpu: the issue's H200 sizes (default: by backend)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per implementation (median)")
    p.add_argument("--no-sweep", action="store_true", help="skip the extra sizes for the plot")
    p.add_argument("--no-fallback", action="store_true",
                   help="skip the column of jaxkv's own XLA fallback (its slow loops are most of "
                        "a GPU run's time)")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the docs/benchmarks.md page")
    p.add_argument("--plot", metavar="PATH",
                   help="write the plot (default with --markdown: benchmarks.png beside it)")
    p.add_argument("--explain", metavar="PATH",
                   help='JSON {"op: case": "why"}: the measured explanation shown beside a row')
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--peers", action="store_true",
                   help="also time the peers that do each case's work (FlashInfer, PyTorch-native "
                        "formulations), cross-checked first; skipped with a note where they do not "
                        "import or there is no GPU")
    p.add_argument("--swap", action="store_true",
                   help="instead: the host tier's swap_out / swap_in against the pinned host copy "
                        "bandwidth of the same run (jaxkv/_bench/swap.py)")
    p.add_argument("--devices", type=int, metavar="N",
                   help="instead: sharded compact / append / paged append per-device bandwidth "
                        "on N devices against 1 (jaxkv/_bench/sharded.py)")
    return p.parse_args(argv)


# Seconds of timed calls after which an implementation stops at two repetitions: the slow XLA
# formulations of prefill took 45 s a row at five (H100, 2026-12-06), jaxkv's own 0.2 s.
TIME_BUDGET_S = 2.0


def measure(step, carry, consts, case: C.Case, reps: int):
    """(carry, result dict, compiled HLO) of one implementation: the timed loop, whose warm-up
    call is also the memory probe."""
    largest = max(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(carry))
    carry, seconds, hlo, (extra, static) = T.time_loop(
        step, carry, consts, case.iters, reps, case.per_step, memory=True, budget_s=TIME_BUDGET_S)
    fixed = T.entry_work(hlo)
    if fixed >= 1 << 16:  # work outside the loop: time 4n iterations too, take the difference
        reps = len(seconds)  # as many as the short loop's budget allowed
        carry, long, _, _ = T.time_loop(step, carry, consts, 4 * case.iters, reps, case.per_step)
        diff = [(4 * b - a) / 3 for a, b in zip(seconds, long)]  # per op, fixed cost removed
        # If noise beats the difference, the long loop's own average is the honest bound.
        seconds = diff if min(diff) > 0 else long
    median = statistics.median(seconds)
    mem = extra if extra is not None else static
    result = dict(
        time_s=median, times_s=seconds,
        # (max - min) / median: the noise to compare differences against.
        spread=(max(seconds) - min(seconds)) / median,
        gbps=case.min_bytes / median / 1e9,
        # Per op, or per group of the ops one launch should do (append_layers: every layer).
        launches=T.jaxkv_calls(hlo, case.iters) * case.per_launch / case.per_step,
        big_copies=T.big_copies(hlo),
        mem_extra_bytes=extra, mem_static_bytes=static, mem_measured=extra is not None,
        mem_overhead_frac=None if mem is None else mem / case.cache_bytes,
        loop_work_bytes=T.loop_work(hlo), entry_work_bytes=fixed,
        # Work of the size of the carry must happen inside the loop, unless nothing should move.
        hoisted=case.min_bytes > 0 and T.loop_work(hlo) < largest,
    )
    return carry, result, hlo


def _through_fallback(step):
    """``step`` with every jaxkv op in it traced as its XLA formulation (``JAXKV_KERNELS=xla``)."""
    def run(*args):
        with _ffi.forced_kernels("xla"):
            return step(*args)
    return run


def run_case(case: C.Case, reps: int, copy_gbps: float, on_gpu: bool, progress,
             with_fallback: bool = True) -> dict:
    row = dict(op=case.op, case=case.name, series=case.series, panel=case.panel or case.op,
               sweep=case.sweep, note=case.note, per_launch=case.per_launch,
               status="ok", reason="", min_bytes=case.min_bytes, cache_bytes=case.cache_bytes,
               flops=case.flops, iters=case.iters, per_step=case.per_step,
               target=case.target.text if case.target else "", jaxkv=None, xla={},
               fallback=None, xla_best=None, speedup=None, met=None, failed=[])
    missing = case.missing()
    progress.step(f"{case.op} {case.name}")
    if missing:
        row.update(status="not available", reason=f"jaxkv.{missing[0]} is not in this build")
        return row
    carry = consts = None
    try:
        carry, consts, kernel, xla = case.build()
        progress.label(f"{case.op} {case.name}: jaxkv")
        carry, row["jaxkv"], hlo = measure(kernel, carry, consts, case, reps)
        if on_gpu:  # the kernel's own device time, from the profiler
            progress.label(f"{case.op} {case.name}: jaxkv under the profiler")
            carry, t, seen, expected = T.kernel_seconds(kernel, carry, consts,
                                                        case.per_step // case.per_launch)
            row["jaxkv"].update(kernel_time_s=None if t is None else t / case.per_launch,
                                kernel_launches=seen, kernel_launches_expected=expected)
        if case.target and case.target.no_kv_bytes:
            big = max(jax.tree_util.tree_leaves(carry), key=lambda x: x.size)
            row["jaxkv"]["touches_kv"] = T.touches(hlo, big)
        # XLA's formulations, then jaxkv's own op with every call traced as its XLA formulation
        # (jaxkv/_fallback.py): the same loop, and the same handling of one that fails
        fallback = _through_fallback(kernel)
        steps = [*xla.items(), ("fallback", fallback)] if with_fallback else [*xla.items()]
        for name, step in steps:
            progress.label(f"{case.op} {case.name}: "
                           + ("jaxkv's XLA fallback" if step is fallback else f"XLA {name}"))
            try:
                carry, result, _ = measure(step, carry, consts, case, reps)
                if on_gpu and name in (C.OWN_KERNEL, C.CUDNN):  # its device time too
                    carry, t, _, _ = T.kernel_seconds(step, carry, consts,
                                                      case.per_step // case.per_launch)
                    result["kernel_time_s"] = None if t is None else t / case.per_launch
            except Exception as e:  # one that does not compile or fit (or has no formulation)
                result = dict(error=first_line(e))
                if "RESOURCE_EXHAUSTED" not in str(e):
                    traceback.print_exc()
                if any(x.is_deleted() for x in jax.tree_util.tree_leaves(carry)):
                    del carry, consts
                    gc.collect()
                    carry, consts, _, _ = case.build()  # it was donated to the failed call
            if step is fallback:
                row["fallback"] = result
            else:
                row["xla"][name] = result
    except Exception as e:
        traceback.print_exc()
        row.update(status="error", reason=first_line(e))
        return row
    finally:
        del carry, consts
        gc.collect()
    k = row["jaxkv"]
    k["copy_frac"] = k["gbps"] / copy_gbps
    if k.get("kernel_time_s"):
        k["kernel_gbps"] = case.min_bytes / k["kernel_time_s"] / 1e9
        k["kernel_copy_frac"] = k["kernel_gbps"] / copy_gbps
    if case.flops:  # compute-bound: the rate that matters
        k["tflops"] = R.tflops(row, k)
    timed = {n: x for n, x in row["xla"].items() if "time_s" in x and not x["hoisted"]}
    for x in timed.values():
        x["copy_frac"] = x["gbps"] / copy_gbps
    if timed:
        row["xla_best"] = min(timed, key=lambda n: timed[n]["time_s"])
        row["speedup"] = timed[row["xla_best"]]["time_s"] / k["time_s"]
    if case.target:
        R.evaluate(row, case.target, on_gpu)
    return row


def add_peers(row: dict, case: C.Case, reps: int, copy_gbps: float, on_gpu: bool,
              progress) -> None:
    """The case's peers into its row (on fresh inputs), and the row's target evaluated again.
    Run after every jaxkv and XLA measurement: their buffers are gone by then, and torch's
    profiler (CUPTI) never runs between two of jaxkv's JAX-profiler sessions."""
    progress.step(f"{case.op} {case.name}: peers")
    if row["status"] != "ok":
        return
    row["peers"] = P.run(case, reps)
    R.compare_peers(row, copy_gbps)
    if case.target:
        R.evaluate(row, case.target, on_gpu)


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def command(args, size: str) -> str:
    """The command line that reproduces the numbers (output paths left out)."""
    words = ["python -m jaxkv.bench", f"--size {size}", f"--reps {args.reps}"]
    words += [f"--op {op}" for op in args.op or []]
    words += [f"--match '{text}'" for text in args.match or []]
    words += ["--peers"] if args.peers else []
    words += ["--no-fallback"] if args.no_fallback else []
    return " ".join(words + (["--no-sweep"] if args.no_sweep else []))


def main(argv=None) -> dict:
    args = parse(argv)
    if args.swap:
        from jaxkv._bench import swap

        result = swap.measure(args.size or ("gpu" if jax.default_backend() == "gpu" else "cpu"))
        print(swap.report(result))
        if args.json:
            R.write_json(result, args.json)
        return result
    if args.devices:
        from jaxkv._bench import sharded

        return sharded.main(args)
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    size = args.size or ("gpu" if on_gpu else "cpu")
    every = C.cases(size)
    chosen = [c for c in every if (not args.op or c.op in args.op)
              and (not args.match or any(text in c.name for text in args.match))
              and not (args.no_sweep and c.sweep)]
    # A target relative to another row (8-bit against bf16, a window against full attention)
    # needs that row in the same run: it joins the chosen ones, in its place (and the rows its
    # own target compares with).
    while True:
        versus = {c.target.versus[0] for c in chosen if c.target and c.target.versus}
        more = [c for c in every if any(c is x for x in chosen) or c.name in versus]
        if len(more) == len(chosen):
            break
        chosen = more
    if args.list:
        for c in chosen:
            target = c.target.text if c.target else "plot point"
            flops = f", {c.flops / 1e12:.3g} TFLOP" if c.flops else ""
            print(f"{c.op:22s} {c.name:45s} {R.fmt_bytes(c.min_bytes):>9s}{flops}  {target}")
        return {}
    cal = CALIBRATION[size]
    want_inc = not args.op or "increment_lengths" in args.op
    measured = [c for c in chosen if c.op != "increment_lengths"]
    progress = T.Progress(len(chosen) + 2 + want_inc + args.peers * len(measured),
                          enabled=not args.no_progress)

    progress.step("copy bandwidth")
    copy = T.copy_bandwidth(cal["copy_bytes"], cal["copy_iters"], args.reps)
    progress.step("loop overhead")
    calibration = dict(copy, copy_gbps=max(copy["stream_gbps"], copy["memcpy_gbps"]),
                       loop_overhead_s=T.loop_overhead(cal["loop_iters"], args.reps))
    inc = None
    if want_inc:
        progress.step("increment_lengths: fused add vs one launch")
        inc = C.increment_lengths_costs(cal["max_batch"], cal["loop_iters"], args.reps)
    # Each row's line as soon as it is measured: a run cut short (a device call's time limit)
    # still shows what it measured; the table follows at the end.
    rows = []
    for c in measured:
        rows.append(run_case(c, args.reps, calibration["copy_gbps"], on_gpu, progress,
                             with_fallback=not args.no_fallback))
        print(R.row_line(rows[-1]), flush=True)
    if args.peers:
        for row, case in zip(rows, measured):
            add_peers(row, case, args.reps, calibration["copy_gbps"], on_gpu, progress)
            print(R.row_line(row, peers=True), flush=True)
    for row, case in zip(rows, measured):  # targets relative to another row of the run
        if case.target and case.target.versus and row["status"] == "ok":
            R.evaluate(row, case.target, on_gpu, rows)
    progress.close()
    if args.explain:
        with open(args.explain) as f:
            explain = json.load(f)
        for row in rows:
            row["explanation"] = explain.get(f"{row['op']}: {row['case']}", "")

    device = jax.devices()[0]
    report = dict(
        meta=dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  device=getattr(device, "device_kind", str(device)), backend=backend,
                  jax=jax.__version__, jaxkv=jaxkv.__version__, size=size, reps=args.reps,
                  command=command(args, size), peers=args.peers, peer_versions=(
                      P.versions() if args.peers else {})),
        calibration=calibration, increment_lengths=inc, rows=rows,
    )
    print(R.text_table(report))
    if inc:
        print(f"increment_lengths per step: fused add {inc['fused_add_us']:.2f} us, one custom "
              f"call {inc['custom_call_us']:.2f} us, neighbours only "
              f"{inc['neighbours_only_us']:.2f} us")
    # Beside the markdown under the docs' name, so the page's link survives copying both to docs/.
    plot_path = args.plot or (os.path.join(os.path.dirname(args.markdown), "benchmarks.png")
                              if args.markdown else None)
    for path in (args.json, args.markdown, plot_path):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        R.write_json(report, args.json)
    plotted = False
    if plot_path:
        from jaxkv._bench.plot import plot

        try:
            plotted = plot(report, plot_path)
        except Exception:  # the numbers matter more than the picture
            traceback.print_exc()
    if args.markdown:
        name = os.path.relpath(plot_path, os.path.dirname(os.path.abspath(args.markdown))) \
            if plotted else None
        with open(args.markdown, "w") as f:
            f.write(R.markdown(report, name))
    return report


if __name__ == "__main__":
    main()
