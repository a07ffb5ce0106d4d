"""docs/benchmarks.png: achieved bandwidth against size, one panel per op (matplotlib optional)."""

from __future__ import annotations

import sys
from collections import defaultdict


# tab10, then tab20's light half: a color a series (a panel of the attention benchmark has 16).
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
          "tab:gray", "tab:olive", "tab:cyan", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
          "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]
MARKERS = ["o", "D", "v", "P"]


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
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return False
    fig = figure(report)
    if fig is None:
        print("no measured op moves bytes: no plot", file=sys.stderr)
        return False
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends beside the panels included
    plt.close(fig)
    return True


def figure(report: dict):
    """The plot's figure (None where no measured op moves bytes). Every series of a panel gets a
    color of its own (markers change past the palette's 20), named once in the panel's legend,
    which sits to its right with the line styles' key."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    per_op = defaultdict(list)
    for r in report["rows"]:
        if r["status"] == "ok" and r["min_bytes"] > 0:
            per_op[r.get("panel") or r["op"]].append(r)
    if not per_op:
        return None
    copy = report["calibration"]["copy_gbps"]
    cols = min(2, len(per_op))
    rows = -(-len(per_op) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8.5 * cols, 3.8 * rows), squeeze=False)
    for ax, (op, rs) in zip(axes.flat, per_op.items()):
        series = defaultdict(list)
        for r in sorted(rs, key=lambda r: r["min_bytes"]):
            series[r.get("series", "")].append(r)
        for i, (name, line) in enumerate(series.items()):
            color, marker = COLORS[i % len(COLORS)], MARKERS[i // len(COLORS) % len(MARKERS)]
            x = [r["min_bytes"] / 1e6 for r in line]
            ax.plot(x, [device_gbps(r) for r in line], marker=marker, ls="-", color=color,
                    label=name or "jaxkv")
            xla = [(xi, r["xla"][r["xla_best"]]["gbps"]) for xi, r in zip(x, line)
                   if r["xla_best"]]
            if xla:
                ax.plot(*zip(*xla), marker=marker, ls="--", color=color, alpha=0.6, mfc="none")
            peer = [(xi, peer_gbps(r)) for xi, r in zip(x, line) if peer_gbps(r)]
            if peer:
                ax.plot(*zip(*peer), marker=marker, ls=":", color=color, alpha=0.8, mfc="none")
        ax.axhline(copy, color="k", lw=1)
        ax.set_xscale("log")
        sizes = [r["min_bytes"] / 1e6 for r in rs]
        label = FuncFormatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_major_formatter(label)
        # Within one decade no major tick shows: the minor ones are labelled instead.
        ax.xaxis.set_minor_formatter(label if max(sizes) < 10 * min(sizes) else NullFormatter())
        ax.set_title(op)
        ax.set_xlabel("minimum bytes moved per op (MB)")
        ax.set_ylabel("achieved GB/s")
        shown = [copy] + [device_gbps(r) for r in rs]
        shown += [r["xla"][r["xla_best"]]["gbps"] for r in rs if r["xla_best"]]
        shown += [peer_gbps(r) for r in rs if peer_gbps(r)]
        ax.set_ylim(0, max(shown) * 1.15)
        ax.grid(alpha=0.3)
        key = [Line2D([], [], color="gray", ls="-", label="jaxkv (solid)"),
               Line2D([], [], color="gray", ls="--", label="fastest XLA (dashed)"),
               Line2D([], [], color="gray", ls=":", label="best peer (dotted)"),
               Line2D([], [], color="k", lw=1, label=f"copy {copy:.0f} GB/s")]
        handles = ax.get_legend_handles_labels()[0] + key
        ax.legend(handles=handles, fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  ncol=1 if len(handles) <= 22 else 2, frameon=False)
    for ax in list(axes.flat)[len(per_op):]:
        ax.axis("off")
    m = report["meta"]
    fig.suptitle(f"jaxkv on {m['device']}, jax {m['jax']}, {m['date']}", fontsize=10)
    fig.tight_layout()
    return fig
