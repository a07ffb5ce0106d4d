"""Smoke test of the benchmark harness at CPU size: a few cases end to end, JSON and markdown."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import bench
from jaxkv._bench import cases as C
from jaxkv._bench import peers as P
from jaxkv._bench import report as R
from jaxkv._bench import timing as T

from helpers import assert_bytes_equal, copies_of, on_gpu


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    paths = dict(json=out / "bench.json", markdown=out / "bench.md", plot=out / "bench.png")
    # Every op, tiny shapes, and the peers (which skip with a note where there is no GPU).
    argv = ["--size", "cpu", "--reps", "2", "--no-progress", "--peers"]
    argv += [x for name, p in paths.items() for x in (f"--{name}", str(p))]
    report = bench.main(argv)
    return report, paths


@pytest.mark.long
def test_json_has_every_number(run):
    report, paths = run
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["jax"] == jax.__version__
    cal = data["calibration"]
    assert cal["copy_gbps"] == max(cal["stream_gbps"], cal["memcpy_gbps"]) > 0
    assert cal["loop_overhead_s"] > 0
    inc = data["increment_lengths"]
    assert inc["extra_launch_us"] == pytest.approx(inc["custom_call_us"] - inc["fused_add_us"])
    rows = data["rows"]
    assert {r["op"] for r in rows} == set(C.OPS) - {"increment_lengths"}
    for r in rows:
        if r["status"] == "not available":  # an op this build does not export yet
            assert not all(hasattr(jaxkv, n) for n in ("save_kv_cache", "PagedKVCache"))
            continue
        assert r["status"] == "ok", r["reason"]
        assert r["fallback"]["time_s"] > 0, r["fallback"]  # the op through its XLA formulation
        if r["op"] == "paged_compact":
            assert r["min_bytes"] == 0 and r["jaxkv"]["touches_kv"] == []
            continue
        k = r["jaxkv"]
        assert r["min_bytes"] > 0 and k["time_s"] > 0 and len(k["times_s"]) == 2
        assert k["gbps"] == pytest.approx(r["min_bytes"] / k["time_s"] / 1e9)
        assert k["copy_frac"] == pytest.approx(k["gbps"] / cal["copy_gbps"])
        # Every layer in one launch; none of jaxkv's where jaxkv.attention hands the call to
        # cuDNN (bfloat16 paged pools on a GPU; never an 8-bit pool, per tensor or per token;
        # not at head_dim 128 on Hopper, where jaxkv's kernels are the default past the
        # smallest decode grids: this test's cases are head_dim 64).
        hopper = " D128 " in r["case"] and jaxkv.attention._compute_capability() == "9.0"
        # Nor with a window, soft cap or sinks, which only jaxkv's kernels serve.
        cudnn = (r["op"].startswith("attention") and "paged" in r["case"] and on_gpu()
                 and not any(name in r["case"] for name in ("float8", "int8")) and not hopper
                 and not any(name in r["case"] for name in HYBRID))
        assert k["launches"] == (0 if cudnn else 1)
        # The op's work happens inside the timed loop, not once before it (loop-invariant code
        # motion), on both sides.
        assert not k["hoisted"] and not any(x["hoisted"] for x in r["xla"].values())
        assert r["xla"] and r["xla_best"] in r["xla"]
        assert r["speedup"] == pytest.approx(r["xla"][r["xla_best"]]["time_s"] / k["time_s"])
        # Targets are the H200's: evaluated on a GPU only (and not met at CPU size there).
        # A row without a target (a plot point) has none to meet anywhere.
        assert r["met"] is None if not (on_gpu() and r["target"]) else isinstance(r["met"], bool)
        assert k["mem_overhead_frac"] is not None


@pytest.mark.long
def test_markdown_table(run):
    report, paths = run
    md = paths["markdown"].read_text()
    columns = R.columns(report)
    assert columns == R.COLUMNS[:11] + R.PEER_COLUMNS + R.COLUMNS[11:]  # the run had --peers
    header = "| " + " | ".join(columns) + " |"
    assert header in md
    lines = md.splitlines()
    start = lines.index(header) + 2
    body = [line for line in lines[start:start + len(report["rows"])]]
    assert all(line.startswith("| ") and line.count(" | ") == len(columns) - 1 for line in body)
    assert [line.split(" | ")[1] for line in body] == [r["case"] for r in report["rows"]]
    # every op that ran also ran through its XLA fallback, in the same loop
    fallback = [line.split(" | ")[columns.index("fallback")] for line in body]
    ran = [f for f, r in zip(fallback, report["rows"]) if r["status"] == "ok"]
    assert ran and all(re.fullmatch(r"[0-9.]+ [mun]?s", f) for f in ran), fallback
    assert jax.__version__ in md
    assert ("Not an H200 run" in md) == (jax.default_backend() != "gpu")
    assert "increment_lengths" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not paths["plot"].exists()
    else:
        assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
        assert "](bench.png)" in md


@pytest.mark.long
def test_peers_are_skipped_with_a_note_off_gpu(run):
    """--peers at CPU size: every case whose work a peer does lists its peers, each skipped with
    the reason (no GPU), none timed; the new paged decode and append_layers cases ran."""
    report, paths = run
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the peers run (where they import)")
    cases = {(c.op, c.name): c for c in C.cases("cpu")}
    # A peer for every op but paged_compact (whose page release no peer does) and a window
    # layer's decode step (no peer releases a window's pages).
    assert {c.op for c in cases.values() if c.peer} == set(C.OPS) - {
        "increment_lengths", "paged_compact", "paged_decode_step"}
    names = [r["case"] for r in report["rows"] if r["op"] == "paged_append"]
    assert any(", one layer" in n for n in names) and any("layers in one launch" in n
                                                           for n in names)
    for r in report["rows"]:
        if r["status"] != "ok":  # an op this build does not export
            continue
        case = cases[(r["op"], r["case"])]
        expected = [s.name for s in P.specs(case)]
        assert list(r["peers"]) == expected
        assert bool(expected) == bool(case.peer), case.name
        for peer in r["peers"].values():
            assert peer == dict(status="skipped", library=peer["library"],
                                note="needs a CUDA GPU")
        assert r["peer_best"] is None
        if expected:
            assert R.peer_cells(r) == ["skipped: needs a CUDA GPU", "-", "-"]
    md = paths["markdown"].read_text()
    assert "## Peers" in md and "FlashInfer append_paged_kv_cache" in md
    assert "skipped (needs a CUDA GPU)" in md


@pytest.mark.long
def test_hybrid_rows_ran_beside_their_full_rows(run):
    """The window, soft-cap and sinks rows ran at CPU size with the full rows they compare with,
    each with its measured ratio in the JSON and the table; the window rows with XLA's read of
    the window's pages beside the masked whole rows."""
    report, paths = run
    rows = {r["case"]: r for r in report["rows"]}
    hybrid = [r for r in report["rows"] if any(h in r["case"] for h in HYBRID)
              and r["op"].startswith("attention")]
    assert len(hybrid) == 12
    md = paths["markdown"].read_text()
    for r in hybrid:
        assert r["status"] == "ok", r["reason"]
        v = r["versus"]
        assert v["ratio"] == pytest.approx(R.device_time(r["jaxkv"])
                                           / R.device_time(rows[v["case"]]["jaxkv"]))
        assert f"[{v['ratio']:.3g}x the row compared with; target <= {v['limit']:.3g}x]" in md
        assert ("window pages+dense" in r["xla"]) == ("window" in r["case"])


