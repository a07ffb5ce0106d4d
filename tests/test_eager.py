"""An op called outside any trace runs as one compiled program (jaxkv._eager)."""

import logging
import re

import jax
import jax.numpy as jnp

import jaxkv


def programs_compiled(caplog, fn) -> list[str]:
    """The names of the programs JAX compiles while running ``fn``."""
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        jax.block_until_ready(fn())
    return [m.group(1) for r in caplog.records
            if (m := re.match(r"Compiling jit\((\w+)\)", r.getMessage()))]


def small_cache():
    return jaxkv.PagedKVCache.create(num_layers=2, max_batch=4, num_kv_heads=2, head_dim=16,
                                     num_pages=32, page_size=4, max_pages_per_seq=8)


def test_an_eager_op_is_one_program_compiled_once_per_shape(caplog):
    cache = small_cache()
    n, m = jnp.array([3, 0, 5, 1], jnp.int32), jnp.array([1, 2, 0, 4], jnp.int32)
    assert programs_compiled(caplog, lambda: cache.reserve(n)) == ["reserve"]
    assert programs_compiled(caplog, lambda: cache.reserve(m)) == []  # same shapes: reused
    cache7 = jaxkv.PagedKVCache.create(num_layers=2, max_batch=7, num_kv_heads=2, head_dim=16,
                                       num_pages=32, page_size=4, max_pages_per_seq=8)
    assert programs_compiled(caplog, lambda: cache7.reserve(jnp.zeros(7, jnp.int32))) == [
        "reserve"]


def test_within_a_trace_the_op_is_part_of_the_callers_program(caplog):
    cache, n = small_cache(), jnp.array([3, 0, 5, 1], jnp.int32)

    @jax.jit
    def step(cache, n):
        cache, served = cache.reserve(n)
        return cache.release(jnp.array([True, False, False, False])), served

    assert programs_compiled(caplog, lambda: step(cache, n)) == ["step"]
    eager_cache, eager_served = cache.reserve(n)
    eager_cache = eager_cache.release(jnp.array([True, False, False, False]))
    jit_cache, jit_served = step(cache, n)
    assert (eager_served == jit_served).all()
    for a, b in zip(jax.tree.leaves(eager_cache), jax.tree.leaves(jit_cache)):
        assert (a == b).all()
