"""Targets checked, and the results written as a terminal table, JSON and docs/benchmarks.md."""

from __future__ import annotations

import json

COLUMNS = ["op", "case", "min bytes", "kernel", "loop", "GB/s", "% copy", "XLA", "XLA time",
           "fallback", "speed-up", "mem", "target", "met"]
PEER_COLUMNS = ["peer", "peer kernel", "vs peer"]  # after "speed-up", with --peers


def columns(report: dict) -> list[str]:
    """The table's columns: with the peers' where the run had ``--peers``."""
    if not report["meta"].get("peers"):
        return COLUMNS
    at = COLUMNS.index("speed-up") + 1
    return COLUMNS[:at] + PEER_COLUMNS + COLUMNS[at:]


def device_time(k: dict) -> float:
    """The op's device time: its kernel's, read from the profiler, where a GPU trace had it;
    otherwise the timed loop's time per op (which also carries the loop's own cost)."""
    return k.get("kernel_time_s") or k["time_s"]


def device_copy_frac(k: dict) -> float:
    return k.get("kernel_copy_frac") or k["copy_frac"]


def tflops(row: dict, impl: dict) -> float | None:
    """The row's FLOPs per op over ``impl``'s device time (jaxkv's or a peer's), in TFLOP/s;
    None where the row counts none (only compute-bound rows do: prefill)."""
    return row["flops"] / device_time(impl) / 1e12 if row.get("flops") else None


def evaluate(row: dict, target, on_gpu: bool, rows=()) -> None:
    """Sets row["met"] (None off GPU: the targets are the H200's) and row["failed"]; ``rows``:
    the run's other rows, for a target relative to one of them."""
    k = row["jaxkv"]
    failed = ["XLA hoisted the op out of the timed loop: time not valid"] if k.get("hoisted") else []
    if target.copy_frac is not None and device_copy_frac(k) < target.copy_frac:
        failed.append(f"{device_copy_frac(k):.0%} < {target.copy_frac:.0%} of copy BW")
    speedup = row.get("speedup")
    if target.speedup is not None and (speedup is None or speedup < target.speedup):
        failed.append(f"speed-up {fmt_x(speedup)} < {target.speedup:g}x")
    if target.beats_xla and (speedup is None or speedup <= 1):
        failed.append(f"speed-up {fmt_x(speedup)} <= 1x")
    if target.max_us is not None and device_time(k) * 1e6 > target.max_us:
        failed.append(f"{device_time(k) * 1e6:.1f} us > {target.max_us:g} us")
    rate = tflops(row, k)
    if target.min_tflops is not None and (rate is None or rate < target.min_tflops):
        failed.append(f"{fmt_tflops(rate)} < {target.min_tflops:g} TFLOP/s")
    if target.one_launch and k["launches"] != 1:
        failed.append(f"{k['launches']:.3g} launches")
    if target.no_kv_bytes and k.get("touches_kv"):
        failed.append("the KV pages are read or written")
    for name, peer in (row.get("peers") or {}).items():
        if peer["status"] == "failed":
            failed.append(f"{name}: {peer['error']}")
    best = row.get("peer_best")
    if target.beats_peers and best:
        peer = row["peers"][best]
        if device_time(k) > peer_time(peer):
            failed.append(f"{fmt_time(device_time(k))} > {best} {fmt_time(peer_time(peer))}")
    if target.peer_speedup is not None and best:
        peer = row["peers"][best]
        if peer_time(peer) < target.peer_speedup * device_time(k):
            failed.append(f"{best} {fmt_time(peer_time(peer))} < {target.peer_speedup:g} x "
                          f"{fmt_time(device_time(k))}")
    row.pop("versus", None)
    if target.versus is not None:
        name, ratio = target.versus
        other = next((r for r in rows if r["case"] == name and r["status"] == "ok"), None)
        if other is None:
            failed.append(f"no row {name!r} in this run to compare with")
        else:  # the measured ratio, shown beside the verdict (fmt_versus)
            time = (lambda x: x["time_s"]) if target.versus_loop else device_time
            mine, theirs = time(k), time(other["jaxkv"])
            row["versus"] = dict(case=name, ratio=mine / theirs, limit=ratio)
            if mine > ratio * theirs:
                failed.append(f"{fmt_time(mine)} > {ratio:.3g} x {fmt_time(theirs)} of the row "
                              "compared with")
    mem = k.get("mem_overhead_frac")
    if mem is not None and mem > target.mem_frac:
        failed.append(f"memory +{mem:.1%} of the cache")
    row["failed"] = failed
    row["met"] = (not failed) if on_gpu else None


