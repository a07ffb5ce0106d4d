"""Command line of ``python -m jaxkv serve``: engines side by side on one stream
(docs/serving.md)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from ..serving import metrics
from ..models import decoder as M
from ..models.registry import PRESETS
from ..serving import serve as S
from .cli import cache_sharding, parse_mesh

# Per preset: the stream (max_seq_len 8x its mean total length), the KV budget, the prefill chunk
# (rows: the row counts compiled; tokens per row) and decode steps per call (while prompts wait
# for prefill: mixed_steps).
# The big presets measure a saturated server over a fixed window (--duration): with a long tail,
# serving a stream to its end is timed by its longest output, decoded alone at the end.
_BIG = dict(requests=8192, duration=15.0, max_seq_len=4096, system_len=64, mean_prompt=256,
            mean_output=192, prefill_rows="2,4,8", prefill_chunk=256, decode_steps=16,
            mixed_steps=2, layers="unroll", prefix_len=2048)
# Layers: a scan over stacked weights makes XLA copy each layer's weights out of the stack for
# cuBLAS (23% of the kernel time at 8B on the H200, docs/serving.md); the big presets unroll.
DEFAULTS = {
    "tiny": dict(kv_gib=1 / 1024, requests=48, duration=None, max_seq_len=256, system_len=8,
                 prefix_len=48, mean_prompt=12, mean_output=12, prefill_rows="2", prefill_chunk=16,
                 decode_steps=8, mixed_steps=2, layers="scan"),
    "1b": dict(kv_gib=8, **_BIG),
    "8b": dict(kv_gib=16, **_BIG),
    "70b": dict(kv_gib=16, **_BIG),  # its 140 GB of weights need --mesh tp=N
    # Models with sliding windows on a long-context stream (prompts of 8k tokens on average, at
    # most 32k): the paged engine releasing window pages against the same engine keeping every
    # layer's tokens, at one KV budget.
    "gemma3-12b": dict(_BIG, kv_gib=64, requests=2048, duration=60.0, max_seq_len=32768,
                       mean_prompt=8192, mean_output=1024, prefill_rows="1,2",
                       prefill_chunk=2048, engines="paged,paged-global"),
    "gpt-oss-20b": dict(_BIG, kv_gib=32, requests=2048, duration=30.0, max_seq_len=32768,
                        mean_prompt=8192, mean_output=1024, prefill_rows="1,2",
                        prefill_chunk=2048, engines="paged,paged-global"),
}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxkv serve",
        description="Serve one synthetic request stream with several engines (jaxkv paged, jaxkv "
                    "linear, fixed slots in pure JAX, jaxkv's loop with XLA cache ops) at the "
                    "same KV memory budget, and report throughput, latency and memory.",
        epilog="Engines: " + "; ".join(f"{k}: {v}" for k, v in S.ENGINES.items()) +
               ". Unset sizes take the preset's defaults (docs/serving.md).")
    add = p.add_argument
    add("--preset", default="tiny", choices=sorted(PRESETS), help="model shapes (tiny)")
    add("--model", metavar="PATH", help="a local Hugging Face checkpoint instead (Llama, "
        "Mistral, Gemma 2, Gemma 3, gpt-oss)")
    add("--dtype", choices=["float32", "bfloat16"],
        help="weights and cache (float32 on CPU, bfloat16 on GPU)")
    add("--engines",
        help=f"comma-separated, from {', '.join(S.ENGINES)} ({','.join(S.DEFAULT_ENGINES)}; "
             "paged,paged-global for a model with sliding windows)")
    add("--kv-gib", type=float, help="KV memory budget of every engine, GiB (default: the "
        "preset's, for each dp batch shard)")
    add("--kv-dtype", choices=sorted(S.KV_DTYPES), default=None,
        help="serve the paged-8bit engine too, its cache in this dtype (8 bits with "
             "per-token-head scales); an --engines list naming paged-8bit alone means fp8_e4m3")
    add("--mesh", metavar="AXES",
        help="serve on several devices: tp=N[,dp=M]: the weights split Megatron-style and the "
             "caches' KV heads over tp (one all-reduce per block), the batch over dp")
    add("--requests", type=int, help="requests in the stream")
    add("--max-seq-len", type=int, help="longest sequence (system prompt + prompt + output)")
    add("--system-len", type=int, help="tokens of the system prompt every request shares")
    add("--mean-prompt", type=float, help="mean prompt length (lognormal)")
    add("--mean-output", type=float, help="mean output length (lognormal)")
    add("--sigma", type=float, default=1.0, help="sigma of log(length) (1.0)")
    add("--rate", type=float, help="Poisson arrivals, requests/s (default: all queued at start; "
        "chat: conversations/s)")
    add("--stream", choices=S.STREAMS, default="lognormal",
        help="lognormal: independent prompts (default); chat: conversations whose every turn "
             "resends the conversation so far; shared: a few long prompts, many requests each")
    add("--turns", type=int, default=4, help="chat: turns per conversation (4)")
    add("--turn-gap", type=float, default=1.0, help="chat: seconds between turns (1.0)")
    add("--prefixes", type=int, default=8, help="shared: the long prompts (8)")
    add("--prefix-len", type=int, help="shared: tokens of each long prompt (2048 on 1b and 8b)")
    add("--preempt", choices=S.PREEMPT, default="swap",
        help="what the paged engines do with a preempted request: swap its pages to host "
             "memory and back (default: measured faster, 1.07x recomputation's output tokens/s "
             "on an H100 and 1.05x on an H200, 8B, 4k-token prompts; docs/host-tier.md) or "
             "recompute its prompt (no pinned host memory); engine paged-swap always swaps")
    add("--host-kv-gib", type=float,
        help="the host tier of a swapping engine, GiB (default: the KV budget); given, the "
             "prefix-caching engine gets one too and spills cached pages to it")
    add("--prefix-cache", action="store_true",
        help="also run the paged engine with automatic prefix caching (paged-prefix)")
    add("--tenants", type=int, default=1,
        help="tenants sharing the server (1): each request belongs to one (chat: each "
             "conversation), and the prefix cache shares cached pages only within a tenant "
             "(its namespace), so no request learns from its time to first token what another "
             "tenant sent; the report gives reuse per tenant and an audit of the index")
    add("--duration", type=float,
        help="serve for this many seconds, then stop (a saturated server: give more requests "
             "than it can serve); 0: serve them all (default on tiny; 15 s on 1b and 8b)")
    add("--seed", type=int, default=0, help="seed of the weights and the stream (0)")
    add("--page-size", type=int, default=16, help="tokens per page (16)")
    add("--max-batch", type=int,
        help="rows the paged engines decode together (default: budget / mean length, <= 256)")
    add("--prefill-rows", metavar="N[,N...]",
        help="rows of one prefill chunk: the sizes compiled (the smallest that fits is used)")
    add("--prefill-chunk", type=int, help="prompt tokens per row per prefill chunk")
    add("--decode-steps", type=int, help="decode steps per dispatch")
    add("--mixed-steps", type=int, help="decode steps per dispatch while prompts are prefilled")
    add("--layers", choices=["scan", "unroll"],
        help="the decoder's layers in a lax.scan (one layer compiled) or unrolled (scan on "
             "tiny, unroll on 1b and 8b)")
    add("--eos", type=int, help="end token: a request stops when it generates it")
    add("--check", type=int,
        help="requests checked against recomputation without a cache (all on tiny, else 0)")
    add("--profile", action=argparse.BooleanOptionalAction,
        help="profile a window of each run for GPU busy time and cache-op share (on GPU)")
    add("--sweep", metavar="GIB,...",
        help="also serve with these KV budgets, paged and fixed engines (the plot's points)")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--plot", metavar="PATH", help="write tokens/s against KV budget (matplotlib)")
    args = p.parse_args(argv)
    kv_given = args.kv_gib is not None
    for name, value in DEFAULTS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.engines is None:
        args.engines = ",".join(S.DEFAULT_ENGINES)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.mesh:
        try:
            args.mesh = parse_mesh(args.mesh)
        except ValueError as e:
            p.error(f"--mesh: {e}")
        if set(args.mesh) - {"tp", "dp"}:
            p.error(f"--mesh: axes are tp and dp, got {', '.join(args.mesh)}")
        if not kv_given:  # a batch shard serves its rows from its own pool, a replica's share
            args.kv_gib *= args.mesh.get("dp", 1)
        cfg, model = PRESETS[args.preset], f"preset {args.preset}"
        if args.model and (pathlib.Path(args.model) / "config.json").is_file():
            from ..models import hf_loader  # the checkpoint's heads, before its weights load

            try:
                cfg = hf_loader.read_config(args.model)
            except (ValueError, KeyError) as e:
                p.error(f"--model {args.model}: {e}")
            model = f"checkpoint {args.model}"
        tp = args.mesh.get("tp", 1)
        if cfg.num_kv_heads % tp or cfg.num_heads % tp:
            p.error(f"--mesh: tp={tp} does not divide the {cfg.num_heads} / {cfg.num_kv_heads} "
                    f"heads of {model}")
    if args.prefix_cache and "paged-prefix" not in args.engines:
        args.engines.append("paged-prefix")
    if args.kv_dtype is not None and "paged-8bit" not in args.engines:
        args.engines.append("paged-8bit")  # asking for a dtype asks for its engine
    args.kv_dtype = args.kv_dtype or "fp8_e4m3"
    for e in args.engines:
        if e not in S.ENGINES:
            p.error(f"--engines: unknown engine {e!r}; choose from {', '.join(S.ENGINES)}")
    if not args.engines:
        p.error("--engines: none given")
    try:
        args.prefill_rows = [int(x) for x in str(args.prefill_rows).split(",")]
    except ValueError:
        p.error(f"--prefill-rows: expected N[,N...], got {args.prefill_rows!r}")
    if min(args.prefill_rows) < 1:
        p.error(f"--prefill-rows must be at least 1, got {min(args.prefill_rows)}")
    for name in ("requests", "max_seq_len", "system_len", "page_size", "prefill_chunk",
                 "decode_steps", "mixed_steps", "tenants"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("kv_gib", "mean_prompt", "mean_output", "sigma"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.rate is not None and not args.rate > 0:
        p.error(f"--rate must be positive, got {args.rate}")
    if args.duration is not None and not args.duration >= 0:
        p.error(f"--duration must be at least 0 (0: serve every request), got {args.duration}")
    args.duration = args.duration or None
    if args.max_batch is not None and args.max_batch < 1:
        p.error(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.system_len + 2 > args.max_seq_len:
        p.error(f"--max-seq-len {args.max_seq_len} leaves no room after the {args.system_len}-"
                "token system prompt")
    if args.check is not None and args.check < 0:
        p.error(f"--check must be at least 0, got {args.check}")
    try:
        args.sweep = [float(x) for x in args.sweep.split(",")] if args.sweep else []
    except ValueError:
        p.error(f"--sweep: expected GiB,GiB,..., got {args.sweep!r}")
    if any(not x > 0 for x in args.sweep):
        p.error("--sweep: budgets must be positive")
    if args.model is not None and not (pathlib.Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    return args


def load(args):
    """(config, params, description): the params in the engines' layout (``--layers``: stacked
    for a scan, a list of layers unrolled), so that no engine holds a second copy of them."""
    if args.model:
        from ..models import hf_loader

        mesh = args.sharding.mesh if args.sharding is not None else None
        cfg, params = hf_loader.load(args.model, dtype=args.dtype, mesh=mesh)
        source = args.model
    else:
        cfg = PRESETS[args.preset]
        mesh = args.sharding.mesh if args.sharding is not None else None
        params = M.init_stacked_params(cfg, args.seed, args.dtype, mesh)
        source = f"preset {args.preset}, random"
    if args.layers == "unroll":
        return cfg, M.unstack_layers(params, consume=True), source
    return cfg, M.stack_layers(params, consume=True), source


def ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def size(x) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def table(results: dict[str, dict], profiled: bool) -> list[str]:
    runs = list(results.values())
    def share(r, key):
        return "n/a" if r["profile"] is None else f"{r['profile'][key] * 100:.0f}%"

    def busy(r):  # every device's
        if r["profile"] is None:
            return "n/a"
        return " / ".join(f"{s * 100:.0f}%" for s in r["profile"]["gpu_busy_per_device"])

    rows = [("", *results),
            ("output tokens/s", *(f"{r['tokens_per_s']:.0f}" for r in runs)),
            ("  before the drain", *("-" if r["loaded_tokens_per_s"] is None else
                                            f"{r['loaded_tokens_per_s']:.0f} in "
                                            f"{r['loaded_s']:.2f} s" for r in runs)),
            ("  second half of the run", *("-" if r["second_half_tokens_per_s"] is None else
                                           f"{r['second_half_tokens_per_s']:.0f}"
                                           for r in runs)),
            ("requests finished", *(str(r["requests"]) for r in runs)),
            ("requests/s", *(f"{r['requests_per_s']:.2f}" for r in runs)),
            ("TTFT p50 / p99 (ms)", *(f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}"
                                      for r in runs)),
            ("TPOT p50 / p99 (ms)", *(f"{ms(r['tpot_p50_s'])} / {ms(r['tpot_p99_s'])}"
                                      for r in runs)),
            ("peak concurrent sequences", *(str(r["peak_concurrent"]) for r in runs)),
            ("peak decoding together", *(str(r["peak_decoding"]) for r in runs)),
            ("mean concurrent sequences", *(f"{r['mean_concurrent']:.1f}" for r in runs)),
            ("KV held per live sequence, mean", *("-" if r["kv_per_sequence_mean_bytes"] is None
                                                  else size(r["kv_per_sequence_mean_bytes"])
                                                  for r in runs)),
            ("KV allocated", *(size(r["kv_allocated_bytes"]) for r in runs)),
            ("KV reserved by live sequences, mean", *(size(r["kv_reserved_mean_bytes"])
                                                      for r in runs)),
            ("KV holding live tokens, mean", *(size(r["kv_live_mean_bytes"]) for r in runs)),
            ("preemptions", *(str(r["preemptions"]) for r in runs)),
            ("pages miscounted at the end (allocator audit)",
             *("-" if r["miscounted_pages"] is None else str(r["miscounted_pages"])
               for r in runs)),
            ("to the host tier: swaps out / in, pages spilled; bytes",
             *(f"{r['swaps_out']} / {r['swaps_in']}, {r['spilled_pages']}; "
               f"{size(r['swap_bytes'])}" for r in runs)),
            ("prefill tokens computed / requested",
             *(f"{r['prefill_computed']} / {r['prefill_requested']}" for r in runs)),
            ("prefix tokens reused / oracle's best",
             *(f"{sum_matched(r)} / {r['oracle_reuse']}" for r in runs)),
            ("pages cached across tenants (index audit)",
             *("-" if r.get("cross_tenant_pages") is None else str(r["cross_tenant_pages"])
               for r in runs)),
            ("dispatches (prefill+decode+evict)",
             *(f"{r['prefill_calls']}+{r['decode_calls']}+{r['evict_calls']}" for r in runs)),
            ("host time between calls (s)", *(f"{r['host_s']:.2f}" for r in runs)),
            ("wall (s)", *(f"{r['wall_s']:.2f}" for r in runs)),
            ("compile + warm-up (s)", *(f"{r['compile_s']:.1f}" for r in runs)),
            ("GPU busy / wall (profiled; each device)", *(busy(r) for r in runs)),
            ("kernel time: cache ops", *(share(r, "cache_share") for r in runs)),
            ("kernel time: jaxkv attention", *(share(r, "attention_share") for r in runs))]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))) for row in rows]


def tenant_lines(results: dict[str, dict]) -> list[str]:
    """Per engine that caches prefixes, each tenant's reuse: tokens found cached against its
    oracle's best (what its own earlier requests could give: pages are shared within a tenant
    only), and its prompt tokens computed against those requested."""
    lines = []
    for name, r in results.items():
        if r.get("cross_tenant_pages") is None or len(r["tenants"]) < 2:
            continue
        lines.append(f"{name}: per tenant, prefix tokens reused / its oracle's best; prefill "
                     "tokens computed / requested: " + "; ".join(
                         f"t{t['tenant']} {t['reused']} / {t['oracle']}; {t['computed']} / "
                         f"{t['requested']}" for t in r["tenants"]))
    return lines


def sum_matched(r) -> str:
    if r["reuse_of_oracle"] is None:
        return "0"
    return f"{r['prefill_matched']} ({r['reuse_of_oracle'] * 100:.0f}%)"


def agreement(outputs: dict[str, list], reference: str) -> dict[str, dict]:
    """Per engine against ``reference``, over the requests both started (a ``--duration`` run
    cuts requests short: their common tokens are compared): how many agree on every common token,
    and the mean share of common tokens before the first difference."""
    ref = outputs[reference]
    out = {}
    for name, outs in outputs.items():
        same, prefix = 0, []
        for a, b in zip(outs, ref):
            n = min(len(a), len(b))
            if n == 0:
                continue
            k = next((i for i, (x, y) in enumerate(zip(a[:n], b[:n])) if x != y), n)
            same += k == n
            prefix.append(k / n)
        out[name] = dict(identical=same, of=len(prefix),
                         token_agreement=float(np.mean(prefix)) if prefix else 1.0)
    return out


def recompute(cfg, params, system, requests, n: int, max_seq_len: int, eos):
    """Greedy tokens of the first ``n`` requests by full recomputation (no cache)."""
    result = []
    for r in requests[:n]:
        toks = M.generate_no_cache(cfg, params, np.concatenate([system, r.prompt]),
                                   r.max_new_tokens, capacity=max_seq_len)
        if eos is not None and eos in toks:
            toks = toks[: toks.index(eos) + 1]
        result.append(toks)
    return result


def engine_bytes_per_token(name, args, cfg, per_token):
    """KV bytes of one token in engine ``name``'s cache: ``per_token`` (the model's dtype), or
    the 8-bit engine's bytes with its scales (the same budget holds about twice the tokens)."""
    if "8bit" in name.split("-"):
        return S.kv_bytes_per_token(cfg, S.KV_DTYPES[args.kv_dtype], scaled=True)
    return per_token


