"""jaxkv/_cudnn.py's plumbing on CPU: how the pool, the page tables, the queries and the merge of
two calls are handed to cuDNN, for both layouts, with a float32 stand-in for cuDNN's paged flash
attention (pages gathered through the table, top-left causal mask, log-sum-exp per query).

The stand-in follows what the GPU tests hold the real binding to (test_attention.py); here the
layout views and the prefill merge are checked against the dense reference on any machine.
"""

from __future__ import annotations

import dataclasses
import enum
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import _cudnn

from test_attention import B, HKV, L, assert_close, make_case, normal, ref_decode, ref_prefill

_rng = np.random.default_rng()


class _Mask(enum.Enum):
    PADDING = 1
    PADDING_CAUSAL = 2


def _stand_in(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k,
              page_table_v, scale, seed, dropout_rate, variadic_args, mask_type, layout,
              sliding_window_length, cudnn_version, return_residual):
    """cuDNN's semantics (jax 0.11's parameters): q [R, T, N, D]; pages k, v [pages, S, Hk, D];
    tables [R, 1, W, 1]."""
    q, k, v, table_k, table_v = query, key, value, page_table_k, page_table_v
    mask, stats = mask_type, return_residual
    R, T, N, D = q.shape
    W, S, Hk = table_k.shape[2], k.shape[1], k.shape[2]
    assert table_k.shape == (R, 1, W, 1) and N % Hk == 0 and layout == "BTNH"

    def rows(pages, table):  # [R, W * S, N, D]
        x = pages[table[:, 0, :, 0]].reshape(R, W * S, Hk, D).astype(jnp.float32)
        return jnp.repeat(x, N // Hk, axis=2)

    s = jnp.einsum("rtnd,rknd->rntk", q.astype(jnp.float32), rows(k, table_k),
                   precision="highest") * scale
    t, key = jnp.arange(T)[:, None], jnp.arange(W * S)[None, :]
    ok = (key[None] < kv_seqlen[:, None, None]) & (t[None] < q_seqlen[:, None, None])
    if mask == _Mask.PADDING_CAUSAL:
        ok &= (key <= t)[None]
    s = jnp.where(ok[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [R, N, T]
    p = jnp.where(ok[:, None], jnp.exp(s - lse[..., None]), 0)
    out = jnp.einsum("rntk,rknd->rtnd", p, rows(v, table_v), precision="highest").astype(q.dtype)
    return (out, lse) if stats else out


def _stand_in_012(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                  page_table_k, page_table_v, score_mod_args, scale, seed, dropout_rate,
                  variadic_args, mask_type, layout, sliding_window_length, score_mod,
                  cudnn_version, return_residual):
    """jax 0.12's parameters: score_mod_args and score_mod, which jaxkv leaves empty."""
    assert score_mod_args == () and score_mod is None
    return _stand_in(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                     page_table_k, page_table_v, scale, seed, dropout_rate, variadic_args,
                     mask_type, layout, sliding_window_length, cudnn_version, return_residual)


def test_the_stand_ins_have_the_pinned_signatures():
    import inspect

    for fn in (_stand_in, _stand_in_012):
        assert tuple(inspect.signature(fn).parameters) in _cudnn.SIGNATURES


def test_the_private_cudnn_binding_has_a_known_signature():
    """For every jax CI installs: from jax 0.11 on, jax's private cuDNN attention must offer one
    of the signatures jaxkv/_cudnn.py knows. A release that changes it fails here, not silently
    on users' GPUs (where the default would fall back to jaxkv's slower kernel)."""
    fa, why = _cudnn._binding()
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        assert fa is None and "older than 0.11" in why
        return
    assert fa is not None, why


@pytest.fixture(params=["jax 0.11", "jax 0.12"])
def stand_in(monkeypatch, request):
    attend = _stand_in if request.param == "jax 0.11" else _stand_in_012
    fa = types.SimpleNamespace(_dot_product_attention=attend, MaskType=_Mask,
                               _normalize_layout=lambda s: types.SimpleNamespace(value=s),
                               check_cudnn_version=lambda: 0)
    monkeypatch.setattr(_cudnn, "_binding", lambda: (fa, None))


_decode = jax.jit(_cudnn.decode, static_argnums=4)
_prefill = jax.jit(_cudnn.prefill, static_argnums=4)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("group,page_size", [(1, 1), (4, 16), (8, 128)])
def test_decode_views_read_the_layer_and_heads_asked_for(stand_in, layout, group, page_size):
    probe = make_case(f"paged-{layout}", jnp.float32, 64, page_size, [0] * B)
    cap = probe.capacity
    case = make_case(f"paged-{layout}", jnp.float32, 64, page_size,
                     [0, cap, int(_rng.integers(1, cap)), int(_rng.integers(1, cap))])
    q = normal((B, HKV * group, 64), jnp.float32)
    for layer in range(L):
        k, v = case.dense(layer)
        want = ref_decode(q, k, v, case.cache.lengths)
        out = _decode(q, case.cache, jnp.int32(layer), case.cache.lengths, 0.125)
        assert out.shape == q.shape and np.all(np.asarray(out[0]) == 0)
        assert_close(out, want, "f32")
    # A layer outside the pool gives zeros.
    out = _decode(q, case.cache, jnp.int32(L), case.cache.lengths, 0.125)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("group,page_size,t", [(1, 1, 8), (4, 16, 8), (8, 16, 1), (2, 128, 24)])
def test_prefill_views_and_merge(stand_in, layout, group, page_size, t):
    """Prefixes on and off page boundaries, none, up to capacity; chunks of 0, 1 and t tokens."""
    probe = make_case(f"paged-{layout}", jnp.float32, 64, page_size, [0] * B)
    cap = probe.capacity
    prefix = np.array([page_size, cap - t, 0, int(_rng.integers(1, cap - t))], np.int32)
    q_lengths = np.array([0, t, min(3, t), int(_rng.integers(1, t + 1))], np.int32)
    case = make_case(f"paged-{layout}", jnp.float32, 64, page_size, prefix + q_lengths)
    cache = dataclasses.replace(case.cache, lengths=jnp.asarray(prefix))
    q = normal((B, t, HKV * group, 64), jnp.float32)
    for layer in range(L):
        k, v = case.dense(layer)
        want = ref_prefill(q, k, v, jnp.asarray(prefix), jnp.asarray(q_lengths), scale=0.125)
        out = _prefill(q, cache, jnp.int32(layer), jnp.asarray(q_lengths), 0.125)
        assert out.shape == q.shape and np.all(np.asarray(out[0]) == 0)
        assert_close(out, want, "f32")
