"""The benchmark cases: each jaxkv op, its XLA-native formulation, the bytes it must move.

A case builds its inputs lazily (``build``) and gives one loop step per implementation:
``step(i, carry, consts) -> carry`` applies the op ``per_step`` times (several input sets in turn
where one set would fit in L2). Both sides get the same carry, the same consts, the same loop and
the same donation. Minimum bytes count what must move at least: bytes read plus bytes written of
only the live data the op moves (never the capacity of the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxkv
from jaxkv import reference

from . import timing

BF16 = np.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Target:
    """The issue's target for a row (evaluated on GPU only: the numbers are the H200's)."""

    text: str
    copy_frac: float | None = None  # achieved bandwidth / copy bandwidth
    speedup: float | None = None  # over the fastest XLA formulation
    max_us: float | None = None  # device time per op
    min_tflops: float | None = None  # Case.flops over the device time, in TFLOP/s
    beats_xla: bool = False
    one_launch: bool = False
    no_kv_bytes: bool = False  # nothing of the size of the KV data moves
    mem_frac: float = 0.01  # extra device memory of one op / cache bytes
    beats_peers: bool = False  # device time <= the fastest peer's (where a peer was timed)
    # the fastest peer's device time >= this x jaxkv's (where a peer was timed)
    peer_speedup: float | None = None
    # device time <= ratio x the device time of another row of the same run (its case name)
    versus: tuple[str, float] | None = None
    versus_loop: bool = False  # compare the loop times, not the kernels' (a step of many ops)


@dataclasses.dataclass
class Case:
    op: str  # what --op selects
    name: str  # the row's label
    # () -> (carry, consts, jaxkv step, {xla name: step}); the carry is what the op updates in
    # place (a cache) or its output (saved tensors, a gather), donated to every loop call.
    build: Callable[[], tuple]
    min_bytes: int  # read + written per op, at least
    cache_bytes: int
    iters: int  # ops per timed call = iters * per_step
    per_step: int = 1
    target: Target | None = None
    requires: tuple[str, ...] = ()  # jaxkv names the case needs (absent: "not available")
    sweep: bool = False  # a point for the plot, not a target row
    series: str = ""  # the plot's line within the op's panel
    note: str = ""
    panel: str = ""  # the plot's panel (default: the op)
    per_launch: int = 1  # ops one jaxkv launch performs (append_layers: every layer at once)
    flops: int = 0  # per op, on compute-bound rows (attention_flops); 0: no TFLOP/s shown
    # The peers that do the same work (jaxkv/_bench/peers.py): a family name, and the static
    # facts of the inputs they need beyond the carry and consts.
    peer: str = ""
    params: dict = dataclasses.field(default_factory=dict)

    def missing(self) -> list[str]:
        return [name for name in self.requires if not hasattr(jaxkv, name)]


def rand(shape, dtype, seed: int) -> jax.Array:
    """Random values of any cache dtype from random bits: never all zeros, never NaN or inf.

    Arrays over 1 GiB are filled one leading slice at a time into a donated buffer, so that the
    generator's temporaries stay the size of a slice (a 17 GiB cache at once would need several
    times that, and lift the peak memory that later cases are measured against).
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    if n * dtype.itemsize > 1 << 30 and len(shape) > 1 and shape[0] > 1:
        out = jnp.zeros(shape, dtype)
        for j in range(shape[0]):
            out = _put(out, _bits(shape[1:], dtype, seed * 1009 + j), j)
        return out
    return _bits(shape, dtype, seed)


