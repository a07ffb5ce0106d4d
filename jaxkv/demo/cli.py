"""Command line of ``python -m jaxkv demo``: options, progress bar, per-phase report."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

from ..serving import caches, loop
from ..models import decoder as M


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxkv demo",
        description="Serve a stream of requests with continuous batching from a jaxkv KV cache.",
    )
    add = p.add_argument
    add("--cache", default="linear", choices=sorted(caches.KINDS), help="cache kind (linear)")
    add("--baseline", choices=["xla"], help="run the loop again with plain-XLA cache ops")
    add("--model", metavar="PATH",
        help="local Hugging Face checkpoint: Llama, Mistral, Gemma 2, Gemma 3 or gpt-oss "
             "(config.json + *.safetensors)")
    add("--requests", type=int, default=64, help="requests in the stream (64)")
    add("--max-batch", type=int, default=16, help="sequences decoded together (16)")
    add("--system-len", type=int, default=32, help="tokens of the shared system prompt (32)")
    add("--max-prompt-len", type=int, default=24, help="longest user turn (24)")
    add("--max-new-tokens", type=int, default=48, help="longest answer (48)")
    add("--page-size", type=int, default=16, help="tokens per page of the paged cache (16)")
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="model and cache dtype (float32)")
    add("--seed", type=int, default=0, help="seed of the random weights and requests (0)")
    add("--show", type=int, default=3, help="requests whose tokens are printed (3)")
    add("--mesh", metavar="AXES", help="serve from a sharded cache: mesh axes and sizes, e.g. "
        "dp=2,tp=2: KV heads split over tp, the batch over dp (each of the dp batch shards "
        "serves its own --max-batch/dp rows; paged: its own share of the pages); other axes "
        "hold copies")
    args = p.parse_args(argv)
    if args.mesh:
        try:
            args.mesh = parse_mesh(args.mesh)
        except ValueError as e:
            p.error(f"--mesh: {e}")
        dp = args.mesh.get("dp", 1)
        if args.max_batch % dp:
            p.error(f"--mesh: dp={dp} does not divide --max-batch {args.max_batch}")
    for name in ("requests", "max_batch", "system_len", "max_prompt_len", "max_new_tokens",
                 "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**31:
        p.error(f"--seed must be in [0, 2**31), got {args.seed}")
    if args.show < 0:
        p.error(f"--show must be at least 0, got {args.show}")
    longest = args.system_len + args.max_prompt_len + args.max_new_tokens
    if args.cache == "paged" and args.page_size > longest:
        p.error(f"--page-size {args.page_size} is longer than the longest sequence ({longest} "
                "tokens: --system-len + --max-prompt-len + --max-new-tokens)")
    if args.model is not None and not (pathlib.Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (expected a local Hugging Face "
                "checkpoint directory)")
    return args


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}``."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"expected NAME=SIZE[,NAME=SIZE...], got {text!r}")
        axes[name.strip()] = int(size)
    return axes


def cache_sharding(axes: dict[str, int] | None):
    """The demo's ``jaxkv.CacheSharding``: KV heads over ``tp``, the batch over ``dp``.

    A batch shard is a cache of its own rows (docs/sharding.md): the scheduler (``loop.Slots``)
    admits and evicts per shard, and the paged cache keeps a system-prompt row per shard.
    """
    if not axes:
        return None
    import jaxkv

    count = int(np.prod(list(axes.values())))
    if count > jax.device_count():
        raise SystemExit(f"--mesh: {count} devices wanted, {jax.device_count()} visible")
    # Auto axes: the model's own arrays (weights, activations) are unsharded, and under Explicit
    # axes (jax 0.11's default) their products with the head-sharded cache reads fail to type.
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices()[:count],
                         axis_types=auto)
    return jaxkv.CacheSharding(mesh, heads="tp" if "tp" in axes else None,
                               batch="dp" if "dp" in axes else None)


def load_model(args):
    """(config, params, description) of the model to serve."""
    if args.model:
        from ..models import hf_loader

        cfg, params = hf_loader.load(args.model, dtype=args.dtype)
        return cfg, params, args.model
    cfg = M.ModelConfig()
    params = M.init_params(cfg, seed=args.seed, dtype=args.dtype)
    return cfg, params, f"random weights, seed {args.seed}"


class ProgressBar:
    """One line redrawn in place on a terminal; elsewhere (a log, a pipe) a line at every tenth of
    the requests and at least every ``every`` seconds, so a long run keeps talking."""

    def __init__(self, total: int, label: str, width: int = 30, every: float = 10.0):
        self.total, self.label, self.width, self.every, self.done = total, label, width, every, 0
        self.tty = sys.stdout.isatty()
        self.last_line, self.last_tenth = time.monotonic(), 0

    def __call__(self, finished, stats: loop.Stats):
        self.done += len(finished)
        tenth = 10 * self.done // self.total
        now = time.monotonic()
        due = tenth > self.last_tenth or now - self.last_line >= self.every
        if not (self.tty or due or self.done == self.total):
            return
        self.last_line, self.last_tenth = now, tenth
        filled = self.width * self.done // self.total
        rate = stats.generated / max(stats.serving_time, 1e-9)
        line = (f"{self.label:>6} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} requests, {stats.generated} tokens, {rate:.0f} tok/s")
        if self.tty:
            print("\r" + line, end="\n" if self.done == self.total else "", flush=True)
        else:
            print(line, flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(results: dict[str, loop.Stats]) -> list[str]:
    """The per-phase table, one column per run."""
    runs = list(results.values())
    rows = [("", *results)]
    for phase in loop.PHASES:
        rows.append((phase, *(f"{r.times[phase] * 1e3:.1f} ms" for r in runs)))
    rows += [
        ("serving total", *(f"{r.serving_time * 1e3:.1f} ms" for r in runs)),
        ("tokens/s (generated)", *(f"{r.generated / r.serving_time:.0f}" for r in runs)),
        ("tokens/s (decode phase)",
         *(f"{r.decode_tokens / max(r.times['decode'], 1e-9):.0f}" for r in runs)),
        ("cache copies in the steps", *(str(r.cache_copies) for r in runs)),
        ("cache in use (peak)", *(mib(r.peak_in_use) for r in runs)),
        ("cache allocated", *(mib(r.allocated) for r in runs)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))) for row in rows]


def main(argv=None) -> int:
    args = parse_args(argv)
    # float32 matmuls in float32 on GPUs too (XLA would use TF32): the jaxkv and XLA loops compile
    # to different programs whose TF32 roundings can flip a near-tied greedy choice, and the
    # baseline comparison is token for token.
    with jax.default_matmul_precision("highest"):
        try:
            return serve(args)
        except (OSError, KeyError, ValueError) as e:  # an unreadable or unexpected checkpoint
            if args.model is None:
                raise
            print(f"python -m jaxkv demo: error: --model {args.model}: {e}", file=sys.stderr)
            return 2


class Stream:
    """The request stream and the engines that serve it, as the command-line arguments set them."""

    def __init__(self, args):
        self.args = args
        self.cfg, self.params, self.source = load_model(args)
        rng = np.random.default_rng(args.seed + 1)
        self.system_prompt = rng.integers(0, self.cfg.vocab_size, args.system_len, dtype=np.int32)
        self.prompt_range = (max(1, args.max_prompt_len // 4), args.max_prompt_len)
        self.answer_range = (max(1, args.max_new_tokens // 8), args.max_new_tokens)

    def engine(self, ops: str) -> loop.Engine:
        """The serving loop with jaxkv's cache ops (``ops="jaxkv"``) or XLA's (``"xla"``)."""
        a = self.args
        options = dict(page_size=a.page_size) if a.cache == "paged" else {}
        if a.cache == "paged" and ops == "jaxkv" and self.cfg.hybrid:
            options["windows"] = self.cfg.windows  # window layers release their old pages
        options["sharding"] = cache_sharding(getattr(a, "mesh", None))
        kind = caches.make_kind(a.cache, self.cfg, dtype=a.dtype, ops=ops, **options)
        return loop.Engine(self.cfg, self.params, kind, max_batch=a.max_batch,
                           system_prompt=self.system_prompt, max_prompt_len=a.max_prompt_len,
                           max_new_tokens=a.max_new_tokens)

    def requests(self) -> list[loop.Request]:
        """A fresh copy of the stream's requests (outputs empty)."""
        return loop.make_requests(self.args.requests, self.cfg.vocab_size, self.args.seed + 2,
                                  self.prompt_range, self.answer_range)


