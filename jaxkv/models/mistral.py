"""Mistral: Llama with a sliding window on every layer (``sliding_window``; none: global)."""

from __future__ import annotations

from . import _hf, llama
from .config import ModelConfig

MODEL_TYPES = ("mistral",)


def config_from_hf(hf: dict) -> ModelConfig:
    cfg = llama.config_from_hf(dict(hf, model_type="mistral"))
    layers = hf["num_hidden_layers"]
    windows = _hf.windows(hf, hf.get("layer_types") or ["sliding_attention"] * layers)
    return _hf.base_config(hf, "mistral", windows=windows,
                           rms_norm_eps=cfg.rms_norm_eps)


layer_weights = llama.layer_weights
