"""Where the demo's serving time goes on a GPU: one run of the demo loop under the profiler, per
cache kind and ops, with the device's kernels summed by name (CUPTI time) against the wall time.

    python3 tools/probes/demo_profile.py [--cache linear] [demo options...]
"""

from __future__ import annotations

import collections
import glob
import sys
import tempfile

import jax

from jaxkv.demo import cli
from jaxkv.serving import loop


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
    stream = cli.Stream(args)
    for ops in ("jaxkv", "xla"):
        engine = stream.engine(ops)
        engine.run(stream.requests())  # warm-up: compiles
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                stats = engine.run(stream.requests())
            total, count = device_events(d)
        phases = ", ".join(f"{p} {stats.times[p] * 1e3:.1f} ms" for p in loop.PHASES[1:])
        print(f"== {args.cache} / {ops}: serving {stats.serving_time * 1e3:.1f} ms ({phases}); "
              f"device busy {sum(total.values()) * 1e3:.1f} ms in {sum(count.values())} events")
        for name, s in total.most_common(8):
            print(f"  {s * 1e3:8.2f} ms  {count[name]:6d}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
