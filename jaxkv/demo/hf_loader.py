"""Loads a local Hugging Face Llama checkpoint (config.json + *.safetensors), no network access.

A safetensors file is an 8-byte little-endian header length, a JSON header of name -> dtype, shape,
byte offsets, then raw data. ``load`` reads every file's header once, then each tensor's bytes
only when that tensor is placed, and drops the host copy once it is on its devices: host memory
holds about one tensor (and its converted copy) at a time, not the checkpoint (140 GB for a 70B
model). Its reader is a few lines of numpy, so the demo needs no extra dependency.
"""

from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .model import LlamaConfig, weight_sharding

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


class _Stored(NamedTuple):
    """Where one tensor lies: its file, safetensors dtype code, shape, and byte range in it."""
    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_header(path) -> dict[str, _Stored]:
    """Name -> ``_Stored`` of every tensor of one ``.safetensors`` file, from its header alone."""
    path = pathlib.Path(path)
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    stored = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]  # relative to the end of the header
        stored[name] = _Stored(path, info["dtype"], tuple(info["shape"]),
                               8 + size + start, 8 + size + end)
    return stored


def _read_tensor(name: str, stored: _Stored) -> np.ndarray:
    """Tensor ``name``'s bytes, read from its file into a fresh array (no other copy)."""
    dtype = np.dtype(_DTYPES[stored.dtype])
    size = stored.end - stored.start
    if size != dtype.itemsize * int(np.prod(stored.shape)):
        raise ValueError(f"{stored.file}: tensor {name} has {size} bytes, not those of a "
                         f"{stored.dtype} tensor of shape {list(stored.shape)}")
    data = bytearray(size)  # as bytes: a bfloat16 array has no buffer to read into
    with stored.file.open("rb") as f:
        f.seek(stored.start)
        read = f.readinto(data)
    if read != size:
        raise ValueError(f"{stored.file}: tensor {name} is cut short ({read} of {size} bytes)")
    return np.frombuffer(data, dtype).reshape(stored.shape)  # data's memory, not a copy


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, as numpy arrays (by the module's reader, also
    where the ``safetensors`` package is installed: the same arrays and errors everywhere)."""
    return {name: _read_tensor(name, stored) for name, stored in _read_header(path).items()}


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


def _checkpoint_index(root: pathlib.Path) -> dict[str, _Stored]:
    """Where each tensor of the checkpoint in ``root`` lies, ``model.`` taken off its name. A
    name in several files is the last file's (in name order), as when every file was read."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    index: dict[str, _Stored] = {}
    for f in files:
        index.update(_read_header(f))
    return {k.removeprefix("model."): v for k, v in index.items()}


def load(path, dtype="float32", mesh=None):
    """(LlamaConfig, params) of the checkpoint in directory ``path``. With ``mesh``, each weight
    goes from the host straight to its devices, split as ``model.weight_sharding`` says: a model
    larger than one device never sits whole on the first one. Each tensor is read from its file
    only as it is placed, so the host never holds the checkpoint (the module's docstring)."""
    root = pathlib.Path(path)
    cfg = read_config(root)
    index = _checkpoint_index(root)

    def host(name, transpose=True):  # torch's Linear is [out, in]
        if name not in index:
            raise KeyError(f"{root}: checkpoint has no tensor {name!r}")
        w = np.asarray(_read_tensor(name, index[name]), np.float32)
        return np.asarray(w.T if transpose else w, jnp.dtype(dtype))

    def place(key, w):  # key: the weight's name in params; w's host copy goes once it returns
        if mesh is None:
            return jnp.asarray(w)
        return jax.device_put(w, weight_sharding(key, w.shape, mesh))

    names = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                 wv="self_attn.v_proj", wo="self_attn.o_proj",
                 mlp_norm="post_attention_layernorm", w_gate="mlp.gate_proj",
                 w_up="mlp.up_proj", w_down="mlp.down_proj")
    layers = [{key: place(key, host(f"layers.{i}.{name}.weight", "norm" not in key))
               for key, name in names.items()} for i in range(cfg.num_layers)]
    embed_host = host("embed_tokens.weight", False)
    embed = place("embed", embed_host)
    if cfg.tie_word_embeddings or "lm_head.weight" not in index:
        lm_head = place("lm_head", embed_host.T)
    else:
        del embed_host  # off the host before lm_head, as large, is read
        lm_head = place("lm_head", host("lm_head.weight"))
    params = dict(embed=embed, layers=layers, norm=place("norm", host("norm.weight", False)),
                  lm_head=lm_head)
    return cfg, params
