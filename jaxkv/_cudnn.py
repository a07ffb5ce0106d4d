"""Attention over an NHD paged pool through cuDNN's paged flash attention, read in place.

jax (0.11 and newer) binds cuDNN's paged flash attention in a private module
(``jax._src.cudnn.fused_attention_stablehlo``). Its public-facing wrapper refuses a pool whose page
count differs from ``batch x table width``; the function under the wrapper has no such rule, and
cuDNN reads whatever pages the table names. So the whole stacked pool ``[L, P, S, H, D]`` is
handed over as one pool of ``L * P`` pages (a reshape: a bitcast, no copy) with the page table
offset by ``layer * P``, which also makes a traced layer index free.

Measured on the H200, jax 0.11.2 (tools/cudnn_paged_probe.py, 2026-11-22): batch 64 x 4096
tokens, 32/8 heads, D 128, page 16: 282 us against 338 us for jaxkv's own kernel in the same
jitted loop, and faster or equal at every other size tried (D 64, pages 1 to 128, ragged
lengths, GQA 1 to 8). It reads only the NHD layout (jaxkv's HND pool ``[L, H, P, S, D]`` is not
a layout it takes) and no fp8 cache; everything else stays on jaxkv's kernel, which is also the
fallback wherever this module's private binding is missing or changed (``unusable`` says why).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

HEAD_DIMS = (64, 128)  # measured; cuDNN takes others on some GPUs, jaxkv's kernel covers them
DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _binding():
    """jax's private cuDNN attention module, or the reason it cannot be used."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        return None, f"jax {jax.__version__} is older than 0.11 (cuDNN paged attention untested)"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        params = list(inspect.signature(fa._dot_product_attention).parameters)
        fa.MaskType.PADDING, fa._normalize_layout, fa.check_cudnn_version  # noqa: B018
    except Exception as e:  # moved, renamed or absent: the fallback is jaxkv's kernel
        return None, f"jax's private cuDNN binding is not as expected ({type(e).__name__}: {e})"
    if params[8:10] != ["page_table_k", "page_table_v"]:
        return None, "jax's private cuDNN binding changed its arguments"
    return fa, None


def unusable(cache, q_dtype, scales_given: bool) -> str | None:
    """Why cuDNN cannot serve this decode call, or None."""
    from .paged import PagedKVCache

    if jax.default_backend() != "gpu":
        return "cuDNN needs a CUDA GPU"
    if not isinstance(cache, PagedKVCache) or cache.layout != "NHD":
        return "cuDNN reads only a PagedKVCache in the NHD layout"
    if np.dtype(cache.dtype) not in DTYPES or np.dtype(q_dtype) != np.dtype(cache.dtype):
        return "cuDNN reads bfloat16 and float16 caches with queries of the same dtype"
    if scales_given:
        return "cuDNN takes no dequantization scales"
    if cache.head_dim not in HEAD_DIMS:
        return f"cuDNN is used for head_dim in {HEAD_DIMS}"
    fa, why = _binding()
    if fa is None:
        return why
    try:
        fa.check_cudnn_version()
    except Exception as e:
        return f"cuDNN is unavailable ({type(e).__name__}: {e})"
    return None


def _attend(fa, q, cache, table, q_seqlen, kv_seqlen, scale, causal: bool):
    """cuDNN over the whole pool seen as [L * P, S, H, D]: (out [B, T, Hq, D], log-sum-exp of
    each query's scaled logits [B, T, Hq], float32)."""
    L, P, S, H, D = cache.k_pages.shape
    pool = lambda x: x.reshape(L * P, S, H, D)  # noqa: E731
    unused = jnp.zeros((0,), q.dtype)
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    out, lse = fa._dot_product_attention(
        q, pool(cache.k_pages), pool(cache.v_pages), unused, q_seqlen, kv_seqlen, unused, unused,
        table[:, None, :, None], table[:, None, :, None], scale, 42, 0.0, (False, False), mask,
        fa._normalize_layout("BTNH").value, None, fa.check_cudnn_version(), True)
    return out, jnp.swapaxes(lse, 1, 2)


def _layer_table(cache, layer):
    """(page table offset to `layer` in the [L * P] pool with entries clamped into it, whether
    the layer exists): a bad layer reads layer 0 and gives zeros."""
    L, P = cache.k_pages.shape[:2]
    valid = (layer >= 0) & (layer < L)
    return jnp.clip(cache.page_table, 0, P - 1) + jnp.where(valid, layer, 0) * P, valid


