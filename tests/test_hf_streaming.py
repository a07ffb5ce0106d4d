"""``hf_loader.load`` streams a safetensors checkpoint: each tensor is read from its file when
it is placed, so host memory holds about one tensor at a time, not the whole checkpoint."""

import json
import re
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.demo import cli
from jaxkv.models import hf_loader
from jaxkv.models import decoder as M

_CODES = {"float32": "F32", "bfloat16": "BF16"}
_LAYER_TENSORS = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                  "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"]


def tensor_shapes(layers, hidden, vocab, tie):
    """Hugging Face names and shapes of a Llama with 4 heads of ``hidden / 4`` (query and KV),
    and an MLP as wide as ``hidden``: every projection is ``[hidden, hidden]``."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        for name in _LAYER_TENSORS:
            shape = (hidden,) if "norm" in name else (hidden, hidden)
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_safetensors(path, tensors, codes):
    """One ``.safetensors`` file of ``tensors`` (name -> array), each stored as ``codes[name]``;
    with the ``__metadata__`` entry that ``save_pretrained`` writes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        blob = value.tobytes()
        header[name] = dict(dtype=codes[name], shape=list(value.shape),
                            data_offsets=[offset, offset + len(blob)])
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def write_split_checkpoint(path, dtype="float32", layers=2, hidden=64, vocab=96, tie=False):
    """A Llama checkpoint split over two ``.safetensors`` files, as ``save_pretrained`` shards
    one (the embedding in the first, ``lm_head`` in the second, the layers across both), of
    ``dtype`` tensors. Returns (path, the tensors written: name -> array)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tie)))
    rng = np.random.default_rng(7)
    tensors = {name: rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(dtype))
               for name, shape in tensor_shapes(layers, hidden, vocab, tie).items()}
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    codes = dict.fromkeys(names, _CODES[dtype])
    for i, half in enumerate(halves, 1):
        write_safetensors(path / f"model-{i:05d}-of-00002.safetensors",
                          {name: tensors[name] for name in half}, codes)
    index = dict(weight_map={name: f"model-{i:05d}-of-00002.safetensors"
                             for i, half in enumerate(halves, 1) for name in half})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, tensors


def expected_params(tensors, num_layers, dtype, tie):
    """The params ``load`` should make of ``tensors``, as float32 host arrays: torch's
    ``[out, in]`` projections transposed, each value rounded to ``dtype`` through float32."""
    def want(name, transpose=True):
        w = np.asarray(tensors[name], np.float32)
        return np.asarray(np.asarray(w.T if transpose else w, jnp.dtype(dtype)), np.float32)

    keys = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    layers = [{key: want(f"model.layers.{i}.{name}.weight", "norm" not in key)
               for key, name in zip(keys, _LAYER_TENSORS)} for i in range(num_layers)]
    embed = want("model.embed_tokens.weight", False)
    lm_head = embed.T if tie else want("lm_head.weight")
    return dict(embed=embed, layers=layers, norm=want("model.norm.weight", False),
                lm_head=lm_head)


def assert_params_equal(params, want):
    got = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("file_dtype, load_dtype",
                         [("float32", "float32"), ("bfloat16", "bfloat16"),
                          ("bfloat16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("tie", [False, True])
def test_a_split_checkpoint_loads_the_values_written(tmp_path, file_dtype, load_dtype, tie):
    path, tensors = write_split_checkpoint(tmp_path / "ckpt", file_dtype, tie=tie)
    cfg, params = hf_loader.load(path, dtype=load_dtype)
    assert cfg.num_layers == 2 and cfg.tie_word_embeddings == tie
    assert all(x.dtype == jnp.dtype(load_dtype) for x in jax.tree.leaves(params))
    assert_params_equal(params, expected_params(tensors, 2, load_dtype, tie))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_safetensors_returns_every_tensor_of_a_file(tmp_path, dtype):
    path, tensors = write_split_checkpoint(tmp_path / "ckpt", dtype)
    read = {}
    for f in sorted(path.glob("*.safetensors")):
        read.update(hf_loader.read_safetensors(f))
    assert set(read) == set(tensors)
    for name, value in tensors.items():
        assert read[name].dtype == value.dtype and read[name].shape == value.shape, name
        np.testing.assert_array_equal(read[name].astype(np.float32), value.astype(np.float32))


def test_a_missing_lm_head_is_the_embedding_transposed(tmp_path):
    """An untied config whose checkpoint has no ``lm_head.weight`` ties it, as before."""
    path, tensors = write_split_checkpoint(tmp_path / "ckpt", tie=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    _, params = hf_loader.load(path)
    np.testing.assert_array_equal(np.asarray(params["lm_head"]),
                                  tensors["model.embed_tokens.weight"].T)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (CPU: conftest emulates 8)")
def test_a_split_checkpoint_goes_to_the_mesh_split_as_drawn_weights_are(tmp_path):
    path, tensors = write_split_checkpoint(tmp_path / "ckpt", "bfloat16")
    mesh = cli.cache_sharding({"tp": 2}).mesh
    _, params = hf_loader.load(path, dtype="bfloat16", mesh=mesh)
    want = M.parameter_shardings(params, mesh)
    for (path_, x), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                    jax.tree.leaves(want)):
        assert x.sharding.is_equivalent_to(sharding, x.ndim), jax.tree_util.keystr(path_)
    assert_params_equal(params, expected_params(tensors, 2, "bfloat16", False))


def test_loading_holds_about_one_tensor_on_the_host_not_the_checkpoint(tmp_path):
    """16 layers of equal [256, 256] float32 tensors (256 KiB each, 29 MiB in all): the host's
    peak while loading is a few tensors. Reading every file first peaks at the whole checkpoint.
    tracemalloc sees numpy's buffers and Python's bytes, not XLA's device (or CPU) buffers."""
    path, tensors = write_split_checkpoint(tmp_path / "ckpt", layers=16, hidden=256, vocab=256)
    total = sum(t.nbytes for t in tensors.values())
    del tensors
    hf_loader.load(path)  # imports and caches outside the measurement
    tracemalloc.start()
    try:
        _, params = hf_loader.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"host peak while loading: {peak / 2**20:.2f} MiB of a {total / 2**20:.2f} MiB "
          "checkpoint")
    assert len(params["layers"]) == 16
    assert peak < total / 8, (peak, total)


