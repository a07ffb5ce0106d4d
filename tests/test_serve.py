"""The serving benchmark (``python -m jaxkv serve``): every engine's greedy tokens equal full
recomputation, the multi-step device loop equals one step per dispatch, the paged pool under
pressure preempts and still answers right, the fixed-slot bar contains no jaxkv."""

import ast
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import __main__ as entry
from jaxkv.serving import metrics
from jaxkv import models
from jaxkv.models import decoder as M
from jaxkv.serving import schedule
from jaxkv.serving import serve as S
from jaxkv.demo import serve_cli

CFG = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)
PARAMS = M.stack_layers(M.init_params(CFG, seed=3))
# Long-tailed lengths, max_seq_len 40; the system prompt (5 tokens) ends inside a page of 4, so
# every paged admission forks its full page and copies the partial one.
STREAM = S.StreamConfig(requests=10, seed=4, system_len=5, mean_prompt=7, mean_output=7,
                        sigma=0.8, max_seq_len=40)
SYSTEM, REQUESTS = S.make_stream(STREAM, CFG.vocab_size)
PER_TOKEN = S.kv_bytes_per_token(CFG, "float32")
# 4 rows of 40 tokens for the row engines; the paged engines' 16 pages of 4 hold fewer tokens
# (64) than their 4 rows want at the longest (4 x 40), so the pool runs short.
PLANS = {"paged": S.Plan("paged", batch=4, num_pages=16, page_size=4),
         "linear": S.Plan("linear", batch=4), "fixed": S.Plan("fixed", batch=4),
         "linear-xla": S.Plan("linear-xla", batch=4),
         "paged-swap": S.Plan("paged-swap", batch=4, num_pages=16, page_size=4)}


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def engine(name, unroll=False):
    """One engine per configuration (each compiles its functions once)."""
    return _engine(name, unroll)


@functools.cache
def _engine(name, unroll):
    kind = S.make_kind(name, CFG, "float32", PLANS[name], unroll=unroll)
    return S.ServeEngine(CFG, PARAMS, kind, batch=PLANS[name].batch, max_seq_len=40,
                         system_prompt=SYSTEM, prefill_rows=2, prefill_chunk=4, decode_steps=4,
                         mixed_steps=2, unroll=unroll)


@functools.cache
def recomputed(eos=None):
    return serve_cli.recompute(CFG, PARAMS, SYSTEM, REQUESTS, len(REQUESTS), 40, eos)


def serve(name, unroll=False, **options):
    requests = S.fresh(REQUESTS)
    m = engine(name, unroll).run(requests, **options)
    return [r.output for r in requests], m


def test_stream_is_long_tailed_and_fits():
    prompts = np.array([len(r.prompt) for r in REQUESTS])
    outputs = np.array([r.max_new_tokens for r in REQUESTS])
    assert np.all(5 + prompts + outputs <= 40) and prompts.min() >= 1 and outputs.min() >= 1
    assert prompts.max() > 2 * np.median(prompts)  # a long tail
    again = S.make_stream(STREAM, CFG.vocab_size)[1]
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(again, REQUESTS))


@pytest.mark.parametrize("name", list(PLANS))
def test_every_engine_generates_what_recomputation_does(name):
    outputs, m = serve(name)
    assert outputs == recomputed()
    assert m["peak_live"] <= PLANS[name].batch
    assert engine(name).cache_copies() == 0  # every call updates the cache in place


# Gemma 3's layer kinds on the test model: a 4-token window on layer 0, layer 1 global.
HYBRID = dataclasses.replace(CFG, family="gemma3", windows=(4, None), local_rope_theta=100.0,
                             gemma_norms=True, qk_norm=True, activation="gelu_tanh",
                             query_scale=0.2)


@pytest.mark.parametrize("name", ["paged", "paged-global", "paged-8bit",
                                  pytest.param("paged-prefix", marks=pytest.mark.long),
                                  pytest.param("paged-swap", marks=pytest.mark.long)])
def test_a_model_with_windows_serves_what_recomputation_does(name):
    """The paged engine releases what the window layer no longer sees; paged-global keeps every
    token (the window in attention only); both generate what recomputation does, in place, with
    the allocator's counts intact. The 8-bit cache's agreement is printed."""
    params = M.stack_layers(M.init_params(HYBRID, seed=5))
    per_token = S.kv_bytes_per_token(HYBRID, "float32")
    p = S.plan(name, 24 * 4 * per_token, per_token, 40, 4, 4, HYBRID)
    kind = S.make_kind(name, HYBRID, "float32", p)
    assert kind.windows == (None if name == "paged-global" else HYBRID.windows)
    assert p.num_pages == (24 if name == "paged-global" else 48)  # pages of one layer each
    assert (kind.prefix_cache, kind.host_pages > 0) == (name == "paged-prefix",
                                                        name == "paged-swap")
    eng = S.ServeEngine(HYBRID, params, kind, batch=4, max_seq_len=40, system_prompt=SYSTEM,
                        prefill_rows=2, prefill_chunk=4, decode_steps=4, mixed_steps=2)
    requests = S.fresh(REQUESTS)
    m = eng.run(requests)
    want = serve_cli.recompute(HYBRID, params, SYSTEM, REQUESTS, len(REQUESTS), 40, None)
    got = [r.output for r in requests]
    assert m["miscounted_pages"] == 0 and eng.cache_copies() == 0
    if name == "paged-8bit":
        agree = np.mean([a == b for a, b in zip(got, want)])
        print(f"8-bit cache with windows: {agree:.0%} of requests identical to recomputation")
        assert agree >= 0.5
    else:
        assert got == want


