"""Attention over a paged pool through cuDNN's paged flash attention, read in place.

jax (0.11 and newer) binds cuDNN's paged flash attention in a private module
(``jax._src.cudnn.fused_attention_stablehlo``). Its public-facing wrapper refuses a pool whose page
count differs from ``batch x table width``; the function under the wrapper has no such rule, and
cuDNN reads whatever pages the table names. So the whole stacked pool is handed over as one pool
of pages (a reshape: a bitcast, no copy) with the page table offset to the layer, which also makes
a traced layer index free:

- NHD ``[L, P, S, H, D]``: ``L * P`` pages of ``[S, H, D]``; table entries ``layer * P + page``.
- HND ``[L, H, P, S, D]``: ``L * H * P`` single-head pages of ``[S, 1, D]``; each (row, KV head)
  becomes a row of its own with the head's ``group`` query heads, table entries
  ``(layer * H + head) * P + page``.

``jaxkv.attention`` calls it by default only where it was measured faster than jaxkv's kernels
(``_jaxkv_is_faster`` there; tools/probes/default_probe.py, docs/perf-notes.md item 38): head_dim 64,
decode's smallest grids on Hopper, and GPUs other than Hopper, where jaxkv's kernels were not
measured against it. No 8-bit cache; everything else is jaxkv's kernels', which are also the
fallback wherever this module's private binding is missing or changed (``unusable`` says why).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

HEAD_DIMS = (64, 128)  # measured; cuDNN takes others on some GPUs, jaxkv's kernel covers them
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# The parameters of jax's private ``_dot_product_attention`` that this module knows, in order:
# jax 0.11's, and jax 0.12's (score_mod_args and score_mod added). tests/test_cudnn_views.py pins
# them for every jax CI installs: a release that changes them fails CI, instead of every user
# silently falling back to the slower kernel.
SIGNATURES = (
    ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
     "page_table_k", "page_table_v", "scale", "seed", "dropout_rate", "variadic_args",
     "mask_type", "layout", "sliding_window_length", "cudnn_version", "return_residual"),
    ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
     "page_table_k", "page_table_v", "score_mod_args", "scale", "seed", "dropout_rate",
     "variadic_args", "mask_type", "layout", "sliding_window_length", "score_mod",
     "cudnn_version", "return_residual"),
)


def _binding():
    """jax's private cuDNN attention module and its parameters, or None and the reason it cannot
    be used."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        return None, f"jax {jax.__version__} is older than 0.11 (cuDNN paged attention untested)"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        params = tuple(inspect.signature(fa._dot_product_attention).parameters)
        fa.MaskType.PADDING, fa._normalize_layout, fa.check_cudnn_version  # noqa: B018
    except Exception as e:  # moved, renamed or absent: the fallback is jaxkv's kernel
        return None, f"jax's private cuDNN binding is not as expected ({type(e).__name__}: {e})"
    if params not in SIGNATURES:
        return None, f"jax's private cuDNN binding changed its arguments: {params}"
    return fa, None


def unusable(cache, q_dtype, scales_given: bool) -> str | None:
    """Why cuDNN cannot serve this decode call, or None."""
    from .paged import PagedKVCache

    if jax.default_backend() != "gpu":
        return "cuDNN needs a CUDA GPU"
    if not isinstance(cache, PagedKVCache):
        return "cuDNN reads only a PagedKVCache"
    if np.dtype(cache.dtype) not in DTYPES or np.dtype(q_dtype) != np.dtype(cache.dtype):
        return "cuDNN reads bfloat16 and float16 caches with queries of the same dtype"
    if scales_given:
        return "cuDNN takes no dequantization scales"
    if cache.head_dim not in HEAD_DIMS:
        return f"cuDNN is used for head_dim in {HEAD_DIMS}"
    if cache.page_size & (cache.page_size - 1):  # its paged load refuses others (BAD_PARAM)
        return "cuDNN needs a power-of-two page size"
    if np.prod(cache.k_pages.shape[:3 if cache.layout == "HND" else 2]) >= 2**31:
        return "the pool has 2**31 pages or more (cuDNN's page table is int32)"
    fa, why = _binding()
    if fa is None:
        return why
    try:
        fa.check_cudnn_version()
    except Exception as e:
        return f"cuDNN is unavailable ({type(e).__name__}: {e})"
    return None


