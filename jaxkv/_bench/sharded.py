"""``python -m jaxkv.bench --devices N``: per-device bandwidth of sharded compact, append and paged
append on N devices against 1 device, measured in the same run.

Weak scaling: on N devices the cache is N times larger and every device holds the shard the
1-device run holds, so a sharded op that adds nothing (no collective, no copy, its kernel on the
local shard only) moves the same bytes per device in the same time: the ratio should be ~1.
Each op runs in the timed loop of the main benchmark (``timing.time_loop``: a jitted
``fori_loop`` with the cache donated, median of ``--reps`` calls).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv._bench import timing as T

# Per-device shapes: (layers, rows, heads, capacity, head_dim, dtype); paged: pages, page size.
SIZES = {
    "gpu": dict(L=32, B=16, H=8, S=2048, D=128, dtype=jnp.bfloat16, page=16, iters=20),
    "cpu": dict(L=2, B=4, H=2, S=64, D=32, dtype=jnp.float32, page=16, iters=4),
}
SPLITS = ("batch", "heads")


@dataclasses.dataclass
class Case:
    op: str
    split: str
    devices: int
    min_bytes: int  # per device, per op

    @property
    def name(self):
        return f"{self.op} ({self.split} over {self.devices})"


def _sharding(devices: int, split: str) -> jaxkv.CacheSharding:
    mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
    return jaxkv.CacheSharding(mesh, **{split: "d"})


def _scaled(z: dict, devices: int, split: str) -> tuple[int, int]:
    """(rows, heads) of the global cache: the split dimension N times the per-device one."""
    return (z["B"] * devices, z["H"]) if split == "batch" else (z["B"], z["H"] * devices)


def build(op: str, split: str, devices: int, z: dict):
    """(carry, consts, step, per-device bytes) of one case."""
    s = _sharding(devices, split)
    rows, heads = _scaled(z, devices, split)
    item = jnp.dtype(z["dtype"]).itemsize
    named = lambda *spec: jax.sharding.NamedSharding(s.mesh, s.spec(*spec))  # noqa: E731
    if op == "paged_append":
        pages_per_seq = z["S"] // z["page"]
        cache = jaxkv.PagedKVCache.create(z["L"], rows * pages_per_seq, z["page"], heads, z["D"],
                                          rows, pages_per_seq, z["dtype"], sharding=s)
        cache, _ = cache.reserve(jnp.full((rows,), z["S"], jnp.int32))
        cache = dataclasses.replace(cache, lengths=jax.device_put(
            jnp.full((rows,), z["S"] // 2, jnp.int32), cache.lengths.sharding))
        kv = jax.device_put(jnp.ones((rows, heads, 1, z["D"]), z["dtype"]),
                            named("batch", "heads"))

        def step(i, c, kv):
            return c.append(i % c.num_layers, kv, kv)

        per_device = 2 * 2 * (rows // s.batch_shards) * (heads // s.heads_shards) * z["D"] * item
        return cache, kv, step, per_device
    cache = jaxkv.LinearKVCache.create(z["L"], rows, heads, z["S"], z["D"], z["dtype"],
                                       sharding=s)
    local_rows = rows // s.batch_shards
    cache = cache.reset(jnp.full((rows,), z["S"] // 2, jnp.int32))
    local_heads = heads // s.heads_shards
    if op == "append":
        kv = jax.device_put(jnp.ones((rows, heads, 1, z["D"]), z["dtype"]),
                            named("batch", "heads"))

        def step(i, c, kv):
            return c.append(i % c.num_layers, kv, kv)

        return cache, kv, step, 2 * 2 * local_rows * local_heads * z["D"] * item
    # compact: neighbouring rows swap inside every shard, so every live token moves every time
    mapping = jnp.asarray(np.arange(rows) ^ 1, jnp.int32)

    def step(i, c, mapping):
        return c.compact(mapping)

    moved = 2 * z["L"] * local_rows * 2 * local_heads * (z["S"] // 2) * z["D"] * item
    return cache, mapping, step, moved


def run(devices: int, size: str, reps: int, ops=("compact", "append", "paged_append"),
        progress=None) -> list[dict]:
    z = SIZES[size]
    if devices > jax.device_count():
        raise ValueError(f"--devices {devices}: only {jax.device_count()} devices are visible")
    rows = []
    for op in ops:
        for split in SPLITS:
            row = dict(op=op, split=split, devices=devices)
            for n in (1, devices):
                if progress:
                    progress.step(f"{op} {split} on {n} device(s)")
                carry, consts, step, per_device = build(op, split, n, z)
                _, seconds, hlo, _ = T.time_loop(step, carry, consts, z["iters"], reps)
                median = float(np.median(seconds))
                row[f"gbps_{n}"] = per_device / median / 1e9
                row[f"time_s_{n}"] = median
                row["bytes_per_device"] = per_device
                row[f"big_copies_{n}"] = T.big_copies(hlo)
                del carry, consts
            row["ratio"] = row[f"gbps_{devices}"] / row["gbps_1"]
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    n = rows[0]["devices"] if rows else 0
    lines = [f"{'op':14s} {'split':6s} {'bytes/device':>13s} {'1 device GB/s':>14s} "
             f"{f'{n} devices GB/s':>15s} {'ratio':>6s}"]
    for r in rows:
        lines.append(f"{r['op']:14s} {r['split']:6s} {r['bytes_per_device']:13d} "
                     f"{r['gbps_1']:14.2f} {r[f'gbps_{n}']:15.2f} {r['ratio']:6.2f}")
    return "\n".join(lines)


def main(args) -> dict:
    size = args.size or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    progress = T.Progress(3 * len(SPLITS) * 2, enabled=not args.no_progress)
    rows = run(args.devices, size, args.reps, progress=progress)
    progress.close()
    device = jax.devices()[0]
    print(f"per-device bandwidth, {args.devices} x {getattr(device, 'device_kind', device)} "
          f"against 1 (weak scaling; jax {jax.__version__})")
    print(table(rows))
    report = dict(devices=args.devices, size=size, rows=rows)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report
