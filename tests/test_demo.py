"""The demo's serving loop: cached greedy generation equals recomputation, steps run in place."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.demo import cli
from jaxkv.serving import caches, loop
from jaxkv import models
from jaxkv.models import decoder as M

from helpers import copies_of, on_gpu, random_array

CFG = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
PARAMS = M.init_params(CFG, seed=3)
SYSTEM = np.random.default_rng(5).integers(0, CFG.vocab_size, 7).astype(np.int32)


# JAX's Pallas paged_attention (deprecated in jax 0.11) is gone from jax 0.12.1.
NEEDS_PALLAS = pytest.mark.skipif(caches.pallas_paged_attention() is None,
                                  reason="this jax no longer ships Pallas paged_attention")


def kind(name, ops, marks=(), **options):
    words = [name, ops] + [f"{k}={v}" for k, v in options.items()]
    return pytest.param(name, ops, options, marks=marks, id="-".join(words))


KINDS = [
    kind("linear", "jaxkv"), kind("linear", "xla"),
    kind("manager", "jaxkv"), kind("manager", "xla"),
    # page_size 4: the system prompt ends inside a page, so admissions copy it (copy-on-write).
    kind("paged", "jaxkv", page_size=4), kind("paged", "xla", page_size=4),
    # JAX's Pallas paged_attention for decode steps, interpreted on CPU. On a GPU the Triton
    # kernel multiplies in TF32, so greedy tokens may differ: compared with a tolerance instead.
    kind("paged", "jaxkv", page_size=16, attention="pallas", marks=[pytest.mark.skipif(
        on_gpu(), reason="TF32 in Triton: see test_pallas_decode_attention_equals_dense"),
        NEEDS_PALLAS]),
]


@pytest.fixture(autouse=True)
def exact_matmuls():
    """float32 matmuls in float32 on GPUs too (no TF32), so greedy choices are comparable."""
    with jax.default_matmul_precision("highest"):
        yield


def engine(kind_name, ops, max_batch=3, **options):
    cache_kind = caches.make_kind(kind_name, CFG, ops=ops, **options)
    return loop.Engine(CFG, PARAMS, cache_kind, max_batch=max_batch, system_prompt=SYSTEM,
                       max_prompt_len=6, max_new_tokens=9)


@functools.cache
def _shared_engine(kind_name, ops, options):
    return engine(kind_name, ops, **dict(options))


def shared_engine(kind_name, ops, **options):
    """One engine per configuration for the tests that only run or inspect it: an engine compiles
    its four steps once (Engine.compile) and keeps no other state between runs."""
    return _shared_engine(kind_name, ops, tuple(sorted(options.items())))


def stream():
    return loop.make_requests(8, CFG.vocab_size, seed=11, prompt_len=(1, 6), new_tokens=(1, 9))


@pytest.fixture(scope="module")
def recomputed():
    """Each request's greedy tokens, recomputed from scratch at every step (no cache)."""
    capacity = len(SYSTEM) + 6 + 9
    # Module-scoped, so set up before the autouse fixture: exact matmuls here too (no TF32).
    with jax.default_matmul_precision("highest"):
        return [M.generate_no_cache(CFG, PARAMS, np.concatenate([SYSTEM, r.prompt]),
                                    r.max_new_tokens, capacity=capacity) for r in stream()]


@pytest.mark.parametrize("kind_name,ops,options", KINDS)
def test_cached_greedy_equals_recomputation_for_every_request(kind_name, ops, options, recomputed):
    eng = shared_engine(kind_name, ops, **options)
    requests = stream()
    stats = eng.run(requests)
    # The stream really was continuous: more requests than slots, several admissions and evictions.
    assert stats.admissions > 2 and stats.evictions > 2
    assert stats.generated == sum(r.max_new_tokens for r in requests)
    for r, expected in zip(requests, recomputed):
        assert r.output == expected, f"request {r.id}"


