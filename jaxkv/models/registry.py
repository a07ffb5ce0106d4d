"""The families jaxkv's decoder serves, by a checkpoint's ``model_type``, and the named shapes
(``PRESETS``) the serving benchmark runs with random weights."""

from __future__ import annotations

from . import gemma, gpt_oss, llama, mistral
from .config import ModelConfig, RopeScaling

FAMILIES = {t: m for m in (llama, mistral, gemma, gpt_oss) for t in m.MODEL_TYPES}


def family(model_type: str):
    """The module of a checkpoint's ``model_type``: ``config_from_hf`` and ``layer_weights``."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; jaxkv serves "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


_LLAMA3 = dict(vocab_size=128256, num_kv_heads=8, rope_theta=500000.0)

PRESETS = {
    # tiny: 8 / 4 heads, so that tp=4 (8 emulated CPU devices) splits them
    "tiny": ModelConfig(num_heads=8, num_kv_heads=4, head_dim=16),
    # Llama 3.2 1B (but not tied), Llama 3.1 8B and 70B.
    "1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      head_dim=64, **_LLAMA3),
    "8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      head_dim=128, **_LLAMA3),
    "70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       head_dim=128, **_LLAMA3),
    # Gemma 3 12B: 48 layers, 40 with a 1024-token window (5 to each global one), head_dim 256.
    "gemma3-12b": ModelConfig(
        family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=1e6,
        rope_scaling=RopeScaling("linear", factor=8.0), local_rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, windows=((1024,) * 5 + (None,)) * 8,
        query_scale=256 ** -0.5, qk_norm=True, gemma_norms=True, activation="gelu_tanh"),
    # gpt-oss-20b: 24 layers alternating a 128-token window and global, sinks, 32 experts (4 a
    # token).
    "gpt-oss-20b": ModelConfig(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0,
        rope_scaling=RopeScaling("yarn", factor=32.0, original_max_positions=4096,
                                 truncate=False),
        windows=(128, None) * 12, sinks=True, attention_bias=True, num_experts=32,
        experts_per_token=4),
}