@pytest.mark.long
def test_window_decode_step_ran_beside_todays_step(run):
    """A window layer's decode step (reserve releasing, append, commit) and today's, their ratio
    by loop time, each beside the same step with XLA's scatter for the append."""
    report, _ = run
    steps = {r["case"]: r for r in report["rows"] if r["op"] == "paged_decode_step"}
    assert len(steps) == 2
    window = next(r for name, r in steps.items() if "window" in name)
    v = window["versus"]
    assert v["limit"] == 1.1 and v["case"] in steps
    assert v["ratio"] == pytest.approx(window["jaxkv"]["time_s"]
                                       / steps[v["case"]]["jaxkv"]["time_s"])


def _fake_case():
    """A tiny case whose 'kernel' is an add (what the cross-check sees is the output leaves)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.bfloat16)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.bfloat16)
    build = lambda: (x, y, lambda i, c, k: c + k, {})
    return C.Case("append", "fake", build, 64, 64, 3, per_step=1)


def _fake_peer(flip: bool):
    def make(case, carry, consts):
        out = {}

        def call(j):
            z = np.asarray(carry + consts).copy()
            if flip:  # one byte of one element
                z.reshape(-1).view(np.uint8)[5] ^= 1
            out["z"] = z

        return P.Peer(call=call, outputs=lambda: [out["z"]])

    return P.Spec("fake peer" + (" (wrong byte)" if flip else ""), "torch", make)


def test_a_peer_that_differs_by_one_byte_is_failed_and_not_timed():
    measured = []

    def measure(peer, case, reps):
        measured.append(case.name)
        return dict(time_s=1e-6, kernel_time_s=1e-6, gbps=64e-3)

    out = P.run(_fake_case(), 2, specs_=[_fake_peer(True), _fake_peer(False)],
                available=lambda library: None, measure=measure)
    bad, good = out["fake peer (wrong byte)"], out["fake peer"]
    assert bad["status"] == "failed" and "cross-check failed" in bad["error"]
    assert "1 of 32 elements differ, the first at (0, 2)" in bad["error"]
    assert not {"time_s", "kernel_time_s", "gbps"} & set(bad)
    assert good["status"] == "ok" and good["checked"] == "byte for byte"
    assert measured == ["fake"]  # only the peer that agreed was timed

    # In a row: the failure is in the peer cell and fails the target; the good one is compared.
    row = dict(jaxkv=dict(time_s=2e-6, copy_frac=0.9, launches=1, mem_overhead_frac=0.0),
               speedup=2.0, peers=out)
    R.compare_peers(row, copy_gbps=1.0)
    assert row["peer_best"] == "fake peer" and row["peers"]["fake peer"]["vs_jaxkv"] == 0.5
    R.evaluate(row, C.Target("t", beats_peers=True), on_gpu=True)
    assert row["met"] is False
    assert any("cross-check failed" in f for f in row["failed"])
    assert any("> fake peer" in f for f in row["failed"])  # the peer was faster
    row["peers"]["fake peer"]["status"] = "failed"  # no peer timed: the cell says why
    row["peers"]["fake peer"]["error"] = "cross-check failed: x"
    R.compare_peers(row, copy_gbps=1.0)
    assert R.peer_cells(row)[0].startswith("NOT TIMED: fake peer (wrong byte): cross-check")


def test_cross_check_reads_only_the_specified_bytes():
    """A compaction specifies only the survivors' live tokens: bytes past them may differ."""
    case = C.compact_linear(2, 8, 2, 128, 64, 3)
    lengths, mapping = case.params["lengths"], case.params["mapping"]
    want = np.asarray(C.rand((2, 8, 2, 2, 128, 64), C.BF16, 3))
    got = want.copy()
    survivors = np.flatnonzero(mapping >= 0)
    unused = sorted(set(range(8)) - set(mapping[survivors]))
    got[:, unused[0]] = 0  # a row no survivor moves to
    i = survivors[np.argmin(lengths[survivors])]
    got[:, mapping[i], ..., lengths[i]:, :] = 0  # past a survivor's live tokens
    pick = P.regions(case)
    assert P.mismatch([got], [jnp.asarray(want)], pick) is None
    got.view(np.uint16)[1, mapping[i], 1, 0, 0, 0] ^= 1  # a live token's byte
    assert "1 of" in P.mismatch([got], [jnp.asarray(want)], pick)


