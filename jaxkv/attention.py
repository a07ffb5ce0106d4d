"""Attention over a jaxkv cache, read in place: ``decode`` and ``prefill``.

Both read one layer of any cache kind (``LinearKVCache``, ``KVCacheManager``, ``PagedKVCache`` in
either layout) without slicing it: the kernel receives the whole buffer (or pool) and the layer
index and computes addresses itself, because a slice of a stacked buffer handed to a custom call
is a copy of the layer. Only live tokens ``[0, length)`` are read, so time follows the live bytes,
not the capacity. The kernels are jaxkv's own FFI targets: on the GPU a split-KV
(flash-decoding) kernel with float32 online softmax, on the CPU exact float32 loops
(``ffi/cpu/attention.cc``); ``jaxkv.reference.attention`` is the dense float32 oracle.

A decode step appends, commits, then attends::

    cache = cache.append(layer, k, v)            # inside the layer loop, before attention
    ...
    cache = cache.commit(1)
    out = jaxkv.attention.decode(q, cache, layer)  # reads tokens [0, lengths[b])

or, inside the layer loop, before ``commit``: ``prefill(q, cache, layer, new_lengths)``, which is
the same for one token per row.

Which kernel: JAX's Pallas ``paged_attention`` is deprecated with its Triton backend,
decode-only, and needs power-of-two blocks; cuDNN's dense attention on a layer of a stacked buffer
makes XLA slice the layer first. jaxkv's own kernels therefore serve every cache kind through one
addressing view (``ffi/include/jaxkv/attention.h``): on the GPU, decode is split-KV; prefill runs
on tensor cores (FlashAttention-2's forward) for bfloat16 / float16 caches and 8-bit ones (each
K/V tile converted exactly to 16 bits in shared memory) with head_dim 64, 128 or 256 and GQA
groups up to its row tile, else the decode kernel with one query row per new token.
On Hopper at head_dim 128 (prefill there on warpgroup MMA) these kernels are the default for
every cache; elsewhere a ``PagedKVCache`` in bfloat16 / float16 (either layout, power-of-two pages)
on a GPU goes to cuDNN's paged flash attention, where it was measured faster, reading the whole
pool in place through jax's private binding (``jaxkv/_cudnn.py``; ``_jaxkv_is_faster`` has the
rule, ``implementation=`` chooses explicitly).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _cudnn
from . import _ffi
from . import _validate as validate
from . import _windows
from . import host_tier
from . import quantization
from ._checks import check
from .layout import HEAD_VALUES, QUERIES, QUERY, ROWS
from .linear import LinearKVCache
from .manager import KVCacheManager
from .paged import PagedKVCache
from .sharding import Role, per_shard

# Head dims the kernels are built for (ffi/cuda/attention_decode.cu instantiates these; the CPU
# handler accepts the same so that a program behaves alike on both).
HEAD_DIMS = (16, 32, 64, 128, 256)
"""The head dims attention takes (another is a trace-time ``ValueError``)."""
QUERY_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
EIGHT_BIT_DTYPES = quantization.QUANTIZED_DTYPES  # fp8 e4m3fn, e5m2, int8

_DENSE, _PAGED_HND, _PAGED_NHD = 0, 1, 2  # ffi/include/jaxkv/attention.h: KVLayout
_DENSE_RING = 3  # a ring of S slots (kv_view.h), its positions given in a frame of two laps
# The GPU kernels split each row's keys over blocks, at least _MIN_KEYS_PER_SPLIT keys a block
# (each split costs a pipeline start and the combine's reads). The 16-bit tensor-core kernel: where
# a block per (query, KV head) pair fits the GPU in one wave (at most _RESIDENT_PER_SM blocks a
# multiprocessor), it splits only as far as _FILL_PER_SM blocks a multiprocessor, one wave with no
# tail; past that it does not split (where that takes two waves either way the kernel keeps a
# deeper ring at 2 blocks a multiprocessor: ffi/cuda/attention_decode.cu's TcDeep). The other
# kernels' grids aim at _TARGET_BLOCKS (several waves, whose tail is then short): over 8-bit
# caches 4 blocks a multiprocessor, where one wave lets an NHD page's heads be read together; the
# CUDA-core kernel (float32, other head dims) as first tuned. Measured on the H200 and the H100:
# docs/perf-notes.md items 37-39.
_TARGET_BLOCKS = {"tensor cores, 8-bit": 512, "CUDA cores": 2048}
_RESIDENT_PER_SM = {"tensor cores": _ffi.DECODE_RESIDENT_BLOCKS}  # the rule measured at 64-256
_FILL_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_HEADS_PER_BLOCK = 8  # q heads one GPU block keeps in registers


@dataclasses.dataclass(frozen=True)
class _Source:
    """What the kernel reads: buffers, page table, layer, geometry."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array  # [B, max_pages], or int32 [0] for a dense cache
    layout: int
    layer: jax.Array  # int32 []
    num_layers: int
    max_batch: int
    num_kv_heads: int
    capacity: int  # positions a row can address
    head_dim: int
    readable: jax.Array  # int32 [B]: positions of each row backed by memory (paged: pages held)
    window: object = None  # the layer's own window (a windowed paged cache): int, None or int32 []
    released: jax.Array | None = None  # int32 [B]: positions below it released by the window
    scaling: str | None = None  # an 8-bit cache's (jaxkv.quantization)
    k_scales: jax.Array | None = None  # per token and head: the cache's scales of this layer's
    v_scales: jax.Array | None = None  # buffer; per tensor: the layer's float32 [] scales
    ring: int = 0  # a dense ring's slots S (capacity: S too, the keys a query sees at most), or 0


