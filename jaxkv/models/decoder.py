"""The decoder every family shares: embedding, layers (attention and a gated MLP or experts, each
residual), final norm and logits, written once in JAX.

The layer math follows transformers' implementations (``layers.py``), so a checkpoint loaded by
``hf_loader`` computes what ``transformers`` computes; the family's switches live in
``ModelConfig``. Attention is the cache's business: ``forward`` hands each layer's new K/V and its
``AttentionSpec`` (window, scale, soft cap, sinks) to a cache kind (``jaxkv.serving.caches``),
which writes them and attends over everything the sequence holds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layers import (FULL, AttentionSpec, dense_attention, experts, gated_mlp, ropes, rms_norm,
                     rope)


Params = dict[str, Any]


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each weight of a layer and its shape (a projection ``[in, out]``; a norm, bias or sink a
    vector), by the family's switches."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f = cfg.intermediate_size
    shapes = dict(attn_norm=(d,), wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), mlp_norm=(d,))
    if cfg.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,), bo=(d,))
    if cfg.sinks:
        shapes.update(sinks=(cfg.num_heads,))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    if cfg.gemma_norms:
        shapes.update(attn_post_norm=(d,), mlp_post_norm=(d,))
    if cfg.num_experts:
        e = cfg.num_experts
        shapes.update(router=(d, e), router_bias=(e,), experts_gate_up=(e, d, 2 * f),
                      experts_gate_up_bias=(e, 2 * f), experts_down=(e, f, d),
                      experts_down_bias=(e, d))
    else:
        shapes.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def _fan_in(shape) -> int:
    return shape[-2] if len(shape) >= 2 else 1


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Params:
    """Deterministic random weights: the same seed gives the same model on every machine.

    The scale (1/sqrt(fan_in), embeddings of unit norm) keeps logits spread out, so greedy decoding
    is not decided by rounding: a cached and a recomputed run agree token for token.
    """
    rng = np.random.default_rng(seed)
    base = 0.0 if cfg.gemma_norms else 1.0  # Gemma's norm weights are offsets from 1

    def draw(name, shape):
        if _is_norm(name):
            return jnp.asarray(base + 0.1 * rng.standard_normal(shape), dtype)
        if len(shape) == 1:  # biases and sinks
            return jnp.asarray(0.1 * rng.standard_normal(shape), dtype)
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(_fan_in(shape)), dtype)

    shapes = layer_shapes(cfg)
    layers = [{name: draw(name, shape) for name, shape in shapes.items()}
              for _ in range(cfg.num_layers)]
    d = cfg.hidden_size
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, d)), dtype)
    if cfg.gemma_norms:  # its embedding is scaled up by sqrt(hidden_size)
        embed = embed / np.sqrt(d).astype(dtype)
    lm_head = embed.T if cfg.tie_word_embeddings else draw("lm_head", (d, cfg.vocab_size)) * 4
    return dict(embed=embed, layers=layers, norm=draw("norm", (d,)), lm_head=lm_head)


# Megatron-style tensor parallelism over a mesh axis: the attention's q / k / v projections and
# the MLP's gate / up split by output columns (heads, FFN columns), o and down by input rows, so
# each device computes its heads and its FFN slice, and each block ends in one all-reduce (which
# XLA inserts, from these placements). The output projection splits by vocabulary columns:
# each device reads its part (a 128k vocabulary is 1 GB at 8B, read at every decode step) and the
# greedy pick combines each part's best (value, index), not the logits. Norms and the embedding
# are replicated.
_TENSOR_PARALLEL = dict(wq=(None, "tp"), wk=(None, "tp"), wv=(None, "tp"), wo=("tp", None),
                        w_gate=(None, "tp"), w_up=(None, "tp"), w_down=("tp", None),
                        lm_head=(None, "tp"))


def weight_sharding(name: str | None, shape, mesh, axis: str = "tp"):
    """The ``NamedSharding`` of weight ``name`` (``wq``, ..., ``lm_head``; a leading layer axis
    allowed): Megatron-style over ``axis`` of ``mesh`` (``_TENSOR_PARALLEL``), replicated for
    any other name, a mesh without ``axis``, or a split that does not divide."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = _TENSOR_PARALLEL.get(name) if axis in mesh.axis_names else None
    if spec is None or any(a and shape[i - 2] % mesh.shape[axis] for i, a in enumerate(spec)):
        return NamedSharding(mesh, PartitionSpec())
    lead = (None,) * (len(shape) - 2)  # the stacked layer axis
    return NamedSharding(mesh, PartitionSpec(*lead, *(axis if a else None for a in spec)))