def test_xla_paged_append_of_every_layer():
    """The XLA formulation of append_layers writes what jaxkv's one launch writes, in the NHD
    layout (the harness's CPU cases cover one layer in both layouts, every layer in HND)."""
    L, B, H, T, D, page = 3, 2, 2, 3, 8, 4
    lengths, counts = np.array([1, 6]), np.array([3, 2])
    cache = C._paged_pools(L, B, 3, page, H, D, lengths, "NHD", 5)
    k, v = (C.rand((L, B, H, T, D), C.BF16, s) for s in (7, 8))
    want = cache.append_layers(k, v, C.i32(counts))
    for pool, x, w in ((cache.k_pages, k, want.k_pages), (cache.v_pages, v, want.v_pages)):
        got = C._xla_paged_append(pool, None, cache.page_table, cache.lengths, x, C.i32(counts),
                                  page, "NHD")
        assert_bytes_equal(got, w, "NHD")


def test_match_keeps_only_the_named_cases(capsys):
    bench.main(["--size", "gpu", "--list", "--op", "paged_append", "--match", "into int8",
                "--match", "decode B256 H8 D128 page 16 NHD, one layer"])
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(None, 1)[1] for line in lines]
    # The one-layer decode row and its two 8-bit rows; the int8 rows of append_layers and prefill,
    # and the two bf16 rows those compare with (their targets need them in the same run).
    assert len(lines) == 7, lines
    compared = ["prefill 5000 tokens H8 D128 page 16 NHD ",
                "decode B256 H8 D128 page 16 NHD, 32 layers in one launch, per layer "]
    assert all("into int8" in n or "decode B256 H8 D128 page 16 NHD, one layer" in n
               or any(n.startswith(c) for c in compared) for n in names)
    assert all(any(n.startswith(c) for n in names) for c in compared)
    assert all(line.startswith("paged_append") for line in lines)


HYBRID = ("window", "soft cap", "sinks")


def test_match_adds_the_rows_hybrid_attention_compares_with(capsys):
    """--match window etc.: the issue's hybrid-attention rows, and the full rows of the same run
    that their targets are relative to (bf16 and 8-bit), nothing else."""
    bench.main(["--size", "gpu", "--list", "--op", "attention_decode", "--op",
                "attention_prefill", "--match", "window", "--match", "soft cap", "--match",
                "sinks"])
    names = [line.split(None, 1)[1].split("  ")[0].strip()
             for line in capsys.readouterr().out.splitlines()]
    full = ["paged NHD B64 N4096 32/8 heads D128 page 16",
            "paged NHD B8 2048 new on 2048 32/8 heads D128 page 16"]
    full += [f"{n} float8_e4m3fn per_token_head" for n in full]
    assert sorted(n for n in names if not any(h in n for h in HYBRID)) == sorted(full)
    assert len(names) == len(full) + 12  # 4 decode and 2 prefill rows, bf16 and fp8


@pytest.mark.parametrize("size", ["cpu", "gpu"], ids=["small", "h200"])  # "gpu" marks GPU-only
def test_hybrid_rows(size):
    """The issue's hybrid rows: each compares with a full row of its dtype in the same list; a
    window row's bytes are those inside the window (decode: the last min(window, length) tokens;
    prefill: those some new token sees); FlashInfer beside the bf16 rows without sinks, planned
    with window_left = window - 1 and logits_soft_cap."""
    from jaxkv._bench import peers_flashinfer as F

    every = {c.name: c for c in C.cases(size)}
    rows = [c for c in every.values() if c.op.startswith("attention") and any(
        h in c.name for h in HYBRID)]
    assert len(rows) == 12
    for c in rows:
        full, ratio = c.target.versus
        assert full in every and not any(h in full for h in HYBRID), c.name
        assert ("float8" in full) == ("float8" in c.name) and c.name.startswith(full)
        assert every[full].params["window"] is None
        window = c.params["window"]
        specs = P.specs(c)
        if "float8" in c.name or "sinks" in c.name:
            assert specs == [] and c.target.peer_speedup is None
        else:  # a prefill beside FlashInfer's FA2 and FA3 backends
            backends = ["(fa2)", "(fa3)"] if c.op == "attention_prefill" else [""]
            assert len(specs) == len(backends)
            assert all(b in spec.name for b, spec in zip(backends, specs))
            plan = F._hybrid(c)
            assert plan == ({"window_left": window - 1} if window else {}) | (
                {"logits_soft_cap": 50.0} if "soft cap" in c.name else {})
            assert all(f"{k}={v:g}" in spec.name for k, v in plan.items() for spec in specs)
        Hq, H, D = (32, 8, 128) if size == "gpu" else (8, 2, 64)
        if window is None:  # the full row's bytes, and the sinks' float32 [Hq]
            assert c.min_bytes == every[full].min_bytes + ("sinks" in c.name) * 4 * Hq
            continue
        if c.op == "attention_prefill":
            B, T = (8, 2048) if size == "gpu" else (2, 32)
            tokens, q_bytes = window + T - 1, 2 * B * T * Hq * D * 2
        else:
            B = 64 if size == "gpu" else 4
            tokens, q_bytes = window, 2 * B * Hq * D * 2
        per_token = 2 * H * (D * 1 + 4) if "float8" in c.name else 2 * H * D * 2
        assert c.min_bytes == B * tokens * per_token + q_bytes, c.name
        assert ratio == (0.30 if c.op == "attention_decode" else 0.45)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [None, jnp.float8_e4m3fn])
