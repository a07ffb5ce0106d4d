"""KV memory one sequence holds against its context length: a model with sliding windows served
from a paged cache that releases window pages, against the same cache keeping every layer's tokens.

    python tools/hybrid_pages.py --preset gemma3-12b --json out.json --plot out.png

The pages come from jaxkv's allocator itself: a one-row ``PagedKVCache`` of the preset's layers
and windows (one KV head of 16 elements: the counts do not depend on the heads) reserves a prompt
in chunks, then decode steps, and ``pages_held`` is read at each context length. Bytes are those
pages at the preset's real shapes (bfloat16, or 8 bits with float32 per-token-head scales).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import _windows
from jaxkv.models import PRESETS

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def pages_held(cfg, windows, lengths, page_size: int, chunk: int) -> list[int]:
    """Pages a row holds, every layer group together, once it reached each of ``lengths``
    (prefilled in chunks of ``chunk``, the last 64 tokens decoded one at a time)."""
    groups = 1 if windows is None else _windows.groups(windows).num_groups
    per_row = -(-max(lengths) // page_size)
    cache = jaxkv.PagedKVCache.create(cfg.num_layers, per_row * groups + 8, page_size, 1, 16, 1,
                                      per_row, jnp.bfloat16, "NHD", windows=windows)
    step = jax.jit(lambda c, n: c.reserve(n)[0].commit(n))
    held, length = [], 0
    for target in lengths:
        while length < target - 64:
            n = min(chunk, target - 64 - length)
            cache, length = step(cache, jnp.array([n], jnp.int32)), length + n
        while length < target:
            cache, length = step(cache, jnp.array([1], jnp.int32)), length + 1
        held.append(int(cache.pages_held[0]))
    return held


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gemma3-12b", choices=[k for k, c in PRESETS.items()
                                                              if c.hybrid])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    slots = _windows.groups(cfg.windows).slots
    rows = {}
    for name, windows, layers in (("hybrid", cfg.windows, slots),
                                  ("all-global", None, cfg.num_layers)):
        held = pages_held(cfg, windows, LENGTHS, args.page_size, args.chunk)
        for dtype, per_elem, scale in (("bfloat16", 2, 0), ("fp8", 1, 4)):
            page = 2 * layers * cfg.num_kv_heads * args.page_size * (
                cfg.head_dim * per_elem + scale)
            rows[f"{name} {dtype}"] = dict(pages=held, bytes=[h * page for h in held],
                                           page_bytes=page)
    doc = dict(preset=args.preset, page_size=args.page_size, chunk=args.chunk,
               lengths=list(LENGTHS), backend=jax.default_backend(), series=rows)
    width = max(map(len, rows))
    print(f"{args.preset}: KV one sequence holds (GiB) at context lengths {list(LENGTHS)}")
    for name, r in rows.items():
        print(f"{name:>{width}}: " + "  ".join(f"{b / 2**30:6.3f}" for b in r["bytes"]))
    ratio = np.array(rows["all-global bfloat16"]["bytes"]) / np.array(
        rows["hybrid bfloat16"]["bytes"])
    print(f"{'all-global / hybrid':>{width}}: " + "  ".join(f"{x:6.2f}" for x in ratio))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, r in rows.items():
            ax.plot(LENGTHS, np.array(r["bytes"]) / 2**30, marker="o", label=name,
                    linestyle="--" if "fp8" in name else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("KV held by one sequence (GiB)")
        ax.set_title(f"{args.preset}: window pages released vs every layer's tokens kept",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
