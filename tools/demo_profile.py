"""Where the demo's serving time goes on a GPU: one run of the demo loop under the profiler, per
cache kind and ops, with the device's kernels summed by name (CUPTI time) against the wall time.

    python3 tools/demo_profile.py [--cache linear] [demo options...]
"""

from __future__ import annotations

import collections
import glob
import sys
import tempfile

import jax
import numpy as np

from jaxkv.demo import caches, cli, loop


def device_events(trace_dir: str):
    """Seconds and count of every event on the GPU planes, by name."""
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb",
                                                        recursive=True)[0])
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                total[e.name] += e.duration_ns * 1e-9
                count[e.name] += 1
    return total, count


def main(argv) -> int:
    args = cli.parse_args(argv)
    cfg, params, _ = cli.load_model(args)
    rng = np.random.default_rng(args.seed + 1)
    system_prompt = rng.integers(0, cfg.vocab_size, args.system_len, dtype=np.int32)
    prompt_range = (max(1, args.max_prompt_len // 4), args.max_prompt_len)
    answer_range = (max(1, args.max_new_tokens // 8), args.max_new_tokens)
    for ops in ("jaxkv", "xla"):
        options = dict(page_size=args.page_size) if args.cache == "paged" else {}
        kind = caches.make_kind(args.cache, cfg, dtype=args.dtype, ops=ops, **options)
        engine = loop.Engine(cfg, params, kind, max_batch=args.max_batch,
                             system_prompt=system_prompt, max_prompt_len=args.max_prompt_len,
                             max_new_tokens=args.max_new_tokens)
        make = lambda: loop.make_requests(args.requests, cfg.vocab_size, args.seed + 2,
                                          prompt_range, answer_range)
        engine.run(make())  # warm-up: compiles
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                stats = engine.run(make())
            total, count = device_events(d)
        phases = ", ".join(f"{p} {stats.times[p] * 1e3:.1f} ms" for p in loop.PHASES[1:])
        print(f"== {args.cache} / {ops}: serving {stats.serving_time * 1e3:.1f} ms ({phases}); "
              f"device busy {sum(total.values()) * 1e3:.1f} ms in {sum(count.values())} events")
        for name, s in total.most_common(8):
            print(f"  {s * 1e3:8.2f} ms  {count[name]:6d}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
