"""What XLA plans for each compiled step of a serving engine: its memory analysis (arguments,
outputs, aliased, temporaries) and the copies of 2^26 elements or more in its optimized HLO. The
steps compile here as XLA would by default: a step whose plan passes the device's limit is
rematerialized (a warning at compile time), which `serve` turns off (docs/serving.md).

    python3 tools/probes/serve_memory_probe.py --preset 8b --engines paged --max-seq-len 8192 ...
(the arguments of ``python -m jaxkv serve``; the stream's mean length sizes the batch). On a GPU
it also prints each device's memory in use after the weights' draw and the peak after each
compile (XLA's autotuner runs kernels there), and a function that fails to compile is reported
and the next one tried."""

import re
import sys

import jax
import numpy as np

from jaxkv.serving import serve as S
from jaxkv.demo import serve_cli

GiB = 2**30


def in_use() -> str:
    """Each device's bytes in use and peak, where the backend reports them (a GPU's)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    if not any(stats):
        return ""
    return "; in use / peak " + ", ".join(
        f"{s.get('bytes_in_use', 0) / GiB:.1f} / {s.get('peak_bytes_in_use', 0) / GiB:.1f}"
        for s in stats) + " GiB"


def main(argv) -> None:
    args = serve_cli.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    args.sharding = serve_cli.cache_sharding(args.mesh)
    cfg, params, source = serve_cli.load(args)
    per_token = S.kv_bytes_per_token(cfg, args.dtype)
    mean_total = args.system_len + args.mean_prompt + args.mean_output
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{source}: weights {weights / GiB:.2f} GiB in all; {jax.devices()[0].device_kind}"
          f"{in_use()}", flush=True)
    for name in args.engines:
        engine, p = serve_cli.make_engine(name, args, cfg, params, np.arange(args.system_len),
                                          args.kv_gib, per_token, mean_total)
        print(f"{name}: rows {p.batch}, pages {p.num_pages}")
        for fn, a in engine.example_args().items():
            try:
                compiled = engine.functions[fn.rstrip("0123456789")].lower(*a).compile()
            except Exception as e:  # noqa: BLE001 (reported, and the next function tried)
                why = (str(e).splitlines() or [repr(e)])[0][:300]
                print(f"  {fn:10s} FAILED: {why}{in_use()}", flush=True)
                continue
            ma = compiled.memory_analysis()
            copies = [int(np.prod([int(d) for d in m.group(2).split(",") if d]))
                      for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? copy\(", compiled.as_text())]
            big = [c for c in copies if c >= 2**26]
            print(f"  {fn:10s} args {ma.argument_size_in_bytes / GiB:6.2f} out "
                  f"{ma.output_size_in_bytes / GiB:6.2f} aliased "
                  f"{ma.alias_size_in_bytes / GiB:6.2f} temp {ma.temp_size_in_bytes / GiB:6.2f} "
                  f"GiB; copies >= 64 Mi elements: {len(big)}{in_use()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
