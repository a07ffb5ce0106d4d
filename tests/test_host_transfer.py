"""The host tier's transfers (``jaxkv_pages_to_host`` / ``jaxkv_pages_from_host``) against the
reference, byte for byte: every dtype width, both page axes, scale pools of narrow runs, pairs out
of range, and the side-stream form (``overlap``) behind its fence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import host_tier, reference

from helpers import assert_bytes_equal, copies_of, random_array

pytestmark = pytest.mark.host_tier

# (device pool shape, page axis): NHD [L, P, S, H, D], HND [L, H, P, S, D], a scale pool
# [L, P, S, H] and a run of 3 elements (1-byte dtypes: the kernel's narrowest access)
SHAPES = [((2, 9, 4, 2, 8), 1), ((2, 2, 9, 4, 8), 2), ((3, 9, 4, 2), 1), ((2, 9, 3), 1)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8]
HOST_PAGES = 6
# pairs: live ones, out of range on either side (skipped), a live one after them, then the
# padding a call uses (the kernels stop after the last live pair, and skip the holes before it)
SRC = [4, 0, 8, -1, 3, 9, 2, 5, 0, 1]
DST = [5, 1, 0, 2, 7, 3, -2, 4, 6, 6]


def host_array(x):
    return jax.device_put(x, jax.memory.Space.Host)


def read(x):
    # through a device copy: numpy's view of a pinned host array would pin its buffer
    return np.asarray(jax.device_put(x, jax.memory.Space.Device))


def pools(shape, axis, dtype):
    host_shape = (HOST_PAGES, 2) + shape[:axis] + shape[axis + 1:]
    return random_array(shape, dtype), random_array(shape, dtype), random_array(host_shape, dtype)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_to_host_matches_the_reference(shape, axis, dtype, overlap):
    k, v, host = pools(shape, axis, dtype)
    src, dst = jnp.asarray(SRC, jnp.int32), jnp.asarray(DST, jnp.int32)
    want = reference.pages_to_host(host, k, v, src, dst, axis)

    @jax.jit
    def f(host, k, v):
        host = host_tier._to_host(axis, host, k, v, src, dst, overlap=overlap)
        return host, host_tier._fence((jnp.zeros((), jnp.int32),), (host,))

    got, _ = f(host_array(host), k, v)
    assert got.sharding.memory_kind == "pinned_host"
    assert_bytes_equal(read(got), want, "host pool")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_from_host_matches_the_reference(shape, axis, dtype, overlap):
    k, v, host = pools(shape, axis, dtype)
    src = jnp.asarray([min(d, HOST_PAGES) if d >= 0 else d for d in DST], jnp.int32)
    dst = jnp.asarray(SRC, jnp.int32)
    want = reference.pages_from_host(k, v, host, src, dst, axis)

    @jax.jit
    def f(k, v, host):
        k, v = host_tier._from_host(axis, k, v, host, src, dst, overlap=overlap)
        return (k, v), host_tier._fence((jnp.zeros((), jnp.int32),), (k, v))

    got, _ = f(k, v, host_array(host))
    assert_bytes_equal(got[0], want[0], "K pool")
    assert_bytes_equal(got[1], want[1], "V pool")


def test_transfers_run_in_place():
    """Donated, each transfer writes its destination pool where it lies: no copy of a pool."""
    shape, axis = SHAPES[0]
    k, v, host = pools(shape, axis, jnp.bfloat16)
    src, dst = jnp.asarray(SRC, jnp.int32), jnp.asarray(DST, jnp.int32)
    out = jax.jit(lambda h, k, v: host_tier._to_host(axis, h, k, v, src, dst), donate_argnums=0)
    back = jax.jit(lambda k, v, h: host_tier._from_host(axis, k, v, h, dst, src),
                   donate_argnums=(0, 1))
    host = host_array(host)
    for f, args in ((out, (host, k, v)), (back, (k, v, host))):
        hlo = f.lower(*args).compile().as_text()
        assert not copies_of(hlo, k) and not copies_of(hlo, host)
    ptr = host.unsafe_buffer_pointer()
    host = out(host, k, v)
    assert host.unsafe_buffer_pointer() == ptr
    kp, vp = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    k, v = back(k, v, host)
    assert (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) == (kp, vp)