def parameter_shardings(params: Params, mesh, axis: str = "tp") -> Params:
    """A ``NamedSharding`` per weight of ``params`` (stacked or a list of layers), by
    ``weight_sharding``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: weight_sharding(getattr(path[-1], "key", None), x.shape, mesh, axis),
        params)


def init_stacked_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32,
                        mesh=None) -> Params:
    """Random weights with stacked layers (``stack_layers``' layout), drawn on the device by one
    jitted function: an 8B model in seconds, with no host copy. The scales are ``init_params``'
    (the same distribution, not the same numbers). With ``mesh``, drawn already placed
    (``parameter_shardings``): a 70B model never exists whole on one device."""
    dtype = jnp.dtype(dtype)
    d, n = cfg.hidden_size, cfg.num_layers
    shapes = layer_shapes(cfg)
    base = 0.0 if cfg.gemma_norms else 1.0

    def make(key):
        keys = iter(jax.random.split(key, len(shapes) + 5))

        def pieces(key, shape, parts, scale=1.0):  # [parts * rows, ...] drawn a piece at a time
            piece = (shape[0] // parts, *shape[1:])
            return jax.lax.map(lambda k: jax.random.normal(k, piece, dtype) * jnp.asarray(
                scale, dtype), jax.random.split(key, parts)).reshape(shape)

        def draw(name, shape):  # [n, *shape]
            if len(shape) == 1:  # norms (around 1, or 0 for Gemma's offsets), biases, sinks
                noise = 0.1 * jax.random.normal(next(keys), (n, *shape), jnp.float32)
                return ((base if _is_norm(name) else 0.0) + noise).astype(dtype)
            return pieces(next(keys), (n, *shape), n, 1 / np.sqrt(_fan_in(shape)))

        # A layer (a vocabulary's eighth) at a time, lax.map being a loop: the generator's
        # temporaries are a piece's, not the whole stack's (a 70B model's at once: 324 GB a
        # device over tp=2 by XLA's CPU memory analysis, beside 73 GB of weights).
        layers = {name: draw(name, shape) for name, shape in shapes.items()}
        eighths = 8 if cfg.vocab_size % 8 == 0 and d % 8 == 0 else 1
        embed = pieces(next(keys), (cfg.vocab_size, d), eighths,
                       1 / np.sqrt(d) if cfg.gemma_norms else 1.0)
        lm_head = (embed.T if cfg.tie_word_embeddings
                   else pieces(next(keys), (d, cfg.vocab_size), eighths, 4 / np.sqrt(d)))
        norm = (base + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32)).astype(dtype)
        return dict(embed=embed, layers=layers, norm=norm, lm_head=lm_head)

    key = jax.random.key(seed)
    if mesh is None:
        return jax.jit(make)(key)
    shardings = parameter_shardings(jax.eval_shape(make, key), mesh)
    return jax.jit(make, out_shardings=shardings)(key)


def layer_windows(cfg: ModelConfig) -> jax.Array | None:
    """int32 [num_layers]: each layer's window (``FULL`` for a global one), for a scan over
    layers; None where every layer is global."""
    if not cfg.hybrid:
        return None
    return jnp.asarray([FULL if w is None else w for w in cfg.windows], jnp.int32)


def decoder(cfg: ModelConfig, params: Params, tokens, positions, attend, state):
    """Hidden states [B, T, hidden] of ``tokens`` [B, T] at ``positions`` [B, T].

    ``attend(state, layer_idx, q, k, v, spec) -> (out, state)`` is attention with whatever memory
    ``state`` keeps (a KV cache, or nothing): q [B, T, Hq, D], k and v [B, T, Hkv, D] after RoPE,
    ``spec`` the layer's ``AttentionSpec`` (window, scale, soft cap, sinks).
    With stacked layers (``stack_layers``: one array per weight, a leading layer axis) the layers
    run in a ``lax.scan`` and ``layer_idx`` and the window are traced (a 48-layer model compiles
    one layer); with a list of layers they are unrolled and both are Python ints.
    """
    r_global, r_local = ropes(cfg)
    x = params["embed"][tokens]
    if cfg.gemma_norms:  # the normalizer in the embedding's dtype, as transformers rounds it
        x = x * jnp.asarray(np.sqrt(cfg.hidden_size), x.dtype)
    windows = layer_windows(cfg)
    if isinstance(params["layers"], dict):
        def body(carry, xs):
            layer, i = xs
            window = None if windows is None else windows[i]
            local = None if window is None else window != FULL
            ctx = (window, local, r_global, r_local)
            return _layer(cfg, layer, i, carry[0], positions, ctx, attend, carry[1]), None

        num_layers = params["layers"]["wq"].shape[0]
        (x, state), _ = jax.lax.scan(body, (x, state),
                                     (params["layers"], jnp.arange(num_layers, dtype=jnp.int32)))
        return x, state
    for i, layer in enumerate(params["layers"]):
        window = cfg.window(i)
        ctx = (window, window is not None, r_global, r_local)
        x, state = _layer(cfg, layer, i, x, positions, ctx, attend, state)
    return x, state


def _norm(cfg: ModelConfig, x, weight):
    return rms_norm(x, weight, cfg.rms_norm_eps, offset=cfg.gemma_norms)


def _layer(cfg: ModelConfig, layer, i, x, positions, ctx, attend, state):
    """One decoder layer: attention (through ``attend``) and the MLP (or experts), both
    residual; Gemma normalizes each one's output too."""
    window, local, r_global, r_local = ctx
    batch, steps = x.shape[:2]
    h = _norm(cfg, x, layer["attn_norm"])

    def project(name, heads):
        y = h @ layer[f"w{name}"]
        if cfg.attention_bias:
            y = y + layer[f"b{name}"]
        return y.reshape(batch, steps, heads, cfg.head_dim)

    q, k, v = project("q", cfg.num_heads), project("k", cfg.num_kv_heads), project(
        "v", cfg.num_kv_heads)
    if cfg.qk_norm:
        q, k = _norm(cfg, q, layer["q_norm"]), _norm(cfg, k, layer["k_norm"])
    q, k = rope(q, positions, r_global, local, r_local), rope(k, positions, r_global, local,
                                                                r_local)
    spec = AttentionSpec(window=window, scale=cfg.query_scale, soft_cap=cfg.attn_soft_cap,
                         sinks=layer["sinks"].astype(jnp.float32) if cfg.sinks else None)
    attn, state = attend(state, i, q, k, v, spec)
    out = attn.reshape(batch, steps, -1) @ layer["wo"]
    if cfg.attention_bias:
        out = out + layer["bo"]
    if cfg.gemma_norms:
        out = _norm(cfg, out, layer["attn_post_norm"])
    x = x + out
    h = _norm(cfg, x, layer["mlp_norm"])
    out = experts(cfg, layer, h) if cfg.num_experts else gated_mlp(cfg, layer, h)
    if cfg.gemma_norms:
        out = _norm(cfg, out, layer["mlp_post_norm"])
    return x + out, state


def unstack_layers(params: Params, consume: bool = False) -> Params:
    """The inverse of ``stack_layers``: a list of layers, which ``decoder`` unrolls. Each layer's
    weights are new arrays (slices of the stacks, copied). ``consume``: each stack is deleted
    once its layers are out, so that the model is held once more by one weight's stack at most,
    not twice over (a 70B model over two H200s: 70 GB a device, which twice does not fit)."""
    if not isinstance(params["layers"], dict):
        return params
    stacks = params["layers"]
    count = stacks["wq"].shape[0]
    layers = [{} for _ in range(count)]
    for name, w in stacks.items():
        for i, layer in enumerate(layers):
            layer[name] = w[i]
        if consume:
            w.delete()
    return dict(params, layers=layers)


def stack_layers(params: Params, consume: bool = False) -> Params:
    """The same model with its layers stacked (each weight ``[num_layers, ...]``): ``decoder``
    then scans over the layers. ``consume``: each weight's layers are deleted once its stack is
    made (a checkpoint loads as a list of layers), so that the model is held once more by one
    weight's stack at most, as in ``unstack_layers``."""
    if isinstance(params["layers"], dict):
        return params
    layers = {}
    for k in params["layers"][0]:
        layers[k] = jnp.stack([layer[k] for layer in params["layers"]])
        if consume:
            for layer in params["layers"]:
                layer[k].delete()
    return dict(params, layers=layers)


def logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    out = _norm(cfg, x, params["norm"]) @ params["lm_head"]
    if cfg.final_soft_cap is not None:  # Gemma 2, in the model's dtype as transformers
        out = cfg.final_soft_cap * jnp.tanh(out / cfg.final_soft_cap)
    return out.astype(jnp.float32)


def forward(cfg: ModelConfig, params: Params, kind, cache, tokens, new_lengths, reserve=True):
    """Runs ``tokens`` [B, T] through the decoder, writing their K/V into ``cache``.

    Row ``b`` contributes ``new_lengths[b]`` tokens (a ragged prefill; 1 per step in decode; 0 for
    rows that take no part), placed after the ``kind.lengths(cache)[b]`` tokens it already holds.
    ``kind`` is a cache kind (``caches.py``): it writes each layer's K/V and attends over the cache.
    Returns (logits [B, vocab] of each row's last new token, the cache with lengths committed).
    """
    steps = tokens.shape[1]
    if reserve:  # (False: the caller reserved already)
        cache = kind.reserve(cache, new_lengths)
    positions = kind.lengths(cache)[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]

    def attend(cache, i, q, k, v, spec):
        cache = kind.append(cache, i, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), new_lengths)
        return kind.attend(cache, i, q, positions, new_lengths, spec), cache

    x, cache = decoder(cfg, params, tokens, positions, attend, cache)
    last = jnp.clip(new_lengths - 1, 0, steps - 1)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return logits(cfg, params, x), kind.commit(cache, new_lengths)


