"""FlashInfer peers (0.7.2; ``/work/shared/peer-wheels/README.md`` for the device machine's
install): ``append_paged_kv_cache`` on the append cases, the batch decode / prefill wrappers on
the attention cases, on DLPack views of the case's JAX arrays (see peers.py for the checks and
the timing).

FlashInfer addresses pages through strides, so jaxkv's pools are handed over without a copy:
layer l of an NHD pool [L, P, S, H, D] is FlashInfer's NHD [P, S, H, D]; of an HND pool
[L, H, P, S, D] it is FlashInfer's HND [P, H, S, D] after a permutation of the view. A
LinearKVCache layer [B, 2, H, S, D] is a paged HND cache of one S-token page per row.
The append's inputs are FlashInfer's: ragged [tokens, H, D] K/V and the (batch index, position)
of each token, made once from the case's padded inputs, as a serving loop hands them over.
"""

from __future__ import annotations

import functools
import importlib.resources

import numpy as np

import jaxkv

from .peers_torch import ragged, ragged_tokens, view
from .peer_types import Peer, Spec

TOLERANCE = 3e-2  # attention: bf16 outputs of two float32-accumulating kernels


def specs(case) -> list:
    if case.peer == "paged_append":
        name = "FlashInfer append_paged_kv_cache" + (
            ", one call per layer" if case.params["all_layers"] else "")
        return [Spec(name, "flashinfer", paged_append)]
    if case.peer == "linear_append":
        return [Spec("FlashInfer append_paged_kv_cache (a row = one page of S tokens)",
                     "flashinfer", linear_append)]
    if case.peer == "attention":
        variant = ", ".join(f"{k}={v:g}" for k, v in _hybrid(case).items())
        if case.op == "attention_decode":
            names = {None: "FlashInfer BatchDecodeWithPagedKVCacheWrapper"}
        else:  # both prefill backends: FA2's, and FA3's on Hopper (a wheel with its sources)
            names = {backend: f"FlashInfer BatchPrefillWithPagedKVCacheWrapper ({backend})"
                     for backend in ("fa2", "fa3")}
        return [Spec(f"{name}, {variant}" if variant else name, "flashinfer",
                     functools.partial(attention, backend=backend))
                for backend, name in names.items()]
    return []


def _hybrid(case) -> dict:
    """The plan() keywords of a hybrid-attention case: jaxkv's ``window`` (the query at p sees
    (p - window, p]) is FlashInfer's ``window_left = window - 1`` (it sees [p - window_left, p]),
    ``soft_cap`` its ``logits_soft_cap`` (both cap the scores after the scale). FlashInfer's
    wrappers have no sinks: a case with sinks has no FlashInfer peer."""
    p = case.params
    out = {}
    if p.get("window") is not None:
        out["window_left"] = int(p["window"]) - 1
    if p.get("soft_cap") is not None:
        out["logits_soft_cap"] = float(p["soft_cap"])
    return out


def _i32(a, device):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(device)