def peer_time(peer: dict) -> float:
    """A peer's device time per op (profiler), else its wall time."""
    return peer.get("kernel_time_s") or peer["time_s"]


def compare_peers(row: dict, copy_gbps: float) -> None:
    """Each timed peer's share of the copy bandwidth and its time over jaxkv's (device times
    where both have one; > 1: jaxkv is faster), and the fastest peer: row["peer_best"]."""
    timed = {n: p for n, p in row["peers"].items() if p["status"] == "ok"}
    for peer in timed.values():
        peer["copy_frac"] = peer["gbps"] / copy_gbps if peer.get("gbps") else None
        peer["vs_jaxkv"] = peer_time(peer) / device_time(row["jaxkv"])
        if row.get("flops"):
            peer["tflops"] = tflops(row, peer)
    row["peer_best"] = min(timed, key=lambda n: peer_time(timed[n])) if timed else None


def peer_summary(row: dict) -> str:
    """What the peer cell says where no peer was timed."""
    peers = row.get("peers") or {}
    if not peers:
        return "-"
    bad = [f"{n}: {p['error']}" for n, p in peers.items() if p["status"] in ("failed", "error")]
    if bad:
        return "NOT TIMED: " + "; ".join(bad)
    notes = sorted({p.get("note", "") for p in peers.values()})
    return "skipped: " + "; ".join(notes)


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def fmt_time(s) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def fmt_tflops(x) -> str:
    return "n/a" if x is None else f"{x:.3g} TFLOP/s"


def with_tflops(text: str, row: dict, impl: dict) -> str:
    """``text`` (a time or a bandwidth) and the TFLOP/s of the same device time, on a row that
    counts FLOPs."""
    rate = tflops(row, impl)
    return text if rate is None else f"{text} ({fmt_tflops(rate)})"


def fmt_x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_versus(row: dict) -> str:
    """The measured ratio of a target relative to another row of the run (its device time over
    that row's), beside the limit: "" where the row has none."""
    v = row.get("versus")
    if not v:
        return ""
    return f" [{v['ratio']:.3g}x the row compared with; target <= {v['limit']:.3g}x]"


def fmt_mem(impl: dict | None) -> str:
    if not impl or impl.get("mem_overhead_frac") is None:
        return "n/a"
    tag = "" if impl.get("mem_measured") else " (static)"
    return f"+{impl['mem_overhead_frac']:.1%}{tag}"


def fmt_extra(impl: dict) -> str:
    if impl.get("mem_measured"):
        return fmt_bytes(impl["mem_extra_bytes"])
    static = impl.get("mem_static_bytes")
    return "n/a" if static is None else f"{fmt_bytes(static)} (static)"