def prefill(q, cache, layer, q_lengths, scale: float):
    """``attention.prefill`` for a cache ``unusable`` accepts; arguments already checked.

    cuDNN's causal mask is aligned top-left (query t sees keys [0, t]) and its paged reads start
    at a page boundary, while a chunk's query t must see [0, lengths + t]. So two calls, merged by
    their log-sum-exps: (a) the page-aligned part of the prefix, [0, aligned), unmasked; (b) the
    rest, from that page boundary, causal, with the queries moved down by r = lengths - aligned
    (< page_size) so that query t sits at row r + t and sees [aligned, lengths + t].
    """
    fa, _ = _binding()
    S, W = cache.page_size, cache.max_pages_per_seq
    B, T = q.shape[:2]
    table, valid_layer = _layer_table(cache, layer)
    lengths = jnp.maximum(cache.lengths, 0)
    # Never past the pages a row holds (reported through checkify by the caller).
    q_len = jnp.clip(q_lengths, 0, jnp.clip(cache.pages_held * S - lengths, 0, T))
    if T == 1:  # a decode step through prefill: one call
        out = decode(q[:, 0], cache, layer, jnp.where(q_len > 0, lengths + 1, 0), scale)
        return out[:, None]
    aligned_pages = lengths // S
    aligned, r = aligned_pages * S, lengths % S
    out_a, lse_a = _attend(fa, q, cache, table, q_len, aligned, scale, causal=False)
    rows = jnp.arange(T + S)[None] - r[:, None]  # row j of (b) holds query j - r (or nothing)
    q_b = jnp.where((rows >= 0)[..., None, None],
                    jnp.take_along_axis(q, jnp.clip(rows, 0, T - 1)[..., None, None], axis=1), 0)
    shift = jnp.clip(aligned_pages[:, None] + jnp.arange(W)[None], 0, W - 1)
    table_b = jnp.take_along_axis(table, shift, axis=1)
    out_b, lse_b = _attend(fa, q_b, cache, table_b, r + q_len, r + q_len, scale, causal=True)
    back = (jnp.arange(T)[None] + r[:, None])[..., None]  # query t is row r + t of (b)
    out_b = jnp.take_along_axis(out_b, back[..., None], axis=1).astype(jnp.float32)
    lse_b = jnp.take_along_axis(lse_b, back, axis=1)
    has_a = (aligned > 0)[:, None, None]
    top = jnp.where(has_a, jnp.maximum(lse_a, lse_b), lse_b)
    w_a = jnp.where(has_a, jnp.exp(lse_a - top), 0)[..., None]
    w_b = jnp.exp(lse_b - top)[..., None]
    part_a = jnp.where(has_a[..., None], out_a.astype(jnp.float32) * w_a, 0)  # (a) may be NaN
    out = (part_a + out_b * w_b) / (w_a + w_b)
    keep = (jnp.arange(T)[None] < q_len[:, None]) & valid_layer
    return jnp.where(keep[..., None, None], out, 0).astype(q.dtype)


def decode(q, cache, layer, kv_lengths, scale: float):
    """``attention.decode`` for a cache ``unusable`` accepts; arguments already checked.

    Rows attend to ``[0, kv_lengths[b])`` clamped to the pages they hold, a layer outside the
    pool reads layer 0 and returns zeros (both reported through checkify by the caller), and table
    entries outside the pool are clamped into it: cuDNN never reads past the pool.
    """
    fa, _ = _binding()
    table, valid_layer = _layer_table(cache, layer)
    lengths = jnp.clip(kv_lengths, 0, cache.pages_held * cache.page_size)
    L, P, S, H, D = cache.k_pages.shape
    pool = lambda x: x.reshape(L * P, S, H, D)  # noqa: E731
    unused = jnp.zeros((0,), q.dtype)
    out = fa._dot_product_attention(
        q[:, None], pool(cache.k_pages), pool(cache.v_pages), unused,
        jnp.ones((q.shape[0],), jnp.int32), lengths, unused, unused, table[:, None, :, None],
        table[:, None, :, None], scale, 42, 0.0, (False, False), fa.MaskType.PADDING,
        fa._normalize_layout("BTNH").value, None, fa.check_cudnn_version(), False)
    keep = ((lengths > 0) & valid_layer)[:, None, None]
    return jnp.where(keep, out[:, 0], jnp.zeros((), q.dtype))
