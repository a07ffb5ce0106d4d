"""Decode attention over an NHD paged pool through cuDNN's paged attention, read in place.

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


def decode(q, cache, layer, kv_lengths, scale: float):
    """``attention.decode`` for a cache ``unusable`` accepts; arguments already checked.

    Rows attend to ``[0, kv_lengths[b])`` clamped to the pages they hold, a layer outside the
    pool reads layer 0 and returns zeros (both reported through checkify by the caller), and table
    entries outside the pool are clamped into it: cuDNN never reads past the pool.
    """
    fa, _ = _binding()
    L, P, S, H, D = cache.k_pages.shape
    B = q.shape[0]
    valid_layer = (layer >= 0) & (layer < L)
    layer = jnp.where(valid_layer, layer, 0)
    table = (jnp.clip(cache.page_table, 0, P - 1) + layer * P)[:, None, :, None]
    lengths = jnp.clip(kv_lengths, 0, cache.pages_held * S)
    pool = lambda x: x.reshape(L * P, S, H, D)  # noqa: E731
    unused = jnp.zeros((0,), q.dtype)
    out = fa._dot_product_attention(
        q[:, None], pool(cache.k_pages), pool(cache.v_pages), unused, jnp.ones((B,), jnp.int32),
        lengths, unused, unused, table, table, scale, 42, 0.0, (False, False),
        fa.MaskType.PADDING, fa._normalize_layout("BTNH").value, None, fa.check_cudnn_version(),
        False)
    keep = ((lengths > 0) & valid_layer)[:, None, None]
    return jnp.where(keep, out[:, 0], jnp.zeros((), q.dtype))