def test_unrolled_layers_equal_the_scan():
    """Unrolled, the fixed slots are a buffer per layer (attention reads each as it is)."""
    outputs, _ = serve("fixed", unroll=True)
    assert outputs == recomputed()
    cache = engine("fixed", unroll=True).final_cache
    assert isinstance(cache.k, tuple) and len(cache.k) == CFG.num_layers
    assert engine("fixed", unroll=True).cache_copies() == 0


def test_unstacking_and_stacking_can_free_their_inputs_and_the_command_loads_one_layout():
    """The unrolled engines take a list of layers: ``load`` makes it from the drawn stacks and
    deletes them (a 70B model held twice over does not fit two H200s)."""
    stacked = M.init_stacked_params(CFG, 1, "float32")
    want = jax.tree.map(np.asarray, stacked)
    layers = M.unstack_layers(stacked, consume=True)["layers"]
    assert all(w.is_deleted() for w in stacked["layers"].values())
    for i, layer in enumerate(layers):
        for k, w in layer.items():
            np.testing.assert_array_equal(w, want["layers"][k][i])
    # and back (a checkpoint loads as a list of layers): the layers go as their stacks are made
    stacks = M.stack_layers(dict(stacked, layers=layers), consume=True)["layers"]
    assert all(w.is_deleted() for layer in layers for w in layer.values())
    for k, w in stacks.items():
        np.testing.assert_array_equal(w, want["layers"][k])
    for how, kind in (("unroll", list), ("scan", dict)):
        args = serve_cli.parse_args(["--preset", "tiny", "--layers", how])
        args.sharding, args.dtype = None, "float32"
        assert isinstance(serve_cli.load(args)[1]["layers"], kind)


def test_multi_step_loop_equals_one_step_per_dispatch():
    many, m_many = serve("paged")
    one, m_one = serve("paged", steps=1)
    assert many == one == recomputed()
    # Several steps per iteration (in two calls: the host reads the first while the second
    # runs): fewer round trips to the host.
    assert m_many["iterations"] < m_one["iterations"]
    assert m_one["decode_calls"] == m_one["iterations"]  # one step, one call


def test_paged_pool_pressure_preempts_recomputes_and_ends_whole():
    outputs, m = serve("paged")
    assert outputs == recomputed()
    assert m["preemptions"] > 0  # the stream asks for more pages than the pool has
    cache = engine("paged").final_cache
    assert np.all(np.asarray(cache.lengths)[:-1] == 0)  # every row but the prompt row is empty
    # Only the system prompt's two pages are still held (the prompt row's).
    assert np.asarray(cache.ref_counts).tolist().count(0) == cache.num_pages - 2
    assert np.all(np.asarray(cache.ref_counts) <= 1)
    assert m["miscounted_pages"] == 0


def test_the_allocator_audit_sees_a_miscounted_page():
    """The audit serve prints after each run counts the pages whose reference count is not the
    number of table entries naming them, on both tiers."""
    _, m = serve("paged-swap")
    kind, cache = engine("paged-swap").kind, engine("paged-swap").final_cache
    assert m["miscounted_pages"] == kind.miscounted_pages(cache) == 0
    held = int(np.flatnonzero(np.asarray(cache.ref_counts))[0])
    lost = dataclasses.replace(cache, ref_counts=cache.ref_counts.at[held].set(0))
    assert kind.miscounted_pages(lost) == 1  # a held page that reserve would give again
    host = dataclasses.replace(cache.host, ref_counts=cache.host.ref_counts.at[3].set(1))
    assert kind.miscounted_pages(dataclasses.replace(cache, host=host)) == 1