def _csr(tables, lengths, page: int, device):
    """FlashInfer's page list of every row: (indptr [B + 1], indices, last_page_len [B]) for rows
    of ``lengths`` tokens on the pages ``tables[b]`` names, in order (the order of the wrappers'
    ``plan``; ``append_paged_kv_cache`` takes indices before indptr)."""
    lengths = np.asarray(lengths)
    pages = -(-lengths // page)
    indptr = np.concatenate([[0], np.cumsum(pages)])
    indices = np.concatenate([np.asarray(tables[b])[: pages[b]] for b in range(len(lengths))])
    last = np.where(pages > 0, lengths - (pages - 1) * page, 0)
    return _i32(indptr, device), _i32(indices, device), _i32(last, device)


def _layer(pool, layer: int, layout: str):
    """Layer ``layer`` of a jaxkv pool as FlashInfer's 4-D cache of the same layout (a view)."""
    return pool[layer] if layout == "NHD" else pool[layer].permute(1, 0, 2, 3)


def paged_append(case, carry, consts):
    import flashinfer

    p = case.params
    page, layout = p["page"], p["layout"]
    pools = [view(x) for x in carry]
    T = consts["k"][0].shape[-2]
    rows, ts, pos = ragged(p["lengths"], p["counts"], T)
    device = pools[0].device
    indptr, indices, last = _csr(np.asarray(consts["rest"]["page_table"]), p["lengths"] +
                                 np.bincount(rows, minlength=len(p["lengths"])), page, device)
    batch, positions = _i32(rows, device), _i32(pos, device)
    sets = [[view(ragged_tokens(x, rows, ts)) for x in (k, v)]
            for k, v in zip(consts["k"], consts["v"])]
    if p["all_layers"]:  # one call per layer: [L, tokens, H, D] -> L sets of [tokens, H, D]
        layers = list(range(pools[0].shape[0]))
        sets = [[x[layer] for x in sets[0]] for layer in layers]
    else:
        layers = p["layers"]
    caches = {layer: tuple(_layer(x, layer, layout) for x in pools) for layer in set(layers)}

    def call(j):
        for layer, (k, v) in zip(layers, sets):
            flashinfer.append_paged_kv_cache(k, v, batch, positions, caches[layer], indices,
                                              indptr, last, kv_layout=layout)

    return Peer(call=call, outputs=lambda: pools)


def linear_append(case, carry, consts):
    import flashinfer

    p = case.params
    buf = view(carry)  # [rounds, B, 2, H, S, D]
    B = buf.shape[1]
    T = consts["k"][0].shape[-2]
    rows, ts, pos = ragged(p["lengths"], p["counts"], T)
    device = buf.device
    totals = np.asarray(p["lengths"]) + np.bincount(rows, minlength=B)
    # One page of S tokens per row, row b's page being b.
    indptr, indices, last = (_i32(np.arange(B + 1), device), _i32(np.arange(B), device),
                             _i32(totals, device))
    batch, positions = _i32(rows, device), _i32(pos, device)
    sets = [[view(ragged_tokens(x, rows, ts)) for x in (k, v)]
            for k, v in zip(consts["k"], consts["v"])]

    def call(j):
        for layer, (k, v) in enumerate(sets):
            cache = (buf[layer][:, 0], buf[layer][:, 1])  # [B, H, S, D] each: HND, page = S
            flashinfer.append_paged_kv_cache(k, v, batch, positions, cache, indices, indptr,
                                              last, kv_layout="HND")

    return Peer(call=call, outputs=lambda: [buf])


def _pool_view(pool):
    """A torch view of a pool; an fp8 pool through its bytes where DLPack does not carry fp8
    (a one-time copy of the bytes, outside the timing)."""
    import jax
    import jax.numpy as jnp
    import torch

    try:
        return view(pool)
    except (BufferError, RuntimeError, TypeError, ValueError):
        if pool.dtype != jnp.float8_e4m3fn:
            raise
        return view(jax.lax.bitcast_convert_type(pool, jnp.uint8)).view(torch.float8_e4m3fn)


def has_fa3_sources() -> bool:
    """Whether the installed FlashInfer carries its sm90 batch prefill sources (the trimmed wheel
    of ../shared/peer-wheels does not; tools/flashinfer_fa3_wheel.py makes one that does)."""
    source = importlib.resources.files("flashinfer").joinpath("data/csrc/batch_prefill_sm90.cu")
    return source.is_file()


def attention(case, carry, consts, backend=None):
    """The wrapper planned once on the case's page table (layer 0, as jaxkv's step i = 0 reads),
    then ``run`` per call (a prefill on FlashInfer's ``backend``, "fa2" or "fa3"); its output is
    compared with jaxkv's within ``TOLERANCE``. An fp8 pool (scaled per tensor: FlashInfer takes
    one K and one V scale) is read as FlashInfer's fp8 cache, with layer 0's scales. A window or
    soft cap goes to ``plan`` (``_hybrid``); the page list stays every page of the row, as a
    serving loop that keeps the pages passes it (jaxkv's kernel gets the same page table): the
    window is applied by ``window_left`` alone. A ragged prefill (``params["new"]``: each row's
    new tokens, q padded to the longest) goes as FlashInfer's packed queries and ``qo_indptr``."""
    import flashinfer
    import torch

    q, cache = carry, consts
    if not isinstance(cache, jaxkv.PagedKVCache):
        raise ValueError("FlashInfer peer: paged caches only (this case reads a LinearKVCache)")
    if cache.scaling == "per_token_head":
        raise ValueError("FlashInfer peer: one scale per tensor, not per token and head")
    hybrid = _hybrid(case)  # window_left, logits_soft_cap: planned like the rest
    layout = cache.layout
    H, D, page = cache.num_kv_heads, cache.head_dim, cache.page_size
    Hq = q.shape[-2]
    pools = tuple(_layer(_pool_view(x), 0, layout) for x in (cache.k_pages, cache.v_pages))
    scales = {}
    if cache.scaling == "per_tensor":
        scales = dict(k_scale=float(cache.k_scales[0]), v_scale=float(cache.v_scales[0]))
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    table = np.asarray(cache.page_table)
    lengths = np.asarray(cache.lengths)
    new = case.params.get("new")  # a ragged prefill's new tokens per row (else T each)
    if case.op == "attention_decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
        wrapper.plan(*_csr(table, lengths, page, "cuda"), Hq, H, D, page,
                     q_data_type=torch.bfloat16, kv_data_type=pools[0].dtype, **hybrid)
        tq = view(q)
    else:
        B, T = q.shape[0], q.shape[1]
        counts = np.full(B, T) if new is None else np.asarray(new)
        qo_indptr = _i32(np.concatenate([[0], np.cumsum(counts)]), "cuda")
        if new is None:
            tq = view(q).reshape(B * T, Hq, D)
        else:  # packed once, outside the timing, as a serving loop hands ragged queries over
            rows, ts, _ = ragged(np.zeros(B, np.int64), counts, T)
            rows, ts = (torch.from_numpy(x).to("cuda") for x in (rows, ts))
            tq = view(q)[rows, ts]
        # Named: the "auto" default picks FA3 on Hopper, whose sources the trimmed wheel lacks.
        if backend == "fa3" and not has_fa3_sources():
            raise ValueError("FlashInfer peer: the installed wheel has no fa3 sources "
                             "(tools/flashinfer_fa3_wheel.py makes one)")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, layout, backend=backend)
        wrapper.plan(qo_indptr, *_csr(table, lengths + counts, page, "cuda"), Hq, H, D, page,
                     causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                     **hybrid)
    out = {}

    def call(j):
        out["o"] = wrapper.run(tq, pools, **scales)

    shape = tuple(q.shape)

    def outputs():  # jaxkv's layout: [B, T, Hq, D], zeros past a row's new tokens
        if new is None:
            return [out["o"].reshape(shape)]
        padded = torch.zeros(shape, dtype=out["o"].dtype, device=out["o"].device)
        padded[rows, ts] = out["o"]
        return [padded]

    return Peer(call=call, outputs=outputs, graph=False, tolerance=TOLERANCE)