def test_slots_admit_and_evict_inside_each_batch_shard():
    """The scheduler: each batch shard's requests live in its first rows; an eviction compacts
    them, in order, to the front of their own shard; admissions fill the emptiest shard first."""
    requests = loop.make_requests(9, 16, seed=0, prompt_len=(1, 2), new_tokens=(1, 2))
    pending = list(reversed(requests))
    slots = loop.Slots(8, shards=2)  # shard 0: rows 0-3, shard 1: rows 4-7
    admitted = slots.admit(pending)
    assert [(row, r.id) for row, r in admitted] == [
        (0, 0), (4, 1), (1, 2), (5, 3), (2, 4), (6, 5), (3, 6), (7, 7)]
    assert len(pending) == 1 and slots.admit(pending) == []  # full
    done = {0, 3, 4, 7}  # shard 0 keeps requests 2, 6 (rows 1, 3); shard 1 keeps 1, 5 (4, 6)
    mapping, finished = slots.evict(lambda r: r.id in done)
    assert mapping.tolist() == [-1, 0, -1, 1, 4, -1, 5, -1]  # never to another shard's rows
    assert [r.id for r in finished] == [0, 4, 3, 7]  # in row order
    assert [(row, r.id) for row, r in slots.rows()] == [(0, 2), (1, 6), (4, 1), (5, 5)]
    assert [(row, r.id) for row, r in slots.admit(pending)] == [(2, 8)]
    # One shard: rows [0, live), survivors compacted to [0, survivors) (the unsharded demo).
    one = loop.Slots(3)
    pending = list(reversed(requests[:3]))
    assert [row for row, _ in one.admit(pending)] == [0, 1, 2]
    mapping, _ = one.evict(lambda r: r.id == 1)
    assert mapping.tolist() == [0, -1, 1]
    with pytest.raises(ValueError, match="does not split into 3 batch shards"):
        loop.Slots(4, shards=3)


def big_buffers(cache):
    """The cache's data buffers (the KV arrays, not lengths or tables)."""
    return [x for x in jax.tree.leaves(cache) if x.ndim >= 4]


@pytest.mark.parametrize("kind_name", ["linear", "manager", "paged"])
def test_step_functions_update_the_cache_in_place(kind_name):
    eng = shared_engine(kind_name, "jaxkv")
    compiled = eng.compile()
    cache = eng.kind.create(eng.max_batch, eng.max_seq_len)
    for name, fn in compiled.items():
        hlo = fn.as_text()
        for buf in big_buffers(cache):
            assert copies_of(hlo, buf) == [], name
    # The executables really reuse the donated buffers.
    pointers = lambda c: [x.unsafe_buffer_pointer() for x in big_buffers(c)]
    tokens = jnp.zeros((eng.max_batch, len(eng.system_prompt)), jnp.int32)
    before = pointers(cache)
    cache, saved = compiled["prompt"](eng.params, cache, tokens)
    assert pointers(cache) == before
    next_tokens = jnp.zeros((eng.max_batch,), jnp.int32)
    prompts = jnp.ones((eng.max_batch, eng.max_prompt_len), jnp.int32)
    lengths = jnp.full((eng.max_batch,), 2, jnp.int32)
    cache, next_tokens = compiled["admit"](eng.params, cache, saved, next_tokens, prompts, lengths)
    assert pointers(cache) == before
    cache, next_tokens, _ = compiled["decode"](eng.params, cache, next_tokens, jnp.int32(2))
    assert pointers(cache) == before
    mapping = jnp.array([-1, 0, -1], jnp.int32)
    cache, _ = compiled["evict"](cache, next_tokens, mapping)
    assert pointers(cache) == before