def run_engine(name, args, cfg, params, system, requests, kv_gib, per_token, mean_total):
    engine, p = make_engine(name, args, cfg, params, system, kv_gib, per_token, mean_total)
    per_token = engine_bytes_per_token(name, args, cfg, per_token)  # the memory rows' bytes
    reqs = S.fresh(requests)
    oracle = S.oracle_reuse(system, requests, args.page_size)
    window = ((args.duration or 0) / 2, 4) if args.profile else None  # mid-run, 4 iterations
    m = engine.run(reqs, eos=args.eos, duration=args.duration, profile=window)
    # a page of a cache with windows holds one layer group's layers: a token of it, a share
    unit = per_token * getattr(engine.kind, "page_layers", cfg.num_layers) / cfg.num_layers
    allocated = (p.num_pages * args.page_size * unit if p.num_pages
                 else p.batch * args.max_seq_len * per_token)
    summary = metrics.summarize(reqs, m, per_token, int(allocated), oracle, unit)
    summary.update(engine=name, kv_gib=kv_gib, batch=p.batch, num_pages=p.num_pages)
    return summary, [r.output for r in reqs]


def make_engine(name, args, cfg, params, system, kv_gib, per_token, mean_total):
    """Engine ``name`` with ``kv_gib`` of KV, and its plan (rows, pages)."""
    per_token = engine_bytes_per_token(name, args, cfg, per_token)
    kv = int(kv_gib * 2**30)
    # the rows decoded together: as many as the budget holds at the mean length (a cache with
    # windows: a decoding sequence holds every global layer's tokens and each window's last ones)
    per_seq = S.sequence_bytes(name, cfg, per_token, int(mean_total), args.page_size, 1)
    batch = args.max_batch or max(1, min(256, int(kv // per_seq)))
    p = S.plan(name, kv, per_token, args.max_seq_len, args.page_size, batch, cfg)
    dp = args.sharding.batch_shards if args.sharding is not None and name != "fixed" else 1
    if dp > 1:  # rows and pages split over dp evenly
        pages = None if p.num_pages is None else p.num_pages // dp * dp
        p = S.Plan(p.name, max(dp, p.batch // dp * dp), pages, p.page_size)
    # Each batch shard's pool must hold a whole sequence: a row never leaves its shard, and one
    # that no shard can finish would be preempted and readmitted for ever.
    if p.batch < 1 or (p.num_pages is not None and p.num_pages // dp * args.page_size
                       < args.max_seq_len + args.system_len + args.page_size):
        where = f" in each of the {dp} batch shards' pools" if dp > 1 else ""
        raise SystemExit(f"{name}: --kv-gib {kv_gib} does not hold one sequence of "
                         f"--max-seq-len {args.max_seq_len}{where}")
    host_pages = 0
    swaps = (name == "paged-swap" or (args.preempt == "swap" and name in ("paged", "paged-8bit"))
             or (name == "paged-prefix" and args.host_kv_gib))  # the prefix cache spills
    if swaps and p.num_pages:  # the host tier: --host-kv-gib, or as many pages as the device
        host_gib = args.host_kv_gib or kv_gib
        host_pages = max(1, int(host_gib * 2**30) // (per_token * args.page_size))
        host_pages = max(dp, host_pages // dp * dp)  # an equal share per batch shard
    kind = S.make_kind(name, cfg, args.dtype, p, unroll=args.layers == "unroll",
                       kv_dtype=S.KV_DTYPES[args.kv_dtype], sharding=args.sharding,
                       host_pages=host_pages)
    engine = S.ServeEngine(cfg, params, kind, batch=p.batch, max_seq_len=args.max_seq_len,
                           system_prompt=system, prefill_rows=args.prefill_rows,
                           prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
                           mixed_steps=args.mixed_steps, unroll=args.layers == "unroll")
    return engine, p


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if args.profile is None:
        args.profile = on_gpu
    if args.check is None:
        args.check = args.requests if args.preset == "tiny" and not args.model else 0
    with jax.default_matmul_precision("highest" if args.dtype == "float32" else "default"):
        return serve(args, on_gpu)


def serve(args, on_gpu: bool) -> int:
    args.sharding = cache_sharding(args.mesh)
    cfg, params, source = load(args)
    sc = S.StreamConfig(requests=args.requests, seed=args.seed + 1, system_len=args.system_len,
                        mean_prompt=args.mean_prompt, mean_output=args.mean_output,
                        sigma=args.sigma, max_seq_len=args.max_seq_len, rate=args.rate,
                        kind=args.stream, turns=args.turns, turn_gap=args.turn_gap,
                        prefixes=args.prefixes, prefix_len=args.prefix_len,
                        tenants=args.tenants)
    system, requests = S.make_stream(sc, cfg.vocab_size)
    per_token = S.kv_bytes_per_token(cfg, args.dtype)
    prompts = np.array([len(r.prompt) for r in requests])
    outs = np.array([r.max_new_tokens for r in requests])
    mean_total = args.system_len + prompts.mean() + outs.mean()
    where = "" if args.sharding is None else (
        f", mesh {' x '.join(f'{k}={v}' for k, v in args.mesh.items())} over "
        f"{args.sharding.mesh.size} devices")
    print(f"jaxkv serve on {jax.default_backend()} ({jax.devices()[0].device_kind}){where}")
    print(f"model: {source}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} / "
          f"{cfg.num_kv_heads} heads x {cfg.head_dim}, FFN {cfg.intermediate_size}, vocab "
          f"{cfg.vocab_size}, {args.dtype}; KV {per_token / 1024:.1f} KiB per token")
    arrivals = f"Poisson arrivals at {args.rate}/s" if args.rate else "all queued at the start"
    if args.duration:
        arrivals += f"; each engine serves for {args.duration:g} s, then stops"
    print(f"stream (seed {sc.seed}): {args.requests} requests, {arrivals}; a "
          f"{args.system_len}-token system prompt shared by all; prompt and output lengths "
          f"lognormal (sigma {args.sigma}, "
          f"means {args.mean_prompt:g} and {args.mean_output:g} before clipping): prompts "
          f"{prompts.min()}-{prompts.max()} (mean {prompts.mean():.0f}, median "
          f"{np.median(prompts):.0f}), outputs {outs.min()}-{outs.max()} (mean {outs.mean():.0f}, "
          f"median {np.median(outs):.0f}); max_seq_len {args.max_seq_len} = "
          f"{args.max_seq_len / mean_total:.1f}x the mean total length {mean_total:.0f}"
          + (f"; {args.tenants} tenants ({'conversation' if args.stream == 'chat' else 'request'}"
             f" i to tenant i % {args.tenants}), cached pages shared within a tenant only"
             if args.tenants > 1 else ""))
    print(f"KV budget {args.kv_gib:g} GiB per engine; prefill chunks of "
          f"{'/'.join(map(str, args.prefill_rows))} rows x {args.prefill_chunk} tokens; "
          f"{args.decode_steps} decode steps per dispatch ({args.mixed_steps} while prompts are "
          "prefilled)"
          + (f"; end token {args.eos}" if args.eos is not None else ""))
    results, outputs, sweep = {}, {}, []
    doc = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
               jax=jax.__version__, model=source, preset=args.preset, dtype=args.dtype,
               args={k: v for k, v in vars(args).items() if k != "sharding"},
               mean_total=mean_total, engines=results, sweep=sweep)
    for name in args.engines:
        print(f"{name:>10}: {S.ENGINES[name]} ...", flush=True)
        results[name], outputs[name] = run_engine(name, args, cfg, params, system, requests,
                                                  args.kv_gib, per_token, mean_total)
        r = results[name]
        print(f"{'':>10}  {r['tokens_per_s']:.0f} tokens/s, {r['wall_s']:.2f} s, rows "
              f"{r['batch']}" + (f", {r['num_pages']} pages" if r["num_pages"] else ""), flush=True)
        write_json(args.json, doc)  # after every run: a run cut short keeps what it measured
    print()
    print("\n".join(table(results, args.profile) + tenant_lines(results)))
    if args.profile and not on_gpu:
        print("(GPU busy and kernel shares: n/a on CPU, measured from the profiler's GPU planes)")
    for name, r in results.items():
        if r["profile"]:
            print(f"{name}: largest shares of kernel time in the profiled window: " + ", ".join(
                f"{k} {t * 100:.1f}%" for k, t in r["profile"]["top"][:6]))
            print(f"{name}: kernel time by family: " + ", ".join(
                f"{k} {t * 100:.1f}%" for k, t in sorted(r["profile"]["families"].items(),
                                                        key=lambda kv: -kv[1])))
            idle = r["profile"]["idle"]
            print(f"{name}: GPU idle in the window: {idle['short_gaps_ms']:.1f} ms in gaps under "
                  f"20 us, {idle['long_gaps_ms']:.1f} ms in longer ones: " + "; ".join(
                      f"{t:.1f} ms {where}" for where, t in idle["longest"][:4]))

    rc = 0
    ref_name = args.engines[0]
    agree = agreement(outputs, ref_name)
    print(f"\ngreedy tokens against {ref_name}: " + ", ".join(
        f"{k} {v['identical']}/{v['of']} requests identical ({v['token_agreement'] * 100:.1f}% of "
        "tokens before a first difference)" for k, v in agree.items() if k != ref_name))
    checked = None
    if args.check:
        want = recompute(cfg, params, system, requests, args.check, args.max_seq_len, args.eos)
        checked = {k: sum(a == b for a, b in zip(outs, want)) for k, outs in outputs.items()}
        print(f"recomputation without a cache, first {len(want)} requests: " + ", ".join(
            f"{k} {v}/{len(want)} identical" for k, v in checked.items()))
        if args.dtype == "float32" and any(v != len(want) for k, v in checked.items()
                                           if "8bit" not in k):
            rc = 1
    # float32 engines must agree token for token; an 8-bit cache's agreement is reported.
    if args.dtype == "float32" and any(v["identical"] != v["of"] for k, v in agree.items()
                                       if "8bit" not in k):
        rc = 1

    miscounted = {k: r["miscounted_pages"] for k, r in results.items() if r["miscounted_pages"]}
    if miscounted:  # the tables and the reference counts disagree: the served tokens are suspect
        print("ALLOCATOR AUDIT FAILED, pages miscounted: " + ", ".join(
            f"{k} {v}" for k, v in miscounted.items()))
        rc = 1
    crossed = {k: r["cross_tenant_pages"] for k, r in results.items()
               if r.get("cross_tenant_pages")}
    if crossed:  # a cached page reachable from two tenants: the side channel is open
        print("PREFIX INDEX AUDIT FAILED, pages cached across tenants: " + ", ".join(
            f"{k} {v}" for k, v in crossed.items()))
        rc = 1
    doc.update(agreement=agree, recomputed=checked)
    write_json(args.json, doc)
    for kv_gib in args.sweep:
        for name in [e for e in ("paged", "fixed") if e in args.engines]:
            summary, _ = run_engine(name, args, cfg, params, system, requests, kv_gib, per_token,
                                    mean_total)
            sweep.append(summary)
            print(f"sweep: {name} at {kv_gib:g} GiB: {summary['tokens_per_s']:.0f} tokens/s, "
                  f"peak {summary['peak_concurrent']} sequences", flush=True)
            write_json(args.json, doc)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot([*results.values(), *sweep], args.plot, f"{source}, {args.dtype}")
    return rc


def write_json(path, doc) -> None:
    if path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=_plain))


def _plain(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(type(x).__name__)


def plot(points: list[dict], path: str, title: str) -> None:
    """Output tokens/s against the KV budget, paged and fixed engines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("paged", "jaxkv paged"), ("fixed", "fixed slots, pure JAX")):
        pts = sorted({(r["kv_gib"], r["tokens_per_s"]) for r in points
                      if r.get("engine", "") == name})
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("KV memory budget (GiB)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