def forward_no_cache(cfg: ModelConfig, params: Params, tokens: jax.Array, length) -> jax.Array:
    """Logits [vocab] of token ``length - 1`` of ``tokens`` [S], recomputed from scratch.

    The reference for the cached loop: no cache, plain causal attention over the whole sequence
    (``tokens`` past ``length`` are padding, invisible to the positions that matter).
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None, :]

    def attend(state, i, q, k, v, spec):
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return dense_attention(q, k, v, positions, spec), state

    x, _ = decoder(cfg, params, tokens[None], positions, attend, None)
    return logits(cfg, params, x[0, length - 1])


_no_cache_step = jax.jit(forward_no_cache, static_argnums=0)


def generate_no_cache(cfg: ModelConfig, params: Params, prompt, max_new_tokens: int,
                      capacity: int | None = None) -> list[int]:
    """Greedy generation by full recomputation at every step (slow, obviously right).

    ``capacity`` (default: just enough) pads the sequence so that calls share one compilation.
    """
    capacity = capacity or len(prompt) + max_new_tokens
    tokens = np.zeros((capacity,), np.int32)
    tokens[: len(prompt)] = prompt
    out = []
    for n in range(len(prompt), len(prompt) + max_new_tokens):
        nxt = int(jnp.argmax(_no_cache_step(cfg, params, jnp.asarray(tokens), n)))
        tokens[n] = nxt
        out.append(nxt)
    return out
