"""Checkpoint configs of every family become ModelConfigs, and what jaxkv cannot compute exactly
is refused with the field that says so (no transformers needed)."""

import pytest

from jaxkv.models import PRESETS, hf_loader

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_each_family_reads_its_layer_kinds():
    gemma2 = hf_loader.config_from_hf(dict(BASE, model_type="gemma2", sliding_window=8))
    assert gemma2.windows == (8, None, 8, None) and gemma2.gemma_norms and not gemma2.qk_norm
    gemma3 = hf_loader.config_from_hf(dict(BASE, model_type="gemma3_text", sliding_window=8,
                                           num_hidden_layers=6, sliding_window_pattern=3))
    assert gemma3.windows == (8, 8, None) * 2 and gemma3.qk_norm
    mistral = hf_loader.config_from_hf(dict(BASE, model_type="mistral", sliding_window=8))
    assert mistral.windows == (8,) * 4
    assert hf_loader.config_from_hf(dict(BASE, model_type="mistral", sliding_window=None)
                                    ).windows is None
    oss = hf_loader.config_from_hf(dict(BASE, model_type="gpt_oss", sliding_window=8,
                                        num_local_experts=4, num_experts_per_tok=2))
    assert oss.windows == (8, None, 8, None) and oss.sinks and oss.num_experts == 4
    multimodal = hf_loader.config_from_hf(dict(model_type="gemma3", text_config=dict(
        BASE, sliding_window=8)))
    assert multimodal.family == "gemma3"


@pytest.mark.parametrize("config, named", [
    (dict(model_type="qwen2"), "model_type 'qwen2' is not supported"),
    (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
          quantization_config=dict(quant_method="mxfp4")), "mxfp4 weights are not supported"),
    (dict(model_type="llama", rope_scaling=dict(rope_type="longrope")), "RoPE type 'longrope'"),
    (dict(model_type="llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(model_type="llama", attention_bias=True), "attention_bias"),
    (dict(model_type="gemma2", hidden_activation="relu"), "hidden_activation relu"),
    (dict(model_type="gemma2", sliding_window=8, layer_types=["chunked_attention"] * 4),
     "layer types ['chunked_attention']"),
])
def test_what_cannot_be_computed_exactly_is_refused_by_name(config, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        hf_loader.config_from_hf(dict(BASE, **config))


def test_the_hybrid_presets_have_their_models_layer_kinds():
    g = PRESETS["gemma3-12b"]
    assert g.num_layers == 48 and g.windows.count(1024) == 40 and g.head_dim == 256
    assert (g.num_heads, g.num_kv_heads, g.hidden_size) == (16, 8, 3840)
    oss = PRESETS["gpt-oss-20b"]
    assert oss.windows == (128, None) * 12 and oss.sinks and oss.experts_per_token == 4
