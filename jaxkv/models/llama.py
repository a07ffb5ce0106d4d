"""Llama (2, 3, 3.1, 3.2): RMSNorm, RoPE (Llama 3 scaling), grouped-query attention, SwiGLU."""

from __future__ import annotations

from . import _hf
from .config import ModelConfig

MODEL_TYPES = ("llama",)


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        _hf.refuse(hf, "attention_bias / mlp_bias are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        _hf.refuse(hf, f"hidden_act {hf['hidden_act']} is not supported (SwiGLU with silu)")
    return _hf.base_config(hf, "llama", rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def layer_weights(cfg: ModelConfig) -> dict:
    return dict(_hf.LLAMA_LAYER)