def test_pool_pressure_swaps_pages_to_the_host_and_back():
    """Preempted by swap, a request resumes on its own pages brought back from the host: the
    same greedy tokens as recomputation, fewer prefill tokens, and the host tier ends empty."""
    outputs, m = serve("paged-swap")
    assert outputs == recomputed()
    assert m["preemptions"] > 0 and m["swaps_out"] > 0 and m["swaps_in"] > 0
    assert m["swap_pages_out"] >= m["swaps_out"] and m["swap_pages_in"] >= m["swaps_in"]
    _, recompute = serve("paged")
    assert m["prefill_computed"] < recompute["prefill_computed"]  # nothing prefilled twice
    assert m["prefill_computed"] == sum(len(r.prompt) for r in REQUESTS)  # each prompt once
    cache = engine("paged-swap").final_cache
    assert not bool(jnp.any(cache.on_host)) and int(cache.num_free_host_pages) == 16
    assert np.asarray(cache.ref_counts).tolist().count(0) == cache.num_pages - 2


def test_a_swapped_request_that_cannot_fit_beside_others_still_finishes():
    """Two long requests in a pool of 11 pages (one at most fits): when no row runs, the oldest
    swapped request comes back whatever the host's estimate, or is recomputed if the device
    cannot take it: the schedule never stalls (a run that did went on for ever)."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 5).astype(np.int32)
    requests = [S.ServeRequest(i, rng.integers(0, 256, 10).astype(np.int32), 25, 0.0)
                for i in range(2)]
    kind = S.make_kind("paged-swap", CFG, "float32", S.Plan("paged-swap", 4, 11, 4),
                       host_pages=11)
    eng = S.ServeEngine(CFG, PARAMS, kind, batch=4, max_seq_len=40, system_prompt=system,
                        prefill_rows=2, prefill_chunk=4, decode_steps=4, mixed_steps=2)
    reqs = S.fresh(requests)
    m = eng.run(reqs, duration=120)  # a stalled schedule ends here, unfinished
    assert [r.phase for r in reqs] == ["done", "done"]
    assert [r.output for r in reqs] == serve_cli.recompute(CFG, PARAMS, system, requests, 2, 40,
                                                           None)
    assert m["swaps_out"] > 0 and m["iterations"] < 100


def test_warm_up_holds_one_cache_at_a_time(monkeypatch):
    """A host-tier engine lowers its functions from a real cache; that cache is freed before the
    warm-up makes its own (two at once put the 8B server out of memory on an 80 GB card)."""
    kind = S.make_kind("paged-swap", CFG, "float32", PLANS["paged-swap"], host_pages=16)
    eng = S.ServeEngine(CFG, PARAMS, kind, batch=4, max_seq_len=40, system_prompt=SYSTEM,
                        prefill_rows=2, prefill_chunk=4, decode_steps=4, mixed_steps=2)
    def live():
        return sum(x.nbytes for x in jax.live_arrays())

    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(kind.create(4, 40)))
    before, at_start = live(), []
    start = S.ServeEngine._start

    def measured_start(self, fns):  # the warm-up's first step: it makes the scratch cache
        at_start.append(live() - before)
        return start(self, fns)

    monkeypatch.setattr(S.ServeEngine, "_start", measured_start)
    eng.compile()
    assert len(at_start) == 1 and at_start[0] < cache_bytes // 4, (at_start, cache_bytes)


def test_end_token_stops_requests_on_the_device():
    longest = max(recomputed(), key=len)
    eos = longest[len(longest) // 2]  # a token the model does generate
    outputs, _ = serve("fixed", eos=eos)
    assert outputs == recomputed(eos)
    assert sum(map(len, outputs)) < sum(map(len, recomputed()))


def test_a_duration_stops_a_saturated_server_with_right_prefixes():
    requests = S.fresh(REQUESTS)
    m = engine("paged").run(requests, duration=1e-3)  # stops after the first iteration
    assert m["iterations"] == 1
    assert any(r.output for r in requests) and not all(r.finish_time for r in requests)
    assert all(r.output == want[:len(r.output)] for r, want in zip(requests, recomputed()))
    cache = engine("paged").final_cache
    assert np.all(np.asarray(cache.lengths)[:-1] == 0)  # the requests cut short left too


def test_poisson_arrivals_wait_for_their_time():
    stream = S.make_stream(dataclasses.replace(STREAM, rate=400.0), CFG.vocab_size)[1]
    assert all(0 < a.arrival < b.arrival for a, b in zip(stream, stream[1:]))
    requests = S.fresh(stream)
    m = engine("linear").run(requests)
    assert [r.output for r in requests] == recomputed()  # same prompts, only arrivals differ
    assert all(r.first_time >= r.arrival for r in requests)
    assert m["wall"] >= stream[-1].arrival


@pytest.mark.gpu_sized
def test_every_engine_lowers_at_the_8b_preset():
    """The GPU run's shapes (32 layers, head_dim 128, bf16, a 16 GiB budget), traced and lowered
    without weights or memory: shape errors show here, not on the device."""
    cfg = models.PRESETS["8b"]
    params = jax.eval_shape(lambda: M.init_stacked_params(cfg, 0, "bfloat16"))
    per_token = S.kv_bytes_per_token(cfg, "bfloat16")
    for name in ("paged", "linear", "fixed", "linear-xla"):
        p = S.plan(name, 16 * 2**30, per_token, 4096, 16, 256)
        e = S.ServeEngine(cfg, params, S.make_kind(name, cfg, "bfloat16", p), batch=p.batch,
                          max_seq_len=4096, system_prompt=np.ones(64, np.int32),
                          prefill_rows=(2, 4, 8), prefill_chunk=256, decode_steps=16)
        for key, args in e.example_args().items():
            e.functions[key.rstrip("0123456789")].lower(*args)
        assert p.batch == (256 if name == "paged" else 32)


@pytest.mark.long
@pytest.mark.parametrize("preset", ["gemma3-12b", "gpt-oss-20b"])
def test_the_hybrid_presets_lower_with_and_without_window_pages(preset):
    """The GPU run's hybrid shapes (Gemma 3 12B: 48 layers, head_dim 256, 40 window layers;
    gpt-oss-20b: sinks and experts), unrolled, lowered without weights or memory."""
    cfg = models.PRESETS[preset]
    params = jax.eval_shape(lambda: M.unstack_layers(M.init_stacked_params(cfg, 0, "bfloat16")))
    per_token = S.kv_bytes_per_token(cfg, "bfloat16")
    for name in ("paged", "paged-global"):
        p = S.plan(name, 8 * 2**30, per_token, 32768, 16, 64, cfg)
        kind = S.make_kind(name, cfg, "bfloat16", p, unroll=True)
        e = S.ServeEngine(cfg, params, kind, batch=p.batch, max_seq_len=32768,
                          system_prompt=np.ones(64, np.int32), prefill_rows=(1, 2),
                          prefill_chunk=2048, decode_steps=16, mixed_steps=2, unroll=True)
        for key, args in e.example_args().items():
            e.functions[key.rstrip("0123456789")].lower(*args)


def test_kernel_summary_takes_the_union_of_kernel_intervals():
    events = [("_ZN5jaxkv12append_kernelEv", 0, 10), ("loop_fusion", 5, 10),  # overlapping
              ("_ZN5jaxkv16attention_kernelEv", 30, 10), ("input_scatter_fusion", 50, 20)]
    s = metrics.kernel_summary(events, wall=100e-9)
    assert s["gpu_busy_share"] == pytest.approx(0.45)  # [0, 15) + [30, 40) + [50, 70)
    assert s["cache_share"] == pytest.approx(30 / 50)
    assert s["attention_share"] == pytest.approx(10 / 50)
    # Idle between the first and last kernel: 15 ns and 10 ns gaps (both under 20 us).
    assert s["idle"]["short_gaps_ms"] == pytest.approx(25e-6) and s["idle"]["long_gaps_ms"] == 0
    late = metrics.kernel_summary(events + [("gemm", 70 + 50_000, 10)], wall=1e-3)["idle"]
    assert late["long_gaps_ms"] == pytest.approx(0.05)
    assert late["longest"] == [("after input_scatter_fusion / before gemm", pytest.approx(0.05))]


def test_kernel_families_split_the_models_time_into_gemms_collectives_and_the_rest():
    events = [("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", 0, 40), ("gemm_fusion_dot_231", 40, 20),
              ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 60, 10), ("loop_multiply_fusion", 70, 5),
              ("_ZN5jaxkv16attention_kernelEv", 75, 20), ("input_scatter_fusion", 95, 5)]
    got = metrics.kernel_summary(events, wall=100e-9)["families"]
    assert got == pytest.approx(dict(gemm=0.6, collective=0.1, elementwise=0.05, attention=0.2,
                                     cache=0.05))
    # NCCL's gathers and scatters are collectives, not cache ops (they were, by their names)
    events = [("ncclDevKernel_AllGather_RING_LL", 0, 10),
              ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 10, 30), ("gemm", 40, 60)]
    s = metrics.kernel_summary(events, wall=100e-9)
    assert s["families"] == pytest.approx(dict(collective=0.4, gemm=0.6))
    assert s["cache_share"] == 0


def test_a_mesh_reports_every_devices_busy_share_and_the_least_busy_ones_summary():
    busy = [("gemm", 0, 80)]  # 80% of 100 ns
    idle = [("gemm", 0, 30), ("_ZN5jaxkv16attention_kernelEv", 50, 10)]  # 40%
    s = metrics.per_device({"/device:GPU:0": busy, "/device:GPU:1": idle}, wall=100e-9)
    assert s["gpu_busy_per_device"] == [pytest.approx(0.8), pytest.approx(0.4)]
    assert s["gpu_busy_share"] == pytest.approx(0.4) and s["attention_share"] == pytest.approx(0.25)
    assert metrics.per_device({"/device:GPU:0": []}, wall=1.0) is None


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is None:  # from . import x
            names |= {"." * node.level + a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + node.module)
    return names


def test_fixed_slot_engine_contains_no_jaxkv():
    """serving/fixed_slot.py and the model code it imports (jaxkv.models) reach only jax and
    numpy: no module of jaxkv's caches or ops."""
    package = pathlib.Path(S.__file__).parent.parent  # jaxkv/
    seen, todo = set(), ["serving/fixed_slot"]
    while todo:
        name = todo.pop()
        seen.add(name)
        here = name.rsplit("/", 1)[0]
        for imp in _imports(package / f"{name}.py"):
            if imp.startswith(".."):  # another subpackage of jaxkv: the models only
                target = imp[2:].replace(".", "/")
                assert target.startswith("models/"), f"{name}.py imports {imp}: jaxkv code"
            elif imp.startswith("."):
                target = f"{here}/{imp[1:]}"
            else:
                assert imp.split(".")[0] in {"__future__", "dataclasses", "typing", "jax",
                                             "numpy", "math"}, f"{name}.py imports {imp}"
                continue
            todo += [] if target in seen else [target]
    assert "serving/fixed_slot" in seen and any(n.startswith("models/") for n in seen)