def test_window_pages_formulation_equals_the_reference(layout, dtype):
    """XLA's window formulation (only the pages a window touches, jnp.take) on ragged rows, a
    window not on a page boundary, soft cap and sinks: the oracle's numbers."""
    from jaxkv import reference

    B, Hq, H, D, page, window = 3, 4, 2, 16, 4, 6
    lengths = np.array([1, 9, 16])
    cache = C.quantized(C._paged_pools(1, B, 4, page, H, D, lengths, layout, 3), dtype)
    q = C.rand((B, Hq, D), C.BF16, 4)
    sinks = jnp.asarray(np.linspace(-1, 2, Hq), jnp.float32)
    hy = dict(window=window, soft_cap=5.0, sinks=sinks)
    k, v, pos = C._window_pages(cache, 0, jnp.maximum(cache.lengths - window, 0), window)
    got = C._dense_attention(q[:, None], k, v, cache.lengths - 1, pos, **hy)[:, 0]
    kd, vd = cache.gather(0, 16, split=True, dtype=jnp.float32)
    want = reference.decode_attention(q, kd, vd, cache.lengths, **hy)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2)


def test_missing_op_is_not_an_error():
    case = C.Case("save_kv_cache", "absent", lambda: None, 1, 1, 1, requires=("no_such_op",))
    row = bench.run_case(case, 1, 1.0, False, T.Progress(1, enabled=False))
    assert row["status"] == "not available" and "jaxkv.no_such_op" in row["reason"]
    assert "not available" in R.cells(row)


def test_a_row_without_a_target_says_so_on_every_device():
    """Not "n/a (cpu)" on a GPU run: a row measured for comparison has no target to meet."""
    k = dict(time_s=2e-6, kernel_time_s=1e-6, copy_frac=0.5, launches=1, mem_overhead_frac=0.0,
             mem_measured=True, mem_extra_bytes=0)
    row = dict(op="attention_decode", case="c", status="ok", min_bytes=1000, jaxkv=k, xla={},
               xla_best=None, speedup=None, sweep=False, target="", met=None, failed=[])
    assert R.cells(row)[-1] == "no target"
    row.update(target="t")  # a target off the GPU: not evaluated there
    assert R.cells(row)[-1] == "n/a (cpu)"


def test_targets_relative_to_peers_and_rows_show_their_ratios():
    """The window decode's ">= 4x FlashInfer" and "<= 30% of the full decode": missed and met,
    the measured ratio of the two rows beside the verdict."""
    k = dict(time_s=2e-6, kernel_time_s=100e-6, copy_frac=0.9, launches=1, mem_overhead_frac=0.0,
             mem_measured=True, mem_extra_bytes=0)
    full = dict(op="attention_decode", case="full", status="ok",
                jaxkv=dict(k, kernel_time_s=400e-6))
    peers = dict(fi=dict(status="ok", time_s=350e-6, kernel_time_s=350e-6, gbps=1.0))
    row = dict(op="attention_decode", case="full window", status="ok", min_bytes=1000, jaxkv=k,
               xla={}, xla_best=None, speedup=None, sweep=False, target="t", peers=peers)
    R.compare_peers(row, copy_gbps=1.0)
    target = C.Target("t", versus=("full", 0.30), peer_speedup=4.0)
    R.evaluate(row, target, on_gpu=True, rows=[full, row])
    assert row["met"] is False and row["versus"]["ratio"] == pytest.approx(0.25)
    assert row["failed"] == ["fi 350 us < 4 x 100 us"]
    assert "[0.25x the row compared with; target <= 0.3x]" in R.cells(row)[-1]
    peers["fi"].update(kernel_time_s=420e-6)
    R.compare_peers(row, copy_gbps=1.0)
    R.evaluate(row, target, on_gpu=True, rows=[full, row])
    assert row["met"] is True
    row["jaxkv"] = dict(k, kernel_time_s=130e-6)  # 0.325x the full row, 3.2x the peer
    R.evaluate(row, target, on_gpu=True, rows=[full, row])
    assert row["met"] is False and len(row["failed"]) == 2
    R.evaluate(row, target, on_gpu=True)  # the full row not in the run: no ratio shown
    assert "versus" not in row and "no row 'full'" in row["failed"][-1]


def test_targets_fail_when_missed():
    row = dict(jaxkv=dict(copy_frac=0.5, time_s=10e-6, launches=2, mem_overhead_frac=0.5),
               speedup=0.9)
    target = C.Target("t", copy_frac=0.85, speedup=5, max_us=5, beats_xla=True, one_launch=True)
    R.evaluate(row, target, on_gpu=True)
    assert row["met"] is False and len(row["failed"]) == 6
    row["jaxkv"] = dict(copy_frac=0.9, time_s=1e-6, launches=1, mem_overhead_frac=0.0)
    row["speedup"] = 6.0
    R.evaluate(row, target, on_gpu=True)
    assert row["met"] is True and row["failed"] == []