# Errors: the same exceptions and messages as when every file was read up front.

def test_no_config_json_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_loader.load(tmp_path)


def test_no_safetensors_files_is_a_file_not_found_error(tmp_path):
    path, _ = write_split_checkpoint(tmp_path / "ckpt")
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        hf_loader.load(path)


def test_a_missing_tensor_is_a_key_error_naming_the_checkpoint(tmp_path):
    path, _ = write_split_checkpoint(tmp_path / "ckpt")
    second = path / "model-00002-of-00002.safetensors"
    kept = hf_loader.read_safetensors(second)
    del kept["model.layers.1.mlp.down_proj.weight"]
    write_safetensors(second, kept, dict.fromkeys(kept, "F32"))
    message = f"{path}: checkpoint has no tensor 'layers.1.mlp.down_proj.weight'"
    with pytest.raises(KeyError, match=re.escape(message)):
        hf_loader.load(path)


def test_an_unsupported_dtype_is_a_value_error_naming_file_and_tensor(tmp_path):
    path, _ = write_split_checkpoint(tmp_path / "ckpt")
    second = path / "model-00002-of-00002.safetensors"
    kept = hf_loader.read_safetensors(second)
    codes = dict.fromkeys(kept, "F32") | {"lm_head.weight": "F8_E4M3"}
    write_safetensors(second, kept, codes)
    message = f"{second}: tensor lm_head.weight has unsupported dtype F8_E4M3"
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_loader.load(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_loader.read_safetensors(second)


def test_a_file_cut_short_is_a_value_error_naming_file_and_tensor(tmp_path):
    """A tensor whose bytes the file lacks (a download cut short) says so, not a reshape error."""
    path, _ = write_split_checkpoint(tmp_path / "ckpt")
    second = path / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-4])
    message = f"{second}: tensor lm_head.weight is cut short"
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_loader.load(path)
