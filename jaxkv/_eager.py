"""An op called outside any trace runs as one compiled program, as jnp's functions do.

Eagerly, each jnp operation inside an op would compile on its own for every new shape and run
as its own dispatch: a cache's ``reserve`` was 65 of them. Compiled whole, an eager call
costs one compilation per shape and one dispatch. Within a trace (the caller's jit, scan,
checkify, a shard's body) the op runs as it is, inlined into the caller's program.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from . import _ffi


def compiled_when_eager(fn):
    """``fn`` compiled whole when none of its arguments is a tracer. Arrays are the program's
    arguments; every other leaf (ints, floats, dtypes, a cache's static fields) is static, as
    under ``per_shard``'s shard_map, and so is the kernels' selection (``JAXKV_KERNELS``), made
    when the program is traced. An argument that cannot be hashed runs ``fn`` op by op."""

    def call(arrays, static):
        treedef, is_array, others, _ = static
        arrays, others = iter(arrays), iter(others)
        args, kwargs = treedef.unflatten([next(arrays) if a else next(others) for a in is_array])
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = fn.__name__  # the program's name: jit(reserve)
    jitted = jax.jit(call, static_argnums=1)

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return fn(*args, **kwargs)
        is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
        others = tuple(x for x, a in zip(leaves, is_array) if not a)
        static = (treedef, is_array, others, _ffi.kernel_selection())
        try:
            hash(static)
        except TypeError:
            return fn(*args, **kwargs)
        return jitted([x for x, a in zip(leaves, is_array) if a], static)

    return compiled