def serve(args) -> int:
    stream = Stream(args)
    cfg = stream.cfg
    prompt_range, answer_range = stream.prompt_range, stream.answer_range
    print(f"jaxkv demo on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"model: {cfg.family}, {stream.source}: {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads x {cfg.head_dim}, "
          f"vocab {cfg.vocab_size}, {args.dtype}")
    print(f"stream: {args.requests} requests, {args.max_batch} slots; a {args.system_len}-token "
          f"system prompt computed once, reused by every request; user turns "
          f"{prompt_range[0]}-{prompt_range[1]} tokens, answers "
          f"{answer_range[0]}-{answer_range[1]} tokens")

    results, outputs = {}, {}
    for ops in ["jaxkv"] + ([args.baseline] if args.baseline else []):
        engine = stream.engine(ops)
        requests = stream.requests()
        print(f"{ops:>6}: compiling {len(engine.functions)} step functions "
              f"({', '.join(engine.functions)})...", flush=True)
        results[ops] = engine.run(requests, ProgressBar(len(requests), ops))
        results[ops].cache_copies = engine.cache_copies()
        outputs[ops] = [r.output for r in requests]

    for i, out in enumerate(outputs["jaxkv"][: args.show]):
        shown = " ".join(map(str, out[:16])) + (" ..." if len(out) > 16 else "")
        print(f"request {i}: {len(out)} tokens: {shown}")
    stats = results["jaxkv"]
    shards = engine.kind.batch_shards  # each batch shard prefills the system prompt once
    more = args.system_len * max(args.requests - shards, 0)
    print(f"\ncache: {args.cache}, max_seq_len {engine.max_seq_len}; {stats.admissions} requests "
          f"admitted in {stats.admit_steps} admit steps, {stats.decode_steps} decode steps, "
          f"{stats.evictions} requests evicted in {stats.evict_steps} evict steps; "
          f"{stats.prefilled} tokens prefilled ({more} more without the reused system prompt)")
    print("\n".join(report(results)))
    if args.baseline:
        # Measured on the H200: 13-15 s for whichever loop runs first, 2.5-3.5 s for the second.
        if jax.default_backend() == "gpu":
            print("(compile + warm-up: the first column also pays the process's one-time "
                  "start-up, such as GPU autotuning, which the second reuses)")
        differ = sum(a != b for a, b in zip(outputs[args.baseline], outputs["jaxkv"]))
        if differ:
            print(f"\n{args.baseline} baseline generated DIFFERENT tokens for {differ} of "
                  f"{len(outputs['jaxkv'])} requests")
            return 1
        print(f"\n{args.baseline} baseline generated the same tokens")
    return 0