_put = jax.jit(lambda out, x, j: lax.dynamic_update_index_in_dim(out, x, j, 0), donate_argnums=0)
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random(shape, dtype, key):
    """Bits drawn as uint32 words and reinterpreted (no wider temporary). For floats the top
    exponent bit is cleared: every NaN and inf has it set, and XLA may canonicalize NaN payloads
    where jaxkv moves bytes verbatim, which would make equal moves compare different."""
    n = int(np.prod(shape))
    words = jax.random.bits(key, (-(-n * dtype.itemsize // 4),), jnp.uint32)
    uint = _UINT[dtype.itemsize]
    x = lax.bitcast_convert_type(words, uint).reshape(-1)[:n]
    if jnp.issubdtype(dtype, jnp.floating):
        x = x & uint(~(1 << (8 * dtype.itemsize - 2)) & (1 << 8 * dtype.itemsize) - 1)
    return lax.bitcast_convert_type(x, dtype).reshape(shape)


def _bits(shape, dtype, seed: int) -> jax.Array:
    return _random(tuple(shape), np.dtype(dtype), jax.random.key(seed))


def i32(x) -> jax.Array:
    return jnp.asarray(np.asarray(x), jnp.int32)


def mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n < 2**30 else f"{n / 2**30:.3g} GiB"


def evict_half(batch: int, seq: int, seed: int):
    """Random live lengths in [1, seq], a random half evicted, survivors packed in order."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, seq + 1, batch)
    evicted = np.zeros(batch, bool)
    evicted[rng.permutation(batch)[: batch // 2]] = True
    survivors = np.flatnonzero(~evicted)
    mapping = np.full(batch, -1)
    mapping[survivors] = np.arange(len(survivors))
    moving = survivors[mapping[survivors] != survivors]  # a row already in place moves nothing
    src = np.arange(batch)  # jnp.take: new row j reads old row src[j]
    src[mapping[survivors]] = survivors
    return lengths, mapping, int(lengths[moving].sum()), src


# --- compaction ---------------------------------------------------------------------------------


def compact_linear(L, B, H, S, D, iters, target=None, sweep=False) -> Case:
    """LinearKVCache.compact: one [L, B, 2, H, S, D] buffer, every layer in one launch."""
    lengths, mapping, moved_tokens, src = evict_half(B, S, seed=1)
    token = L * 2 * H * D * BF16.itemsize

    def build():
        buffer = rand((L, B, 2, H, S, D), BF16, 2)
        consts = dict(lengths=i32(lengths), mapping=i32(mapping), src=i32(src),
                      targets=i32(np.where(mapping >= 0, mapping, B)), active=i32(B))

        def kernel(i, buf, c):
            cache = jaxkv.LinearKVCache(buffer=buf, lengths=c["lengths"],
                                        active_batch_size=c["active"])
            return cache.compact(c["mapping"]).buffer

        def take(i, buf, c):
            return jnp.take(buf, c["src"], axis=1)

        def scatter(i, buf, c):
            return buf.at[:, c["targets"]].set(buf, mode="drop")

        return buffer, consts, kernel, {"take": take, "scatter": scatter}

    return Case("compact_kv_cache", f"LinearKVCache L{L} B{B} H{H} S{S} D{D}", build,
                2 * token * moved_tokens, B * S * token, iters, target=target,
                sweep=sweep, series="LinearKVCache",
                note="random lengths in [1, S], random half evicted", peer="compact_linear",
                params=dict(lengths=lengths, mapping=mapping, src=src))


def compact_layers(layer_shapes, B, S, iters, target=None) -> Case:
    """compact_kv_cache on a list of [B, 2, H, S, D] layers whose H and D differ."""
    lengths, mapping, moved_tokens, src = evict_half(B, S, seed=3)
    tokens = [2 * h * d * BF16.itemsize for h, d in layer_shapes]

    def build():
        layers = [rand((B, 2, h, S, d), BF16, 10 + j) for j, (h, d) in enumerate(layer_shapes)]
        consts = dict(lengths=i32(lengths), mapping=i32(mapping), src=i32(src),
                      targets=i32(np.where(mapping >= 0, mapping, B)))

        def kernel(i, layers, c):
            out, _ = jaxkv.compact_kv_cache(layers, c["lengths"], c["mapping"])
            return list(out)

        def take(i, layers, c):
            return [jnp.take(x, c["src"], axis=0) for x in layers]

        def scatter(i, layers, c):
            return [x.at[c["targets"]].set(x, mode="drop") for x in layers]

        return layers, consts, kernel, {"take": take, "scatter": scatter}

    kinds = sorted(set(layer_shapes))
    label = ",".join(f"H{h}xD{d}" for h, d in kinds)
    return Case("compact_kv_cache", f"mixed layers L{len(layer_shapes)} B{B} S{S} {label}", build,
                2 * sum(tokens) * moved_tokens, sum(tokens) * B * S, iters, target=target,
                series="mixed layers", note="heterogeneous layers", peer="compact_layers",
                params=dict(lengths=lengths, mapping=mapping, src=src))


# --- save / instantiate (jaxkv.save_kv_cache, jaxkv.instantiate_kv_cache) ------------------------


def save(L, B, H, S, D, T, iters, target=None, sweep=False) -> Case:
    """One sequence's first T tokens of every layer into per-layer [2, H, T, D] tensors."""
    saved = L * 2 * H * T * D * BF16.itemsize

    def build():
        layers = [rand((B, 2, H, S, D), BF16, 20 + j) for j in range(L)]
        out = [rand((2, H, T, D), BF16, 60 + j) for j in range(L)]

        def kernel(i, out, layers):
            return list(jaxkv.save_kv_cache(layers, i % B, T))

        def dynamic_slice(i, out, layers):
            b = i % B
            return [lax.dynamic_slice(x, (b, 0, 0, 0, 0), (1, 2, H, T, D))[0] for x in layers]

        return out, layers, kernel, {"dynamic_slice": dynamic_slice}

    return Case("save_kv_cache", f"L{L} H{H} D{D} T{T} ({mib(saved)})", build, 2 * saved,
                L * B * 2 * H * S * D * BF16.itemsize, iters,
                target=target, requires=("save_kv_cache",), sweep=sweep, series="one row",
                note="the batch row changes every iteration", peer="save",
                params=dict(B=B, T=T))


def instantiate(L, B, H, S, D, T, iters, target=None, sweep=False) -> Case:
    """Saved [2, H, T, D] tensors written back into one row of every layer (donated)."""
    saved = L * 2 * H * T * D * BF16.itemsize

    def build():
        layers = [rand((B, 2, H, S, D), BF16, 20 + j) for j in range(L)]
        src = [rand((2, H, T, D), BF16, 60 + j) for j in range(L)]

        def kernel(i, layers, src):
            return list(jaxkv.instantiate_kv_cache(layers, src, i % B))

        def dynamic_update_slice(i, layers, src):
            b = i % B
            return [lax.dynamic_update_slice(x, s[None], (b, 0, 0, 0, 0))
                    for x, s in zip(layers, src)]

        return layers, src, kernel, {"dynamic_update_slice": dynamic_update_slice}

    return Case("instantiate_kv_cache", f"L{L} H{H} D{D} T{T} ({mib(saved)})", build, 2 * saved,
                L * B * 2 * H * S * D * BF16.itemsize, iters, target=target,
                requires=("instantiate_kv_cache",), sweep=sweep, series="one row",
                peer="instantiate", params=dict(B=B, T=T))


def instantiate_linear(L, B, H, S, D, T, iters, target=None, dtype=None) -> Case:
    """``LinearKVCache.instantiate`` of a bf16 prefix [2, H, T, D] per layer into one row;
    ``dtype``: into an 8-bit cache with per-token-head scales, quantized on the way in (the
    prefix of a float cache reused by an 8-bit one)."""
    elem, scale = _scale_bytes(dtype)
    tokens = L * 2 * H * T
    carried = ("buffer",) + (("k_scales", "v_scales") if dtype is not None else ())

    def build():
        cache = jaxkv.LinearKVCache(buffer=rand((L, B, 2, H, S, D), BF16, 20),
                                    lengths=i32(np.zeros(B)), active_batch_size=i32(B))
        cache = quantized(cache, dtype)
        saved = jaxkv.SavedKV(layers=tuple(rand((2, H, T, D), BF16, 60 + j) for j in range(L)),
                              length=i32(T))

        def kernel(i, leaves, saved):
            cache = jaxkv.LinearKVCache(**dict(zip(carried, leaves)), lengths=i32(np.zeros(B)),
                                        active_batch_size=i32(B),
                                        scaling=None if dtype is None else "per_token_head")
            cache = cache.instantiate(saved, i % B)
            return tuple(getattr(cache, f) for f in carried)

        def dynamic_update_slice(i, leaves, saved):  # quantized by XLA (8-bit), then written
            b, prefix = i % B, jnp.stack(saved.layers)[:, None]  # [L, 1, 2, H, T, D]
            if dtype is None:
                return (lax.dynamic_update_slice(leaves[0], prefix, (0, b, 0, 0, 0, 0)),)
            q, s = _quantize(prefix, dtype)  # s [L, 1, 2, H, T]
            return (lax.dynamic_update_slice(leaves[0], q, (0, b, 0, 0, 0, 0)),
                    *(lax.dynamic_update_slice(x, s[:, :, j], (0, b, 0, 0))
                      for j, x in enumerate(leaves[1:])))

        return (tuple(getattr(cache, f) for f in carried), saved, kernel,
                {"dynamic_update_slice": dynamic_update_slice})

    label = "" if dtype is None else f", into {np.dtype(dtype).name}"
    return Case("instantiate_kv_cache", f"LinearKVCache L{L} H{H} D{D} T{T}{label}", build,
                tokens * (D * BF16.itemsize + D * elem + scale),
                L * B * 2 * H * S * (D * elem + scale), iters, target=target,
                requires=("LinearKVCache",), series=f"LinearKVCache{label}")


def instantiate_slots(L, B, H, S, D, T, slots, iters, target=None) -> Case:
    """One saved prefix into ``slots`` rows of every layer at once."""
    saved = L * 2 * H * T * D * BF16.itemsize

    def build():
        layers = [rand((B, 2, H, S, D), BF16, 20 + j) for j in range(L)]
        consts = dict(src=[rand((2, H, T, D), BF16, 60 + j) for j in range(L)],
                      slots=i32(np.arange(slots)))

        def kernel(i, layers, c):
            return list(jaxkv.instantiate_kv_cache(layers, c["src"], c["slots"]))

        def scatter(i, layers, c):
            return [x.at[c["slots"], :, :, :T].set(jnp.broadcast_to(s, (slots, 2, H, T, D)))
                    for x, s in zip(layers, c["src"])]

        def dynamic_update_slice(i, layers, c):
            out = []
            for x, s in zip(layers, c["src"]):
                for slot in range(slots):
                    x = lax.dynamic_update_slice(x, s[None], (c["slots"][slot], 0, 0, 0, 0))
                out.append(x)
            return out

        return layers, consts, kernel, {"scatter": scatter,
                                        "dynamic_update_slice": dynamic_update_slice}

    return Case("instantiate_kv_cache", f"{slots} slots L{L} H{H} D{D} T{T}", build,
                (1 + slots) * saved, L * B * 2 * H * S * D * BF16.itemsize, iters,
                target=target, requires=("instantiate_kv_cache",), series=f"{slots} slots",
                note="min bytes: the prefix read once, written once per slot",
                peer="instantiate_slots", params=dict(T=T))


# --- append (LinearKVCache.append) ----------------------------------------------------------------


def _xla_append(buf, layer, k, v, lengths, new_lengths):
    """``.at[].set``: one scatter of each (row, token) to lengths[row] + token, ragged dropped."""
    B, H, T, D = k.shape
    S = buf.shape[4]
    t = jnp.arange(T)
    pos = lengths[:, None] + t[None, :]
    if new_lengths is not None:
        pos = jnp.where(t[None, :] < new_lengths[:, None], pos, S)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    kv = jnp.moveaxis(jnp.stack([k, v], axis=1), 3, 1)  # [B, T, 2, H, D]
    return buf.at[layer, rows, :, :, pos].set(kv, mode="drop")


def _vmap_append(buf, layer, k, v, lengths, new_lengths):
    """``dynamic_update_slice`` under ``vmap``; ragged rows rewrite their old tokens past
    new_lengths (a dynamic_update_slice cannot be ragged)."""
    T = k.shape[2]
    kv = jnp.stack([k, v], axis=1)  # [B, 2, H, T, D]

    def row(x, kv_b, start, count):
        if count is not None:
            old = lax.dynamic_slice(x, (0, 0, start, 0), kv_b.shape)
            kv_b = jnp.where((jnp.arange(T) < count)[:, None], kv_b, old)
        return lax.dynamic_update_slice(x, kv_b, (0, 0, start, 0))

    counts = new_lengths if new_lengths is not None else None
    axes = (0, 0, 0, 0 if counts is not None else None)
    return buf.at[layer].set(jax.vmap(row, in_axes=axes)(buf[layer], kv, lengths, counts))


def append(B, H, S, D, T, rounds, iters, ragged, target=None, sweep=False) -> Case:
    """``rounds`` appends per loop iteration, into layers 0..rounds-1 of a LinearKVCache, each from
    its own k/v set: a prefill's inputs then do not stay in L2, and a decode step's share of the
    loop's own per-iteration cost is divided by ``rounds``."""
    rng = np.random.default_rng(5)
    if ragged:
        new_lengths = rng.integers(1, T + 1, B)
        lengths = rng.integers(0, S - T + 1, B)
    else:
        new_lengths, lengths = None, rng.integers(0, S - T + 1, B)
    tokens = int(new_lengths.sum()) if ragged else B * T
    token = 2 * H * D * BF16.itemsize

    def build():
        buffer = rand((rounds, B, 2, H, S, D), BF16, 30)
        consts = dict(k=[rand((B, H, T, D), BF16, 31 + r) for r in range(rounds)],
                      v=[rand((B, H, T, D), BF16, 41 + r) for r in range(rounds)],
                      lengths=i32(lengths), active=i32(B),
                      new=None if new_lengths is None else i32(new_lengths))

        def kernel(i, buf, c):
            cache = jaxkv.LinearKVCache(buffer=buf, lengths=c["lengths"],
                                        active_batch_size=c["active"])
            for r in range(rounds):
                cache = cache.append(r, c["k"][r], c["v"][r], c["new"])
            return cache.buffer

        def xla(fn):
            def step(i, buf, c):
                for r in range(rounds):
                    buf = fn(buf, r, c["k"][r], c["v"][r], c["lengths"], c["new"])
                return buf
            return step

        return buffer, consts, kernel, {".at[].set": xla(_xla_append),
                                        "vmap(dynamic_update_slice)": xla(_vmap_append)}

    kind = "prefill" if ragged else "decode"
    return Case("append", f"{kind} B{B} T{T} H{H} D{D}" + (" ragged" if ragged else ""), build,
                2 * token * tokens, rounds * B * S * token, iters, per_step=rounds,
                target=target, sweep=sweep, series=kind,
                note="" if ragged else "launch-bound: includes 1/rounds of the loop's cost",
                peer="linear_append", params=dict(lengths=lengths, counts=new_lengths))


# --- paged (jaxkv.PagedKVCache, HND pools [L, H, num_pages, page_size, D]) -----------------------


def split(total: int, parts: int, most: int, seed: int) -> np.ndarray:
    """``parts`` random positive counts of at most ``most`` that add up to ``total``."""
    rng = np.random.default_rng(seed)
    while True:
        cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
        counts = np.diff(np.concatenate([[0], cuts, [total]]))
        if counts.max() <= most:
            return counts


def _paged(num_pages, page, H, D, B, pages_per_seq, lengths, seed, num_layers=1):
    """(k_pages, v_pages, the rest of the cache as a dict): ``lengths`` tokens per sequence on
    reserved pages, pools filled with random bits. The pools travel as the loop carry, the small
    arrays as consts (a pool captured in a closure would become an HLO constant)."""
    cache = jaxkv.PagedKVCache.create(num_layers=num_layers, num_pages=num_pages, page_size=page,
                                      num_kv_heads=H, head_dim=D, max_batch=B,
                                      max_pages_per_seq=pages_per_seq, dtype=jnp.bfloat16)
    cache, served = cache.reserve(i32(lengths))
    assert bool(jnp.all(served)), "benchmark cache: out of pages"
    cache = cache.commit(i32(lengths))
    pools = (rand(cache.k_pages.shape, BF16, seed), rand(cache.v_pages.shape, BF16, seed + 1))
    rest = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
            if f.name not in ("k_pages", "v_pages", "layout")}
    return pools, rest


def _cache(pools, rest):
    return jaxkv.PagedKVCache(k_pages=pools[0], v_pages=pools[1], **rest)


def _paged_append(label, B, H, D, T, page, layout, lengths, counts, num_layers, rounds,
                  all_layers, pages_per_seq, iters, target, series, panel, note,
                  dtype=None) -> Case:
    """A paged-append case on pools of ``num_layers`` layers with shuffled pages: per loop step
    ``rounds`` appends of one layer each (round r into layer r % num_layers), each from its own
    k/v set [B, H, T, D]; or, ``all_layers``, one ``append_layers`` of every layer at once
    (k/v [L, B, H, T, D]), counted as ``num_layers`` ops (one per layer) of one launch.
    Row b writes its first ``counts[b]`` tokens (None: all T) at positions lengths[b] ...
    ``dtype``: an 8-bit cache with per-token-head scales, quantizing bf16 K/V on the way in."""
    elem, scale = _scale_bytes(dtype)
    token = 2 * H * D * BF16.itemsize  # the bf16 K/V read
    written = 2 * H * (D * elem + scale)
    tokens = int(np.sum(counts)) if counts is not None else B * T
    ops = num_layers if all_layers else rounds
    carried = ("k_pages", "v_pages") + (("k_scales", "v_scales") if dtype is not None else ())

    def build():
        cache = quantized(_paged_pools(num_layers, B, pages_per_seq, page, H, D, lengths, layout,
                                       60), dtype)
        rest = {f: getattr(cache, f) for f in ("page_table", "lengths", "ref_counts", "new_tokens")}
        shape = (num_layers, B, H, T, D) if all_layers else (B, H, T, D)
        sets = 1 if all_layers else rounds
        consts = dict(rest=rest, new=None if counts is None else i32(counts),
                      k=[rand(shape, BF16, 71 + r) for r in range(sets)],
                      v=[rand(shape, BF16, 81 + r) for r in range(sets)])

        def kernel(i, pools, c):
            cache = jaxkv.PagedKVCache(**dict(zip(carried, pools)), layout=layout,
                                       scaling=None if dtype is None else "per_token_head",
                                       **c["rest"])
            if all_layers:
                cache = cache.append_layers(c["k"][0], c["v"][0], c["new"])
            for r in range(0 if all_layers else rounds):
                cache = cache.append(r % num_layers, c["k"][r], c["v"][r], c["new"])
            return tuple(getattr(cache, f) for f in carried)

        def scatter(i, pools, c):
            table, start = c["rest"]["page_table"], c["rest"]["lengths"]
            for r in range(len(c["k"])):
                layer = None if all_layers else r % num_layers
                news = (c["k"][r], c["v"][r])
                if dtype is not None:  # quantized by XLA, then scattered: data and scales
                    (kq, ks), (vq, vs) = (_quantize(x, dtype) for x in news)
                    news = (kq, vq, ks[..., None], vs[..., None])
                    pools = pools[:2] + tuple(x[..., None] for x in pools[2:])
                pools = tuple(_xla_paged_append(x, layer, table, start, new, c["new"], page, layout)
                              for x, new in zip(pools, news))
                if dtype is not None:
                    pools = pools[:2] + tuple(x[..., 0] for x in pools[2:])
            return pools

        return tuple(getattr(cache, f) for f in carried), consts, kernel, {"scatter": scatter}

    return Case("paged_append", label, build, (token + written) * tokens,
                num_layers * B * pages_per_seq * page * written, iters, per_step=ops,
                target=target, requires=("PagedKVCache",), series=series, panel=panel,
                note=note, per_launch=ops if all_layers else 1,
                peer="paged_append" if dtype is None else "",  # no peer quantizes on the way in
                params=dict(layout=layout, page=page, lengths=lengths, counts=counts,
                            layers=[r % num_layers for r in range(rounds)], all_layers=all_layers))


def paged_append(B, T, tokens, H, D, page, rounds, iters, target=None, layout="HND",
                 dtype=None) -> Case:
    """Ragged prefill of ``tokens`` tokens (at most T per sequence) after random lengths,
    ``rounds`` appends per loop step into layer 0."""
    new_lengths = split(tokens, B, T, seed=8)
    start = np.random.default_rng(7).integers(0, T, B)
    label = "" if dtype is None else f" into {np.dtype(dtype).name}"
    return _paged_append(f"prefill {tokens} tokens H{H} D{D} page {page} {layout}{label}", B, H,
                         D, T, page, layout, start, new_lengths, 1, rounds, False,
                         -(-(2 * T) // page), iters, target, f"page {page} {layout}{label}",
                         "paged_append (prefill)",
                         f"B{B}, at most {T} new tokens each, after random lengths", dtype)


def paged_decode_append(B, H, D, page, layout, rounds, iters, target=None, layers=0,
                        dtype=None) -> Case:
    """One decode step's append: one token per row after random lengths in [0, 2 * page).

    ``layers`` 0: ``rounds`` single-layer appends per loop step into layers 0..rounds-1, as a
    decode step does (each from its own k/v set). ``layers`` L: ``append_layers``, every one of
    L layers in one launch, reported per layer (the step's time / L), beside the single-layer
    rows."""
    lengths = np.random.default_rng(12).integers(0, 2 * page, B)
    kind = f"{layers} layers in one launch, per layer" if layers else "one layer"
    label = "" if dtype is None else f", into {np.dtype(dtype).name}"
    return _paged_append(
        f"decode B{B} H{H} D{D} page {page} {layout}, {kind}{label}", B, H, D, 1, page, layout,
        lengths, None, layers or rounds, 1 if layers else rounds, bool(layers), 2, iters, target,
        f"{'append_layers' if layers else 'one layer'} page {page} {layout}{label}",
        "paged_append (decode)", "latency-bound: the loop time includes 1/" +
        (f"{layers} of a step's loop cost" if layers else f"{rounds} of the loop's cost"), dtype)


def paged_decode_step(B, H, D, page, window, lengths_lo, iters, target=None) -> Case:
    """One layer's share of a decode step on a paged cache: ``reserve`` a token a row, ``append``
    it, ``commit``. With ``window``, the cache is ``PagedKVCache(windows=(window,))``, whose
    reserve also releases the page a row's window has just left: the row beside it without a
    window is today's step. Rows start at random lengths in ``[lengths_lo, 2 * lengths_lo)``
    and grow a token a step. Its device time is the loop's (the step is several XLA ops around
    the append kernel)."""
    lengths = np.random.default_rng(14).integers(lengths_lo, 2 * lengths_lo, B)
    steps = 8 * iters  # warm-ups, repetitions and the profiler's loops, at most
    pages = -(-(2 * lengths_lo + steps) // page) + 1
    name = f"decode step B{B} H{H} D{D} page {page} NHD" + (f" window {window}" if window else "")

    def build():
        cache = jaxkv.PagedKVCache.create(1, B * pages, page, H, D, B, pages, BF16, "NHD",
                                          windows=None if window is None else (window,))
        cache, served = cache.reserve(i32(lengths))
        assert bool(jnp.all(served)), "benchmark cache: out of pages"
        cache = cache.commit(i32(lengths))
        cache = dataclasses.replace(cache, k_pages=rand(cache.k_pages.shape, BF16, 91),
                                    v_pages=rand(cache.v_pages.shape, BF16, 92))
        one = jnp.ones((B,), jnp.int32)
        consts = dict(one=one, k=rand((B, H, 1, D), BF16, 93), v=rand((B, H, 1, D), BF16, 94))

        def kernel(i, cache, c):
            cache, _ = cache.reserve(c["one"])
            return cache.append(0, c["k"], c["v"], c["one"]).commit(c["one"])

        def scatter(i, cache, c):  # the same step, the append by XLA's scatter
            cache, _ = cache.reserve(c["one"])
            k, v = (_xla_paged_append(pool, 0, cache.page_table, cache.lengths, x, c["one"],
                                      page, "NHD")
                    for pool, x in ((cache.k_pages, c["k"]), (cache.v_pages, c["v"])))
            return dataclasses.replace(cache, k_pages=k, v_pages=v).commit(c["one"])

        return cache, consts, kernel, {"scatter": scatter}

    token = 2 * H * D * BF16.itemsize
    return Case("paged_decode_step", name, build, 2 * token * B, B * pages * page * token,
                iters, target=target, requires=("PagedKVCache",), series=name,
                note="the whole step's loop time: reserve (and a window's release), append, "
                     "commit")


def _xla_paged_append(pool, layer, table, lengths, x, counts, page, layout):
    """``.at[].set``: x[(l,) b, :, t] to page table[b, p // page], slot p % page, of layer
    ``layer`` (None: x [L, B, H, T, D] has every layer), p = lengths[b] + t; tokens at or past
    counts[b] are dropped (counts None: none)."""
    T = x.shape[-2]
    t = jnp.arange(T)[None, :]
    pos = lengths[:, None] + t
    phys = jnp.take_along_axis(table, pos // page, axis=1, mode="clip")  # [B, T]
    if counts is not None:
        phys = jnp.where(t < counts[:, None], phys, pool.shape[2 if layout == "HND" else 1])
    slot = pos % page
    if layer is None:
        if layout == "HND":  # pool[:, :, phys, slot]: [L, H, B, T, D]
            return pool.at[:, :, phys, slot].set(jnp.transpose(x, (0, 2, 1, 3, 4)), mode="drop")
        return pool.at[:, phys, slot].set(jnp.transpose(x, (0, 1, 3, 2, 4)), mode="drop")
    xt = jnp.swapaxes(x, 1, 2)  # [B, T, H, D]: what pool[layer, (:,) phys, slot] is, either layout
    if layout == "HND":
        return pool.at[layer, :, phys, slot].set(xt, mode="drop")
    return pool.at[layer, phys, slot].set(xt, mode="drop")


def paged_gather(B, N, H, D, page, iters, target=None, sweep=False) -> Case:
    """Every sequence's N tokens of one layer into a dense [B, 2, H, N, D].

    Iteration i gathers layer i % 2: a gather of loop-invariant inputs would otherwise be hoisted
    out of the timed loop by XLA (and both layers together are twice the bytes for L2)."""
    token = 2 * H * D * BF16.itemsize
    pages_per_seq = -(-N // page)
    num_pages = B * pages_per_seq
    dense = B * N * token

    def build():
        pools, rest = _paged(num_pages, page, H, D, B, pages_per_seq, np.full(B, N), 90, 2)
        out = rand((B, 2, H, N, D), BF16, 92)
        consts = dict(pools=pools, rest=rest)

        def kernel(i, out, c):
            return _cache(c["pools"], c["rest"]).gather(i % 2, N)

        def take(i, out, c):
            table, lengths = c["rest"]["page_table"], c["rest"]["lengths"]
            dense = []
            for pool in c["pools"]:
                pool = lax.dynamic_index_in_dim(pool, i % 2, 0, keepdims=False)
                g = jnp.take(pool, table, axis=1, mode="clip")  # [H, B, pages, page, D]
                g = jnp.moveaxis(g, 1, 0).reshape(B, H, pages_per_seq * page, D)[:, :, :N]
                live = jnp.arange(N)[None, None, :, None] < lengths[:, None, None, None]
                dense.append(jnp.where(live, g, 0))
            return jnp.stack(dense, axis=1)

        return out, consts, kernel, {"take": take}

    return Case("paged_gather", f"B{B} N{N} H{H} D{D} page {page}", build, 2 * dense,
                2 * num_pages * page * token, iters,
                target=target, requires=("PagedKVCache",), sweep=sweep, series=f"page {page}",
                peer="paged_gather", params=dict(N=N, page=page))


def paged_compact(B, N, H, D, page, iters, target=None) -> Case:
    """PagedKVCache.compact: the page table and lengths move, the pages do not."""
    token = 2 * H * D * BF16.itemsize
    pages_per_seq = -(-N // page)
    num_pages = B * pages_per_seq
    lengths, mapping, _, _ = evict_half(B, N, seed=9)

    def build():
        pools, rest = _paged(num_pages, page, H, D, B, pages_per_seq, lengths, 95)

        def kernel(i, cache, m):
            return cache.compact(m)

        return _cache(pools, rest), i32(mapping), kernel, {}

    return Case("paged_compact", f"B{B} N{N} H{H} D{D} page {page}", build, 0,
                num_pages * page * token, iters, target=target, requires=("PagedKVCache",),
                note="min bytes 0: only the page table and lengths (O(batch)) may move")


# --- attention (jaxkv.attention) ------------------------------------------------------------------


def _dense_attention(q, k, v, lengths, positions=None, window=None, soft_cap=None, sinks=None):
    """XLA's masked dense attention over every position (what a reader without a kernel does):
    q [B, T, Hq, D], k/v [B, Hkv, S, D]; query t of row b sees keys <= lengths[b] + t, with
    ``window`` only the last ``window`` of them. ``positions``: int32 [B, S], each key's position
    (default: its index). ``soft_cap``: scores (after the scale) become ``soft_cap * tanh(s /
    soft_cap)``; ``sinks`` (float32 [Hq]): a logit per head in the softmax's denominator only."""
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    last = (lengths[:, None] + jnp.arange(T)[None, :])[:, :, None]  # [B, T, 1]
    pos = (jnp.arange(S)[None, :] if positions is None else positions)[:, None, :]  # [B|1, 1, S]
    visible = pos <= last
    if window is not None:
        visible &= pos > last - window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:  # the sink as one more logit, dropped after the softmax
        sink = jnp.broadcast_to(sinks.reshape(1, Hkv, G, 1, 1), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    p = p.astype(v.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(B, T, Hq, D)


def _window_pages(c, layer, first, count: int, dtype=BF16):
    """XLA's read of only the pages a window touches: for each row b the pages holding positions
    ``[first[b], first[b] + count)`` (one more than ``count`` needs where they do not start on a
    page), taken from layer ``layer`` of the paged cache ``c`` with ``jnp.take``: ``(k, v,
    positions)``, k/v [B, H, n, D] (an 8-bit cache's dequantized into ``dtype``), positions
    int32 [B, n]. Pages past the table's end are clipped to its last entry; their positions lie
    past every row's length, so a causal mask drops them."""
    page, B = c.page_size, c.page_table.shape[0]
    n = min(-(-count // page) + 1, c.max_pages_per_seq)
    idx = first[:, None] // page + jnp.arange(n)[None, :]  # [B, n] logical pages
    pages = jnp.take_along_axis(c.page_table, jnp.minimum(idx, c.max_pages_per_seq - 1), axis=1)
    positions = (idx[:, :, None] * page + jnp.arange(page)).reshape(B, n * page)

    def take(pool):  # pool [L, P, S, H, ...] (NHD) or [L, H, P, S, ...] (HND)
        pool = lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)
        if c.layout == "NHD":  # [B, n, S, H, ...] -> [B, H, n * S, ...]
            g = jnp.take(pool, pages, axis=0, mode="clip")
            return jnp.moveaxis(g.reshape(B, n * page, *g.shape[3:]), 2, 1)
        g = jnp.moveaxis(jnp.take(pool, pages, axis=1, mode="clip"), 0, 1)  # [B, H, n, S, ...]
        return g.reshape(*g.shape[:2], n * page, *g.shape[4:])

    k, v = take(c.k_pages), take(c.v_pages)
    if c.scaling == "per_token_head":  # the scale pools are pools without D
        k = reference.dequantize(k, take(c.k_scales), dtype)
        v = reference.dequantize(v, take(c.v_scales), dtype)
    elif c.scaling is not None:  # per tensor: the layer's scale
        k = reference.dequantize(k, c.k_scales[layer][None], dtype)
        v = reference.dequantize(v, c.v_scales[layer][None], dtype)
    return k, v, positions


def _kv_bytes(lengths, H, D, dtype=None, scaling="per_token_head") -> int:
    """K and V bytes of the live tokens (an 8-bit cache's: data and per-token-head scales)."""
    elem, scale = _scale_bytes(dtype, scaling)
    return int(np.sum(lengths)) * 2 * H * (D * elem + scale)


def attention_flops(prefix, new, Hq: int, D: int, window=None) -> int:
    """FLOPs of a causal prefill's work alone: 4 * D per visible (query, key) pair and query
    head (QK^T and PV, a multiply-add each). Row b's new queries sit at positions p in
    [prefix[b], prefix[b] + new[b]) and see min(window, p + 1) keys: with x = p + 1 running
    over [a, z], a = prefix + 1, z = prefix + new, that is sum(min(window, x))."""
    a = np.asarray(prefix, np.int64) + 1
    z = a - 1 + np.asarray(new, np.int64)
    w = np.iinfo(np.int64).max if window is None else int(window)
    tri = lambda n: n * (n + 1) // 2  # 1 + ... + n
    # x <= w counts x; past it, w each
    pairs = tri(np.minimum(z, w)) - tri(np.minimum(a - 1, w)) + w * np.maximum(
        0, z - np.maximum(a - 1, w))
    return 4 * D * Hq * int(pairs.sum())


def _with_output(target, out_bytes: int, cache_bytes: int):
    """``target`` allowing a new output of ``out_bytes`` beside the cache: a prefill does not
    write over the donated queries, and its targets are about its time."""
    if target is None:
        return None
    return dataclasses.replace(target, mem_frac=target.mem_frac + out_bytes / cache_bytes)


def _paged_pools(L, B, pages_per_seq, page, H, D, lengths, layout, seed, elem=None):
    """A PagedKVCache of random pools (``elem``: their dtype, bf16 by default) whose rows own
    shuffled pages, built without the allocator (numpy page table: cheap at any size, and
    traceable with abstract pools)."""
    num_pages = B * pages_per_seq
    shape = (L, H, num_pages, page, D) if layout == "HND" else (L, num_pages, page, H, D)
    table = np.random.default_rng(seed).permutation(num_pages).reshape(B, pages_per_seq)
    elem = BF16 if elem is None else elem
    return jaxkv.PagedKVCache(
        k_pages=rand(shape, elem, seed), v_pages=rand(shape, elem, seed + 1),
        page_table=i32(table), lengths=i32(lengths), ref_counts=i32(np.ones(num_pages)),
        new_tokens=i32(np.zeros(B)), layout=layout)


def quantized(cache, dtype, scaling="per_token_head"):
    """``cache`` (bf16, random values) as an 8-bit cache with per-token-head scales: its values
    quantized as ``append`` would (jaxkv.reference.quantize), same geometry and page table.
    ``scaling="per_tensor"`` (paged caches): scale 1.0 for every layer, the values rounded into
    ``dtype`` as they are (a bf16 normal sample fits e4m3's range): the cache FlashInfer reads."""
    if dtype is None:
        return cache
    if scaling == "per_tensor":
        (kq, _), (vq, _) = (_quantize(x, dtype, 1.0) for x in (cache.k_pages, cache.v_pages))
        layers = (cache.k_pages.shape[0],)
        ones = (jax.ShapeDtypeStruct(layers, jnp.float32) if isinstance(kq, jax.ShapeDtypeStruct)
                else jnp.ones(layers, jnp.float32))
        return dataclasses.replace(cache, k_pages=kq, v_pages=vq, k_scales=ones, v_scales=ones,
                                   scaling="per_tensor")
    if isinstance(cache, jaxkv.PagedKVCache):
        (kq, ks), (vq, vs) = (_quantize(x, dtype) for x in (cache.k_pages, cache.v_pages))
        return dataclasses.replace(cache, k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs,
                                   scaling="per_token_head")
    if isinstance(cache, jaxkv.KVCacheManager):  # a buffer per layer [B, 2, H, S, D]
        pairs = [_quantize(layer, dtype) for layer in cache.layers]  # scales [B, 2, H, S]
        return dataclasses.replace(cache, layers=tuple(q for q, _ in pairs),
                                   k_scales=tuple(_half_of(s, 1, 0) for _, s in pairs),
                                   v_scales=tuple(_half_of(s, 1, 1) for _, s in pairs),
                                   scaling="per_token_head")
    q, s = _quantize(cache.buffer, dtype)  # [L, B, 2, H, S, D], scales [L, B, 2, H, S]
    return dataclasses.replace(cache, buffer=q, k_scales=_half_of(s, 2, 0),
                               v_scales=_half_of(s, 2, 1), scaling="per_token_head")


def _half_of(scales, axis, kind):
    """K's (kind 0) or V's (1) scales out of ``scales`` whose ``axis`` is the K/V pair (abstract
    for abstract ``scales``)."""
    if isinstance(scales, jax.ShapeDtypeStruct):
        shape = scales.shape[:axis] + scales.shape[axis + 1:]
        return jax.ShapeDtypeStruct(shape, scales.dtype)
    return lax.index_in_dim(scales, kind, axis, keepdims=False)


def _quantize(x, dtype, scale=None):
    """``reference.quantize``, abstract for abstract ``x`` (the trace test's inputs)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.eval_shape(lambda x: reference.quantize(x, dtype, scale), x)
    return _quantize_jit(x, dtype, scale)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_jit(x, dtype, scale):
    return reference.quantize(x, dtype, scale)


def _half(dtype) -> bool:
    """A 16-bit cache other than the default bf16 (float16): no scales, no quantization."""
    return dtype is not None and np.dtype(dtype).itemsize == 2


def _cache_label(dtype, scaling="per_token_head") -> str:
    """The case-name suffix of a cache that is not bf16 ("" for bf16; float16 without scaling)."""
    if dtype is None:
        return ""
    return f" {np.dtype(dtype).name}" + ("" if _half(dtype) else f" {scaling}")


def _scale_bytes(dtype, scaling="per_token_head") -> tuple[int, int]:
    """(bytes of a K/V element, bytes of scales per token and head) of a cache dtype."""
    if dtype is None or _half(dtype):
        return 2, 0
    return 1, 4 if scaling == "per_token_head" else 0


OWN_KERNEL, CUDNN = "jaxkv kernel", "cuDNN"  # the paged default's other kernel, as a row


def _attention_xla(gather_dense, window_dense, beside: bool, op: str, cache, q, attend) -> dict:
    """An attention row's other formulations: XLA over the gathered rows, over the window's
    pages alone (``window_dense``, a window row), and beside the default (``beside``)."""
    xla = {"gather+dense": gather_dense}
    if window_dense is not None:
        xla["window pages+dense"] = window_dense
    if beside:
        xla.update(_beside_default(op, cache, q, attend))
    return xla


def _beside_default(op: str, cache, q, attend) -> dict:
    """The other kernel of a paged bf16 call as an extra row (GPU only): jaxkv's own where the
    default goes to cuDNN (jaxkv/_cudnn.py), cuDNN's where it goes to jaxkv's (Hopper at head_dim
    128); the harness also reads its device time from the profiler. ``attend(i, q, c,
    implementation)``: the op."""
    A = jaxkv.attention
    if jax.default_backend() != "gpu" or A._cudnn.unusable(cache, q.dtype, False):
        return {}
    src = A._source(op, cache, 0)
    plain = A._hybrid(op, None, None, None, q.shape[-2], src.capacity)  # no window, cap, sinks
    default = A._implementation(op, None, cache, q, None, None, src, plain)
    if default == "cudnn":
        return {OWN_KERNEL: lambda i, q, c: attend(i, q, c, "jaxkv")}
    return {CUDNN: lambda i, q, c: attend(i, q, c, "cudnn")}


def _variant(window, soft_cap, sinks: bool, Hq: int, span: int, seed: int) -> tuple[str, dict]:
    """(the case-name suffix, the build's keywords of jaxkv.attention) of a hybrid-attention
    row: ``window``, ``soft_cap``, and with ``sinks`` a float32 [Hq] sink logit per head near
    log(``span``), the keys a query sees, so that the sink takes a visible share of the softmax."""
    parts = ([f"window {window}"] if window is not None else []) + (
        [f"soft cap {soft_cap:g}"] if soft_cap is not None else []) + (["sinks"] if sinks else [])
    kwargs = dict(window=window, soft_cap=soft_cap)
    if sinks:
        rng = np.random.default_rng(seed)
        kwargs["sinks"] = np.float32(np.log(span)) + rng.standard_normal(Hq).astype(np.float32)
    return (" " + ", ".join(parts) if parts else ""), kwargs


def _hybrid_args(kwargs: dict) -> dict:
    """The keywords of jaxkv.attention (and of _dense_attention) that are set: sinks as an array."""
    out = {k: v for k, v in kwargs.items() if v is not None}
    if "sinks" in out:
        out["sinks"] = jnp.asarray(out["sinks"])
    return out


def attention_decode_paged(B, N, Hq, H, D, page, layout, iters, target=None, dtype=None,
                           scaling="per_token_head", window=None, soft_cap=None,
                           sinks=False) -> Case:
    """One decode step of attention per op over a paged pool of 2 layers (layer i % 2), every
    row N tokens. The output is the next op's query, so nothing is loop-invariant. ``dtype``: an
    8-bit cache in place of bf16, scaled per token and head or (``scaling="per_tensor"``, the
    one FlashInfer's fp8 decode can read, so the one with its peer) per layer; float16: the
    cache and the queries in float16, cuDNN's kernel beside jaxkv's as for bf16.

    Hybrid attention (jaxkv's kernels only: cuDNN serves none of it): ``window`` (each query
    sees its last ``window`` tokens: the minimum bytes are those inside the window, and XLA's
    formulations are the whole rows masked and the window's pages alone), ``soft_cap``, and
    ``sinks`` (a sink logit per head); FlashInfer beside the bf16 ones without sinks."""
    pages_per_seq = -(-N // page)
    num_pages = B * pages_per_seq
    lengths = np.full(B, N)
    values, eight_bit = (dtype, None) if _half(dtype) else (BF16, dtype)  # values' dtype
    seen = lengths if window is None else np.minimum(lengths, window)  # keys a query sees
    suffix, hybrid = _variant(window, soft_cap, sinks, Hq, int(seen.max()), 113)
    plain = not suffix

    def build():
        cache = quantized(_paged_pools(2, B, pages_per_seq, page, H, D, lengths, layout, 110,
                                       values), eight_bit, scaling)
        q = rand((B, Hq, D), values, 112)
        hy = _hybrid_args(hybrid)

        def kernel(i, q, c):
            return jaxkv.attention.decode(q, c, i % 2, **hy)

        def gather_dense(i, q, c):
            k, v = c.gather(i % 2, N, split=True, dtype=None if eight_bit is None else BF16)
            return _dense_attention(q[:, None], k, v, c.lengths - 1, **hy)[:, 0]

        def window_dense(i, q, c):  # only the pages the window touches
            k, v, pos = _window_pages(c, i % 2, jnp.maximum(c.lengths - window, 0), window)
            return _dense_attention(q[:, None], k, v, c.lengths - 1, pos, **hy)[:, 0]

        def attend(i, q, c, implementation):
            return jaxkv.attention.decode(q, c, i % 2, implementation=implementation)

        xla = _attention_xla(gather_dense, window_dense if window is not None else None,
                             eight_bit is None and plain, "attention.decode", cache, q, attend)
        return q, cache, kernel, xla

    elem, scale = _scale_bytes(dtype, scaling)
    token = 2 * H * (D * elem + scale)
    label = _cache_label(dtype, scaling)
    peer = (dtype is None or scaling == "per_tensor") and not sinks
    return Case("attention_decode", f"paged {layout} B{B} N{N} {Hq}/{H} heads D{D} page {page}"
                f"{label}{suffix}", build,
                _kv_bytes(seen, H, D, dtype, scaling) + 2 * B * Hq * D * BF16.itemsize
                + (4 * Hq if sinks else 0),
                2 * num_pages * page * token, iters, target=target,
                requires=("attention",), series=f"paged {layout}{label}{suffix}",
                note="min bytes: the live K/V tokens read once (8-bit: data and scales), plus q "
                "and the output" + ("; with a window only the tokens inside it" if window else ""),
                peer="attention" if peer else "",
                params=dict(layout=layout, window=window, soft_cap=soft_cap))


def attention_decode_linear(B, S, Hq, H, D, ragged, iters, target=None, dtype=None) -> Case:
    """Decode attention on one layer of a 2-layer LinearKVCache, read in place; ragged: lengths
    uniform in [1, S] (mean S/2), so time should follow the live bytes. ``dtype``: 8-bit, or
    float16 (cache and queries)."""
    rng = np.random.default_rng(13)
    lengths = rng.integers(1, S + 1, B) if ragged else np.full(B, S)
    values, eight_bit = (dtype, None) if _half(dtype) else (BF16, dtype)  # values' dtype

    def build():
        cache = jaxkv.LinearKVCache(buffer=rand((2, B, 2, H, S, D), values, 120),
                                    lengths=i32(lengths), active_batch_size=jnp.asarray(B, jnp.int32))
        cache = quantized(cache, eight_bit)
        q = rand((B, Hq, D), values, 121)

        def kernel(i, q, c):
            return jaxkv.attention.decode(q, c, i % 2)

        def dense(i, q, c):
            layer = lax.dynamic_index_in_dim(c.buffer, i % 2, 0, keepdims=False)
            k, v = layer[:, 0], layer[:, 1]
            if eight_bit is not None:  # dequantized by XLA, fused into the attention's reads
                ks = lax.dynamic_index_in_dim(c.k_scales, i % 2, 0, keepdims=False)
                vs = lax.dynamic_index_in_dim(c.v_scales, i % 2, 0, keepdims=False)
                k, v = reference.dequantize(k, ks, BF16), reference.dequantize(v, vs, BF16)
            return _dense_attention(q[:, None], k, v, c.lengths - 1)[:, 0]

        return q, cache, kernel, {"dense": dense}

    kind = f"ragged mean {int(np.mean(lengths))}" if ragged else "full"
    elem, scale = _scale_bytes(dtype)
    label = _cache_label(dtype)
    return Case("attention_decode", f"linear B{B} S{S} {kind} {Hq}/{H} heads D{D}{label}", build,
                _kv_bytes(lengths, H, D, dtype) + 2 * B * Hq * D * BF16.itemsize,
                2 * B * 2 * H * S * (D * elem + scale), iters, target=target,
                requires=("attention",), series=f"linear{label}",
                note="min bytes: the live tokens only (not the capacity)")


def attention_decode_manager(B, S, Hq, H, D, iters, target=None, dtype=None) -> Case:
    """Decode attention on layer 0 of a 2-layer KVCacheManager (a buffer per layer), every row S
    tokens, read in place (the manager's layer index is static: the loop reads one layer).
    ``dtype``: 8-bit (scaled per token and head), or float16 (cache and queries)."""
    lengths = np.full(B, S)
    values, eight_bit = (dtype, None) if _half(dtype) else (BF16, dtype)  # values' dtype

    def build():
        layers = tuple(rand((B, 2, H, S, D), values, 150 + j) for j in range(2))
        cache = jaxkv.KVCacheManager(layers=layers, lengths=i32(lengths),
                                     active_batch_size=jnp.asarray(B, jnp.int32))
        cache = quantized(cache, eight_bit)
        q = rand((B, Hq, D), values, 152)

        def kernel(i, q, c):
            return jaxkv.attention.decode(q, c, 0)

        def dense(i, q, c):
            k, v = c.layers[0][:, 0], c.layers[0][:, 1]
            if eight_bit is not None:  # dequantized by XLA, fused into the attention's reads
                k = reference.dequantize(k, c.k_scales[0], BF16)
                v = reference.dequantize(v, c.v_scales[0], BF16)
            return _dense_attention(q[:, None], k, v, c.lengths - 1)[:, 0]

        return q, cache, kernel, {"dense": dense}

    elem, scale = _scale_bytes(dtype)
    label = _cache_label(dtype)
    return Case("attention_decode", f"manager B{B} S{S} full {Hq}/{H} heads D{D}{label}", build,
                _kv_bytes(lengths, H, D, dtype) + 2 * B * Hq * D * BF16.itemsize,
                2 * B * 2 * H * S * (D * elem + scale), iters, target=target,
                requires=("attention", "KVCacheManager"), series=f"manager{label}",
                note="min bytes: the live tokens only (not the capacity)")


def attention_prefill_paged(B, prefix, T, Hq, H, D, page, iters, target=None,
                            dtype=None, window=None, soft_cap=None, sinks=False) -> Case:
    """Chunked prefill: T new tokens per row (already appended) attend causally over a cached
    prefix of `prefix` tokens; 2 layers (layer i % 2), the output feeds the next op's queries.
    ``dtype``: an 8-bit cache (per-token-head scales) in place of bf16. ``window``, ``soft_cap``,
    ``sinks``: hybrid attention, as in ``attention_decode_paged`` (with a window the minimum
    bytes are the keys some query of the row sees: the last ``window + T - 1``)."""
    pages_per_seq = -(-(prefix + T) // page)
    num_pages = B * pages_per_seq
    lengths = np.full(B, prefix)
    total = lengths + T
    seen = total if window is None else np.minimum(total, window + T - 1)  # keys any query sees
    span = int(total.max()) if window is None else min(int(total.max()), window)
    suffix, hybrid = _variant(window, soft_cap, sinks, Hq, span, 133)
    plain = not suffix

    def build():
        cache = quantized(_paged_pools(2, B, pages_per_seq, page, H, D, lengths, "NHD", 130),
                          dtype)
        q = rand((B, T, Hq, D), BF16, 132)
        new = i32(np.full(B, T))
        hy = _hybrid_args(hybrid)

        def kernel(i, q, c):
            return jaxkv.attention.prefill(q, c, i % 2, new, **hy)

        def gather_dense(i, q, c):  # the new tokens are appended, not committed: lengths + T
            k, v = dataclasses.replace(c, lengths=c.lengths + T).gather(
                i % 2, prefix + T, split=True, dtype=None if dtype is None else BF16)
            return _dense_attention(q, k, v, c.lengths, **hy)

        def window_dense(i, q, c):  # only the pages some query's window touches
            first = jnp.maximum(c.lengths - window + 1, 0)
            k, v, pos = _window_pages(c, i % 2, first, window + T - 1)
            return _dense_attention(q, k, v, c.lengths, pos, **hy)

        def attend(i, q, c, implementation):
            return jaxkv.attention.prefill(q, c, i % 2, new, implementation=implementation)

        xla = _attention_xla(gather_dense, window_dense if window is not None else None,
                             dtype is None and plain, "attention.prefill", cache, q, attend)
        return q, cache, kernel, xla

    label = _cache_label(dtype)
    elem, scale = _scale_bytes(dtype)
    cache_bytes = 2 * num_pages * page * 2 * H * (D * elem + scale)
    out_bytes = B * T * Hq * D * BF16.itemsize
    return Case("attention_prefill", f"paged NHD B{B} {T} new on {prefix} {Hq}/{H} heads D{D} "
                f"page {page}{label}{suffix}", build,
                _kv_bytes(seen, H, D, dtype) + 2 * out_bytes + (4 * Hq if sinks else 0),
                cache_bytes, iters, target=_with_output(target, out_bytes, cache_bytes),
                requires=("attention",), series=f"paged prefill{label}{suffix}",
                note="compute-bound: the bandwidth column is only the bytes read once"
                + ("; with a window only the keys some query sees" if window else ""),
                peer="attention" if dtype is None and not sinks else "",
                params=dict(layout="NHD", T=T, window=window, soft_cap=soft_cap),
                flops=attention_flops(lengths, np.full(B, T), Hq, D, window))


def serving_step(B, total, most, max_prefix, seed) -> tuple[np.ndarray, np.ndarray]:
    """(cached lengths, new tokens) of the rows of one serving step: a quarter decode rows (one
    token), the rest prefill chunks of at most ``most`` tokens, ``total`` new tokens in all, in
    random order, on cached prefixes uniform in [0, max_prefix]."""
    rng = np.random.default_rng(seed)
    decode = B // 4
    new = np.concatenate([np.ones(decode, np.int64),
                          split(total - decode, B - decode, most, seed + 1)])
    return rng.integers(0, max_prefix + 1, B), rng.permutation(new)


def attention_prefill_ragged(B, total, most, max_prefix, Hq, H, D, page, iters,
                             target=None) -> Case:
    """The chunked prefill of a serving step (``serving_step``): rows of 1 to ``most`` new
    tokens (already appended) on cached prefixes of random length, each row's count passed as
    prefill's ``q_lengths``, q padded to the longest. Paged NHD bf16, 2 layers (layer i % 2),
    the output the next op's queries, as ``attention_prefill_paged``."""
    lengths, new = serving_step(B, total, most, max_prefix, 150)
    T, S = int(new.max()), int((lengths + new).max())
    pages_per_seq = -(-S // page)
    num_pages = B * pages_per_seq

    def build():
        cache = _paged_pools(2, B, pages_per_seq, page, H, D, lengths, "NHD", 151)
        q = rand((B, T, Hq, D), BF16, 152)
        counts = i32(new)

        def kernel(i, q, c):
            return jaxkv.attention.prefill(q, c, i % 2, counts)

        def gather_dense(i, q, c):  # the padding's queries give zeros, as prefill's
            k, v = dataclasses.replace(c, lengths=c.lengths + counts).gather(i % 2, S, split=True)
            live = (jnp.arange(T)[None, :] < counts[:, None])[:, :, None, None]
            return jnp.where(live, _dense_attention(q, k, v, c.lengths), 0).astype(q.dtype)

        def attend(i, q, c, implementation):
            return jaxkv.attention.prefill(q, c, i % 2, counts, implementation=implementation)

        xla = _attention_xla(gather_dense, None, True, "attention.prefill", cache, q, attend)
        return q, cache, kernel, xla

    cache_bytes = 2 * num_pages * page * 2 * H * D * BF16.itemsize
    return Case("attention_prefill", f"paged NHD serving step B{B} {total} new ragged on cached "
                f"prefixes {Hq}/{H} heads D{D} page {page}", build,
                _kv_bytes(lengths + new, H, D) + 2 * total * Hq * D * BF16.itemsize,
                cache_bytes, iters, requires=("attention",), series="paged prefill, serving step",
                target=_with_output(target, B * T * Hq * D * BF16.itemsize, cache_bytes),
                note=f"compute-bound: the bandwidth column is only the bytes read once; "
                f"{B // 4} decode rows, chunks of up to {most}, prefixes in [0, {max_prefix}]",
                peer="attention", params=dict(layout="NHD", T=T, new=new),
                flops=attention_flops(lengths, new, Hq, D))


def attention_prefill_linear(B, prefix, T, Hq, H, D, iters, target=None) -> Case:
    """Chunked prefill over one layer of a 2-layer LinearKVCache (cuDNN cannot read it): T new
    tokens per row (already written) attend causally over a prefix of `prefix` tokens."""
    S = prefix + T

    def build():
        cache = jaxkv.LinearKVCache(buffer=rand((2, B, 2, H, S, D), BF16, 140),
                                    lengths=i32(np.full(B, prefix)),
                                    active_batch_size=jnp.asarray(B, jnp.int32))
        q = rand((B, T, Hq, D), BF16, 141)
        new = i32(np.full(B, T))

        def kernel(i, q, c):
            return jaxkv.attention.prefill(q, c, i % 2, new)

        def dense(i, q, c):
            layer = lax.dynamic_index_in_dim(c.buffer, i % 2, 0, keepdims=False)
            return _dense_attention(q, layer[:, 0], layer[:, 1], c.lengths)

        return q, cache, kernel, {"dense": dense}

    return Case("attention_prefill", f"linear B{B} {T} new on {prefix} {Hq}/{H} heads D{D}", build,
                _kv_bytes(np.full(B, S), H, D) + 2 * B * T * Hq * D * 2,
                2 * B * 2 * H * S * D * BF16.itemsize, iters, target=target,
                requires=("attention",), series="linear prefill",
                note="compute-bound: the bandwidth column is only the bytes read once",
                params=dict(T=T), flops=attention_flops(np.full(B, prefix), np.full(B, T), Hq, D))


# --- the sizes ------------------------------------------------------------------------------------

T_COMPACT = Target(">= 85% of copy BW on live bytes; >= 5x XLA (take)", copy_frac=0.85,
                   speedup=5)
T_HETERO = Target("one launch; >= 85% of copy BW", copy_frac=0.85, one_launch=True)
T_SAVE = Target(">= 85% of copy BW at >= 64 MB; >= 5x XLA", copy_frac=0.85, speedup=5)
T_SLOTS = Target(">= 85% of copy BW on bytes written", copy_frac=0.85)
T_DECODE = Target("<= 5 us; beats .at[].set", max_us=5.0, beats_xla=True)
T_PREFILL = Target(">= 80% of copy BW", copy_frac=0.80)
T_PAGED = Target(">= 85% of copy BW; <= the fastest peer", copy_frac=0.85, beats_peers=True)
T_PAGED_DECODE = Target("<= the fastest peer", beats_peers=True)
T_PAGED_COMPACT = Target("O(batch) bytes: no KV data moved", no_kv_bytes=True)
T_ATTN_DECODE = Target(">= 90% of copy BW on the KV bytes read", copy_frac=0.90)
T_ATTN_FILLED = Target(">= 80% of copy BW where the bytes fill the GPU", copy_frac=0.80)
T_ATTN_LIVE = Target("reads live tokens only: >= 90% of copy BW on live bytes", copy_frac=0.90)
# Issue 68 (prefill at FlashAttention-3's level), on the causal work's FLOPs (attention_flops).
T_PREFILL_FA3 = Target(">= 600 TFLOP/s; >= 1.3x FlashInfer's fastest backend", min_tflops=600,
                       peer_speedup=1.3)
T_SERVING_PREFILL = Target(">= 500 TFLOP/s", min_tflops=500)


def t_quant_append(bf16: Case) -> Target:
    return Target("within 1.1x of the same bf16 write's device time (the row without 'into')",
                  versus=(bf16.name, 1.1))


def t_prefill_8bit(bf16: Case) -> Target:
    return Target(">= 1.4x the bf16 prefill's speed (the row without float8)",
                  versus=(bf16.name, 1 / 1.4))


def t_attn_8bit(bf16: Case) -> Target:
    return Target(">= 85% of copy BW on the bytes read (data + scales); >= 1.7x the bf16 row",
                  copy_frac=0.85, versus=(bf16.name, 1 / 1.7))


def hybrid_decode(B, N, Hq, H, D, page, window, iters, dtype=None) -> list[Case]:
    """The issue's hybrid-attention decode rows on the paged NHD decode of this size (``dtype``:
    its 8-bit cache, per-token-head scales): a ``window``, soft cap 50, sinks, and both; each
    timed against the full decode row of the same dtype (``attention_decode_paged`` of the same
    arguments), which must be in the same run (``bench.main`` adds it). FlashInfer beside the
    bf16 window and soft-cap rows (it reads no per-token-head scales and has no sinks)."""
    make = functools.partial(attention_decode_paged, B, N, Hq, H, D, page, "NHD", iters,
                             dtype=dtype)
    full = make().name
    eight = dtype is not None
    window_target = Target(
        "<= 30% of the full decode's time (the row without 'window'); >= 85% of copy BW on the "
        "bytes inside the window" + (" (data + scales)" if eight else
                                     "; >= 4x FlashInfer's window decode"),
        copy_frac=0.85, versus=(full, 0.30), peer_speedup=None if eight else 4.0)
    plain = Target("<= 1.05x the plain decode's time (the row without soft cap and sinks)",
                   versus=(full, 1.05))
    return [make(window_target, window=window), make(plain, soft_cap=50.0),
            make(plain, sinks=True), make(plain, soft_cap=50.0, sinks=True)]


def hybrid_prefill(B, prefix, T, Hq, H, D, page, window, iters, dtype=None) -> list[Case]:
    """The issue's hybrid-attention prefill rows on the paged NHD prefill of this size: a
    ``window`` and soft cap 50, each against the full prefill row of the same dtype (in the same
    run) and, in bf16, FlashInfer's prefill with the same window or cap."""
    make = functools.partial(attention_prefill_paged, B, prefix, T, Hq, H, D, page, iters,
                             dtype=dtype)
    full = make().name
    peer = dtype is None
    return [
        make(Target("<= 45% of the full prefill's time (the row without 'window')"
                    + ("; <= FlashInfer's window prefill" if peer else ""),
                    versus=(full, 0.45), beats_peers=peer), window=window),
        make(Target("<= 1.10x the plain prefill's time (the row without 'soft cap')"
                    + ("; <= FlashInfer's soft-cap prefill" if peer else ""),
                    versus=(full, 1.10), beats_peers=peer), soft_cap=50.0),
    ]


MIXED = [(8, 128), (4, 256), (16, 64), (2, 128)]
EIGHT_BIT = (jnp.float8_e4m3fn, jnp.int8)


def t_window_step(plain: Case) -> Target:
    """The issue's line for a window layer's decode step: within 1.1x of today's (``plain``)."""
    return Target("within 1.1x of the step without a window (the row without 'window'), "
                  "loop time", versus=(plain.name, 1.1), versus_loop=True)


def cases(size: str) -> list[Case]:
    if size == "cpu":  # tiny: the whole run in well under a minute on two cores
        return [
            compact_linear(2, 8, 2, 128, 64, 3, T_COMPACT),
            compact_layers([(2, 64), (1, 128), (4, 32)], 8, 128, 3, T_HETERO),
            save(2, 2, 2, 256, 64, 128, 5, T_SAVE),
            instantiate(2, 2, 2, 256, 64, 128, 5, T_SAVE),
            instantiate_slots(2, 8, 2, 128, 64, 64, 8, 3, T_SLOTS),
            instantiate_linear(2, 2, 2, 256, 64, 128, 5),
            instantiate_linear(2, 2, 2, 256, 64, 128, 5, t_quant_append(
                instantiate_linear(2, 2, 2, 256, 64, 128, 5)), dtype=jnp.int8),
            append(16, 2, 128, 64, 1, 2, 20, ragged=False, target=T_DECODE),
            append(4, 2, 256, 64, 64, 2, 3, ragged=True, target=T_PREFILL),
            paged_append(4, 64, 160, 2, 64, 16, 2, 3, T_PAGED),
            paged_decode_append(16, 2, 64, 16, "NHD", 2, 20, T_PAGED_DECODE),
            paged_decode_append(16, 2, 64, 16, "HND", 1, 10, T_PAGED_DECODE, layers=4),
            paged_decode_append(16, 2, 64, 16, "NHD", 2, 20, dtype=jnp.float8_e4m3fn),
            paged_decode_step(8, 2, 64, 16, None, 64, 5),
            paged_decode_step(8, 2, 64, 16, 32, 64, 5, t_window_step(
                paged_decode_step(8, 2, 64, 16, None, 64, 5))),
            paged_append(4, 64, 160, 2, 64, 16, 2, 3, layout="NHD", dtype=jnp.int8),
            paged_gather(4, 128, 2, 64, 16, 3, Target(">= 80% of copy BW", copy_frac=0.80)),
            paged_compact(8, 128, 2, 64, 16, 10, T_PAGED_COMPACT),
            attention_decode_paged(4, 128, 8, 2, 64, 16, "HND", 3, T_ATTN_DECODE),
            attention_decode_linear(4, 128, 8, 2, 64, True, 3, T_ATTN_LIVE),
            attention_decode_manager(4, 128, 8, 2, 64, 3, T_ATTN_DECODE),
            attention_decode_manager(4, 128, 8, 2, 64, 3, dtype=jnp.int8),
            attention_decode_paged(4, 128, 8, 2, 64, 16, "NHD", 3, dtype=jnp.float16),
            attention_decode_paged(4, 128, 8, 2, 64, 16, "NHD", 3, t_attn_8bit(
                attention_decode_paged(4, 128, 8, 2, 64, 16, "NHD", 3)),
                                   dtype=jnp.float8_e4m3fn),
            attention_decode_paged(4, 128, 8, 2, 64, 16, "HND", 3, dtype=jnp.float8_e4m3fn,
                                   scaling="per_tensor"),
            # Hybrid attention (window 32 of 128, soft cap, sinks) against the full NHD rows.
            attention_decode_paged(4, 128, 8, 2, 64, 16, "NHD", 3, T_ATTN_DECODE),
            *[c for dt in (None, jnp.float8_e4m3fn)
              for c in hybrid_decode(4, 128, 8, 2, 64, 16, 32, 3, dtype=dt)],
            attention_prefill_paged(2, 32, 32, 8, 2, 64, 16, 2, T_PREFILL_FA3),
            attention_prefill_paged(2, 32, 32, 8, 2, 64, 16, 2, t_prefill_8bit(
                attention_prefill_paged(2, 32, 32, 8, 2, 64, 16, 2)), dtype=jnp.float8_e4m3fn),
            *[c for dt in (None, jnp.float8_e4m3fn)
              for c in hybrid_prefill(2, 32, 32, 8, 2, 64, 16, 16, 2, dtype=dt)],
            attention_prefill_linear(2, 32, 32, 8, 2, 64, 2),
            attention_prefill_ragged(8, 96, 32, 64, 8, 2, 64, 16, 2, T_SERVING_PREFILL),
        ]
    # The sizes on the H200, and a few smaller points per op for the plot.
    return [long_enough(c) for c in gpu_cases()]


def long_enough(case: Case, call_s: float = 0.01, bandwidth: float = 4e12) -> Case:
    """Enough iterations that one timed call lasts ~``call_s`` at ``bandwidth`` (dispatch and the
    host's wait then cost under 1%), between the case's own count and 2000."""
    per_op = case.min_bytes / bandwidth
    n = 2000 if per_op == 0 else int(np.ceil(call_s / (per_op * case.per_step)))
    return dataclasses.replace(case, iters=int(np.clip(n, case.iters, 2000)))


def gpu_cases() -> list[Case]:
    return [
        compact_linear(32, 32, 8, 4096, 128, 5, T_COMPACT),
        compact_linear(32, 32, 8, 1024, 128, 5, sweep=True),
        compact_linear(32, 32, 8, 2048, 128, 5, sweep=True),
        compact_layers(MIXED * 8, 32, 4096, 5, T_HETERO),
        *[save(32, 4, 8, 8192, 128, t, 10, T_SAVE) for t in (1024, 2048, 4096, 8192)],
        save(32, 4, 8, 8192, 128, 256, 20, sweep=True),
        *[instantiate(32, 4, 8, 8192, 128, t, 10, T_SAVE) for t in (1024, 2048, 4096, 8192)],
        instantiate(32, 4, 8, 8192, 128, 256, 20, sweep=True),
        instantiate_slots(32, 32, 8, 2048, 128, 1024, 32, 5, T_SLOTS),
        # A float prefix reused by an 8-bit cache: quantized on the way in, against the bf16 row.
        instantiate_linear(32, 4, 8, 8192, 128, 2048, 10),
        *[instantiate_linear(32, 4, 8, 8192, 128, 2048, 10, t_quant_append(
            instantiate_linear(32, 4, 8, 8192, 128, 2048, 10)), dtype=dt) for dt in EIGHT_BIT],
        append(256, 8, 1024, 128, 1, 8, 250, ragged=False, target=T_DECODE),
        append(8, 8, 8192, 128, 2048, 4, 5, ragged=True, target=T_PREFILL),
        append(8, 8, 8192, 128, 512, 4, 10, ragged=True, sweep=True),
        *[paged_append(8, 1024, 5000, 8, 128, page, 4, 10, T_PAGED, layout)
          for page in (16, 128) for layout in ("NHD", "HND")],
        # One decode step: one layer per launch (8 layers per loop step), and all 32 layers in
        # one launch (page 16 only: 32 layers of page-128 pools would be 17 GB each).
        *[paged_decode_append(b, 8, 128, page, layout, 8, 250, T_PAGED_DECODE)
          for b in (256, 1024) for page in (16, 128) for layout in ("NHD", "HND")],
        *[paged_decode_append(b, 8, 128, 16, layout, 1, 10, T_PAGED_DECODE, layers=32)
          for b in (256, 1024) for layout in ("NHD", "HND")],
        # 8-bit caches: quantized on the way in, against the same bf16 rows above.
        *[paged_decode_append(256, 8, 128, 16, "NHD", 8, 250, t_quant_append(
            paged_decode_append(256, 8, 128, 16, "NHD", 8, 250)), dtype=dt) for dt in EIGHT_BIT],
        paged_decode_step(64, 8, 128, 16, None, 2048, 100),
        paged_decode_step(64, 8, 128, 16, 1024, 2048, 100, t_window_step(
            paged_decode_step(64, 8, 128, 16, None, 2048, 100))),
        *[paged_decode_append(256, 8, 128, 16, "NHD", 1, 10, t_quant_append(
            paged_decode_append(256, 8, 128, 16, "NHD", 1, 10, layers=32)), layers=32, dtype=dt)
          for dt in EIGHT_BIT],
        *[paged_append(8, 1024, 5000, 8, 128, 16, 4, 10, t_quant_append(
            paged_append(8, 1024, 5000, 8, 128, 16, 4, 10, layout="NHD")), "NHD", dtype=dt)
          for dt in EIGHT_BIT],
        paged_gather(64, 4096, 8, 128, 16, 5, Target(">= 80% of copy BW", copy_frac=0.80)),
        paged_gather(64, 1024, 8, 128, 16, 10, sweep=True),
        paged_compact(64, 4096, 8, 128, 16, 100, T_PAGED_COMPACT),
        attention_decode_paged(64, 4096, 32, 8, 128, 16, "NHD", 20, T_ATTN_DECODE),
        attention_decode_paged(64, 4096, 32, 8, 128, 16, "HND", 20, T_ATTN_DECODE),
        attention_decode_linear(64, 4096, 32, 8, 128, False, 20, T_ATTN_DECODE),
        attention_decode_linear(64, 4096, 32, 8, 128, True, 20, T_ATTN_LIVE),
        attention_decode_manager(64, 4096, 32, 8, 128, 20, T_ATTN_DECODE),
        # float16 caches (issue 23 asks bf16 and f16 alike), cuDNN beside the paged ones
        *[attention_decode_paged(64, 4096, 32, 8, 128, 16, layout, 20, T_ATTN_DECODE,
                                 dtype=jnp.float16) for layout in ("NHD", "HND")],
        attention_decode_linear(64, 4096, 32, 8, 128, False, 20, T_ATTN_DECODE, dtype=jnp.float16),
        attention_decode_manager(64, 4096, 32, 8, 128, 20, T_ATTN_DECODE, dtype=jnp.float16),
        # Issue 23's other shapes: small batches (plot points: too few bytes to fill the GPU)
        # and head dims 64 / 256 at the same bytes.
        *[attention_decode_paged(b, 4096, 32, 8, 128, 16, "NHD", 20) for b in (1, 4, 16)],
        attention_decode_paged(64, 4096, 32, 16, 64, 16, "NHD", 20, T_ATTN_FILLED),
        attention_decode_paged(64, 4096, 32, 4, 256, 16, "NHD", 20, T_ATTN_FILLED),
        # fp8 scaled per layer (scale 1): the 8-bit cache FlashInfer's decode reads, its peer.
        *[attention_decode_paged(64, 4096, 32, 8, 128, 16, layout, 20, dtype=jnp.float8_e4m3fn,
                                 scaling="per_tensor") for layout in ("NHD", "HND")],
        *[attention_decode_paged(64, 4096, 32, 8, 128, 16, layout, 20, t_attn_8bit(
            attention_decode_paged(64, 4096, 32, 8, 128, 16, layout, 20)), dtype=dt)
          for dt in EIGHT_BIT for layout in ("NHD", "HND")],
        *[attention_decode_linear(64, 4096, 32, 8, 128, False, 20, t_attn_8bit(
            attention_decode_linear(64, 4096, 32, 8, 128, False, 20)), dtype=dt)
          for dt in EIGHT_BIT],
        *[attention_decode_manager(64, 4096, 32, 8, 128, 20, t_attn_8bit(
            attention_decode_manager(64, 4096, 32, 8, 128, 20)), dtype=dt) for dt in EIGHT_BIT],
        # Hybrid attention (the speed table): a window of 1024, soft cap 50, sinks, in
        # bf16 and fp8 (per-token-head scales), each against the full row of its dtype above.
        *[c for dt in (None, jnp.float8_e4m3fn)
          for c in hybrid_decode(64, 4096, 32, 8, 128, 16, 1024, 20, dtype=dt)],
        # Issue 68's prefill rows (the full rows the fp8, window and soft-cap rows compare with).
        attention_prefill_paged(8, 2048, 2048, 32, 8, 128, 16, 3, T_PREFILL_FA3),
        attention_prefill_paged(8, 2048, 2048, 16, 8, 256, 16, 3, T_PREFILL_FA3),  # Gemma 3
        attention_prefill_paged(8, 2048, 2048, 32, 8, 128, 16, 3, t_prefill_8bit(
            attention_prefill_paged(8, 2048, 2048, 32, 8, 128, 16, 3)), dtype=jnp.float8_e4m3fn),
        *[c for dt in (None, jnp.float8_e4m3fn)
          for c in hybrid_prefill(8, 2048, 2048, 32, 8, 128, 16, 1024, 3, dtype=dt)],
        attention_prefill_linear(8, 2048, 2048, 32, 8, 128, 3),
        attention_prefill_ragged(64, 5000, 512, 4096, 32, 8, 128, 16, 3, T_SERVING_PREFILL),
    ]


OPS = ("compact_kv_cache", "save_kv_cache", "instantiate_kv_cache", "append", "paged_append",
       "paged_decode_step",
       "paged_gather", "paged_compact", "attention_decode", "attention_prefill", "increment_lengths")


def increment_lengths_costs(max_batch: int, n: int, reps: int) -> dict:
    """Per-iteration time of a decode-like length update, three ways, to decide whether
    ``increment_lengths`` should be a kernel: the neighbours alone, with ``lengths + 1`` fused into
    them, and with the increment replaced by one custom call (``compact_tensor_batch`` with the
    identity mapping, the cheapest jaxkv launch on a [max_batch] int32 array). The differences
    are a fraction of a microsecond, so the three loops are timed in turn, repetition by
    repetition (drift hits all three alike), three times as often as the other cases."""
    capacity = 4096

    def neighbours(lengths, active):  # what a decode step does around the increment
        return jnp.where(active & (lengths < capacity), lengths, 0)

    def base(i, c, k):
        return neighbours(c, k["active"] ^ (i < 0))

    def fused(i, c, k):
        return neighbours(c + 1, k["active"] ^ (i < 0))

    def launch(i, c, k):
        # compact_tensor_batch moves float32, not int32: bitcasts are free.
        moved = jaxkv.compact_tensor_batch(lax.bitcast_convert_type(c, jnp.float32), k["identity"])
        return neighbours(lax.bitcast_convert_type(moved, jnp.int32), k["active"] ^ (i < 0))

    consts = dict(active=jnp.arange(max_batch) < max_batch - 3, identity=i32(np.arange(max_batch)))
    variants = {"neighbours_only": base, "fused_add": fused, "custom_call": launch}
    carry, compiled, seconds = {}, {}, {name: [] for name in variants}
    for name, step in variants.items():
        carry[name] = i32(np.random.default_rng(11).integers(0, 100, max_batch))
        compiled[name] = timing.loop(step, n).lower(carry[name], consts).compile()
        carry[name] = compiled[name](carry[name], consts)  # warm-up
    for _ in range(3 * reps):
        for name in variants:
            start = time.perf_counter()
            carry[name] = compiled[name](carry[name], consts)
            timing.block(carry[name])
            seconds[name].append((time.perf_counter() - start) / n)
    out = {f"{name}_us": float(np.median(s)) * 1e6 for name, s in seconds.items()}
    out["spread_us"] = max(float(np.percentile(s, 75) - np.percentile(s, 25)) * 1e6
                           for s in seconds.values())
    out["extra_launch_us"] = out["custom_call_us"] - out["fused_add_us"]
    out["max_batch"] = max_batch
    return out
