"""PyTorch-native peers: what a torch user writes for each case's op, on DLPack views of the
case's JAX arrays (see peers.py for how they are checked and timed).

Index tensors (slot numbers, rows) are computed once on the host from the case's page table and
lengths, as a serving loop hands them to its kernels (vLLM's ``slot_mapping``): they are inputs
here, not timed. Every function binds one peer to one set of inputs and works on any torch device
(the tests run them on CPU tensors where torch is installed).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from .peer_types import Peer, Spec


def specs(case) -> list:
    names = {
        "paged_append": ["torch index_put_, every layer at once (pool[:, slots] = k)"
                         if case.params.get("all_layers") else
                         "torch index_put_ (pool[slots] = k)"],
        "linear_append": ["torch index_put_ (cache[rows, :, positions] = k)"],
        "compact_linear": ["torch index_select into a second buffer (out = buf[:, src])",
                           "torch in place (buf[:, dst] = buf[:, src])"],
        "compact_layers": ["torch index_select per layer into second buffers",
                           "torch in place per layer (x[dst] = x[src])"],
        "save": ["torch copy_ per layer (out[l].copy_(layer[b, :, :, :T]))"],
        "instantiate": ["torch copy_ per layer (layer[b, :, :, :T].copy_(saved[l]))"],
        "instantiate_slots": ["torch index_put_ per layer (layer[slots, :, :, :T] = saved[l])"],
        "paged_gather": ["torch index_select + copy_ (pool[l][:, table] to out)"],
    }.get(case.peer, [])
    makers = {
        "paged_append": [paged_append], "linear_append": [linear_append],
        "compact_linear": [compact_select, compact_in_place],
        "compact_layers": [compact_select, compact_in_place],
        "save": [save], "instantiate": [instantiate], "instantiate_slots": [instantiate_slots],
        "paged_gather": [paged_gather],
    }.get(case.peer, [])
    return [Spec(name, "torch", make) for name, make in zip(names, makers)]


def view(x):
    """A torch view of a JAX array's device memory (DLPack, no copy)."""
    import torch

    return torch.from_dlpack(x)


def index(a, device):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device)


def ragged(lengths, counts, tokens: int):
    """(rows, ts, positions) of every appended token, row by row: row b's tokens t < counts[b]
    (counts None: all ``tokens``), at positions lengths[b] + t."""
    lengths = np.asarray(lengths)
    c = np.full(len(lengths), tokens) if counts is None else np.minimum(counts, tokens)
    rows = np.repeat(np.arange(len(lengths)), c)
    ts = np.concatenate([np.arange(n) for n in c]) if len(c) else np.zeros(0, int)
    return rows, ts, lengths[rows] + ts


def ragged_tokens(x, rows, ts):
    """x [B, H, T, D] -> [tokens, H, D]; x [L, B, H, T, D] -> [L, tokens, H, D] (JAX arrays)."""
    if x.ndim == 4:
        return x[rows, :, ts, :]
    return jnp.swapaxes(x[:, rows, :, ts, :], 0, 1)  # the indexed axis comes first


def _peer(**kw):
    return Peer(**kw)


# --- appends --------------------------------------------------------------------------------------


