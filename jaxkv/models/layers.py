"""The pieces every family's decoder layer is built from, each as transformers computes it.

RMSNorm (Llama's, and Gemma's with weights offset from 1), RoPE (rotate-half; Llama 3, linear
and YaRN scaling), the gated MLPs (SwiGLU, GeGLU), gpt-oss's mixture of experts, and dense
attention with a sliding window, a soft cap and sinks (the reference of the cache-free run and of
the XLA baseline; the cached run reads jaxkv's caches through ``jaxkv.attention``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, RopeScaling

FULL = np.iinfo(np.int32).max  # a global layer's window, where the window is traced


class AttentionSpec(NamedTuple):
    """What a layer's attention does beyond causal softmax(q k^T) v, as ``jaxkv.attention``
    takes it: ``window`` (None, a Python int, or an int32 scalar; ``FULL``: global), ``scale``
    (None: 1/sqrt(head_dim)), ``soft_cap`` and ``sinks`` (float32 [num_q_heads])."""

    window: object = None
    scale: float | None = None
    soft_cap: float | None = None
    sinks: jax.Array | None = None


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm in float32. Llama scales the normalized value in ``x``'s dtype by ``weight``;
    Gemma (``offset``) by ``1 + weight`` in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(float32 [head_dim / 2] inverse frequencies, the factor on cos and sin), as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    s = scaling
    if s.kind == "linear":
        return (inv_freq / s.factor).astype(np.float32), 1.0
    if s.kind == "llama3":
        low, high, context = s.low_freq_factor, s.high_freq_factor, s.original_max_positions
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > context / low, inv_freq / s.factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if s.kind == "yarn":
        def correction_dim(rotations):
            return d * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp
        inv = (inv_freq / s.factor) * (1 - extrapolate) + inv_freq * extrapolate
        factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
        return inv.astype(np.float32), factor
    raise ValueError(f"RoPE scaling {s.kind!r} is not supported (linear, llama3, yarn)")


class Rope(NamedTuple):
    """A layer kind's RoPE: inverse frequencies and the factor on cos and sin."""

    inv_freq: np.ndarray
    factor: float


def ropes(cfg: ModelConfig) -> tuple[Rope, Rope]:
    """(the global layers' RoPE, the window layers'): Gemma 3 gives its window layers a base of
    their own, unscaled; every other family one RoPE for all."""
    glob = Rope(*inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    if cfg.local_rope_theta is None:
        return glob, glob
    return glob, Rope(*inverse_frequencies(cfg.head_dim, cfg.local_rope_theta, None))


def rope(x: jax.Array, positions: jax.Array, r: Rope, local=None, r_local: Rope | None = None):
    """Rotate-half RoPE (transformers' convention). x: [B, T, H, D]; positions: int32 [B, T].
    ``local`` (a bool, traced in a scan over layers) picks ``r_local`` instead of ``r``."""
    def angles(rr):
        a = positions.astype(jnp.float32)[..., None] * rr.inv_freq  # [B, T, D/2]
        a = jnp.concatenate([a, a], axis=-1)[:, :, None, :]  # [B, T, 1, D]
        return jnp.cos(a) * rr.factor, jnp.sin(a) * rr.factor

    cos, sin = angles(r)
    if r_local is not None and r_local is not r:
        cos_l, sin_l = angles(r_local)
        cos, sin = jnp.where(local, cos_l, cos), jnp.where(local, sin_l, sin)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                    spec: AttentionSpec = AttentionSpec()) -> jax.Array:
    """Causal GQA attention of new queries over a sequence's keys, masked by position.

    q: [B, T, Hq, D] at positions [B, T]; k, v: [B, Hkv, S, D], key ``s`` is position ``s``.
    Query ``t`` of row ``b`` sees keys ``s <= positions[b, t]`` (and, with a window ``w``,
    ``s > positions[b, t] - w``). Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k).astype(jnp.float32)
    scores = scores / np.sqrt(d) if spec.scale is None else scores * spec.scale
    if spec.soft_cap is not None:
        scores = spec.soft_cap * jnp.tanh(scores / spec.soft_cap)
    keys = jnp.arange(s)[None, None, :]
    visible = keys <= positions[:, :, None]  # [B, T, S]
    if spec.window is not None:
        visible &= keys > positions[:, :, None] - spec.window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    if spec.sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # a sink logit per head joins the softmax's denominator only
        sinks = spec.sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        both = jnp.concatenate([scores, jnp.broadcast_to(sinks, (*scores.shape[:-1], 1))], -1)
        probs = jax.nn.softmax(both, axis=-1)[..., :-1]
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, hq, d)


def gated_mlp(cfg: ModelConfig, layer, h: jax.Array) -> jax.Array:
    """SwiGLU (silu) or GeGLU (tanh-approximated gelu): down(act(gate h) * up h)."""
    gate = h @ layer["w_gate"]
    act = jax.nn.silu(gate) if cfg.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return (act * (h @ layer["w_up"])) @ layer["w_down"]


def experts(cfg: ModelConfig, layer, h: jax.Array) -> jax.Array:
    """gpt-oss's mixture of experts: each token's top-k experts by the router's logits, weighted
    by the softmax of those logits; each expert a clamped SwiGLU with biases. Computed densely
    over every expert (the routing weights of the others are 0): right, not fast."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])  # [N, hidden]
    logits = x @ layer["router"] + layer["router_bias"]  # [N, E]
    top, index = jax.lax.top_k(logits, cfg.experts_per_token)
    weights = jax.nn.softmax(top, axis=-1)
    routing = jnp.zeros_like(logits).at[jnp.arange(x.shape[0])[:, None], index].set(weights)
    gate_up = jnp.einsum("nh,ehf->nef", x, layer["experts_gate_up"]) + layer[
        "experts_gate_up_bias"]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    act = (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    out = jnp.einsum("nei,eih->neh", act, layer["experts_down"]) + layer["experts_down_bias"]
    return jnp.einsum("ne,neh->nh", routing, out).astype(h.dtype).reshape(shape)
