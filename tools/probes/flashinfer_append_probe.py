"""FlashInfer's append_paged_kv_cache on the cases of tools/probes/paged_append_probe.cu, for ncu.

GPU probe, not part of the suite: the same cases timed by the same tool as jaxkv's
kernel, so the two can be compared launch for launch.

    eval "$(bash .peers/setup_on_gpu.sh $PWD/.peers)"
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --kernel-name regex:Append python3 tools/probes/flashinfer_append_probe.py
"""

import flashinfer
import numpy as np
import torch


def case(name, batch, tokens, heads, page, total, layout):
    counts = np.zeros(batch, np.int64)
    left = total
    for b in range(batch):  # the probe's ragged split
        c = left if b + 1 == batch else min(left, tokens // 2 + (b * 97) % (tokens // 2 + 1))
        c = 1 if tokens == 1 else c  # decode: one token per row
        counts[b] = min(c, tokens)
        left -= counts[b]
    lengths = np.array([(b * 37) % 512 for b in range(batch)])
    max_pages = (512 + tokens + page - 1) // page
    pages = batch * max_pages
    table = (np.arange(pages) * 7919 % pages).reshape(batch, max_pages)
    kv_len = lengths + counts
    used = -(-kv_len // page)
    indptr = np.concatenate([[0], np.cumsum(used)])
    indices = np.concatenate([table[b, : used[b]] for b in range(batch)])
    last = kv_len - (used - 1) * page
    dev = lambda a, t=torch.int32: torch.as_tensor(np.asarray(a), dtype=t, device="cuda")
    nnz = int(counts.sum())
    k = torch.randn(nnz, heads, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    shape = (pages, page, heads, 128) if layout == "NHD" else (pages, heads, page, 128)
    k_pool = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    append_indptr = dev(np.concatenate([[0], np.cumsum(counts)]))
    batch_idx, positions = flashinfer.get_batch_indices_positions(
        append_indptr, dev(kv_len), nnz)
    torch.cuda.synchronize()
    for _ in range(5):
        print(f"{name} {layout} total {total} page {page}", flush=True)
        flashinfer.append_paged_kv_cache(k, v, batch_idx, positions, (k_pool, v_pool),
                                         dev(indices), dev(indptr), dev(last), kv_layout=layout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    for layout in ("NHD", "HND"):
        for batch in (256, 1024):
            for page in (16, 128):
                case("decode", batch, 1, 8, page, batch, layout)
        for page in (16, 128):
            case("prefill", 8, 1024, 8, page, 5000, layout)
