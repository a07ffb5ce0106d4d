"""How evenly the Hopper prefill's items spread over its persistent blocks, on the CPU: each item
(token tile, KV head, row) costs its key tiles plus a fixed cost, and each block's sum is compared
with the mean for the static snake order and for items handed out as blocks free (a counter).

    python3 tools/probes/prefill_schedule_model.py            # the benchmark's prefill rows
    python3 tools/probes/prefill_schedule_model.py --fixed 2  # a fixed cost of 2 key tiles an item

The items, their order and their key tiles follow ffi/cuda/attention_prefill_wgmma.cu (WgItems,
item_at): 128 query rows a tile (128 / group tokens), 128 keys a K/V tile (64 at head_dim 256).
Items past a row's count cost only the fixed cost's tenth (their zeros). A model, not a timing:
it says which order leaves a block far past the mean, not how long anything takes.
"""
import argparse
import heapq

import numpy as np

from jaxkv._bench.cases import serving_step

ROWS = 128


def item_costs(cached, new, group, head_dim, heads, window=None, fixed=1.0):
    """Each item's cost in the kernel's order: row-major over (row, KV head), token tiles last first."""
    per, keys_a_tile = ROWS // group, 64 if head_dim == 256 else 128
    tiles = -(-int(new.max()) // per)
    costs = []
    for prefix, count in zip(cached, new):
        for _ in range(heads):
            for t in reversed(range(tiles)):
                if t * per >= count:
                    costs.append(fixed / 10)
                    continue
                last = prefix + min(count, (t + 1) * per)  # keys the tile's last query sees
                first = 0 if window is None else max(0, prefix + t * per - window + 1)
                costs.append(-(-(last - first) // keys_a_tile) + fixed)
    return np.array(costs)


def static_order(costs, blocks):
    """Block g takes item r G + g in round r, r G + G - 1 - g in an odd one: each block's sum."""
    sums = np.zeros(blocks)
    for k, c in enumerate(costs):
        r, g = divmod(k, blocks)
        sums[blocks - 1 - g if r % 2 else g] += c
    return sums


def handed_out(costs, blocks):
    """Block g takes item g, then the next item whenever it is free: each block's sum."""
    free = [(0.0, g) for g in range(blocks)]
    for c in costs:
        t, g = heapq.heappop(free)
        heapq.heappush(free, (t + c, g))
    return np.array([t for t, _ in free])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=132, help="multiprocessors (H100 / H200)")
    parser.add_argument("--fixed", type=float, default=1.0, help="an item's fixed cost, key tiles")
    args = parser.parse_args()
    uniform = np.full(8, 2048)
    rows = {
        "8 x 2048 on 2048, D 128": (uniform, uniform, 4, 128, None),
        "8 x 2048 on 2048, D 128, window 1024": (uniform, uniform, 4, 128, 1024),
        "8 x 2048 on 2048, D 256 (16 / 8 heads)": (uniform, uniform, 2, 256, None),
        "serving step: 64 rows, 5000 new": (*serving_step(64, 5000, 512, 4096, 150), 4, 128, None),
    }
    print(f"{'row':42s} {'mean':>7s} {'static':>14s} {'handed out':>14s}")
    for name, (cached, new, group, head_dim, window) in rows.items():
        costs = item_costs(np.asarray(cached), np.asarray(new), group, head_dim, 8, window, args.fixed)
        mean = costs.sum() / args.blocks
        snake, dynamic = static_order(costs, args.blocks).max(), handed_out(costs, args.blocks).max()
        print(f"{name:42s} {mean:7.0f} {snake:7.0f} {snake / mean:5.2f}x {dynamic:7.0f} "
              f"{dynamic / mean:5.2f}x")


if __name__ == "__main__":
    main()