def _source(op: str, cache, layer_idx) -> _Source:
    src = _addressing(op, cache, layer_idx)
    if getattr(cache, "scaling", None) is None:
        return src
    if cache.scaling == "per_tensor":  # a manager's layer_idx is a static int, checked above
        # the layer's own scales (a windowed paged cache's src.layer is a slot of its group)
        layer = (layer_idx if isinstance(cache, KVCacheManager)
                 else jnp.clip(jnp.asarray(layer_idx, jnp.int32), 0, cache.num_layers - 1))
        return dataclasses.replace(src, scaling="per_tensor", k_scales=cache.k_scales[layer],
                                   v_scales=cache.v_scales[layer])
    ks, vs = cache.k_scales, cache.v_scales
    if isinstance(cache, KVCacheManager):
        ks, vs = ks[layer_idx], vs[layer_idx]
    return dataclasses.replace(src, scaling="per_token_head", k_scales=ks, v_scales=vs)


def _addressing(op: str, cache, layer_idx) -> _Source:
    no_table = jnp.zeros((0,), jnp.int32)
    if isinstance(cache, LinearKVCache):
        layer = validate.layer_index(op, layer_idx, cache.num_layers)
        _, batch, _, heads, cap, d = cache.buffer.shape
        ring = cap if cache.ring else 0
        return _Source(cache.buffer, cache.buffer, no_table, _DENSE_RING if ring else _DENSE,
                       layer, cache.num_layers, batch, heads, cap, d,
                       _dense_readable(batch, ring, cap), ring=ring)
    if isinstance(cache, KVCacheManager):
        i = cache._index(op, layer_idx)
        buf = cache.layers[i]
        batch, _, heads, cap, d = buf.shape
        ring = cap if cache.is_ring(i) else 0
        return _Source(buf, buf, no_table, _DENSE_RING if ring else _DENSE,
                       jnp.zeros((), jnp.int32), 1, batch, heads, cap, d,
                       _dense_readable(batch, ring, cap), ring=ring)
    if isinstance(cache, PagedKVCache):
        layout = _PAGED_NHD if cache.layout == "NHD" else _PAGED_HND
        cap = cache.max_pages_per_seq * cache.page_size
        table, slot, window = cache.route(op, layer_idx)
        layer = validate.layer_index(op, slot, cache.k_pages.shape[0])
        src = _Source(cache.k_pages, cache.v_pages, table, layout, layer, cache.k_pages.shape[0],
                      cache.max_batch, cache.num_kv_heads, cap, cache.head_dim, cache._reach())
        if cache.windows is None:
            return src
        return dataclasses.replace(src, window=window,
                                   released=_windows.first_column(table) * cache.page_size)
    raise TypeError(f"{op}: cache must be a LinearKVCache, KVCacheManager or PagedKVCache, got "
                    f"{type(cache).__name__}")


