"""Mistral: Llama with a sliding window on every layer (``sliding_window``; none: global)."""

from __future__ import annotations

import dataclasses

from . import _hf, llama
from .config import ModelConfig

MODEL_TYPES = ("mistral",)


def config_from_hf(hf: dict) -> ModelConfig:
    layers = hf.get("layer_types") or ["sliding_attention"] * hf["num_hidden_layers"]
    return dataclasses.replace(llama.config_from_hf(hf), family="mistral",
                               windows=_hf.windows(hf, layers))


layer_weights = llama.layer_weights
