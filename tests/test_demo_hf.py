"""A tiny random Llama from transformers, loaded by the demo, decodes what transformers decodes."""

import sys

import jax
import numpy as np
import pytest

from jaxkv.demo import cli
from jaxkv import models
from jaxkv.models import hf_loader
from jaxkv.serving import caches, loop

pytestmark = [pytest.mark.hf, pytest.mark.long]  # transformers parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def exact_matmuls():
    """float32 matmuls in float32 on GPUs too (no TF32), as torch computes them on CPU."""
    with jax.default_matmul_precision("highest"):
        yield


def save_tiny_llama(path, **rope):
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **rope,
    )
    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a wrong norm weight layout shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), rope_theta=5000.0)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    # Llama 3 RoPE scaling with a short original context, so most frequencies are rescaled.
    rope = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8)
    new_style = "rope_parameters" in transformers.LlamaConfig().to_dict()  # transformers >= 5
    key = "rope_parameters" if new_style else "rope_scaling"
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama3"), **{key: rope})


def test_loader_reads_safetensors_without_the_package(checkpoint, monkeypatch):
    path, model = checkpoint
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # forces the built-in reader
    tensors = hf_loader.read_safetensors(next(path.glob("*.safetensors")))
    state = model.state_dict()
    assert set(tensors) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)


def test_loader_reads_bfloat16_checkpoints(checkpoint, tmp_path):
    _, model = checkpoint
    half = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    half.save_pretrained(tmp_path)
    _, params = hf_loader.load(tmp_path, dtype="bfloat16")
    want = lambda name: half.state_dict()[name].float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32),
                                  want("model.embed_tokens.weight"))
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["wk"], np.float32),
                                  want("model.layers.1.self_attn.k_proj.weight").T)


def greedy_matches_transformers(path, model, kind_name):
    cfg, params = hf_loader.load(path)
    system = np.random.default_rng(1).integers(0, cfg.vocab_size, 5).astype(np.int32)
    # Dense attention: on a GPU the Pallas kernel multiplies in TF32, unlike torch on the CPU.
    options = dict(attention="dense") if kind_name == "paged" else {}
    eng = loop.Engine(cfg, params, caches.make_kind(kind_name, cfg, **options), max_batch=3,
                      system_prompt=system, max_prompt_len=6, max_new_tokens=8)
    requests = loop.make_requests(5, cfg.vocab_size, seed=2, prompt_len=(1, 6), new_tokens=(1, 8))
    eng.run(requests)
    for r in requests:
        ids = torch.tensor(np.concatenate([system, r.prompt])[None].astype(np.int64))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=r.max_new_tokens, do_sample=False)
        assert r.output == out[0, ids.shape[1]:].tolist(), f"request {r.id}"
    return cfg


@pytest.mark.parametrize("kind_name", ["linear", "paged"])
def test_greedy_tokens_match_transformers_generate(checkpoint, kind_name):
    greedy_matches_transformers(*checkpoint, kind_name)


def test_llama3_rope_scaling_matches_transformers(llama3_checkpoint):
    cfg = greedy_matches_transformers(*llama3_checkpoint, "linear")
    assert cfg.rope_scaling == models.RopeScaling("llama3", 8.0, 1.0, 4.0, 8)


def test_demo_command_loads_a_checkpoint(checkpoint, capsys):
    path, _ = checkpoint
    argv = ["--model", str(path), "--requests", "3", "--max-batch", "2", "--system-len", "3",
            "--max-prompt-len", "3", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "3/3 requests" in out and "vocab 300" in out