def _dense_readable(batch: int, ring: int, capacity: int) -> jax.Array:
    """A dense layer's readable positions: its capacity, a ring's every int32 (``_ring_reads``
    checks what it still holds)."""
    return jnp.full((batch,), validate.INT32_MAX if ring else capacity, jnp.int32)


def _ring_reads(op: str, src: _Source, ends, starts, counts, hybrid: _Hybrid):
    """A dense ring's reads, checked and put in its kernels' frame: ``(starts, counts)``.

    The ring of ``S = src.ring`` slots holds each row's positions ``[end - S, end)``, ``end`` =
    ``ends[b]``: the row's length (decode after commit; before it, ``kv_lengths`` one past the
    length: the token just appended) or the end of the tokens just appended (prefill, before
    commit: ``lengths + q_lengths``, the append's counts). A row whose queries (at positions
    ``starts[b] + t``, ``t < counts[b]``) read a position outside it is reported (a window wider
    than ``S - q_len + 1``, or full attention past ``S`` tokens): the kernels clamp each query's
    first key to the ring (``first_key``: ``starts + counts - S``), so such a read never returns
    another token's data; a row whose reads do not end at ``end`` (a decode at other
    ``kv_lengths``), which that clamp cannot bound, gives zeros. The frame: positions less a
    multiple of ``S`` per row, so that the newest lies in ``[0, 2S)`` (kv_view.h)."""
    if not src.ring:
        return starts, counts
    size = src.ring
    reading = counts > 0
    last = starts + counts  # the end of the newest position a row's queries read
    first = starts + 1 - jnp.minimum(hybrid.window, jnp.maximum(starts + 1, 0))  # query 0's key
    held = (last <= ends) & (first >= ends - size)
    check(jnp.all(~reading | held),
          f"{op}: a read of positions that have left the ring: a ring of {size} slots holds a "
          f"row's last {size} tokens (a window of at most {size} - q_len + 1 tokens, full "
          f"attention only up to {size} tokens); only the ring is read (decode at kv_lengths "
          "other than the row's length: zeros)")
    counts = jnp.where(reading & ~held & (last != ends), 0, counts)
    shift = jnp.maximum(last // size - 1, 0) * size
    return starts - shift, counts


def _check_query(op: str, q, src: _Source, rank: int, hint: str, cache_dtype) -> int:
    validate.array(op, "q", q)
    validate.rank(op, "q", q, rank, hint)
    if np.dtype(q.dtype) not in QUERY_DTYPES:
        raise TypeError(f"{op}: q has dtype {q.dtype}; supported: float32, bfloat16, float16")
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype in EIGHT_BIT_DTYPES:
        if np.dtype(q.dtype) == np.dtype(jnp.float32):
            raise TypeError(f"{op}: q must be bfloat16 or float16 over the cache's {cache_dtype}")
    elif cache_dtype != np.dtype(q.dtype):
        raise TypeError(f"{op}: q has dtype {q.dtype}, the cache holds {cache_dtype} (they must "
                        "match, except over 8-bit caches)")
    batch, q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if batch != src.max_batch:
        raise ValueError(f"{op}: q has {batch} rows, the cache max_batch {src.max_batch} ({hint})")
    if head_dim != src.head_dim:
        raise ValueError(f"{op}: q has head_dim {head_dim}, the cache {src.head_dim} ({hint})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    if q_heads % src.num_kv_heads:
        raise ValueError(f"{op}: q's num_q_heads ({q_heads}) must be a multiple of the cache's "
                         f"num_kv_heads ({src.num_kv_heads})")
    return q_heads


def _check_released(op: str, src: _Source, ends: jax.Array, hybrid: _Hybrid, reading) -> None:
    """A windowed paged cache: the first key the queries ending at ``ends`` see must not lie
    in a page the window has released (the kernels read nothing there: zeros)."""
    if src.released is None:
        return
    first = ends - jnp.minimum(hybrid.window, ends)  # max(ends - window, 0), no overflow
    check(jnp.all(~reading | (first >= src.released)),
          f"{op}: a query's window reaches pages its layer released (a window wider than the "
          "layer's, or a query before the row's end)")


def _check_home(op: str, cache, reading: jax.Array) -> None:
    """A row on the host tier holds no device page: reading it is reported by name (the kernels
    read nothing for it and give zeros)."""
    if isinstance(cache, PagedKVCache) and cache.host is not None:
        check(jnp.all(~cache.on_host | ~reading),
              f"{op}: a row is on the host ({host_tier.SWAP_IN_FIRST})")


def _dequant_scale(op: str, name: str, value, cache_dtype) -> jax.Array:
    if value is None:
        if np.dtype(cache_dtype) in EIGHT_BIT_DTYPES:
            raise ValueError(f"{op}: {name} is required for an 8-bit cache without scales of its "
                             "own (its dequantization scale)")
        return jnp.ones((), jnp.float32)
    if isinstance(value, (int, float, np.floating)) and not isinstance(value, bool):
        return jnp.asarray(value, jnp.float32)
    validate.array(op, name, value)
    validate.rank(op, name, value, 0)
    if value.dtype != jnp.float32:
        raise TypeError(f"{op}: {name} must be a float or a float32 scalar, got {value.dtype}")
    return value


def _softmax_scale(op: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"{op}: scale must be a Python float (static), got {type(scale).__name__}")
    return float(scale)


def _scales(op: str, src: _Source, k_scale, v_scale, scale):
    """(k dequantization scale, v dequantization scale, softmax scale), checked. A cache with
    scales of its own (jaxkv.quantization) takes none: per tensor they are its layer's."""
    if src.scaling is not None:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{op}: the cache keeps its own scales (scaling={src.scaling!r}); "
                             "k_scale / v_scale are only for an 8-bit cache without them")
        if src.scaling == "per_tensor":
            return src.k_scales, src.v_scales, _softmax_scale(op, scale, src.head_dim)
        one = jnp.ones((), jnp.float32)
        return one, one, _softmax_scale(op, scale, src.head_dim)
    return (_dequant_scale(op, "k_scale", k_scale, src.k.dtype),
            _dequant_scale(op, "v_scale", v_scale, src.k.dtype),
            _softmax_scale(op, scale, src.head_dim))


_FULL = np.int32(np.iinfo(np.int32).max)  # the kernels' window of full attention


@dataclasses.dataclass(frozen=True)
class _Hybrid:
    """A call's window, soft cap and sinks, checked, as the kernels take them."""

    window: jax.Array  # int32 []: _FULL for full attention
    span: int  # keys a query sees at most: the capacity, or a static window's width
    soft_cap: float  # 0.0: none
    sinks: jax.Array  # float32 [Hq], or [0]: none
    plain: bool  # full attention, no cap, no sinks


def _window(op: str, window, capacity: int) -> tuple[jax.Array, int]:
    """(the kernels' window, the keys a query sees at most)."""
    if window is None:
        return jnp.asarray(_FULL), capacity
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        if window < 1:
            raise ValueError(f"{op}: window must be >= 1 (the tokens a query sees, itself "
                             f"included), got {window}")
        return jnp.asarray(min(int(window), int(_FULL)), jnp.int32), min(capacity, int(window))
    if isinstance(window, bool) or not hasattr(window, "dtype"):
        raise TypeError(f"{op}: window must be None, a Python int or an int32 scalar, got "
                        f"{type(window).__name__}")
    validate.rank(op, "window", window, 0)
    if window.dtype != jnp.int32:
        raise TypeError(f"{op}: window must be an int32 scalar, got {window.dtype}")
    check(window >= 1, f"{op}: window < 1 (its queries see no key)")
    return window, capacity


def _soft_cap(op: str, soft_cap) -> float:
    if soft_cap is None:
        return 0.0
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float, np.floating,
                                                              np.integer)):
        raise TypeError(f"{op}: soft_cap must be None or a Python float (static), got "
                        f"{type(soft_cap).__name__}")
    if not (math.isfinite(soft_cap) and soft_cap > 0):
        raise ValueError(f"{op}: soft_cap must be a finite float > 0, got {soft_cap}")
    return float(soft_cap)