def test_serve_command_reports_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(models.PRESETS, "tiny", CFG)
    path = tmp_path / "serve.json"
    rc = entry.main(["serve", "--engines", "paged,fixed", "--requests", "6", "--max-seq-len",
                     "40", "--system-len", "5", "--mean-prompt", "6", "--mean-output", "6",
                     "--kv-gib", str(2 * 40 * PER_TOKEN / 2**30), "--page-size", "4",
                     "--prefill-chunk", "4", "--decode-steps", "4", "--dtype", "float32",
                     "--json", str(path)])  # in bfloat16 (the GPU default) tokens may differ
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "output tokens/s" in out and "TTFT p50 / p99" in out
    assert "GPU busy / wall (profiled; each device)" in out
    if jax.default_backend() != "gpu":  # no device trace: the profiled rows say so
        assert "n/a" in out
    assert "first 6 requests: paged 6/6 identical, fixed 6/6 identical" in out
    doc = json.loads(path.read_text())
    assert set(doc["engines"]) == {"paged", "fixed"}
    assert doc["engines"]["paged"]["peak_concurrent"] > doc["engines"]["fixed"]["peak_concurrent"]


@pytest.mark.long
def test_serve_preempt_swap_reports_swaps_and_agrees(tmp_path, capsys, monkeypatch):
    """--preempt swap: the paged engine swaps (and paged-swap always does) under pool pressure;
    the table reports the swaps and bytes moved; the tokens agree with recomputation."""
    monkeypatch.setitem(models.PRESETS, "tiny", CFG)
    path = tmp_path / "serve.json"
    # float32 at full matmul precision: greedy tokens equal recomputation on a GPU too
    with jax.default_matmul_precision("highest"):
        rc = entry.main(["serve", "--engines", "fixed,paged", "--preempt", "swap", "--requests",
                         "12", "--max-seq-len", "40", "--system-len", "5", "--mean-prompt",
                         "10", "--mean-output", "10", "--kv-gib", str(56 * PER_TOKEN / 2**30),
                         "--max-batch", "4", "--page-size", "4", "--prefill-chunk", "4",
                         "--decode-steps", "4", "--dtype", "float32", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "to the host tier: swaps out / in, pages spilled; bytes" in out
    assert "first 12 requests: fixed 12/12 identical, paged 12/12 identical" in out
    paged = json.loads(path.read_text())["engines"]["paged"]
    assert paged["preemptions"] > 0 and paged["swaps_out"] > 0 and paged["swap_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--preempt", "drop"], "invalid choice: 'drop'"),
    (["--engines", "paged,vllm"], "unknown engine 'vllm'"),
    (["--kv-gib", "0"], "--kv-gib must be positive"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--max-seq-len", "8", "--system-len", "8"], "leaves no room"),
    (["--sweep", "4,x"], "--sweep: expected GiB"),
    (["--rate", "-1"], "--rate must be positive"),
    (["--duration", "-1"], "--duration must be at least 0"),
    (["--tenants", "0"], "--tenants must be at least 1"),
])
def test_serve_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "python -m jaxkv serve: error:" in err and message in err