def _pairs(prefix, new, window=None) -> int:
    """Visible (query, key) pairs, counted one by one: a query at position p sees the keys at
    positions (p - window, p] that exist (0 .. p)."""
    n = 0
    for start, count in zip(prefix, new):
        for p in range(start, start + count):
            keys = np.arange(p + 1)
            n += int(np.sum(keys > p - window)) if window else len(keys)
    return n


def test_prefill_flops_count_the_causal_work():
    """Issue 68's FLOPs: 4 * D per visible (query, key) pair and query head; 8 rows of 2048 new
    tokens on 2048 cached are 0.825 TFLOP at 32 heads of D128 and at 16 of D256, and the cases
    carry it. A window and ragged rows against a count pair by pair."""
    full = C.attention_flops(np.full(8, 2048), np.full(8, 2048), 32, 128)
    assert full == 8 * 32 * 4 * 128 * (2048 * 2048 + 2048 * 2049 // 2)
    assert full == pytest.approx(0.825e12, rel=1e-3)
    assert C.attention_flops(np.full(8, 2048), np.full(8, 2048), 16, 256) == full
    rows = {c.name: c for c in C.cases("gpu") if c.op == "attention_prefill"}
    d128 = rows["paged NHD B8 2048 new on 2048 32/8 heads D128 page 16"]
    assert d128.flops == full and d128.target.min_tflops == 600
    rng = np.random.default_rng(0)
    prefix, new = rng.integers(0, 40, 6), rng.integers(0, 30, 6)
    for window in (None, 1, 7, 25, 100):
        want = 4 * 16 * 3 * _pairs(prefix, new, window)
        assert C.attention_flops(prefix, new, 3, 16, window) == want, window
    # The window rows count the keys of the window only: (1024 / 3072) of the full row's.
    assert rows[d128.name + " window 1024"].flops == 8 * 32 * 4 * 128 * 2048 * 1024
    step = next(c for c in rows.values() if "serving step" in c.name)
    lengths, counts = C.serving_step(64, 5000, 512, 4096, 150)
    assert counts.sum() == 5000 and counts.max() <= 512 and np.sum(counts == 1) >= 16
    assert step.flops == 4 * 128 * 32 * _pairs(lengths, counts)
    assert step.target.min_tflops == 500 and np.array_equal(step.params["new"], counts)


def test_a_prefill_under_its_tflops_fails_on_gpu():
    """min_tflops on the row's FLOPs over its device time: 0.825 TFLOP in 1.65 ms is 500
    TFLOP/s, under 600 (and shown in the table); evaluated on the GPU only."""
    k = dict(time_s=1.9e-3, kernel_time_s=1.65e-3, copy_frac=0.1, launches=1,
             mem_overhead_frac=0.0, mem_measured=True, mem_extra_bytes=0)
    row = dict(op="attention_prefill", case="c", status="ok", min_bytes=403e6, flops=0.825e12,
               jaxkv=k, xla={}, xla_best=None, speedup=None, sweep=False, target="t")
    target = C.Target("t", min_tflops=600)
    R.evaluate(row, target, on_gpu=True)
    assert row["met"] is False and row["failed"] == ["500 TFLOP/s < 600 TFLOP/s"]
    assert "(500 TFLOP/s)" in R.cells(row)[5] and "(500 TFLOP/s)" in R.row_line(row)
    R.evaluate(row, target, on_gpu=False)  # the numbers are the H200's
    assert row["met"] is None
    row["jaxkv"] = dict(k, kernel_time_s=1.3e-3)
    R.evaluate(row, target, on_gpu=True)
    assert row["met"] is True
    row["flops"] = 0  # a row that counts no FLOPs cannot meet a FLOP rate
    R.evaluate(row, target, on_gpu=True)
    assert row["failed"] == ["n/a < 600 TFLOP/s"] and "TFLOP" not in R.cells(row)[5]


def test_hlo_copy_counting():
    x = jnp.ones((512, 1024), jnp.float32)  # 2 MiB
    hlo = jax.jit(jnp.copy).lower(x).compile().as_text()
    assert T.big_copies(hlo) == 1 and T.big_copies(hlo, min_bytes=4 << 20) == 0
    assert "copy" in T.touches(hlo, x)
    assert T.touches(jax.jit(lambda x: x.sum()).lower(x).compile().as_text(), x)
    assert not T.touches(jax.jit(lambda x, y: y + 1).lower(x, 1.0).compile().as_text(), x)


def test_timed_loop_runs_in_place():
    """The harness's loop must not copy the cache per iteration, or it would time the copy."""
    case = C.compact_linear(2, 8, 2, 128, 64, 3)
    buffer, consts, kernel, _ = case.build()
    hlo = T.loop(kernel, 3).lower(buffer, consts).compile().as_text()
    assert not copies_of(hlo, buffer)
    assert T.jaxkv_calls(hlo, 3) == 1
    pointer = buffer.unsafe_buffer_pointer()
    buffer, seconds, _, _ = T.time_loop(kernel, buffer, consts, 3, 2)
    assert buffer.unsafe_buffer_pointer() == pointer and len(seconds) == 2


def test_a_slow_implementation_stops_at_two_timed_calls_past_its_budget():
    case = C.compact_linear(2, 8, 2, 128, 64, 3)
    buffer, consts, kernel, _ = case.build()
    buffer, seconds, _, _ = T.time_loop(kernel, buffer, consts, 3, 5, budget_s=0.0)
    assert len(seconds) == 2
    buffer, seconds, _, _ = T.time_loop(kernel, buffer, consts, 3, 5, budget_s=1e9)
    assert len(seconds) == 5


def test_minimum_bytes_count_only_moving_live_tokens():
    lengths, mapping, moved, _ = C.evict_half(8, 128, seed=1)
    survivors = np.flatnonzero(mapping >= 0)
    assert len(survivors) == 4 and moved <= lengths[survivors].sum()
    expect = sum(int(lengths[i]) for i in survivors if mapping[i] != i)
    assert moved == expect
    case = C.compact_linear(2, 8, 2, 128, 64, 3)
    assert case.min_bytes == 2 * moved * 2 * 2 * 2 * 64 * 2  # read+write, L, K/V, H, D, bf16
    assert jaxkv.LinearKVCache  # the case runs through the public API


@pytest.mark.long
def test_gpu_sizes_trace(monkeypatch):
    """Every H200-size case traces (abstract inputs: nothing is allocated), so the device run
    cannot stop on a shape or validation error. The paged gather and compaction cases build a
    real page table with compiled allocator code, seconds each on CPU: they are traced at CPU
    size above (the paged appends build theirs with numpy)."""
    monkeypatch.setattr(C, "rand", lambda shape, dtype, seed: jax.ShapeDtypeStruct(shape, dtype))
    for case in C.cases("gpu"):
        if case.missing() or case.op in ("paged_gather", "paged_compact"):
            continue
        carry, consts, kernel, xla = case.build()
        for step in [kernel, *xla.values()]:
            T.loop(step, 2).lower(carry, consts)


def _live(tree, consts):
    """The specified part of a compaction's output: the live tokens of every survivor's new row."""
    lengths, mapping = np.asarray(consts["lengths"]), np.asarray(consts["mapping"])
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        x = np.asarray(x)
        stacked = x.ndim == 6  # LinearKVCache [L, B, 2, H, S, D]
        for i in np.flatnonzero(mapping >= 0):
            row = x[:, mapping[i]] if stacked else x[mapping[i]]
            out.append(row[..., : lengths[i], :])
    return out


def _first_of_each_op(cases) -> list:
    """The cases as parameters, each op's first in README's tests and the rest long."""
    params, seen = [], set()
    for c in cases:
        params.append(pytest.param(c, id=f"{c.op}-{c.name}",
                                   marks=[pytest.mark.long] * (c.op in seen)))
        seen.add(c.op)
    return params


@pytest.mark.parametrize("case", _first_of_each_op(
    c for c in C.cases("cpu") if c.op != "paged_compact"))
def test_xla_formulations_compute_the_same(case):
    """A baseline that did less work than the op would make the speed-up a lie: every XLA
    formulation must produce the op's specified bytes, from the same inputs. So must every
    PyTorch-native peer where torch imports (CPU tensors through DLPack on a CPU backend): what
    --peers checks on the GPU before it times them."""
    if case.missing():
        pytest.skip(f"jaxkv.{case.missing()[0]} is not in this build")
    carry, consts, kernel, xla = case.build()
    run = lambda step, i=1: jax.jit(step)(jnp.int32(i), carry, consts)
    expected = run(kernel)
    pick = (lambda t: _live(t, consts)) if case.op == "compact_kv_cache" else (
        jax.tree_util.tree_leaves)
    for name, step in xla.items():
        got = run(step)
        for e, g in zip(pick(expected), pick(got), strict=True):
            if case.op.startswith("attention"):  # arithmetic: bf16 rounding, not bytes
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                                           rtol=2e-2, atol=2e-2, err_msg=f"{case.name}: {name}")
            elif " into " in case.name and on_gpu():
                # XLA's own quantization: on the GPU its float32 division is not correctly
                # rounded (a few percent of the values land one step off: docs/perf-notes.md);
                # the kernels match jaxkv.reference bit for bit (test_quantized.py).
                a, b = np.asarray(g, np.float32), np.asarray(e, np.float32)
                step = 1.0 if g.dtype == jnp.int8 else np.abs(b) * 2.0**-2 + 1e-6
                assert np.all(np.abs(a - b) <= step), f"{case.name}: {name}"
                assert np.mean(a != b) < 0.05, f"{case.name}: {name}"
            else:
                assert_bytes_equal(g, e, f"{case.name}: {name}")
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    expected = None
    for n, spec in enumerate(s for s in P.specs(case) if s.library == "torch"):
        # The first peer on the inputs built above (the XLA checks did not write them; jaxkv's
        # step i = 0 then compiles no new program), the next on fresh ones.
        inputs = (carry, consts, kernel) if n == 0 else None
        peer, expected, problem = P.bind(case, spec, expected, inputs)
        assert problem is None, f"{case.name}: {spec.name}: {problem}"
        peer.call(1)  # the second call (another row or layer) runs too