def _sinks(op: str, sinks, q_heads: int) -> jax.Array:
    if sinks is None:
        return jnp.zeros((0,), jnp.float32)
    validate.array(op, "sinks", sinks)
    validate.shape(op, "sinks", sinks, (q_heads,), "[num_q_heads]")
    if sinks.dtype != jnp.float32:
        raise TypeError(f"{op}: sinks must be float32 [num_q_heads], got {sinks.dtype}")
    return sinks


def _hybrid(op: str, window, soft_cap, sinks, q_heads: int, capacity: int) -> _Hybrid:
    """Checks ``window``, ``soft_cap`` and ``sinks`` at trace time; a traced window below 1 is
    reported through checkify (its queries then see no key)."""
    win, span = _window(op, window, capacity)
    return _Hybrid(win, span, _soft_cap(op, soft_cap), _sinks(op, sinks, q_heads),
                   plain=window is None and soft_cap is None and sinks is None)


def _gpu_kernel(src: _Source) -> str:
    """Which split-KV kernel serves src on the GPU (ffi/cuda/attention_decode.cu's dispatch)."""
    dtype = np.dtype(src.k.dtype)
    if dtype in EIGHT_BIT_DTYPES:
        return "tensor cores, 8-bit" if src.head_dim in (64, 128) else "CUDA cores"
    if dtype != np.dtype(jnp.float32) and src.head_dim in (64, 128, 256):
        return "tensor cores"
    return "CUDA cores"


