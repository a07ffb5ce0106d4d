"""Data-dependent checks: reported under checkify, free otherwise (no effect, nothing compiled)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from jaxkv._checks import check

from helpers import random_array

L, B, H, S, D = 2, 4, 2, 16, 8
IDX = jnp.int32(1)
MAPPING = jnp.asarray([1, -1, 0, -1], jnp.int32)


def linear():
    return jaxkv.LinearKVCache.create(L, B, H, S, D, jnp.float32).set_active_batch_size(3)


def manager():
    layers = [jaxkv.KVLayerConfig(H, D), jaxkv.KVLayerConfig(1, 2 * D)]
    return jaxkv.KVCacheManager.create(layers, B, S, jnp.float32).set_active_batch_size(3)


def paged():
    cache = jaxkv.PagedKVCache.create(L, 16, 4, H, D, B, 4, jnp.float32)
    return cache.reserve(jnp.asarray([5, 3, 0, 0], jnp.int32))[0]


def tokens(n=3, heads=H, dim=D):
    return random_array((B, heads, n, D if dim is None else dim), jnp.float32)


# Every cache op with a data-dependent check (some with several), traced under jit as users do.
OPS = {
    "linear.append": lambda: (lambda c, k, v: c.append(IDX, k, v), linear(), tokens(), tokens()),
    "linear.commit": lambda: (lambda c: c.commit(jnp.full((B,), 2, jnp.int32)), linear()),
    "linear.compact": lambda: (lambda c, m: c.compact(m), linear(), MAPPING),
    "linear.set_active_batch_size": lambda: (lambda c: c.set_active_batch_size(IDX), linear()),
    "linear.reset": lambda: (lambda c: c.reset(jnp.full((B,), 2, jnp.int32)), linear()),
    "linear.instantiate": lambda: (lambda c: c.instantiate(c.save(0, 4), IDX), linear()),
    "manager.compact": lambda: (lambda c, m: c.compact(m), manager(), MAPPING),
    "manager.commit": lambda: (lambda c: c.commit(jnp.full((B,), 2, jnp.int32)), manager()),
    "paged.reserve": lambda: (lambda c: c.reserve(jnp.full((B,), 3, jnp.int32)), paged()),
    "paged.fork": lambda: (lambda c: c.fork(0, jnp.asarray([2, 3], jnp.int32)), paged()),
    "paged.append": lambda: (lambda c, k, v: c.append(IDX, k, v), paged(), tokens(), tokens()),
    "paged.commit": lambda: (lambda c: c.commit(jnp.full((B,), 2, jnp.int32)), paged()),
    "paged.gather": lambda: (lambda c: c.gather(IDX, 8), paged()),
    "paged.copy_pages": lambda: (
        lambda c: c.copy_pages(jnp.asarray([0], jnp.int32), jnp.asarray([9], jnp.int32)), paged()),
}


@pytest.mark.parametrize("name", OPS)
def test_ops_leave_no_effect_in_the_jaxpr(name):
    # An effect (checkify.debug_check leaves one) takes the compiled step off JAX's C++ dispatch
    # path: tens of microseconds more per call of every jitted step that uses the op.
    fn, *args = OPS[name]()
    assert jax.make_jaxpr(fn)(*args).effects == set()


def test_the_checks_still_report_under_checkify():
    # The same ops with bad data: each reports, inside jit, with the op's name.
    cache = linear()
    err, _ = jax.jit(checkify.checkify(lambda c, i: c.set_active_batch_size(i)))(cache, 9)
    assert "LinearKVCache.set_active_batch_size" in err.get()
    bad = jnp.asarray([0, 0, -1, -1], jnp.int32)  # two survivors sent to row 0
    err, compacted = jax.jit(checkify.checkify(lambda c, m: c.compact(m)))(cache, bad)
    assert "same new row" in err.get()
    assert int(compacted.active_batch_size) == 1  # the one row written, counted once
    err, _ = jax.jit(checkify.checkify(lambda c: c.reserve(jnp.full((B,), 99, jnp.int32))))(paged())
    assert "PagedKVCache.reserve" in err.get()


def test_a_check_reports_inside_scan_while_and_vmap():
    def body(c, _):
        check(c < 3, "counter past 3")
        return c + 1, None

    scanned = lambda c: jax.lax.scan(body, c, None, length=4)[0]
    # A traced trip count makes fori_loop a while loop.
    looped = lambda c: jax.lax.fori_loop(0, c * 0 + 4, lambda i, c: body(c, None)[0], c)
    for fn in (scanned, looped):
        err, _ = jax.jit(checkify.checkify(fn))(jnp.int32(0))
        assert "counter past 3" in err.get()
        err, _ = jax.jit(checkify.checkify(fn))(jnp.int32(-10))
        assert err.get() is None

    def row(x):
        check(x >= 0, "negative row")
        return x

    err, _ = checkify.checkify(jax.vmap(row))(jnp.asarray([1, -1, 2]))
    assert "negative row" in err.get()
    err, _ = checkify.checkify(jax.vmap(row))(jnp.asarray([1, 0, 2]))
    assert err.get() is None


def test_a_check_compiles_to_nothing():
    x = jnp.arange(8)
    plain = jax.jit(lambda x: x * 2).lower(x).compile().as_text()
    checked = jax.jit(lambda x: (check(jnp.all(x < 100), "big"), x * 2)[1]).lower(x).compile()
    body = lambda hlo: [line for line in hlo[hlo.index("ENTRY"):].splitlines() if "=" in line]
    assert len(body(checked.as_text())) == len(body(plain))
    assert jax.make_jaxpr(lambda x: check(x > 0, "m"))(x).effects == set()


def test_a_gpu_without_the_cuda_kernels_runs_xla_and_is_told_why(monkeypatch):
    """A CPU-only build run by JAX on a GPU: one warning names the cause (no CUDA kernels in
    this build) and the fixes, and the ops run their XLA formulation; with
    JAXKV_KERNELS=require the first op is an error saying the same, at trace time, instead of
    XLA's missing-handler error."""
    from jaxkv import _ffi
    cache = jaxkv.LinearKVCache.create(1, 2, 1, 8, 16, jnp.float32).reset(
        jnp.zeros((2,), jnp.int32))
    k = jnp.arange(2 * 3 * 16, dtype=jnp.float32).reshape(2, 1, 3, 16)
    want = cache.append(0, k, k).commit(3).compact(jnp.array([1, 0], jnp.int32))
    monkeypatch.setattr(_ffi, "WITH_CUDA", False)
    monkeypatch.setattr(_ffi, "_jax_platform", lambda: "cuda")
    monkeypatch.setattr(_ffi, "_warned", set())
    monkeypatch.delenv("JAXKV_KERNELS", raising=False)
    with pytest.warns(UserWarning, match="built without its CUDA kernels.*build_wheel.sh"
                                         ".*XLA formulation"):
        got = cache.append(0, k, k).commit(3).compact(jnp.array([1, 0], jnp.int32))
    np.testing.assert_array_equal(got.buffer, want.buffer)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    monkeypatch.setenv("JAXKV_KERNELS", "require")
    with pytest.raises(RuntimeError, match="built without its CUDA kernels.*build_wheel.sh"):
        cache.commit(1).compact(jnp.array([0, 1], jnp.int32))
    monkeypatch.setenv("JAXKV_KERNELS", "fast")
    with pytest.raises(ValueError, match="JAXKV_KERNELS must be one of auto, xla, require"):
        cache.commit(1).compact(jnp.array([0, 1], jnp.int32))
