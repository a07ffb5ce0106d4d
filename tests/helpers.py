"""Test utilities: fresh random data for every dtype, byte-exact comparison, in-place checks."""

from __future__ import annotations

import inspect
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import reference as _reference

DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.int8,
    jnp.uint8,
]
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]

_rng = np.random.default_rng()


def fresh_key() -> jax.Array:
    """A new PRNG key per call: tests never reuse data."""
    return jax.random.key(int(_rng.integers(0, 2**31 - 1)))


def random_array(shape, dtype) -> jax.Array:
    """Fresh random values (never all zeros, never NaN) of any cache dtype.

    Drawn with numpy: jax.random would compile once per shape, which dominates a CPU test run.
    """
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return jnp.asarray(_rng.integers(info.min, info.max + 1, shape, dtype=dtype))
    return jnp.asarray((_rng.standard_normal(shape, np.float32) * 4).astype(dtype))


# Arguments of the references that fix a shape or a branch: static under jit.
_STATIC = {"save_kv_cache": ("seq_len",), "paged_append": ("layout",),
           "paged_gather": ("max_len", "layout"), "copy_pages": ("layout",)}

# jaxkv.reference with every function under jit. Eagerly, each jnp op of a reference compiles on
# its own for every new shape (op by op), which dominated the CPU run; under jit a reference is one
# compile per shape. The same oracle: the references move bytes (identical either way) or compute
# the attention in float32 at HIGHEST precision (compared with a tolerance).
ref = types.SimpleNamespace(**{
    name: jax.jit(fn, static_argnames=_STATIC.get(name, ()))
    for name, fn in inspect.getmembers(_reference, inspect.isfunction)
    if not name.startswith("_") and fn.__module__ == _reference.__name__
})


def as_bytes(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8).reshape(x.shape + (x.dtype.itemsize,))


def assert_bytes_equal(actual, expected, what: str = "") -> None:
    a, e = as_bytes(actual), as_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    bad = np.argwhere(np.any(a != e, axis=-1))
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def hlo_type(x) -> str:
    """HLO spelling of an array type, e.g. 'bf16[2,4,2,8,64,128]'."""
    names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8", "uint8": "u8",
             "int32": "s32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
    return f"{names[np.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


def copies_of(compiled_hlo: str, x) -> list[str]:
    """Instructions of a compiled module that copy a buffer of x's type (a cache copy)."""
    t = re.escape(hlo_type(x))
    pattern = re.compile(rf"=\s*{t}(\{{[^}}]*\}})?\s+copy(-start)?\(")
    return [line.strip() for line in compiled_hlo.splitlines() if pattern.search(line)]


XLA_FALLBACK = os.environ.get("JAXKV_KERNELS", "auto").lower() == "xla"
"""The suite runs with every op's XLA formulation forced (``JAXKV_KERNELS=xla``, jaxkv._fallback):
no jaxkv kernel is launched."""


def assert_launches(compiled_hlo: str, target: str, count: int = 1) -> None:
    """The compiled module launches ``target`` ``count`` times (one launch for every layer, ...);
    under the forced XLA formulation, it launches no jaxkv kernel at all."""
    if XLA_FALLBACK:
        assert 'custom_call_target="jaxkv_' not in compiled_hlo
    else:
        assert compiled_hlo.count(f'custom_call_target="{target}"') == count


def mesh_of(shape, names):
    """jax.make_mesh over the first devices of the default backend; skips the test where there
    are fewer (a one-GPU machine; CPU runs force 8 host devices)."""
    need = int(np.prod(shape))
    if jax.device_count() < need:
        pytest.skip(f"needs {need} devices of the default backend")
    return jax.make_mesh(shape, names, devices=jax.devices()[:need])
