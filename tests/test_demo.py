"""The demo's serving loop: cached greedy generation equals recomputation, steps run in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.demo import caches, cli, loop
from jaxkv.demo import model as M

from helpers import copies_of

CFG = M.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
KINDS = [("linear", "jaxkv"), ("linear", "xla")]


def engine(kind_name, ops, *, max_batch=3, params=None, cfg=CFG):
    params = M.init_params(cfg, seed=3) if params is None else params
    kind = caches.make_kind(kind_name, cfg, ops=ops)
    system = np.random.default_rng(5).integers(0, cfg.vocab_size, 7).astype(np.int32)
    return loop.Engine(cfg, params, kind, max_batch=max_batch, system_prompt=system,
                       max_prompt_len=6, max_new_tokens=9)


@pytest.mark.parametrize("kind_name,ops", KINDS)
def test_cached_greedy_equals_recomputation_for_every_request(kind_name, ops):
    eng = engine(kind_name, ops)
    requests = loop.make_requests(8, CFG.vocab_size, seed=11, prompt_len=(1, 6), new_tokens=(1, 9))
    stats = eng.run(requests)
    # The stream really was continuous: more requests than slots, several admissions and evictions.
    assert stats.admissions > 2 and stats.evictions > 2
    assert stats.generated == sum(r.max_new_tokens for r in requests)
    for r in requests:
        prompt = np.concatenate([eng.system_prompt, r.prompt])
        expected = M.generate_no_cache(CFG, eng.params, prompt, r.max_new_tokens,
                                       capacity=eng.max_seq_len)
        assert r.output == expected, f"request {r.id}"


def test_step_functions_update_the_cache_in_place():
    eng = engine("linear", "jaxkv")
    compiled = eng.compile()
    cache = eng.kind.create(eng.max_batch, eng.max_seq_len)
    for name, fn in compiled.items():
        hlo = fn.as_text()
        assert copies_of(hlo, cache.buffer) == [], name
    # The executable really reuses the donated buffer.
    tokens = jnp.zeros((eng.max_batch, len(eng.system_prompt)), jnp.int32)
    before = cache.buffer.unsafe_buffer_pointer()
    cache, _ = compiled["prompt"](eng.params, cache, tokens)
    assert cache.buffer.unsafe_buffer_pointer() == before
    next_tokens = jnp.zeros((eng.max_batch,), jnp.int32)
    before = cache.buffer.unsafe_buffer_pointer()
    cache, _, _ = compiled["decode"](eng.params, cache, next_tokens, jnp.int32(2))
    assert cache.buffer.unsafe_buffer_pointer() == before


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