def paged_append(case, carry, consts):
    """``index_put_`` through flat slot numbers table[b, p // page] * page + p % page, per round
    into its layer; with ``all_layers`` one ``index_put_`` writes every layer."""
    p = case.params
    page, layout = p["page"], p["layout"]
    pools = [view(x) for x in carry]  # HND [L, H, P, S, D]; NHD [L, P, S, H, D]
    L = pools[0].shape[0]
    T = consts["k"][0].shape[-2]
    rows, ts, pos = ragged(p["lengths"], p["counts"], T)
    table = np.asarray(consts["rest"]["page_table"])
    slots = index(table[rows, pos // page] * page + pos % page, pools[0].device)
    if layout == "HND":  # [L, H, P * S, D]: tokens index dim 2
        flat = [x.view(L, x.shape[1], -1, x.shape[-1]) for x in pools]
    else:  # [L, P * S, H, D]: tokens index dim 1
        flat = [x.view(L, -1, x.shape[-2], x.shape[-1]) for x in pools]
    sets = [[view(ragged_tokens(x, rows, ts)) for x in (k, v)]
            for k, v in zip(consts["k"], consts["v"])]

    def call(j):
        if p["all_layers"]:  # [L, tokens, H, D]
            for f, x in zip(flat, sets[0]):
                if layout == "HND":
                    f[:, :, slots] = x.transpose(1, 2)
                else:
                    f[:, slots] = x
            return
        for layer, kv in zip(p["layers"], sets):  # [tokens, H, D]
            for f, x in zip(flat, kv):
                if layout == "HND":
                    f[layer][:, slots] = x.transpose(0, 1)
                else:
                    f[layer].index_put_((slots,), x)

    return _peer(call=call, outputs=lambda: pools)


def linear_append(case, carry, consts):
    """``index_put_`` of each token at (row, position) of layer r's [B, 2, H, S, D] slab."""
    p = case.params
    buf = view(carry)  # [rounds, B, 2, H, S, D]
    T = consts["k"][0].shape[-2]
    rows, ts, pos = ragged(p["lengths"], p["counts"], T)
    r_t, p_t = index(rows, buf.device), index(pos, buf.device)
    sets = [[view(ragged_tokens(x, rows, ts)) for x in (k, v)]
            for k, v in zip(consts["k"], consts["v"])]

    def call(j):
        for layer, kv in enumerate(sets):
            for half, x in enumerate(kv):
                buf[layer][:, half][r_t, :, p_t] = x  # [B, H, S, D][rows, :, pos]: [tokens, H, D]

    return _peer(call=call, outputs=lambda: [buf])


# --- compaction -----------------------------------------------------------------------------------


def _moves(case):
    mapping = case.params["mapping"]
    moving = np.flatnonzero((mapping >= 0) & (mapping != np.arange(len(mapping))))
    return moving, mapping[moving]


def compact_select(case, carry, consts):
    """Every new row j gathers old row src[j] into a second buffer (``index_select``, whole rows:
    what a torch user's ``buf[:, src]`` moves), allocated beside the cache once."""
    stacked = case.peer == "compact_linear"
    xs = [view(x) for x in (carry if isinstance(carry, list) else [carry])]
    # The second buffers come from JAX's memory pool, where the cache lives (torch's is smaller).
    seconds = [jnp.zeros(x.shape, x.dtype) for x in (carry if isinstance(carry, list) else [carry])]
    outs = [view(s) for s in seconds]
    src = index(case.params["src"], xs[0].device)

    def call(j):
        import torch

        for x, out in zip(xs, outs):
            torch.index_select(x, 1 if stacked else 0, src, out=out)

    return _peer(call=call, outputs=lambda: outs)


def compact_in_place(case, carry, consts):
    """The moving survivors' rows copied to their new rows in the cache itself: ``x[dst] =
    x[src]`` (torch gathers the right side into a temporary first, so rows may overlap)."""
    stacked = case.peer == "compact_linear"
    xs = [view(x) for x in (carry if isinstance(carry, list) else [carry])]
    moving, targets = _moves(case)
    src, dst = index(moving, xs[0].device), index(targets, xs[0].device)

    def call(j):
        for x in xs:
            if stacked:
                x[:, dst] = x[:, src]
            else:
                x[dst] = x[src]

    return _peer(call=call, outputs=lambda: xs)


# --- save / instantiate ---------------------------------------------------------------------------


def save(case, carry, consts):
    """Call j saves row j % B (as the jaxkv step i saves row i % B)."""
    B, T = case.params["B"], case.params["T"]
    outs, layers = [view(x) for x in carry], [view(x) for x in consts]

    def call(j):
        for out, layer in zip(outs, layers):
            out.copy_(layer[j % B, :, :, :T])

    return _peer(call=call, outputs=lambda: outs)


def instantiate(case, carry, consts):
    B, T = case.params["B"], case.params["T"]
    layers, saved = [view(x) for x in carry], [view(x) for x in consts]

    def call(j):
        for layer, s in zip(layers, saved):
            layer[j % B, :, :, :T].copy_(s)

    return _peer(call=call, outputs=lambda: layers)


def instantiate_slots(case, carry, consts):
    T = case.params["T"]
    layers, saved = [view(x) for x in carry], [view(x) for x in consts["src"]]
    slots = index(np.asarray(consts["slots"]), layers[0].device)

    def call(j):
        for layer, s in zip(layers, saved):
            layer[slots, :, :, :T] = s  # broadcast over the slots

    return _peer(call=call, outputs=lambda: layers)


# --- paged gather ---------------------------------------------------------------------------------


def paged_gather(case, carry, consts):
    """Call j gathers layer j % 2 (as the jaxkv step i gathers layer i % 2): ``index_select`` of
    every row's pages from the HND pool, then one copy into the dense [B, 2, H, N, D] output.
    Every row of the case holds N tokens, so nothing past a length needs zeroing."""
    N = case.params["N"]
    lengths = np.asarray(consts["rest"]["lengths"])
    if not np.all(lengths == N):
        raise ValueError("torch gather peer: written for full rows (lengths == N) only")
    out = view(carry)  # [B, 2, H, N, D]
    pools = [view(x) for x in consts["pools"]]  # [2 layers, H, P, S, D]
    table = np.asarray(consts["rest"]["page_table"])
    B, pages = table.shape
    flat = index(table.reshape(-1), out.device)

    def call(j):
        for half, pool in enumerate(pools):
            H, _, S, D = pool.shape[1:]
            g = pool[j % 2].index_select(1, flat)  # [H, B * pages, S, D]
            out[:, half].copy_(g.view(H, B, pages * S, D)[:, :, :N].transpose(0, 1))

    return _peer(call=call, outputs=lambda: [out])
