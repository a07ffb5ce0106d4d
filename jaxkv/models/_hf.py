"""Reading a transformers ``config.json``: the fields every family shares, RoPE, layer kinds.

Each family's module calls these and names what it adds; anything a family cannot compute
exactly is refused here with the field that says so.
"""

from __future__ import annotations

from .config import ModelConfig, RopeScaling


def refuse(hf: dict, what: str):
    raise ValueError(f"{hf.get('model_type', '?')} checkpoint: {what}")


def rope_parameters(hf: dict, layer_type: str | None = None) -> dict:
    """The RoPE parameters (``rope_theta`` in them): transformers 5 writes ``rope_parameters``
    (Gemma 3: one per layer type), earlier versions ``rope_scaling`` and ``rope_theta``."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type is not None and layer_type in rope:
        rope = rope[layer_type]
    rope = dict(rope)
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def rope_scaling(hf: dict, rope: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(rope["factor"]),
                           low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]),
                           original_max_positions=int(rope["original_max_position_embeddings"]))
    if kind == "yarn":
        if rope.get("attention_factor") is not None or rope.get("mscale"):
            refuse(hf, "YaRN with attention_factor / mscale is not supported")
        return RopeScaling("yarn", factor=float(rope["factor"]),
                           beta_fast=float(rope.get("beta_fast") or 32),
                           beta_slow=float(rope.get("beta_slow") or 1),
                           original_max_positions=int(rope["original_max_position_embeddings"]),
                           truncate=bool(rope.get("truncate", True)))
    refuse(hf, f"RoPE type {kind!r} is not supported (default, linear, llama3, yarn)")


def windows(hf: dict, layer_types: list[str] | None) -> tuple[int | None, ...] | None:
    """Each layer's window from ``layer_types`` (``sliding_attention`` / ``full_attention``) and
    ``sliding_window``; None where no layer has one."""
    window = hf.get("sliding_window")
    if layer_types is None or window is None:
        return None
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        refuse(hf, f"layer types {sorted(unknown)} are not supported")
    out = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return out if any(w is not None for w in out) else None


def base_config(hf: dict, family: str, **fields) -> ModelConfig:
    """The fields every family spells alike, and ``fields`` over them."""
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(hf, "partial_rotary_factor is not supported")
    heads = hf["num_attention_heads"]
    rope = rope_parameters(hf)
    base = dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope_scaling(hf, rope),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    base.update(fields)
    return ModelConfig(**base)


# Each layer weight of the Llama layout: (name in the checkpoint, torch Linear [out, in] to
# transpose). Families add to it or rename.
LLAMA_LAYER = dict(
    attn_norm=("input_layernorm.weight", False), wq=("self_attn.q_proj.weight", True),
    wk=("self_attn.k_proj.weight", True), wv=("self_attn.v_proj.weight", True),
    wo=("self_attn.o_proj.weight", True), mlp_norm=("post_attention_layernorm.weight", False),
    w_gate=("mlp.gate_proj.weight", True), w_up=("mlp.up_proj.weight", True),
    w_down=("mlp.down_proj.weight", True))
