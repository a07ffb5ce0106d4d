"""gpt-oss: alternating 128-token window and global layers, a sink logit per head, biased
projections, a mixture of experts (top-k routing, clamped SwiGLU) and YaRN RoPE."""

from __future__ import annotations

from . import _hf
from .config import ModelConfig

MODEL_TYPES = ("gpt_oss",)


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("quantization_config"):
        _hf.refuse(hf, f"{hf['quantization_config'].get('quant_method', 'quantized')} weights "
                       "are not supported: load it dequantized (transformers' "
                       "Mxfp4Config(dequantize=True)) and save it again")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(n)]
    return _hf.base_config(
        hf, "gpt_oss", windows=_hf.windows(hf, types), sinks=True,
        attention_bias=bool(hf.get("attention_bias", True)),
        num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def layer_weights(cfg: ModelConfig) -> dict:
    names = {k: v for k, v in _hf.LLAMA_LAYER.items() if not k.startswith("w_")}
    names.update(bq=("self_attn.q_proj.bias", False), bk=("self_attn.k_proj.bias", False),
                 bv=("self_attn.v_proj.bias", False), bo=("self_attn.o_proj.bias", False),
                 sinks=("self_attn.sinks", False),
                 router=("mlp.router.weight", True), router_bias=("mlp.router.bias", False),
                 experts_gate_up=("mlp.experts.gate_up_proj", False),
                 experts_gate_up_bias=("mlp.experts.gate_up_proj_bias", False),
                 experts_down=("mlp.experts.down_proj", False),
                 experts_down_bias=("mlp.experts.down_proj_bias", False))
    return names
