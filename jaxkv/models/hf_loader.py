"""Loads a local Hugging Face checkpoint (config.json + *.safetensors) of a family jaxkv serves
(``registry.FAMILIES``), with no network access.

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

from . import registry
from .config import ModelConfig
from .decoder import weight_sharding

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


def text_config(hf: dict) -> dict:
    """A checkpoint's language model's config: a multimodal Gemma 3 (``model_type`` gemma3)
    keeps it under ``text_config``; jaxkv serves its text decoder."""
    if hf.get("model_type") == "gemma3" and "text_config" in hf:
        return dict({"model_type": "gemma3_text"}, **hf["text_config"])
    return dict(hf, model_type=hf.get("model_type", "llama"))


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face ``config.json``: its family's (``registry.FAMILIES``,
    by ``model_type``); a family or a feature jaxkv cannot compute exactly is refused, naming it."""
    hf = text_config(hf)
    return registry.family(hf["model_type"]).config_from_hf(hf)


def _read_hf(path) -> dict:
    """The language model's part of the ``config.json`` in directory ``path`` (``text_config``)."""
    config = pathlib.Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{path}: no config.json (expected a local Hugging Face checkpoint)")
    return text_config(json.loads(config.read_text()))


def read_config(path) -> ModelConfig:
    """The ModelConfig of the checkpoint in directory ``path`` (its ``config.json`` alone)."""
    return config_from_hf(_read_hf(path))


def _checkpoint_index(root: pathlib.Path) -> dict[str, _Stored]:
    """Where each tensor of the checkpoint in ``root`` lies, ``model.`` taken off its name. A
    name in several files is the last file's (in name order), as when every file was read."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    index: dict[str, _Stored] = {}
    for f in files:
        index.update(_read_header(f))
    # A multimodal checkpoint's language model: model.language_model.* (transformers 5) or
    # language_model.model.* (earlier); its vision tower's tensors are never read.
    prefixes = ("model.language_model.", "language_model.model.", "language_model.", "model.")
    return {next((k.removeprefix(p) for p in prefixes if k.startswith(p)), k): v
            for k, v in index.items()}


def load(path, dtype="float32", mesh=None):
    """(ModelConfig, params) of the checkpoint in directory ``path``. With ``mesh``, each weight
    goes from the host straight to its devices, split as ``model.weight_sharding`` says: a model
    larger than one device never sits whole on the first one. Each tensor is read from its file
    only as it is placed, so the host never holds the checkpoint (the module's docstring)."""
    root = pathlib.Path(path)
    hf = _read_hf(root)
    cfg = config_from_hf(hf)
    index = _checkpoint_index(root)

    def host(name, transpose=True):  # torch's Linear is [out, in]
        if name not in index:
            raise KeyError(f"{root}: checkpoint has no tensor {name!r} (a {cfg.family} "
                           f"checkpoint's weights, unquantized, are expected)")
        w = np.asarray(_read_tensor(name, index[name]), np.float32)
        return np.asarray(w.T if transpose else w, jnp.dtype(dtype))

    def place(key, w):  # key: the weight's name in params; w's host copy goes once it returns
        if mesh is None:
            return jnp.asarray(w)
        return jax.device_put(w, weight_sharding(key, w.shape, mesh))

    names = registry.family(hf["model_type"]).layer_weights(cfg)
    layers = [{key: place(key, host(f"layers.{i}.{name}", transpose))
               for key, (name, transpose) in names.items()} for i in range(cfg.num_layers)]
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
