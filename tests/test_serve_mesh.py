"""``python -m jaxkv serve --mesh``: the tiny preset on 8 emulated CPU devices, tensor parallel
(Megatron-style weights, caches split over KV heads) and data parallel (the batch split), gives
every engine the same greedy tokens as recomputation on one device, and the compiled steps move
no cache data between devices (only the model's all-reduces and a few row counts)."""

import json
import re

import jax
import numpy as np
import pytest

from jaxkv import __main__ as entry
from jaxkv.demo import cli
from jaxkv.models import hf_loader
from jaxkv import models
from jaxkv.models import decoder as M
from jaxkv.serving import serve as S
from jaxkv.demo import serve_cli

pytestmark = [pytest.mark.long,  # every engine served on meshes: minutes on CPU
              pytest.mark.skipif(jax.device_count() < 4,
                                 reason="needs 4 devices (CPU: conftest emulates 8)")]


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("mesh", ["tp=2,dp=2", "tp=4", "dp=4"])
def test_every_engine_on_a_mesh_generates_what_one_device_recomputes(mesh, tmp_path, capsys):
    path = tmp_path / "serve.json"
    # float32 (a GPU's default is bf16) at full matmul precision: every engine equals
    # recomputation on one device, token for token, on CPU devices and on GPUs alike
    rc = entry.main(["serve", "--mesh", mesh, "--requests", "12", "--dtype", "float32",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    assert set(doc["engines"]) == set(S.DEFAULT_ENGINES)
    assert doc["recomputed"] == {name: 12 for name in S.DEFAULT_ENGINES}
    assert "mesh " in out


def test_a_swapping_engine_on_a_mesh_generates_what_one_device_recomputes(tmp_path, capsys):
    """``paged-swap`` over tp=2, dp=2 under pool pressure: each batch shard swaps its preempted
    rows to its own host pages and back; every request's tokens equal recomputation on one
    device, and the allocator audit counts every page (both tiers) right."""
    path = tmp_path / "serve.json"
    rc = entry.main(["serve", "--mesh", "tp=2,dp=2", "--engines", "paged-swap", "--requests",
                     "24", "--max-batch", "8", "--kv-gib", "0.00035", "--max-seq-len", "128",
                     "--mean-prompt", "24", "--mean-output", "48", "--dtype", "float32",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    m = doc["engines"]["paged-swap"]
    assert m["swaps_out"] > 0 and m["swaps_in"] > 0 and m["miscounted_pages"] == 0
    assert doc["recomputed"] == {"paged-swap": 24}


@pytest.mark.parametrize("mesh", ["tp=2", "dp=4"])
def test_the_prefix_caching_engine_on_a_mesh_reuses_its_prefixes(mesh, tmp_path, capsys):
    """``paged-prefix`` on the chat stream under pool pressure. Heads over tp=2 (the batch
    unsplit: one index), with a host tier: reuse equals the oracle's best and spilled pages come
    back. Batch over dp=4 (an index a shard, a prefill lane a shard): a conversation's turns go
    to the shard that took its first one, so most of the oracle's reuse is found (77% of it
    here; 71% without that). Every request's tokens equal recomputation on one device, every
    page is counted."""
    path = tmp_path / "serve.json"
    tier = ["--kv-gib", "0.0004", "--host-kv-gib", "0.002"] if mesh == "tp=2" else [
        "--kv-gib", "0.002"]
    rc = entry.main(["serve", "--mesh", mesh, "--engines", "paged-prefix", "--stream", "chat",
                     "--requests", "48", "--max-batch", "8", *tier, "--dtype", "float32",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(path.read_text())
    m = doc["engines"]["paged-prefix"]
    assert m["reuse_of_oracle"] >= (1.0 if mesh == "tp=2" else 0.75), m["reuse_of_oracle"]
    assert m["miscounted_pages"] == 0 and (m["spilled_pages"] > 0) == (mesh == "tp=2")
    assert doc["recomputed"] == {"paged-prefix": 48}


def test_a_batch_shards_pool_must_hold_a_whole_sequence(capsys):
    """A row never leaves its batch shard: a pool that cannot hold --max-seq-len in each shard
    is refused (a sequence no shard can finish was preempted and readmitted for ever). Without
    --kv-gib each shard gets the preset's budget."""
    with pytest.raises(SystemExit, match="in each of the 4 batch shards' pools"):
        entry.main(["serve", "--mesh", "dp=4", "--engines", "paged", "--kv-gib", "0.0008",
                    "--requests", "4"])
    assert serve_cli.parse_args(["--mesh", "dp=4"]).kv_gib == 4 * serve_cli.DEFAULTS["tiny"][
        "kv_gib"]
    assert serve_cli.parse_args(["--mesh", "tp=4"]).kv_gib == serve_cli.DEFAULTS["tiny"]["kv_gib"]


def test_weights_split_megatron_style():
    s = cli.cache_sharding({"tp": 2, "dp": 2})
    params = M.init_stacked_params(models.PRESETS["tiny"], 0, "float32", s.mesh)
    specs = {k: tuple(v.sharding.spec) for k, v in params["layers"].items()}
    assert specs["wq"][-1] == specs["wk"][-1] == specs["w_up"][-1] == "tp"  # by columns
    assert specs["wo"][-2] == specs["w_down"][-2] == "tp"  # by rows
    assert tuple(params["embed"].sharding.spec) in ((), (None, None))
    assert tuple(params["lm_head"].sharding.spec) == (None, "tp")  # by vocabulary columns
    plain = M.init_stacked_params(models.PRESETS["tiny"], 0, "float32")
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"]),
                                  np.asarray(plain["layers"]["wq"]))


_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|"
                         r"collective-permute|reduce-scatter)(-start)?\(")


@pytest.mark.parametrize("name", ["paged", "linear", "fixed", "paged-prefix"])
def test_no_collective_moves_cache_data(name):
    """Every collective of the compiled prefill, decode and evict is smaller than one layer's
    K of one row, and none has a cache leaf's shape (global or per device) or the logits'."""
    cfg = models.PRESETS["tiny"]
    s = cli.cache_sharding({"tp": 2} if name == "paged-prefix" else {"tp": 2, "dp": 2})
    params = M.init_stacked_params(cfg, 0, "float32", s.mesh)
    system, _ = S.make_stream(S.StreamConfig(requests=4), cfg.vocab_size)
    paged = name.startswith("paged")
    plan = S.Plan(name, 4, 64 if paged else None, 16 if paged else None)
    kind = S.make_kind(name, cfg, "float32", plan, sharding=s)
    eng = S.ServeEngine(cfg, params, kind, batch=4, max_seq_len=256, system_prompt=system,
                        prefill_rows=2, prefill_chunk=16, decode_steps=4)
    fns = eng.compile()
    leaves = jax.tree.leaves(jax.eval_shape(lambda: kind.create(4, 256)))
    shapes = {tuple(x.shape) for x in leaves if len(x.shape) >= 3}
    local = {tuple(x.shape[:i]) + (x.shape[i] // k,) + tuple(x.shape[i + 1:])
             for x in leaves if len(x.shape) >= 3 for i in range(len(x.shape))
             for k in (2, 4) if x.shape[i] % k == 0}  # split by tp, dp or both
    one_row = 256 * cfg.head_dim * cfg.num_kv_heads // 2  # a row's K of one layer, per device
    found = []
    for fname in [k for k in fns if k.startswith(("prefill", "decode", "evict"))]:
        for dtype, dims, op, _ in _COLLECTIVE.findall(fns[fname].as_text()):
            shape = tuple(int(d) for d in dims.split(",") if d)
            found.append((fname, op, shape))
            assert shape not in shapes | local, (fname, op, shape)
            assert np.prod(shape, dtype=np.int64) < one_row, (fname, op, shape)
            # the greedy pick combines each device's best (value, index), never the logits
            assert not {cfg.vocab_size, cfg.vocab_size // 2} & set(shape), (fname, op, shape)
    assert any(op == "all-reduce" for _, op, _ in found)  # the model's, one per block


def _paged_prefill_hlo(axes) -> str:
    """The compiled prefill of a paged engine of 4 rows (chunks of 2 lanes x 16 tokens) over
    ``axes``."""
    cfg = models.PRESETS["tiny"]
    s = cli.cache_sharding(axes)
    params = M.init_stacked_params(cfg, 0, "float32", s.mesh)
    system, _ = S.make_stream(S.StreamConfig(requests=4), cfg.vocab_size)
    kind = S.make_kind("paged", cfg, "float32", S.Plan("paged", 4, 64, 16), sharding=s)
    eng = S.ServeEngine(cfg, params, kind, batch=4, max_seq_len=256, system_prompt=system,
                        prefill_rows=2, prefill_chunk=16, decode_steps=4)
    return eng.functions["prefill"].lower(*eng.example_args()["prefill2"]).compile().as_text()


@pytest.mark.parametrize("axes, rows", [({"tp": 2}, 2), ({"tp": 2, "dp": 2}, 1)])
def test_a_prefill_attends_its_rows_alone(axes, rows):
    """The paged prefill appends and attends through a view of the chunk's rows: the 2 lanes
    here, as on one device, where the batch is not split; over 2 batch shards, each device's
    lane group, one row (not arrays of a shard's whole batch and its prompt row). (The
    full-batch path at tp=2 made the 8B prefill attend 257 rows for 8, perf notes item 60.)"""
    hlo = _paged_prefill_hlo(axes)
    calls = re.findall(r"= \((\w+)\[(\d+),[^\n]*custom_call_target=\"jaxkv_attention", hlo)
    assert calls and {int(n) for _, n in calls} == {rows}, calls


@pytest.mark.parametrize("axes", [{"dp": 2}, {"tp": 2, "dp": 2}])
def test_each_batch_shard_runs_the_model_on_its_own_lanes(axes):
    """Over batch shards a prefill chunk's lanes split with them: each device's matmuls take its
    own lane's 16 tokens (2 lanes over 2 shards) and its logits one row, not every lane's (every
    device ran every lane, so dp=2 prefilled no faster than one device)."""
    hlo = _paged_prefill_hlo(axes)
    rows = {int(n) for n in re.findall(r"= \w+\[(\d+),\d+\]\S* dot\(", hlo)}
    assert rows == {16, 1}, rows


def test_host_arrays_reach_every_device_in_one_put():
    """The prefill's host arrays (rows, tokens, counts, the end token) are taken replicated and
    ``put`` places them so: none is copied from the first device to the others at each call."""
    cfg = models.PRESETS["tiny"]
    s = cli.cache_sharding({"tp": 2})
    params = M.init_stacked_params(cfg, 0, "float32", s.mesh)
    system, _ = S.make_stream(S.StreamConfig(requests=4), cfg.vocab_size)
    kind = S.make_kind("paged", cfg, "float32", S.Plan("paged", 4, 64, 16), sharding=s)
    eng = S.ServeEngine(cfg, params, kind, batch=4, max_seq_len=256, system_prompt=system,
                        prefill_rows=2, prefill_chunk=16, decode_steps=4)
    compiled = eng.functions["prefill"].lower(*eng.example_args()["prefill2"]).compile()
    host = compiled.input_shardings[0][-7:]  # new, rows, tokens, n, last, budget, eos
    assert all(x.is_fully_replicated and len(x.device_set) == 2 for x in host), host
    put = eng.put(np.zeros(4, bool), np.int32(-1))
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 2 for x in put)


def write_checkpoint(path, tie: bool):
    """A 2-layer Llama checkpoint in Hugging Face's layout (config.json, float32 safetensors
    written by hand: no torch here), vocabulary 300, 4 / 2 heads of 16."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)))
    rng = np.random.default_rng(5)
    shapes = {"model.embed_tokens.weight": (300, 64), "model.norm.weight": (64,)}
    for i in range(2):
        for name, shape in [("input_layernorm", (64,)), ("post_attention_layernorm", (64,)),
                            ("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (96, 64)), ("mlp.up_proj", (96, 64)),
                            ("mlp.down_proj", (64, 96))]:
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    if not tie:
        shapes["lm_head.weight"] = (300, 64)
    header, blobs, offset = {}, [], 0
    for name, shape in shapes.items():
        blob = rng.standard_normal(shape).astype(np.float32).tobytes()
        header[name] = dict(dtype="F32", shape=list(shape),
                            data_offsets=[offset, offset + len(blob)])
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (path / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head
                                             + b"".join(blobs))
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_goes_to_the_mesh_split_as_drawn_weights_are(tmp_path, tie):
    """``--model`` on a mesh: every weight lands split Megatron-style straight from the host,
    with the values of a one-device load."""
    path = write_checkpoint(tmp_path / "ckpt", tie)
    mesh = cli.cache_sharding({"tp": 2, "dp": 2}).mesh
    _, plain = hf_loader.load(path)
    _, split = hf_loader.load(path, mesh=mesh)
    want = M.parameter_shardings(plain, mesh)
    for got, expected, value in zip(jax.tree.leaves(split), jax.tree.leaves(want),
                                    jax.tree.leaves(plain)):
        assert got.sharding == expected
        np.testing.assert_array_equal(np.asarray(got), np.asarray(value))
    assert tuple(split["lm_head"].sharding.spec) == (None, "tp")
    assert tuple(split["layers"][1]["w_down"].sharding.spec) == ("tp", None)


def test_a_tp_that_does_not_divide_a_checkpoints_heads_is_an_argument_error(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "ckpt", tie=False)  # 4 / 2 heads
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--model", str(path), "--mesh", "tp=4"])
    assert f"tp=4 does not divide the 4 / 2 heads of checkpoint {path}" in capsys.readouterr().err
    assert serve_cli.parse_args(["--model", str(path), "--mesh", "tp=2"]).mesh == {"tp": 2}


def test_every_engine_lowers_at_the_70b_preset_over_tp4():
    """The multi-GPU run's shapes (80 layers, 64 / 8 heads, FFN 28672, bf16) with the weights
    split over tp=4, traced and lowered without weights or memory."""
    cfg = models.PRESETS["70b"]
    s = cli.cache_sharding({"tp": 4})
    abstract = jax.eval_shape(lambda: M.init_stacked_params(cfg, 0, "bfloat16"))
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          abstract, M.parameter_shardings(abstract, s.mesh))
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(params)) > 70e9
    per_token = S.kv_bytes_per_token(cfg, "bfloat16")
    for name in ("paged", "linear", "fixed"):
        p = S.plan(name, 16 * 2**30, per_token, 4096, 16, 64)
        e = S.ServeEngine(cfg, params, S.make_kind(name, cfg, "bfloat16", p, sharding=s),
                          batch=p.batch, max_seq_len=4096, system_prompt=np.ones(64, np.int32),
                          prefill_rows=(2, 8), prefill_chunk=256, decode_steps=16)
        for key, args in e.example_args().items():
            e.functions[key.rstrip("0123456789")].lower(*args)