class _View:
    """The pool as cuDNN's pages, and the rows cuDNN sees: one per batch row (NHD) or one per
    (batch row, KV head) (HND)."""

    def __init__(self, cache, layer):
        self.hnd = cache.layout == "HND"
        if self.hnd:
            L, H, P, S, D = cache.k_pages.shape
            self.k = cache.k_pages.reshape(L * H * P, S, 1, D)
            self.v = cache.v_pages.reshape(L * H * P, S, 1, D)
        else:
            L, P, S, H, D = cache.k_pages.shape
            self.k = cache.k_pages.reshape(L * P, S, H, D)
            self.v = cache.v_pages.reshape(L * P, S, H, D)
        self.heads, self.pages = H, P
        self.valid = (layer >= 0) & (layer < L)  # a bad layer reads layer 0 and gives zeros
        self.layer = jnp.where(self.valid, layer, 0)

    def table(self, table):
        """[B, W] pages of a layer -> cuDNN's [rows, 1, W, 1] (entries clamped into the pool)."""
        table = jnp.clip(table, 0, self.pages - 1)
        if not self.hnd:
            return (table + self.layer * self.pages)[:, None, :, None]
        head = self.layer * self.heads + jnp.arange(self.heads, dtype=table.dtype)
        rows = table[:, None, :] + (head * self.pages)[None, :, None]  # [B, H, W]
        return rows.reshape(-1, 1, table.shape[1], 1)

    def per_row(self, x):
        """[B] -> [rows]."""
        return jnp.repeat(x, self.heads) if self.hnd else x

    def queries(self, q):
        """[B, T, Hq, D] -> [rows, T, query heads per row, D]."""
        if not self.hnd:
            return q
        B, T, Hq, D = q.shape
        q = q.reshape(B, T, self.heads, Hq // self.heads, D).transpose(0, 2, 1, 3, 4)
        return q.reshape(B * self.heads, T, Hq // self.heads, D)

    def outputs(self, out, lse):
        """cuDNN's [rows, T, g, D] and [rows, g, T] -> [B, T, Hq, D] and [B, T, Hq]."""
        if self.hnd:
            R, T, g, D = out.shape
            B = R // self.heads
            out = out.reshape(B, self.heads, T, g, D).transpose(0, 2, 1, 3, 4)
            out = out.reshape(B, T, self.heads * g, D)
            if lse is not None:
                lse = lse.reshape(B, self.heads * g, T)
        return out, None if lse is None else jnp.swapaxes(lse, 1, 2)


def _attend(view, q, table, q_seqlen, kv_seqlen, scale, causal: bool, stats: bool):
    """cuDNN over the whole pool: (out [B, T, Hq, D], the log-sum-exp of each query's scaled
    logits [B, T, Hq] in float32, or None without ``stats``)."""
    fa, _ = _binding()
    unused = jnp.zeros((0,), q.dtype)
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    t = view.table(table)
    values = dict(
        query=view.queries(q), key=view.k, value=view.v, bias=unused,
        q_seqlen=view.per_row(q_seqlen), kv_seqlen=view.per_row(kv_seqlen), q_offsets=unused,
        kv_offsets=unused, page_table_k=t, page_table_v=t, score_mod_args=(), scale=scale,
        seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
        layout=fa._normalize_layout("BTNH").value, sliding_window_length=None, score_mod=None,
        cudnn_version=fa.check_cudnn_version(), return_residual=stats)
    # Positionally, in the signature's order (its custom_vjp fixes the non-differentiable ones by
    # position).
    params = inspect.signature(fa._dot_product_attention).parameters
    res = fa._dot_product_attention(*(values[name] for name in params))
    return view.outputs(*(res if stats else (res, None)))


def prefill(q, cache, layer, q_lengths, scale: float):
    """``attention.prefill`` for a cache ``unusable`` accepts; arguments already checked.

    cuDNN's causal mask is aligned top-left (query t sees keys [0, t]) and its paged reads start
    at a page boundary, while a chunk's query t must see [0, lengths + t]. So two calls, merged by
    their log-sum-exps: (a) the page-aligned part of the prefix, [0, aligned), unmasked; (b) the
    rest, from that page boundary, causal, with the queries moved down by r = lengths - aligned
    (< page_size) so that query t sits at row r + t and sees [aligned, lengths + t].
    """
    S, W = cache.page_size, cache.max_pages_per_seq
    T = q.shape[1]
    view = _View(cache, layer)
    table = cache.page_table
    lengths = jnp.maximum(cache.lengths, 0)
    # Never past the pages a row holds (reported through checkify by the caller).
    q_len = jnp.clip(q_lengths, 0, jnp.clip(cache.pages_held * S - lengths, 0, T))
    if T == 1:  # a decode step through prefill: one call
        out = decode(q[:, 0], cache, layer, jnp.where(q_len > 0, lengths + 1, 0), scale)
        return out[:, None]
    aligned_pages = lengths // S
    aligned, r = aligned_pages * S, lengths % S
    out_a, lse_a = _attend(view, q, table, q_len, aligned, scale, causal=False, stats=True)
    rows = jnp.arange(T + S)[None] - r[:, None]  # row j of (b) holds query j - r (or nothing)
    q_b = jnp.where((rows >= 0)[..., None, None],
                    jnp.take_along_axis(q, jnp.clip(rows, 0, T - 1)[..., None, None], axis=1), 0)
    shift = jnp.clip(aligned_pages[:, None] + jnp.arange(W)[None], 0, W - 1)
    table_b = jnp.take_along_axis(table, shift, axis=1)
    out_b, lse_b = _attend(view, q_b, table_b, r + q_len, r + q_len, scale, causal=True,
                           stats=True)
    back = (jnp.arange(T)[None] + r[:, None])[..., None]  # query t is row r + t of (b)
    out_b = jnp.take_along_axis(out_b, back[..., None], axis=1).astype(jnp.float32)
    lse_b = jnp.take_along_axis(lse_b, back, axis=1)
    has_a = (aligned > 0)[:, None, None]
    top = jnp.where(has_a, jnp.maximum(lse_a, lse_b), lse_b)
    w_a = jnp.where(has_a, jnp.exp(lse_a - top), 0)[..., None]
    w_b = jnp.exp(lse_b - top)[..., None]
    part_a = jnp.where(has_a[..., None], out_a.astype(jnp.float32) * w_a, 0)  # (a) may be NaN
    out = (part_a + out_b * w_b) / (w_a + w_b)
    keep = (jnp.arange(T)[None] < q_len[:, None]) & view.valid
    return jnp.where(keep[..., None, None], out, 0).astype(q.dtype)


def decode(q, cache, layer, kv_lengths, scale: float):
    """``attention.decode`` for a cache ``unusable`` accepts; arguments already checked.

    Rows attend to ``[0, kv_lengths[b])`` clamped to the pages they hold, a layer outside the
    pool reads layer 0 and returns zeros (both reported through checkify by the caller), and table
    entries outside the pool are clamped into it: cuDNN never reads past the pool.
    """
    view = _View(cache, layer)
    lengths = jnp.clip(kv_lengths, 0, cache.pages_held * cache.page_size)
    ones = jnp.ones((q.shape[0],), jnp.int32)
    out, _ = _attend(view, q[:, None], cache.page_table, ones, lengths, scale, causal=False,
                     stats=False)
    keep = ((lengths > 0) & view.valid)[:, None, None]
    return jnp.where(keep, out[:, 0], jnp.zeros((), q.dtype))
