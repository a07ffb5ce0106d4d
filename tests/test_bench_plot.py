"""The benchmark's plot: every series of a panel drawn and named, whatever their number."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jaxkv._bench.plot import figure  # noqa: E402


def _row(op, series, mbytes, seconds, xla_gbps=None, peer_seconds=None):
    return {"op": op, "series": series, "status": "ok", "min_bytes": mbytes * 1e6,
            "jaxkv": {"time_s": seconds * 1.2, "kernel_time_s": seconds},
            "xla_best": "dense" if xla_gbps else None,
            "xla": {"dense": {"gbps": xla_gbps}} if xla_gbps else {},
            "peer_best": "peer" if peer_seconds else None,
            "peers": {"peer": {"time_s": peer_seconds}} if peer_seconds else {}}


def test_every_series_gets_a_line_and_a_name_of_its_own():
    """16 series in one panel (the attention benchmark's decode has as many): 16 solid lines of
    distinct color and marker, each named in the legend; the dashed and dotted lines are XLA's
    and the peer's, named once in the key. A palette of 10 used to drop the last 6."""
    names = [f"kind {i}" for i in range(16)]
    rows = [_row("attention_decode", n, mb, 1e-4 * (1 + i) * mb / 100, xla_gbps=500.0,
                 peer_seconds=3e-4 * mb / 100)
            for i, n in enumerate(names) for mb in (100, 1000)]
    rows.append(_row("attention_prefill", "paged prefill", 400, 2e-3))
    report = {"rows": rows, "calibration": {"copy_gbps": 4000.0},
              "meta": {"device": "test", "jax": "0", "date": "today"}}
    fig = figure(report)
    try:
        decode = next(ax for ax in fig.axes if ax.get_title() == "attention_decode")
        solid = [line for line in decode.lines if line.get_label() in names]
        assert sorted(line.get_label() for line in solid) == sorted(names)
        assert all(line.get_linestyle() == "-" for line in solid)
        assert len({(line.get_color(), line.get_marker()) for line in solid}) == len(names)
        assert sum(line.get_linestyle() == "--" for line in decode.lines) == len(names)
        assert sum(line.get_linestyle() == ":" for line in decode.lines) == len(names)
        legend = [t.get_text() for t in decode.get_legend().get_texts()]
        assert legend[:len(names)] == names
        assert "copy 4000 GB/s" in legend and "fastest XLA (dashed)" in legend
        # The prefill panel's sizes lie within one decade: its ticks are labelled all the same.
        prefill = next(ax for ax in fig.axes if ax.get_title() == "attention_prefill")
        fig.canvas.draw()
        assert any(t.get_text() for t in prefill.xaxis.get_ticklabels(minor=True))
    finally:
        plt.close(fig)


def test_nothing_to_plot_gives_no_figure():
    report = {"rows": [dict(_row("x", "", 1, 1e-3), status="skipped")],
              "calibration": {"copy_gbps": 1.0}, "meta": {"device": "", "jax": "", "date": ""}}
    assert figure(report) is None