def _splits(rows: int, src: _Source, q_heads: int, span: int | None = None) -> int:
    """Blocks each (query, KV head) pair's keys are split over on the GPU (1: no combine); a
    query sees at most ``span`` keys (default: the capacity)."""
    span = src.capacity if span is None else span
    per_block = math.ceil(q_heads // src.num_kv_heads / _MAX_HEADS_PER_BLOCK)
    pairs = rows * src.num_kv_heads * per_block
    by_keys = max(1, span // _MIN_KEYS_PER_SPLIT)
    kernel = _gpu_kernel(src)
    sms = _multiprocessors()
    if kernel in _RESIDENT_PER_SM:
        fits = pairs <= _RESIDENT_PER_SM[kernel] * sms
        return max(1, min(by_keys, _FILL_PER_SM * sms // pairs)) if fits else 1
    return max(1, min(by_keys, -(-_TARGET_BLOCKS[kernel] // pairs)))


@functools.cache
def _multiprocessors() -> int:
    """The GPU's multiprocessors (132 on an H100 / H200, also assumed off a GPU, where the split
    count only shapes the CPU handler's unused workspace)."""
    return int(getattr(jax.devices()[0], "core_count", None) or 132)


def _call(target, q4, src: _Source, starts, counts, k_scale, v_scale, scale, hybrid: _Hybrid,
          splits):
    b, t, hq, d = q4.shape
    per_token = src.scaling == "per_token_head"
    work: tuple[int, ...] = (b, t, hq, splits, d + 2) if splits > 1 else (0,)
    # The Hopper prefill's workspace: word 0 counts the items its blocks have taken, and over
    # per-token scales [B, H] floats after it keep each row and KV head's largest V scale; a
    # split-KV workspace, when there is one, is larger and serves.
    if target == "jaxkv_attention_prefill" and splits == 1:
        work = (1 + b * src.num_kv_heads,) if per_token else (1,)
    none = jnp.zeros((0,), jnp.float32)
    out, _ = _ffi.call(
        target,
        (jax.ShapeDtypeStruct(q4.shape, q4.dtype), jax.ShapeDtypeStruct(work, jnp.float32)),
        q4, src.k, src.v, src.page_table, starts, counts, src.layer, k_scale, v_scale,
        src.k_scales if per_token else none, src.v_scales if per_token else none,
        hybrid.window, hybrid.sinks, scale=np.float32(scale), soft_cap=np.float32(hybrid.soft_cap),
        span=np.int32(hybrid.span), layout=np.int32(src.layout),
    )
    return out


IMPLEMENTATIONS = (None, "jaxkv", "cudnn")
"""``implementation=`` of ``decode`` / ``prefill``: None picks the faster of the two that can
serve the call, ``"jaxkv"`` jaxkv's kernels, ``"cudnn"`` JAX's cuDNN path (an error where it
cannot serve the call)."""


def _implementation(op: str, implementation, cache, q, k_scale, v_scale, src: _Source,
                    hybrid: _Hybrid | None = None) -> str:
    """Which kernel serves a call: ``implementation``, or the faster one that can."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "jaxkv" or (implementation is None and _jaxkv_is_faster(op, src, q)):
        return "jaxkv"
    why = _cudnn.unusable(cache, q.dtype, k_scale is not None or v_scale is not None)
    if why is None and getattr(cache, "windows", None) is not None:
        why = "a PagedKVCache with windows is read by jaxkv's kernels only"
    if why is None and hybrid is not None and not hybrid.plain:
        why = "window, soft_cap and sinks are served by jaxkv's kernels only"
    if implementation == "cudnn" and why is not None:
        raise ValueError(f"{op}: implementation='cudnn' cannot serve this call: {why}")
    return "jaxkv" if why else "cudnn"


# Decode grids of at most this many (row, KV head) pairs (4 rows of 8 KV heads) go to cuDNN where
# it can serve them: its kernel measured 1-5 us ahead there (docs/perf-notes.md item 38).
_CUDNN_DECODE_MAX_PAIRS = 32


def _jaxkv_is_faster(op: str, src: _Source, q) -> bool:
    """Where cuDNN could serve a call but jaxkv's kernel is the default: on Hopper at head_dim
    128, for decode (and one-token prefill, the same split-KV kernel) past the smallest grids,
    and for prefill where the wgmma kernel is built (GQA groups of at most its 128 rows;
    ffi/cuda/attention_prefill_wgmma.cu). Measured on the H200 (docs/perf-notes.md item 38):
    as fast or faster than the cuDNN path by a call's wall time, which also counts the XLA ops
    around cuDNN's (its page-table views, the merge of its two prefill calls)."""
    if _compute_capability() != "9.0" or src.head_dim != 128:
        return False
    if op == "attention.decode" or q.shape[1] == 1:
        return q.shape[0] * src.num_kv_heads > _CUDNN_DECODE_MAX_PAIRS
    return _ffi.WITH_SM90A and q.shape[-2] // src.num_kv_heads <= 128


@functools.cache
def _compute_capability() -> str | None:
    """The first device's compute capability ("9.0"), None off a CUDA GPU."""
    return getattr(jax.devices()[0], "compute_capability", None)


# On a sharded cache each device attends with its rows and KV heads, and the q heads that read
# them: q head h reads KV head h // group, so splitting q heads and KV heads into as many
# contiguous blocks keeps every group on one device. Per shard the default kernel is jaxkv's:
# cuDNN's binding has not been run under shard_map on several GPUs.
_PER_SHARD = dict(defaults=dict(implementation="jaxkv"))


@per_shard("attention.decode", q=Role(QUERY), kv_lengths=Role(ROWS), sinks=Role(HEAD_VALUES),
           out=Role(QUERY), **_PER_SHARD)
def decode(q, cache, layer_idx, *, kv_lengths=None, scale=None, k_scale=None, v_scale=None,
           window=None, soft_cap=None, sinks=None, implementation=None):
    """One query token per sequence attends over its cached tokens, read in place.

    **Arguments:**
    - ``q``: ``[max_batch, num_q_heads, head_dim]``, float32, bfloat16 or float16 (the cache's
      dtype; bfloat16 or float16 over an 8-bit cache). ``num_q_heads`` is a multiple of the layer's
      KV heads (grouped-query attention: q head ``h`` reads KV head ``h // (num_q_heads / H)``).
    - ``cache``: a ``LinearKVCache``, ``KVCacheManager`` or ``PagedKVCache`` (HND or NHD).
    - ``layer_idx``: the layer; an int or an int32 scalar (traced, e.g. in a ``scan`` over layers),
      a Python int for a ``KVCacheManager``. A Python int out of range is a ``ValueError``; a
      traced one out of range gives zeros (reported through checkify).
    - ``kv_lengths``: int32 ``[max_batch]``: row ``b`` attends to tokens ``[0, kv_lengths[b])``;
      default ``cache.lengths`` (append, commit, then attend). A ``KVCacheManager`` layer of
      smaller capacity than the rows' lengths holds only its first tokens (its append reported
      the rest): pass ``kv_lengths=jnp.minimum(cache.lengths, S)``, ``S`` its ``max_seq_len``.
    - ``scale``: softmax scale (a Python number), default ``1/sqrt(head_dim)``.
    - ``k_scale``, ``v_scale``: scales (float or float32 scalar) of a cache without scales of its
      own: keys are read as ``k_scale * k``, values as ``v_scale * v``. Required for an 8-bit
      cache constructed from raw bytes; optional for a float cache (default 1). An 8-bit cache
      made by ``create`` keeps its scales (``jaxkv.quantization``) and is read with them, per
      token and head or per tensor; passing these then is a ``ValueError``.
    - ``window``: ``None`` (full attention), a Python int >= 1, or an int32 scalar (traced: a
      ``scan`` over layers can mix window and global layers). The query at position ``p`` sees
      the keys at ``(p - window, p]``, the last ``window`` tokens, itself included (transformers'
      ``sliding_window``); the kernels read no page wholly outside it. A traced window below 1 is
      reported through checkify, and its queries see no key. Default: full attention, or over a
      ``PagedKVCache`` created with ``windows``, the layer's own window (a wider one, reaching
      pages the layer released, is reported through checkify).
    - ``soft_cap``: ``None`` or a float > 0: each score, after ``scale``, becomes
      ``soft_cap * tanh(s / soft_cap)`` before the softmax (Gemma 2: 50).
    - ``sinks``: ``None`` or float32 ``[num_q_heads]``: each head's sink logit enters the
      softmax's denominator and nothing else (gpt-oss),
      ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``.
    - ``implementation``: ``None`` (default: the fastest that can serve the call), ``"jaxkv"``
      (jaxkv's own kernel, every cache kind) or ``"cudnn"`` (cuDNN's paged flash attention through
      jax's private binding: on a GPU, for a ``PagedKVCache`` (HND or NHD) in bfloat16 or
      float16, head_dim 64 or 128; a clear error where it cannot serve the call). The default
      is cuDNN's only where it was measured faster: head_dim 64, the smallest decode grids on
      Hopper (at most 32 rows x KV heads), and GPUs other than Hopper (``docs/perf-notes.md``
      item 38). A sharded cache defaults to jaxkv's kernel in every shard.

    **Returns:** ``[max_batch, num_q_heads, head_dim]`` in ``q``'s dtype; rows of length 0 give
    zeros. Lengths past the capacity (or, paged, past the pages a row holds) are reported through
    ``checkify``; positions that no memory backs are never read.

    >>> cache = LinearKVCache.create(1, 2, 2, 16, 64, jnp.float32)
    >>> cache = cache.reset(jnp.array([3, 0], jnp.int32))
    >>> out = decode(jnp.ones((2, 4, 64)), cache, 0)
    >>> out.shape, bool(jnp.all(out[1] == 0))       # row 1 holds no token: zeros
    ((2, 4, 64), True)
    """
    op = "attention.decode"
    src = _source(op, cache, layer_idx)
    q_heads = _check_query(op, q, src, 3, "[max_batch, num_q_heads, head_dim]", src.k.dtype)
    if kv_lengths is None:
        kv_lengths = cache.lengths
    validate.array(op, "kv_lengths", kv_lengths)
    validate.int32(op, "kv_lengths", kv_lengths)
    validate.shape(op, "kv_lengths", kv_lengths, (src.max_batch,), "[max_batch]")
    hybrid = _hybrid(op, src.window if window is None else window, soft_cap, sinks, q_heads,
                     src.capacity)
    use = _implementation(op, implementation, cache, q, k_scale, v_scale, src, hybrid)
    k_scale, v_scale, scale = _scales(op, src, k_scale, v_scale, scale)
    check((src.layer >= 0) & (src.layer < src.num_layers), f"{op}: layer_idx out of range")
    _check_home(op, cache, kv_lengths > 0)
    _check_released(op, src, kv_lengths, hybrid, kv_lengths > 0)
    check(jnp.all((kv_lengths >= 0) & (kv_lengths <= src.readable)),
          f"{op}: kv_lengths outside [0, capacity] (paged: past the pages a row holds)")
    if use == "cudnn":
        return _cudnn.decode(q, cache, src.layer, kv_lengths, scale)
    starts = kv_lengths - 1
    counts = (kv_lengths > 0).astype(jnp.int32)
    # A ring ends at the row's length, or one past it (before commit: the token just appended).
    ends = jnp.maximum(cache.lengths, jnp.minimum(kv_lengths, cache.lengths + 1))
    starts, counts = _ring_reads(op, src, ends, starts, counts, hybrid)
    out = _call("jaxkv_attention_decode", q[:, None], src, starts, counts, k_scale, v_scale, scale,
                hybrid, _splits(src.max_batch, src, q_heads, hybrid.span))
    return out[:, 0]


@per_shard("attention.prefill", q=Role(QUERIES), q_lengths=Role(ROWS), sinks=Role(HEAD_VALUES),
           out=Role(QUERIES), **_PER_SHARD)
def prefill(q, cache, layer_idx, q_lengths, *, scale=None, k_scale=None, v_scale=None,
            window=None, soft_cap=None, sinks=None, implementation=None):
    """Ragged chunked prefill: new tokens attend causally to themselves and the cached prefix.

    Call after ``append`` and before ``commit``: ``q`` ``[max_batch, T, num_q_heads, head_dim]``
    holds the queries of the tokens just appended, at positions ``[lengths[b], lengths[b] +
    q_lengths[b])`` of row ``b`` (``lengths`` = ``cache.lengths``). Query ``t`` of row ``b`` attends
    to tokens ``[0, lengths[b] + t]`` (with ``window``, the last ``window`` of them).
    ``q_lengths``: int32 ``[max_batch]`` (0 for rows taking no part). Other arguments as in
    ``decode`` (cuDNN, where it serves the call, runs as two calls
    merged by their log-sum-exps: the page-aligned prefix, then the rest causally).

    **Returns:** ``[max_batch, T, num_q_heads, head_dim]`` in ``q``'s dtype; queries at
    ``t >= q_lengths[b]`` give zeros.
    """
    op = "attention.prefill"
    src = _source(op, cache, layer_idx)
    q_heads = _check_query(op, q, src, 4, "[max_batch, T, num_q_heads, head_dim]", src.k.dtype)
    validate.array(op, "q_lengths", q_lengths)
    validate.int32(op, "q_lengths", q_lengths)
    validate.shape(op, "q_lengths", q_lengths, (src.max_batch,), "[max_batch]")
    hybrid = _hybrid(op, src.window if window is None else window, soft_cap, sinks, q_heads,
                     src.capacity)
    use = _implementation(op, implementation, cache, q, k_scale, v_scale, src, hybrid)
    k_scale, v_scale, scale = _scales(op, src, k_scale, v_scale, scale)
    lengths = cache.lengths
    _check_released(op, src, lengths + 1, hybrid, q_lengths > 0)
    check((src.layer >= 0) & (src.layer < src.num_layers), f"{op}: layer_idx out of range")
    check(jnp.all((q_lengths >= 0) & (q_lengths <= q.shape[1])),
          f"{op}: q_lengths outside [0, T]")
    _check_home(op, cache, q_lengths > 0)
    check(jnp.all((q_lengths == 0) | ((lengths >= 0) & (lengths + q_lengths <= src.readable))),
          f"{op}: lengths + q_lengths past the capacity (paged: past the pages a row holds)")
    if q.shape[1] == 0:  # no query: an empty result, and no kernel (its grid would be empty)
        return jnp.zeros(q.shape, q.dtype)
    if use == "cudnn":
        return _cudnn.prefill(q, cache, src.layer, q_lengths, scale)
    # One new token a row is a decode step: the split-KV kernel, not the prefill's 128-row tiles.
    target = "jaxkv_attention_decode" if q.shape[1] == 1 else "jaxkv_attention_prefill"
    starts, q_lengths = _ring_reads(op, src, lengths + q_lengths, lengths, q_lengths, hybrid)
    return _call(target, q, src, starts, q_lengths, k_scale, v_scale, scale, hybrid,
                 _splits(src.max_batch * q.shape[1], src, q_heads, hybrid.span))