def cells(row: dict, peers: bool = False) -> list[str]:
    if row["status"] != "ok":
        return [row["op"], row["case"], fmt_bytes(row["min_bytes"]), row["status"], "", "", "",
                "", "", "", "", *(["", "", ""] if peers else []), "", row["target"], row["reason"]]
    k = row["jaxkv"]
    best = row["xla"].get(row["xla_best"]) if row["xla_best"] else None
    met = {True: "yes", False: "NO: " + "; ".join(row["failed"]), None: "n/a (cpu)"}[row["met"]]
    if row["sweep"]:
        met = "plot point"
    elif not row["target"]:  # measured for comparison only: nothing to meet, on any device
        met = "no target"
    if not row["sweep"]:
        met += fmt_versus(row)
    if row.get("explanation"):
        met += f" ({row['explanation']})"
    return [
        row["op"], row["case"], fmt_bytes(row["min_bytes"]), fmt_time(k.get("kernel_time_s")),
        fmt_time(k["time_s"]),
        with_tflops(f"{row['min_bytes'] / device_time(k) / 1e9:.0f}" if row["min_bytes"] else "-",
                    row, k),
        f"{device_copy_frac(k):.0%}" if row["min_bytes"] else "-",
        row["xla_best"] or "-", fmt_time(best["time_s"]) if best else "-", fallback_cell(row),
        fmt_x(row["speedup"]), *(peer_cells(row) if peers else []), fmt_mem(k), row["target"],
        met,
    ]


def row_line(row: dict, peers: bool = False) -> str:
    """One measured row as a line: jaxkv's device time, XLA's best and the fallback (or the
    peers' best, with ``peers``)."""
    head = f"{row['op']} {row['case']}:"
    if row["status"] != "ok":
        return f"{head} {row['status']} ({row['reason']})"
    if peers:
        best, t, x = peer_cells(row)
        if row.get("peer_best"):
            t = with_tflops(t, row, row["peers"][best])
        return f"{head} peer {best} {t} ({x} jaxkv's time)"
    best = row["xla"].get(row["xla_best"]) if row["xla_best"] else None
    jaxkv_time = with_tflops(fmt_time(device_time(row["jaxkv"])), row, row["jaxkv"])
    return (f"{head} jaxkv {jaxkv_time}, XLA "
            f"{fmt_time(best['time_s']) if best else '-'}, fallback {fallback_cell(row)}")


def fallback_cell(row: dict) -> str:
    """jaxkv's op through its XLA formulation: its loop time, or why it has none."""
    fb = row.get("fallback")
    if not fb:
        return "-"
    return fmt_time(fb["time_s"]) if "time_s" in fb else "none: " + fb["error"][:60]


def peer_cells(row: dict) -> list[str]:
    best = row.get("peer_best")
    if not best:
        return [peer_summary(row), "-", "-"]
    peer = row["peers"][best]
    return [best, fmt_time(peer_time(peer)), fmt_x(peer["vs_jaxkv"])]


