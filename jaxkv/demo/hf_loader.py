"""Loads a local Hugging Face Llama checkpoint (config.json + *.safetensors), no network access.

Uses the ``safetensors`` package when installed; otherwise a small reader of the format (an 8-byte
little-endian header length, a JSON header of name -> dtype, shape, byte offsets, then raw data), so
the demo needs no extra dependency.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from .model import LlamaConfig, weight_sharding

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, as numpy arrays."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        pass
    else:
        try:
            return load_file(str(path))
        except TypeError:  # bf16 tensors: numpy has no bfloat16 of its own
            pass
    data = pathlib.Path(path).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = data[8 + size + start : 8 + size + end]
        tensors[name] = np.frombuffer(raw, _DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def config_from_hf(hf: dict) -> LlamaConfig:
    """LlamaConfig of a Hugging Face ``config.json`` (Llama architecture only)."""
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or archs[0] != "LlamaForCausalLM":
        raise ValueError(
            f"only Llama checkpoints are supported, got {hf.get('model_type')} {archs}")
    # transformers 5 writes rope_parameters (with rope_theta in it), earlier versions rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported (default and llama3 only)")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']} is not supported (SwiGLU with silu only)")
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_llama3=llama3,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def read_config(path) -> LlamaConfig:
    """The LlamaConfig of the checkpoint in directory ``path`` (its ``config.json`` alone)."""
    config = pathlib.Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{path}: no config.json (expected a local Hugging Face checkpoint)")
    return config_from_hf(json.loads(config.read_text()))


def load(path, dtype="float32", mesh=None):
    """(LlamaConfig, params) of the checkpoint in directory ``path``. With ``mesh``, each weight
    goes from the host straight to its devices, split as ``model.weight_sharding`` says: a model
    larger than one device never sits whole on the first one."""
    root = pathlib.Path(path)
    cfg = read_config(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    weights = {}
    for f in files:
        weights.update(read_safetensors(f))
    weights = {k.removeprefix("model."): v for k, v in weights.items()}

    def host(name, transpose=True):  # torch's Linear is [out, in]
        if name not in weights:
            raise KeyError(f"{root}: checkpoint has no tensor {name!r}")
        w = np.asarray(weights.pop(name), np.float32)
        return np.asarray(w.T if transpose else w, jnp.dtype(dtype))

    def place(key, w):  # key: the weight's name in params
        if mesh is None:
            return jnp.asarray(w)
        return jax.device_put(w, weight_sharding(key, w.shape, mesh))

    names = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                 wv="self_attn.v_proj", wo="self_attn.o_proj",
                 mlp_norm="post_attention_layernorm", w_gate="mlp.gate_proj",
                 w_up="mlp.up_proj", w_down="mlp.down_proj")
    layers = [{key: place(key, host(f"layers.{i}.{name}.weight", "norm" not in key))
               for key, name in names.items()} for i in range(cfg.num_layers)]
    embed = host("embed_tokens.weight", False)
    if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        lm_head = embed.T
    else:
        lm_head = host("lm_head.weight")
    params = dict(embed=place("embed", embed), layers=layers,
                  norm=place("norm", host("norm.weight", False)),
                  lm_head=place("lm_head", lm_head))
    return cfg, params