def test_memory_probe_pads_to_the_peak(monkeypatch):
    """The probe's arithmetic with a device's memory_stats (CPU has none): it pads the bytes in use
    up to the old peak, so the new peak minus the bytes in use is what the call allocated."""
    seen = []
    gap = 4096

    def fake_stats():
        seen.append(len(seen))
        used = 1000 + (gap if len(seen) > 1 else 0)  # the pad is live from the 2nd reading on
        peak = 1000 + gap + (123 if len(seen) > 2 else 0)  # the call lifts the peak by 123
        return dict(bytes_in_use=used, peak_bytes_in_use=peak, bytes_limit=1 << 40)

    monkeypatch.setattr(T, "memory_stats", fake_stats)
    monkeypatch.setattr(T, "PAD_PIECE", 1000)  # the pad in pieces: 4 of 1000 bytes and one of 96
    pads = []
    real_pad = T.pad_device_memory
    monkeypatch.setattr(T, "pad_device_memory", lambda n: pads.append(real_pad(n)) or pads[-1])
    x = jnp.ones((8,), jnp.float32)
    out, measured = T.peak_extra(lambda: x * 2, 0)
    assert measured == 123 and len(seen) == 3
    assert [p.size for p in pads[0]] == [1000] * 4 + [96]
    np.testing.assert_array_equal(out, 2 * np.ones(8, np.float32))

    # No room for the pad and the call: no measurement, the call still ran once.
    monkeypatch.setattr(T, "memory_stats", lambda: dict(bytes_in_use=10, peak_bytes_in_use=20,
                                                        bytes_limit=40))
    out, measured = T.peak_extra(lambda: out * 2, 0)
    assert measured is None
    np.testing.assert_array_equal(out, 4 * np.ones(8, np.float32))

    # Through time_loop: its warm-up call is the probe.
    monkeypatch.setattr(T, "memory_stats", lambda: None)
    out, seconds, _, (measured, static) = T.time_loop(lambda i, c, k: c * 2, out, (), 3, 2,
                                                       memory=True)
    assert measured is None and static is not None and static >= 0 and len(seconds) == 2
    np.testing.assert_array_equal(out, 4 * 2**9 * np.ones(8, np.float32))