def test_serve_is_a_listed_command(capsys):
    with pytest.raises(SystemExit):
        entry.main(["--help"])
    assert "serve" in capsys.readouterr().out


@pytest.mark.long
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_an_8bit_cache_holds_more_sequences_in_the_same_budget(tmp_path, capsys, monkeypatch,
                                                                kv_dtype):
    """``--engines paged,paged-8bit``: the 8-bit engine plans about twice the pages of bf16 (4x
    float32) in the same KV budget, serves every request, and reports its greedy agreement
    (float32 runs require it of every other engine, not of the 8-bit one)."""
    monkeypatch.setitem(models.PRESETS, "tiny", CFG)
    eight = S.kv_bytes_per_token(CFG, S.KV_DTYPES[kv_dtype], scaled=True)
    assert S.kv_bytes_per_token(CFG, "bfloat16") / eight >= 1.5  # head_dim 16: scales weigh
    assert S.kv_bytes_per_token(models.PRESETS["8b"], "bfloat16") / S.kv_bytes_per_token(
        models.PRESETS["8b"], S.KV_DTYPES[kv_dtype], scaled=True) >= 1.9
    path = tmp_path / "serve.json"
    rc = entry.main(["serve", "--engines", "paged,paged-8bit", "--kv-dtype", kv_dtype,
                     "--requests", "6", "--max-seq-len", "40", "--system-len", "5",
                     "--mean-prompt", "6", "--mean-output", "6", "--kv-gib",
                     str(2 * 40 * PER_TOKEN / 2**30), "--page-size", "4", "--prefill-chunk", "4",
                     "--decode-steps", "4", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    paged, eight_bit = doc["engines"]["paged"], doc["engines"]["paged-8bit"]
    # The pages follow the bytes per token (float32 on CPU, bfloat16 on GPU -> 1 byte, plus 4
    # bytes of scales per head of 16).
    ratio = S.kv_bytes_per_token(CFG, doc["dtype"]) / eight
    assert eight_bit["num_pages"] >= 0.95 * ratio * paged["num_pages"]
    # Memory is counted in each engine's own bytes: both within the same budget.
    for run in (paged, eight_bit):
        assert run["kv_allocated_bytes"] <= 2 * 40 * PER_TOKEN, run["kv_allocated_bytes"]
    assert eight_bit["kv_allocated_bytes"] == eight_bit["num_pages"] * 4 * eight
    assert eight_bit["requests"] == paged["requests"] == 6
    assert "paged-8bit" in doc["agreement"] and "greedy tokens against paged: paged-8bit" in out


CHAT = dataclasses.replace(STREAM, kind="chat", turns=3, turn_gap=0.0, requests=9)
SHARED = dataclasses.replace(STREAM, kind="shared", prefixes=2, prefix_len=12)


def test_chat_turns_resend_the_conversation_and_shared_prompts_repeat():
    _, chat = S.make_stream(CHAT, CFG.vocab_size)
    by_time = sorted(chat, key=lambda r: r.arrival)
    assert 4 <= len(chat) <= 9 and by_time == chat  # a conversation ends at max_seq_len
    later = [r for r in chat if len(r.prompt) > 8]
    # a later turn starts with an earlier turn's whole prompt
    assert any(np.array_equal(b.prompt[:len(a.prompt)], a.prompt) for a in chat for b in later
               if len(b.prompt) > len(a.prompt))
    _, shared = S.make_stream(SHARED, CFG.vocab_size)
    heads = {tuple(r.prompt[:12]) for r in shared}
    assert len(heads) == 2
    best = S.oracle_reuse(SYSTEM, shared, 4)
    assert sum(best.values()) > 0 and all(b % 4 == 0 for b in best.values())


def prefix_engine(system, num_pages):
    """A prefix-caching engine of 4 rows over pages of 4 tokens, in float32."""
    plan = S.Plan("paged-prefix", batch=4, num_pages=num_pages, page_size=4)
    kind = S.make_kind("paged-prefix", CFG, "float32", plan)
    return S.ServeEngine(CFG, PARAMS, kind, batch=4, max_seq_len=40, system_prompt=system,
                         prefill_rows=2, prefill_chunk=4, decode_steps=4, mixed_steps=2)


@pytest.mark.parametrize("stream", [CHAT, SHARED], ids=["chat", "shared"])
def test_prefix_caching_reuses_pages_and_generates_what_recomputation_does(stream):
    system, requests = S.make_stream(stream, CFG.vocab_size)
    eng = prefix_engine(system, num_pages=24)
    reqs = S.fresh(requests)
    m = eng.run(reqs)
    want = serve_cli.recompute(CFG, PARAMS, system, requests, len(requests), 40, None)
    assert [r.output for r in reqs] == want
    assert m["prefill_matched"] > 0
    # every requested token is computed or found (more once a preempted request comes back)
    done = m["prefill_computed"] + m["prefill_matched"]
    assert done == m["prefill_requested"] if not m["preemptions"] else done >= m[
        "prefill_requested"]
    assert eng.cache_copies() == 0


@pytest.mark.long
@pytest.mark.parametrize("stream", [CHAT, SHARED], ids=["chat", "shared"])
def test_a_burst_waits_for_its_prefix_and_reuses_what_the_oracle_does(stream, monkeypatch):
    """Every request queued at once (chat: all turns of a conversation together): a request
    whose prefix another row is still prefilling waits for it instead of computing it again, so
    reuse equals the oracle's best (a pool large enough to evict nothing); admitted in arrival
    order regardless, the burst reuses less. Tokens equal recomputation either way."""
    system, requests = S.make_stream(stream, CFG.vocab_size)
    best = S.oracle_reuse(system, requests, 4)
    want = serve_cli.recompute(CFG, PARAMS, system, requests, len(requests), 40, None)
    reuse, on = {}, schedule._DEFER_SCAN
    for scan in (on, 0):  # 0: no request is looked past (first come first served)
        monkeypatch.setattr(schedule, "_DEFER_SCAN", scan)
        reqs = S.fresh(requests)
        m = prefix_engine(system, num_pages=128).run(reqs)
        assert [r.output for r in reqs] == want
        assert m["preemptions"] == 0
        reuse[scan] = sum(r.matched for r in reqs)
        assert (m["deferred"] > 0) == (scan > 0)
    assert reuse[on] == sum(best[r.id] for r in requests)
    assert reuse[0] < reuse[on]


@pytest.mark.long
def test_prefix_cache_spills_to_the_host_and_finds_pages_there():
    """A prefix-caching engine with a host tier spills cached pages ahead of eviction and finds
    them on the host later: the same tokens as recomputation, more reuse than without a host
    tier at the same device budget."""
    system, requests = S.make_stream(SHARED, CFG.vocab_size)
    want = serve_cli.recompute(CFG, PARAMS, system, requests, len(requests), 40, None)
    reuse = {}
    for host in (0, 32):  # 13 pages: one sequence of max_seq_len, and the pool runs short
        plan = S.Plan("paged-prefix", batch=4, num_pages=13, page_size=4)
        kind = S.make_kind("paged-prefix", CFG, "float32", plan, host_pages=host)
        eng = S.ServeEngine(CFG, PARAMS, kind, batch=4, max_seq_len=40, system_prompt=system,
                            prefill_rows=2, prefill_chunk=4, decode_steps=4, mixed_steps=2)
        reqs = S.fresh(requests)
        m = eng.run(reqs)
        assert [r.output for r in reqs] == want
        reuse[host] = m["prefill_matched"]
        assert (m["spilled_pages"] > 0) == bool(host)
        assert eng.cache_copies() == 0
    assert reuse[32] > reuse[0]


@pytest.mark.long
def test_serve_prefix_cache_flag_reports_reuse(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(models.PRESETS, "tiny", CFG)
    path = tmp_path / "serve.json"
    rc = entry.main(["serve", "--engines", "paged", "--prefix-cache", "--stream", "shared",
                     "--prefixes", "2", "--prefix-len", "12", "--requests", "8",
                     "--max-seq-len", "40", "--system-len", "5", "--mean-prompt", "5",
                     "--mean-output", "5", "--kv-gib", str(4 * 40 * PER_TOKEN / 2**30),
                     "--page-size", "4", "--prefill-chunk", "4", "--decode-steps", "4",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    on, off = doc["engines"]["paged-prefix"], doc["engines"]["paged"]
    assert on["prefill_computed"] < off["prefill_computed"]
    assert on["prefill_requested"] == off["prefill_requested"]
    assert off["prefill_matched"] == 0 and on["reuse_of_oracle"] > 0.5
    assert "prefix tokens reused / oracle's best" in out


def test_tenants_own_whole_conversations_and_the_oracle_counts_within_a_tenant():
    """--tenants N: the same requests, each conversation's turns all of one tenant (chat) or
    request i of tenant i % N; the oracle's best counts pages of a tenant's own earlier requests
    only (the system prompt is cached once per tenant)."""
    _, one = S.make_stream(CHAT, CFG.vocab_size)
    system, chat = S.make_stream(dataclasses.replace(CHAT, tenants=2), CFG.vocab_size)
    assert [r.prompt.tolist() for r in chat] == [r.prompt.tolist() for r in one]
    assert {r.tenant for r in one} == {0} and {r.tenant for r in chat} == {0, 1}
    for a in chat:  # a later turn (it starts with an earlier turn's prompt): the same tenant
        for b in chat:
            if len(b.prompt) > len(a.prompt) and np.array_equal(b.prompt[:len(a.prompt)],
                                                                a.prompt):
                assert a.tenant == b.tenant
    assert [r.tenant for r in S.fresh(chat)] == [r.tenant for r in chat]
    _, shared = S.make_stream(dataclasses.replace(SHARED, tenants=3), CFG.vocab_size)
    assert [r.tenant for r in shared] == [r.id % 3 for r in shared]
    best = S.oracle_reuse(system, chat, 4)
    assert sum(best.values()) < sum(S.oracle_reuse(system, one, 4).values())
    # the first request of each tenant finds nothing, not even the system prompt's page
    for t in (0, 1):
        assert best[min(r.id for r in chat if r.tenant == t)] == 0


@functools.cache
def _tenant_engine():
    return prefix_engine(SYSTEM, num_pages=24)  # compiled once for both tests


@pytest.mark.parametrize("tenants", [True, False], ids=["two tenants", "one tenant"])
def test_another_tenant_sending_the_same_prompt_computes_every_token(tenants):
    """The side channel, closed at the server: tenant A's request is served and its pages
    cached; then tenant B sends the same tokens: B matches 0 tokens and its prefill computes
    every one (the system prompt's too: each tenant caches its own), so its time to first token
    tells it nothing of A's prompt. With one tenant B finds every full page. Tokens equal
    recomputation either way, and the end-of-run audit finds no page across tenants."""
    prompt = np.arange(1, 21, dtype=np.int32)
    reqs = [S.ServeRequest(0, prompt, 4, 0.0, tenant=0),
            S.ServeRequest(1, prompt.copy(), 4, 1.0, tenant=1 if tenants else 0)]
    eng = _tenant_engine()
    m = eng.run(reqs)
    a, b = reqs
    assert a.first_time < b.arrival  # A's prompt was prefilled and indexed before B arrived
    want = serve_cli.recompute(CFG, PARAMS, SYSTEM, reqs, 2, 40, None)
    assert [r.output for r in reqs] == want
    total = len(SYSTEM) + len(prompt)  # 25: 6 full pages of 4, then 1 token
    assert a.matched == 0 and a.computed == total
    if tenants:
        assert b.matched == 0 and b.computed == total
    else:
        assert b.matched == 24 and b.computed == 1
    assert m["cross_tenant_pages"] == 0
    # the audit is of the index itself: a cached page moved to another tenant under its
    # parent is counted, with the page below it
    kind, cache = eng.kind, eng.final_cache
    ix = cache.prefix_cache
    assert kind.cross_namespace_pages(cache) == 0
    chain = np.flatnonzero(np.asarray(ix.depth) == 4)
    crossed = dataclasses.replace(ix, namespace=ix.namespace.at[chain[0]].add(7))
    assert kind.cross_namespace_pages(dataclasses.replace(cache, prefix_cache=crossed)) == 2


@pytest.mark.long
def test_serve_tenants_reports_reuse_per_tenant_and_audits_the_index(tmp_path, capsys,
                                                                    monkeypatch):
    """`serve --stream chat --prefix-cache --tenants 2`: each conversation a tenant's, reuse
    reported per tenant (within each tenant's oracle best), and the audit of the index at the
    end: no page cached across tenants. The tokens equal recomputation."""
    monkeypatch.setitem(models.PRESETS, "tiny", CFG)
    path = tmp_path / "serve.json"
    rc = entry.main(["serve", "--engines", "paged-prefix", "--stream", "chat", "--tenants", "2",
                     "--turns", "3", "--turn-gap", "0", "--requests", "9", "--max-seq-len",
                     "40", "--system-len", "5", "--mean-prompt", "7", "--mean-output", "5",
                     "--kv-gib", str(4 * 40 * PER_TOKEN / 2**30), "--page-size", "4",
                     "--prefill-chunk", "4", "--decode-steps", "4", "--dtype", "float32",
                     "--json", str(path)])  # float32: the tokens must equal recomputation
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    run = doc["engines"]["paged-prefix"]
    assert run["cross_tenant_pages"] == 0
    assert [t["tenant"] for t in run["tenants"]] == [0, 1]
    assert sum(t["reused"] for t in run["tenants"]) == run["prefill_matched"] > 0
    assert sum(t["computed"] for t in run["tenants"]) == run["prefill_computed"]
    assert all(t["reused"] <= t["oracle"] for t in run["tenants"])
    assert "pages cached across tenants (index audit)" in out
    assert "paged-prefix: per tenant, prefix tokens reused / its oracle's best" in out
    n = run["requests"]
    assert f"paged-prefix {n}/{n} identical" in out and "2 tenants" in out


@pytest.mark.parametrize("preset", sorted(models.PRESETS))
def test_every_preset_the_command_offers_parses(preset):
    """`--preset` offers every model preset; each has the serving defaults it needs."""
    args = serve_cli.parse_args(["--preset", preset])
    assert args.kv_gib > 0 and args.max_seq_len > 0 and args.requests > 0


def test_a_kv_dtype_asks_for_the_8bit_engine():
    """``--kv-dtype`` alone adds the engine it configures (it was silently ignored without
    ``--engines ...,paged-8bit``); without it the default engines run, and paged-8bit named
    alone gets fp8_e4m3."""
    args = serve_cli.parse_args(["--kv-dtype", "int8"])
    assert "paged-8bit" in args.engines and args.kv_dtype == "int8"
    assert args.engines[:-1] == list(S.DEFAULT_ENGINES)
    args = serve_cli.parse_args([])
    assert "paged-8bit" not in args.engines
    args = serve_cli.parse_args(["--engines", "paged,paged-8bit"])
    assert args.engines == ["paged", "paged-8bit"] and args.kv_dtype == "fp8_e4m3"
