"""A small Llama-style decoder in JAX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The layer math follows Hugging Face's ``LlamaForCausalLM`` (rotate-half RoPE, RMSNorm in
float32), so a checkpoint loaded by ``hf_loader`` computes what ``transformers`` computes.
Attention is the cache's business: ``forward`` hands each layer's new K/V to a cache kind
(``caches.py``), which writes them and attends over everything the sequence holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    # Llama 3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_positions).
    rope_llama3: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.head_dim}")


Params = dict[str, Any]


def init_params(cfg: LlamaConfig, seed: int = 0, dtype=jnp.float32) -> Params:
    """Deterministic random weights: the same seed gives the same model on every machine.

    The scale (1/sqrt(fan_in), embeddings of unit norm) keeps logits spread out, so greedy decoding
    is not decided by rounding: a cached and a recomputed run agree token for token.
    """
    rng = np.random.default_rng(seed)

    def dense(fan_in, fan_out):
        return jnp.asarray(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in), dtype)

    def norm(n):
        return jnp.asarray(1.0 + 0.1 * rng.standard_normal(n), dtype)

    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = [
        dict(
            attn_norm=norm(d), wq=dense(d, q), wk=dense(d, kv), wv=dense(d, kv), wo=dense(q, d),
            mlp_norm=norm(d), w_gate=dense(d, cfg.intermediate_size),
            w_up=dense(d, cfg.intermediate_size), w_down=dense(cfg.intermediate_size, d),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, d)), dtype)
    lm_head = embed.T if cfg.tie_word_embeddings else dense(d, cfg.vocab_size) * 4
    return dict(embed=embed, layers=layers, norm=norm(d), lm_head=lm_head)


# Model shapes for ``python -m jaxkv serve --preset``: the demo's small model, and the shapes of
# Llama 3.2 1B (but not tied) and Llama 3.1 8B, with random weights (init_stacked_params).
PRESETS = {
    # tiny: 8 / 4 heads, so that tp=4 (8 emulated CPU devices) splits them
    "tiny": LlamaConfig(num_heads=8, num_kv_heads=4, head_dim=16),
    "1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0),
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                       rope_theta=500000.0),
}

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


def init_stacked_params(cfg: LlamaConfig, seed: int = 0, dtype=jnp.float32,
                        mesh=None) -> Params:
    """Random weights with stacked layers (``stack_layers``' layout), drawn on the device by one
    jitted function: an 8B model in seconds, with no host copy. The scales are ``init_params``'
    (the same distribution, not the same numbers). With ``mesh``, drawn already placed
    (``parameter_shardings``): a 70B model never exists whole on one device."""
    dtype = jnp.dtype(dtype)
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f, n = cfg.intermediate_size, cfg.num_layers
    shapes = dict(wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), w_gate=(d, f), w_up=(d, f),
                  w_down=(f, d))

    def make(key):
        keys = iter(jax.random.split(key, len(shapes) + 5))
        norm = lambda shape: (1 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)  # noqa
                              ).astype(dtype)

        def pieces(key, shape, parts, scale=1.0):  # [parts * rows, ...] drawn a piece at a time
            piece = (shape[0] // parts, *shape[1:])
            return jax.lax.map(lambda k: jax.random.normal(k, piece, dtype) * jnp.asarray(
                scale, dtype), jax.random.split(key, parts)).reshape(shape)

        # A layer (a vocabulary's eighth) at a time, lax.map being a loop: the generator's
        # temporaries are a piece's, not the whole stack's (a 70B model's at once: 324 GB a
        # device over tp=2 by XLA's CPU memory analysis, beside 73 GB of weights).
        layers = {name: pieces(next(keys), (n, *shape), n, 1 / np.sqrt(shape[0]))
                  for name, shape in shapes.items()}
        layers.update(attn_norm=norm((n, d)), mlp_norm=norm((n, d)))
        eighths = 8 if cfg.vocab_size % 8 == 0 and d % 8 == 0 else 1
        embed = pieces(next(keys), (cfg.vocab_size, d), eighths)
        lm_head = (embed.T if cfg.tie_word_embeddings
                   else pieces(next(keys), (d, cfg.vocab_size), eighths, 4 / np.sqrt(d)))
        return dict(embed=embed, layers=layers, norm=norm((d,)), lm_head=lm_head)

    key = jax.random.key(seed)
    if mesh is None:
        return jax.jit(make)(key)
    shardings = parameter_shardings(jax.eval_shape(make, key), mesh)
    return jax.jit(make, out_shardings=shardings)(key)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """float32 [head_dim / 2]: RoPE's inverse frequencies, with Llama 3 scaling when configured
    (transformers' ``_compute_llama3_parameters``)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    if cfg.rope_llama3 is None:
        return inv_freq.astype(np.float32)
    factor, low, high, context = cfg.rope_llama3
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (Hugging Face's convention). x: [B, T, H, D]; positions: int32 [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal GQA attention of new queries over a sequence's keys, masked by position.

    q: [B, T, Hq, D] at positions [B, T]; k, v: [B, Hkv, S, D], key ``s`` is position ``s``.
    Query ``t`` of row ``b`` sees keys ``s <= positions[b, t]``. Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k).astype(jnp.float32) / np.sqrt(d)
    visible = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, hq, d)


def decoder(cfg: LlamaConfig, params: Params, tokens, positions, attend, state):
    """Hidden states [B, T, hidden] of ``tokens`` [B, T] at ``positions`` [B, T].

    ``attend(state, layer_idx, q, k, v) -> (out, state)`` is attention with whatever memory
    ``state`` keeps (a KV cache, or nothing): q [B, T, Hq, D], k and v [B, T, Hkv, D] after RoPE.
    With stacked layers (``stack_layers``: one array per weight, a leading layer axis) the layers
    run in a ``lax.scan`` and ``layer_idx`` is traced (a 32-layer model compiles one layer);
    with a list of layers they are unrolled and ``layer_idx`` is a Python int.
    """
    inv_freq = rope_frequencies(cfg)
    x = params["embed"][tokens]
    if isinstance(params["layers"], dict):
        def body(carry, xs):
            layer, i = xs
            return _layer(cfg, layer, i, carry[0], positions, inv_freq, attend, carry[1]), None

        num_layers = params["layers"]["wq"].shape[0]
        (x, state), _ = jax.lax.scan(body, (x, state),
                                     (params["layers"], jnp.arange(num_layers, dtype=jnp.int32)))
        return x, state
    for i, layer in enumerate(params["layers"]):
        x, state = _layer(cfg, layer, i, x, positions, inv_freq, attend, state)
    return x, state


def _layer(cfg: LlamaConfig, layer, i, x, positions, inv_freq, attend, state):
    """One decoder layer: attention (through ``attend``) and the SwiGLU MLP, both residual."""
    batch, steps = x.shape[:2]
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q = (h @ layer["wq"]).reshape(batch, steps, cfg.num_heads, cfg.head_dim)
    k = (h @ layer["wk"]).reshape(batch, steps, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ layer["wv"]).reshape(batch, steps, cfg.num_kv_heads, cfg.head_dim)
    q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
    attn, state = attend(state, i, q, k, v)
    x = x + attn.reshape(batch, steps, -1) @ layer["wo"]
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    return x, state


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


def logits(cfg: LlamaConfig, params: Params, x: jax.Array) -> jax.Array:
    return (rms_norm(x, params["norm"], cfg.rms_norm_eps) @ params["lm_head"]).astype(jnp.float32)


def forward(cfg: LlamaConfig, params: Params, kind, cache, tokens, new_lengths, reserve=True):
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

    def attend(cache, i, q, k, v):
        cache = kind.append(cache, i, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), new_lengths)
        return kind.attend(cache, i, q, positions, new_lengths), cache

    x, cache = decoder(cfg, params, tokens, positions, attend, cache)
    last = jnp.clip(new_lengths - 1, 0, steps - 1)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return logits(cfg, params, x), kind.commit(cache, new_lengths)


def forward_no_cache(cfg: LlamaConfig, params: Params, tokens: jax.Array, length) -> jax.Array:
    """Logits [vocab] of token ``length - 1`` of ``tokens`` [S], recomputed from scratch.

    The reference for the cached loop: no cache, plain causal attention over the whole sequence
    (``tokens`` past ``length`` are padding, invisible to the positions that matter).
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None, :]

    def attend(state, i, q, k, v):
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return dense_attention(q, k, v, positions), state

    x, _ = decoder(cfg, params, tokens[None], positions, attend, None)
    return logits(cfg, params, x[0, length - 1])


_no_cache_step = jax.jit(forward_no_cache, static_argnums=0)


def generate_no_cache(cfg: LlamaConfig, params: Params, prompt, max_new_tokens: int,
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