def test_hlo_check_sees_copies_of_the_cache():
    # The in-place check above can fail: without donation the compiled step must copy the cache.
    eng = engine("linear", "jaxkv")
    cache = eng.kind.create(eng.max_batch, eng.max_seq_len)
    args = eng.example_args()["evict"]
    undonated = jax.jit(lambda c, t, m: eng.kind.evict(c, m)).lower(*args).compile().as_text()
    assert copies_of(undonated, cache.buffer)


def test_demo_command_runs(capsys):
    argv = ["--requests", "5", "--max-batch", "2", "--system-len", "4", "--max-prompt-len", "4",
            "--max-new-tokens", "6", "--baseline", "xla"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "5/5 requests" in out
    assert "tokens/s (generated)" in out and "cache allocated" in out
    assert "xla baseline generated the same tokens" in out


def test_paged_kind_reads_the_pool_with_jaxkv_by_default(monkeypatch):
    def no_pallas(*args, **kwargs):
        raise AssertionError("the default path called Pallas paged_attention")

    # (Not a search of the HLO text for "paged_attention": jax 0.12 can carry a source path of
    # that module in the metadata of ops traced by an earlier test.)
    monkeypatch.setattr(caches.PagedKind, "_pallas", no_pallas)
    eng = engine("paged", "jaxkv", page_size=16)  # attention="auto": jaxkv.attention
    hlo = eng.compile()["decode"].as_text()
    assert "jaxkv_attention" in hlo


def test_asking_for_pallas_where_jax_lacks_it_says_so(monkeypatch):
    monkeypatch.setattr(caches, "pallas_paged_attention", lambda: None)
    with pytest.raises(ValueError, match="attention='pallas'.*no longer ships"):
        engine("paged", "jaxkv", page_size=16, attention="pallas").compile()


@NEEDS_PALLAS
@pytest.mark.gpu
def test_paged_decode_attends_with_pallas_on_gpu_when_asked():
    eng = engine("paged", "jaxkv", page_size=16, attention="pallas")
    assert "paged_attention" in eng.compile()["decode"].as_text()
    dense = engine("paged", "jaxkv", page_size=16, attention="dense")
    assert "paged_attention" not in dense.compile()["decode"].as_text()


@NEEDS_PALLAS
@pytest.mark.long
def test_pallas_decode_attention_equals_dense():
    """The Pallas reader's view of the pool (one head of L * H * P pages, a page table per
    sequence and head) attends to exactly what the gathered cache holds, in every layer."""
    pallas = caches.make_kind("paged", CFG, page_size=16, attention="pallas")
    dense = dataclasses.replace(pallas, attention="dense")
    # Jitted, as in the demo's steps (eagerly, every op of the allocator compiles on its own).
    reserve, commit = jax.jit(pallas.reserve), jax.jit(pallas.commit)
    append = jax.jit(pallas.append, static_argnums=1)  # layer
    attend_dense = jax.jit(dense.attend, static_argnums=1)
    attend_pallas = jax.jit(pallas.attend, static_argnums=1)
    cache = pallas.create(max_batch=3, max_seq_len=40)
    kv_shape = lambda t: (3, CFG.num_kv_heads, t, CFG.head_dim)
    for n in ([20, 5, 33], [1, 1, 1]):  # a ragged prefill, then one decode step
        n = jnp.asarray(n, jnp.int32)
        t = int(n.max())
        cache = reserve(cache, n)
        for layer in range(CFG.num_layers):
            k, v = random_array(kv_shape(t), jnp.float32), random_array(kv_shape(t), jnp.float32)
            cache = append(cache, layer, k, v, n)
        if t > 1:
            cache = commit(cache, n)
    positions = pallas.lengths(cache)[:, None]  # the decode token, appended, not committed
    tol = 2e-2 if on_gpu() else 1e-5
    for layer in range(CFG.num_layers):
        q = random_array((3, 1, CFG.num_heads, CFG.head_dim), jnp.float32) / 8
        want = attend_dense(cache, layer, q, positions)
        got = attend_pallas(cache, layer, q, positions)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