def text_table(report: dict) -> str:
    cols = columns(report)
    peers = cols is not COLUMNS
    rows = [cols] + [cells(r, peers) for r in report["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    out = [header_line(report), line(rows[0]), line(["-" * w for w in widths])]
    return "\n".join(out + [line(r) for r in rows[1:]] + peer_lines(report))


def peer_lines(report: dict) -> list[str]:
    """One line per peer (``--peers``): its device time beside jaxkv's on the same inputs, or why
    it was not timed."""
    out = []
    for r in report["rows"]:
        for name, impl in (r.get("peers") or {}).items():
            head = f"{r['op']} {r['case']}: {name}"
            if impl["status"] == "skipped":
                out.append(f"{head}: skipped ({impl['note']})")
            elif impl["status"] != "ok":
                out.append(f"{head}: {impl['status'].upper()}, not timed ({impl['error']})")
            else:
                bw = (f", {impl['gbps']:.0f} GB/s ({impl['copy_frac']:.0%} of copy)"
                      if impl.get("gbps") and r["min_bytes"] else "")
                rate = tflops(r, impl)
                bw += f", {fmt_tflops(rate)}" if rate is not None else ""
                out.append(f"{head}: {fmt_time(peer_time(impl))} on the device "
                           f"({impl.get('profiler', 'profiler')}){bw}, "
                           f"{fmt_time(impl['time_s'])} per op wall ({impl['timing']}); jaxkv "
                           f"{with_tflops(fmt_time(device_time(r['jaxkv'])), r, r['jaxkv'])}: "
                           f"peer / jaxkv "
                           f"{fmt_x(impl['vs_jaxkv'])}; checked {impl['checked']}")
    return ["", "peers (same inputs, cross-checked first):"] + out if out else []


def header_line(report: dict) -> str:
    m, c = report["meta"], report["calibration"]
    return (f"{m['device']} | jax {m['jax']} | size {m['size']} | copy {c['copy_gbps']:.0f} GB/s "
            f"(stream {c['stream_gbps']:.0f}, memcpy {c['memcpy_gbps']:.0f}) | loop overhead "
            f"{c['loop_overhead_s'] * 1e6:.2f} us/iteration")


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def markdown(report: dict, plot_name: str | None) -> str:
    m, c = report["meta"], report["calibration"]
    md = ["# jaxkv benchmarks", "",
          f"Generated by `{m['command']}` on {m['date']} (one run: every number below comes from "
          "it). How it is measured, and the two numbers per op: [perf-notes.md](perf-notes.md).",
          "", "| device | jax | jaxkv | size | copy bandwidth (read + written) | loop overhead |",
          "| --- | --- | --- | --- | --- | --- |",
          f"| {m['device']} | {m['jax']} | {m['jaxkv']} | {m['size']} | {c['copy_gbps']:.0f} GB/s "
          f"(stream {c['stream_gbps']:.0f}, memcpy {c['memcpy_gbps']:.0f}) | "
          f"{c['loop_overhead_s'] * 1e6:.2f} us per iteration |", ""]
    if m["backend"] != "gpu":
        md += ["**Not an H200 run**: the targets are the H200's and are not evaluated here.", ""]
    md += ["## Results", "",
           "kernel: the op's kernel time on the device, read from the profiler (GPU only). loop: "
           "time per op in the timed loop (median of the repetitions), which also carries the "
           "loop's own per-iteration cost. GB/s and % copy: minimum bytes (read + written) over "
           "the kernel time (the loop time where there is none), and that over the copy "
           "bandwidth above; the targets are checked on these. On compute-bound rows (prefill) "
           "GB/s is followed by TFLOP/s: the causal work's FLOPs (4 x head_dim per visible "
           "(query, key) pair and query head) over the same time. XLA: the fastest XLA-native "
           "formulation, same loop, same donation (for paged 16-bit attention on a GPU, also "
           "the kernel jaxkv's default did not pick: cuDNN's, or jaxkv's own as \"jaxkv "
           "kernel\"); fallback: jaxkv's own op with every call traced as its XLA "
           "formulation (jaxkv/_fallback.py, JAXKV_KERNELS=xla), same loop: what a backend "
           "without jaxkv's kernels runs; speed-up: the XLA column's loop time over jaxkv's. mem: "
           "device memory one op allocates beyond its inputs and required outputs, as a share "
           "of the cache. met: a target relative to another row of the run (an 8-bit row "
           "against its bf16 row, a window or soft-cap row against the full row) shows the "
           "measured ratio of the two device times in brackets, beside its limit."]
    cols = columns(report)
    peers = cols is not COLUMNS
    if peers:
        md[-1] += (" peer: the fastest peer doing the same work on the same inputs (FlashInfer, "
                   "PyTorch-native), whose result equalled jaxkv's before it was timed; peer "
                   "kernel: its device time per op from the profiler (torch's, else JAX's); vs "
                   "peer: that over jaxkv's kernel time (above 1x: jaxkv is faster). Every peer: "
                   "[Peers](#peers).")
    md += ["", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    md += ["| " + " | ".join(x.replace("|", "/") for x in cells(r, peers)) + " |"
           for r in report["rows"]]
    inc = report.get("increment_lengths")
    if inc:
        md += ["", "## increment_lengths: kernel or fused XLA op", "",
               f"One decode-like length update on int32 [{inc['max_batch']}] per loop iteration:",
               "", "| variant | us per iteration |", "| --- | --- |",
               f"| the neighbouring length arithmetic only | {inc['neighbours_only_us']:.2f} |",
               f"| with `lengths + 1` fused into it | {inc['fused_add_us']:.2f} |",
               f"| with one jaxkv custom call instead | {inc['custom_call_us']:.2f} |", "",
               f"A kernel would add {inc['extra_launch_us']:.2f} us per step; the fused add adds "
               f"{inc['fused_add_us'] - inc['neighbours_only_us']:.2f} us (interquartile range "
               f"of the repetitions: up to {inc['spread_us']:.2f} us).", ""]
    detail = [r for r in report["rows"] if r["status"] == "ok"]
    md += ["", "## Every implementation", "",
           "device time: from the profiler (jaxkv: its kernels in the JAX profiler's trace; "
           "peers: the same trace, torch.profiler where it records nothing); time: the loop's time per op (jaxkv, XLA) or the peer's wall "
           "time per op (a CUDA graph of its calls, replayed); GB/s: minimum bytes over that time; "
           "launches: jaxkv custom calls per op (per launch of several ops: append_layers), or a "
           "peer's device kernels (and copies) per op.", "",
           "| op | case | implementation | device time | time | spread | GB/s | launches "
           "| big copies | extra memory |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in detail:
        for name, impl in [("jaxkv", r["jaxkv"])] + list(r["xla"].items()):
            if "error" in impl:
                md.append(f"| {r['op']} | {r['case']} | {name} | error: {impl['error']} |"
                          " | | | | | |")
                continue
            md.append(f"| {r['op']} | {r['case']} | {name} | "
                      f"{fmt_time(impl['kernel_time_s']) if impl.get('kernel_time_s') else '-'} | "
                      f"{fmt_time(impl['time_s'])} | "
                      f"{impl['spread']:.0%} | {impl['gbps']:.0f} | {impl['launches']:.3g} | "
                      f"{impl['big_copies']} | {fmt_extra(impl)} |"
                      + (" **hoisted out of the loop: not valid**" if impl["hoisted"] else ""))
        for name, impl in (r.get("peers") or {}).items():
            if impl["status"] != "ok":
                why = (impl.get("error") or impl.get("note", "")).replace("|", "/")
                md.append(f"| {r['op']} | {r['case']} | {name} | {impl['status']}: {why} |"
                          " | | | | | |")
                continue
            md.append(f"| {r['op']} | {r['case']} | {name} | "
                      f"{fmt_time(impl.get('kernel_time_s'))} | {fmt_time(impl['time_s'])} | "
                      f"{impl['spread']:.0%} | {r['min_bytes'] / impl['time_s'] / 1e9:.0f} | "
                      f"{impl['kernel_launches']:.3g} | - | - |")
    peers = peer_lines(report)
    if peers:
        versions = ", ".join(f"{k} {v}" for k, v in m.get("peer_versions", {}).items())
        md += ["", "## Peers", "",
               f"`--peers` ({versions or 'no peer library imported'}): for every case where "
               "another library does the same work, FlashInfer's kernels and the PyTorch-native "
               "formulation a torch user would write (named in each line), on the same inputs "
               "(DLPack views of jaxkv's arrays). Each peer's result is compared with jaxkv's "
               "first, byte for byte (attention: within a tolerance); one that differs is marked "
               "and not timed. Device time: the JAX profiler's trace (CUPTI; torch.profiler where "
               "it records nothing, as each line says), every kernel, memcpy and memset of a call "
               "summed, the same measure as jaxkv's kernel time; wall time: the "
               "calls captured in a CUDA graph and replayed (CUDA events). Index metadata (slot "
               "numbers, FlashInfer's batch indices and positions) is made once, outside the "
               "timing, as a serving loop passes it in. jaxkv/_bench/peers.py has the method.",
               ""] + [f"- {x}" for x in peers[2:]]
    if plot_name:
        md += ["", f"![achieved bandwidth per op]({plot_name})"]
    return "\n".join(md) + "\n"