def test_memory_probe_without_a_place_for_its_pad_runs_the_call_unmeasured(monkeypatch):
    """Where the allocator cannot place the pad (its free bytes in holes smaller than a piece, as
    after a full GPU run's largest cases), the call runs once, unmeasured, instead of failing."""
    monkeypatch.setattr(T, "memory_stats", lambda: dict(bytes_in_use=1000, peak_bytes_in_use=5096,
                                                        bytes_limit=1 << 40))

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    x = jnp.ones((8,), jnp.float32)
    calls = []
    monkeypatch.setattr(T.jnp, "zeros", exhausted)
    out, measured = T.peak_extra(lambda: calls.append(1) or x * 2, 0)
    assert measured is None and calls == [1]
    np.testing.assert_array_equal(out, 2 * np.ones(8, np.float32))


def test_a_hoisted_op_is_detected():
    """What the harness's `hoisted` flag relies on, on ops of loop-invariant inputs (XLA hoists
    them on CPU; whether it does elsewhere, the flags must agree with where the work went)."""
    x = jnp.ones((64, 1024), jnp.float32)
    identity = jnp.arange(64, dtype=jnp.int32)
    invariant = [lambda i, c, k: k * 2, lambda i, c, k: jaxkv.compact_tensor_batch(k, identity)]
    for step in invariant:
        hlo = T.loop(step, 3).lower(x, x).compile().as_text()
        out_of_loop = T.entry_work(hlo) >= x.nbytes
        assert (T.loop_work(hlo) < x.nbytes) == out_of_loop
        if jax.default_backend() == "cpu":
            assert out_of_loop
    hlo = T.loop(invariant[1], 3).lower(x, x).compile().as_text()
    assert T.jaxkv_calls(hlo, 3) == pytest.approx(1 / 3 if T.loop_work(hlo) < x.nbytes else 1)
    kept = lambda i, c, k: jaxkv.compact_tensor_batch(c, identity)  # depends on the carry
    hlo = T.loop(kept, 3).lower(x, x).compile().as_text()
    assert T.jaxkv_calls(hlo, 3) == 1 and T.loop_work(hlo) >= x.nbytes


def test_a_failing_xla_formulation_is_reported_and_the_others_run():
    case = C.compact_linear(2, 8, 2, 128, 64, 2)
    build = case.build

    def with_failure():
        carry, consts, kernel, xla = build()

        def fails(i, c, k):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (simulated)")

        return carry, consts, kernel, {"fails": fails, **xla}

    case.build = with_failure
    row = bench.run_case(case, 1, 10.0, False, T.Progress(1, enabled=False))
    assert row["status"] == "ok" and "RESOURCE_EXHAUSTED" in row["xla"]["fails"]["error"]
    assert row["xla_best"] in ("take", "scatter") and row["speedup"] > 0
    # The row's line, printed as soon as it is measured (a run cut short keeps it).
    line = R.row_line(row)
    best = R.fmt_time(row["xla"][row["xla_best"]]["time_s"])
    assert line.startswith(f"{row['op']} {row['case']}: jaxkv ") and f"XLA {best}," in line
    assert R.row_line(dict(row, status="error", reason="boom")).endswith(": error (boom)")


