"""Gemma 2 and Gemma 3 (text): window and global layers, Gemma's norms and GeGLU.

- Gemma 2: alternating window (first) and global layers; scores soft-capped (50) and the final
  logits too (30); softmax scale ``query_pre_attn_scalar ** -0.5``.
- Gemma 3: five window layers to one global (``layer_types``); RMSNorm over each head's q and k;
  the window layers' RoPE base (10 000) apart from the global layers' (scaled).

Both: RMSNorm weights as offsets from 1, a norm after attention and after the MLP as well as
before, the embedding scaled by sqrt(hidden_size), tied embeddings.
"""

from __future__ import annotations

from . import _hf
from .config import ModelConfig

MODEL_TYPES = ("gemma2", "gemma3_text")


def _layer_types(hf: dict) -> list[str]:
    if hf.get("layer_types"):
        return hf["layer_types"]
    n = hf["num_hidden_layers"]
    if hf["model_type"] == "gemma2":  # transformers' default: window on even layers
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def config_from_hf(hf: dict) -> ModelConfig:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        _hf.refuse(hf, f"hidden_activation {act} is not supported (GeGLU with tanh gelu)")
    if hf.get("attention_bias"):
        _hf.refuse(hf, "attention_bias is not supported")
    gemma3 = hf["model_type"] == "gemma3_text"
    types = _layer_types(hf)
    fields = dict(
        windows=_hf.windows(hf, types),
        query_scale=float(hf.get("query_pre_attn_scalar") or hf["head_dim"]) ** -0.5,
        attn_soft_cap=hf.get("attn_logit_softcapping"),
        final_soft_cap=hf.get("final_logit_softcapping"),
        gemma_norms=True, activation="gelu_tanh",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=gemma3)
    if gemma3:
        glob = _hf.rope_parameters(hf, "full_attention")
        local = _hf.rope_parameters(hf, "sliding_attention")
        if "rope_local_base_freq" in hf:  # transformers 4 spelled the window layers' base so
            local = dict(rope_theta=hf["rope_local_base_freq"])
        if _hf.rope_scaling(hf, local) is not None:
            _hf.refuse(hf, "a scaled RoPE on the window layers is not supported")
        fields.update(rope_theta=float(glob["rope_theta"]),
                      rope_scaling=_hf.rope_scaling(hf, glob),
                      local_rope_theta=float(local["rope_theta"]))
    return _hf.base_config(hf, "gemma3" if gemma3 else "gemma2", **fields)


def layer_weights(cfg: ModelConfig) -> dict:
    names = dict(_hf.LLAMA_LAYER)
    names.update(attn_post_norm=("post_attention_layernorm.weight", False),
                 mlp_norm=("pre_feedforward_layernorm.weight", False),
                 mlp_post_norm=("post_feedforward_layernorm.weight", False))
    if cfg.qk_norm:
        names.update(q_norm=("self_attn.q_norm.weight", False),
                     k_norm=("self_attn.k_norm.weight", False))
    return names
