"""docs/benchmarks.png: achieved bandwidth against size, one panel per op (matplotlib optional)."""

from __future__ import annotations

import sys
from collections import defaultdict


COLORS = [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink",
                                 "gray", "olive", "cyan")]


def device_gbps(row: dict) -> float:
    """jaxkv's bandwidth on its device time (the table's GB/s), else on its loop time."""
    k = row["jaxkv"]
    return row["min_bytes"] / (k.get("kernel_time_s") or k["time_s"]) / 1e9


def peer_gbps(row: dict):
    """The fastest peer's bandwidth on its device time, or None."""
    best = row.get("peer_best")
    if not best:
        return None
    peer = row["peers"][best]
    return row["min_bytes"] / (peer.get("kernel_time_s") or peer["time_s"]) / 1e9


def plot(report: dict, path: str) -> bool:
    """One panel per op (or per a case's panel): jaxkv (solid, on its kernel time where the
    profiler had it), the fastest XLA formulation (dashed, loop time) and the fastest peer
    (dotted, device time) per series, and the copy bandwidth measured in the same run. Returns
    whether a file was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return False
    per_op = defaultdict(list)
    for r in report["rows"]:
        if r["status"] == "ok" and r["min_bytes"] > 0:
            per_op[r.get("panel") or r["op"]].append(r)
    if not per_op:
        print("no measured op moves bytes: no plot", file=sys.stderr)
        return False
    copy = report["calibration"]["copy_gbps"]
    cols = min(3, len(per_op))
    rows = -(-len(per_op) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (op, rs) in zip(axes.flat, per_op.items()):
        series = defaultdict(list)
        for r in sorted(rs, key=lambda r: r["min_bytes"]):
            series[r.get("series", "")].append(r)
        for color, (name, line) in zip(COLORS, series.items()):
            x = [r["min_bytes"] / 1e6 for r in line]
            ax.plot(x, [device_gbps(r) for r in line], "o-", color=color,
                    label=f"jaxkv {name}".strip())
            xla = [(xi, r["xla"][r["xla_best"]]["gbps"]) for xi, r in zip(x, line)
                   if r["xla_best"]]
            if xla:
                ax.plot(*zip(*xla), "s--", color=color, alpha=0.6,
                        label=f"XLA {name}".strip())
            peer = [(xi, peer_gbps(r)) for xi, r in zip(x, line) if peer_gbps(r)]
            if peer:
                ax.plot(*zip(*peer), "^:", color=color, alpha=0.8,
                        label=f"best peer {name}".strip())
        ax.axhline(copy, color="k", lw=1, label=f"copy {copy:.0f} GB/s")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(op)
        ax.set_xlabel("minimum bytes moved per op (MB)")
        ax.set_ylabel("achieved GB/s")
        shown = [copy] + [device_gbps(r) for r in rs]
        shown += [r["xla"][r["xla_best"]]["gbps"] for r in rs if r["xla_best"]]
        shown += [peer_gbps(r) for r in rs if peer_gbps(r)]
        ax.set_ylim(0, max(shown) * 1.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(per_op):]:
        ax.axis("off")
    m = report["meta"]
    fig.suptitle(f"jaxkv on {m['device']}, jax {m['jax']}, {m['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