@pytest.mark.parametrize("make", [
    lambda: C.compact_layers([(2, 64), (1, 128)] * 4, 8, 128, 2),
    lambda: C.save(8, 2, 2, 256, 64, 128, 2),
    lambda: C.instantiate(8, 2, 2, 256, 64, 128, 2),
], ids=["compact", "save", "instantiate"])
def test_many_layers_are_read_right(make):
    """The H200 cases have 32 layers: XLA prints such result tuples with /*index=N*/ markers,
    which the HLO checks must read through (else a kernel would look hoisted)."""
    case = make()
    if case.missing():
        pytest.skip(f"jaxkv.{case.missing()[0]} is not in this build")
    carry, consts, kernel, _ = case.build()
    hlo = T.loop(kernel, 2).lower(carry, consts).compile().as_text()
    largest = max(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(carry))
    assert "/*index=" in hlo  # the case this test is about
    assert T.loop_work(hlo) >= largest and T.jaxkv_calls(hlo, 2) == 1


def test_an_unrolled_loop_counts_its_launches():
    """If XLA unrolls the timed loop completely, the ops sit in the entry, once per iteration."""
    call = ('%c{i} = bf16[8,1024]{{1,0}} custom-call(%p), custom_call_target="jaxkv_compact", '
            'metadata={{op_name="x=y"}}')
    hlo = "\n".join(["HloModule m", "", "ENTRY %main (p: bf16[8,1024]) -> bf16[8,1024] {",
                     "  %p = bf16[8,1024]{1,0} parameter(0)"]
                    + ["  " + call.format(i=i) for i in range(3)] + ["}", ""])
    assert T.jaxkv_calls(hlo, 3) == 1
    assert T.loop_work(hlo) == 8 * 1024 * 2


def test_a_loop_inside_a_command_buffer_is_found():
    """On GPU XLA may move the timed loop into a command buffer that the entry calls."""
    hlo = """HloModule m

%body (p: (s32[], bf16[8,1024])) -> (s32[], bf16[8,1024]) {
  %p = (s32[], bf16[8,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %g = bf16[8,1024]{1,0} get-tuple-element(%p), index=1
  %c = bf16[8,1024]{1,0} custom-call(%g), custom_call_target="jaxkv_compact"
  ROOT %t = (s32[], bf16[8,1024]{1,0}) tuple(%i, %c)
}

%cond (q: (s32[], bf16[8,1024])) -> pred[] {
  %q = (s32[], bf16[8,1024]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%command_buffer (a: (s32[], bf16[8,1024])) -> (s32[], bf16[8,1024]) {
  %a = (s32[], bf16[8,1024]{1,0}) parameter(0)
  ROOT %w = (s32[], bf16[8,1024]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}

ENTRY %main (x: bf16[8,1024]) -> bf16[8,1024] {
  %x = bf16[8,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], bf16[8,1024]{1,0}) tuple(%z, %x)
  %r = (s32[], bf16[8,1024]{1,0}) call(%t), to_apply=%command_buffer
  ROOT %o = bf16[8,1024]{1,0} get-tuple-element(%r), index=1
}
"""
    assert T.jaxkv_calls(hlo, 3) == 1
    assert T.loop_work(hlo) == 8 * 1024 * 2
    assert T.entry_work(hlo) == 0


@pytest.mark.gpu
def test_kernel_time_comes_from_the_profiler():
    """On a GPU, every jaxkv launch of the loop is found in the trace, with a plausible time."""
    x = jnp.asarray(np.random.default_rng().standard_normal((64, 1 << 16), np.float32))
    mapping = jnp.asarray(np.random.default_rng().permutation(64).astype(np.int32))
    step = lambda i, c, m: jaxkv.compact_tensor_batch(c, m)
    x, t, seen, expected = T.kernel_seconds(step, x, mapping, n=4)
    assert seen == expected == 4
    moved = 2 * x.nbytes  # every row moves: read once, written once
    assert 1e-7 < t < moved / 1e11  # faster than 100 GB/s, slower than nothing


def test_kernel_time_is_none_without_a_gpu_trace():
    """Off a GPU the trace has no device plane: no kernel time, and nothing breaks."""
    if jax.default_backend() == "gpu":
        pytest.skip("covered by test_kernel_time_comes_from_the_profiler")
    x = jnp.ones((8, 16), jnp.float32)
    step = lambda i, c, m: jaxkv.compact_tensor_batch(c, m)
    _, t, seen, expected = T.kernel_seconds(step, x, jnp.arange(8, dtype=jnp.int32), n=2)
    assert (t, seen, expected) == (None, 0, 2)


def test_an_op_of_several_launches_is_timed_as_their_sum():
    """A split-KV attention launches a main kernel and a combine per op: the op's time is both,
    not the median launch (which would halve it)."""
    launches = [450e-6, 5e-6, 452e-6, 6e-6, 449e-6, 5e-6, 451e-6, 5e-6]
    assert T.per_op_seconds(launches, 4) == pytest.approx(455.5e-6)  # sums 455, 458, 454, 456
    assert T.per_op_seconds(launches[:4], 4) == pytest.approx(np.median(launches[:4]))
    assert T.per_op_seconds(launches[:7], 4) is None  # a launch missing: no time, not a wrong one
    assert T.per_op_seconds([], 4) is None


@pytest.mark.long
def test_swap_benchmark_checks_the_bytes_and_reports_against_the_copy(tmp_path):
    """--swap: swap_out and swap_in of scattered rows, each checked byte for byte, beside the
    pinned copy of the same bytes measured in the same run."""
    path = tmp_path / "swap.json"
    result = bench.main(["--swap", "--size", "cpu", "--json", str(path)])
    for key in ("d2h_gbps", "h2d_gbps", "swap_out_gbps", "swap_in_gbps"):
        assert result[key] > 0, key
    assert result["swap_out_of_copy"] == result["swap_out_gbps"] / result["d2h_gbps"]
    assert json.loads(path.read_text())["pages"] == 32
