"""Data-dependent checks that cost nothing unless the caller asks for them with ``checkify``.

``checkify.debug_check`` would do the same job, but it leaves an effect in every jaxpr that holds
one, and an effectful executable loses JAX's C++ dispatch path: on the H200 every jitted step that
touched a jaxkv op paid 60-90 us more per call (tools/evict_call_cost.py). ``check`` binds a
primitive with no effect that lowers to nothing, so ``jit`` compiles it away, and registers a
checkify rule for it, the way jnp's own index checks work: under ``checkify.checkify`` (the
default ``user_checks``) a failed check is reported like a failed ``debug_check``.

The rule uses ``jax._src.checkify``; where that is missing, ``check`` falls back to ``debug_check``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir

_checkify_internals: Any  # jax's private checkify module, or None where it moved
try:
    from jax._src import checkify as _checkify_internals

    # jax 0.11 passes a context first to the checkify rules and to assert_func; jax 0.10 does not.
    _assert_params = list(inspect.signature(_checkify_internals.assert_func).parameters)
    _TAKES_CTX = _assert_params[0] == "ctx"
    if _assert_params[_TAKES_CTX] != "error":
        raise ImportError("unknown checkify.assert_func signature")
except (ImportError, AttributeError):  # a jax that moved them: keep the checks, lose the speed
    _checkify_internals = None

check_p = jax_core.Primitive("jaxkv_check")
check_p.multiple_results = True  # no results at all
check_p.def_impl(lambda pred, *, msg: [])
check_p.def_abstract_eval(lambda pred, *, msg: [])
mlir.register_lowering(check_p, lambda ctx, pred, *, msg: [])


def _batched(args, dims, *, msg):
    return check_p.bind(jnp.all(args[0]), msg=msg), []


def _jvp(primals, tangents, *, msg):
    return check_p.bind(*primals, msg=msg), []


batching.primitive_batchers[check_p] = _batched
ad.primitive_jvps[check_p] = _jvp

if _checkify_internals is not None:

    def _merged_over_devices(error):
        """jax 0.10's checkify rule of shard_map returns the error with a leading device axis,
        which the next check cannot combine with: merge it to one error (a gather of a few
        flags, under checkify only)."""
        preds = getattr(error, "_pred", None)
        merge = getattr(_checkify_internals, "_reduce_any_error", None)
        if preds is None or merge is None or all(jnp.ndim(p) == 0 for p in preds.values()):
            return error  # nothing to merge, or a jax whose errors look otherwise

        def replicated(x):
            mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if mesh is None or not getattr(mesh, "axis_names", ()):
                return x
            return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))

        return merge(jax.tree.map(replicated, error))

    def _checkify_rule(*args, msg):
        # (ctx,) error, enabled_errors, pred
        ctx, (error, enabled_errors, pred) = args[:_TAKES_CTX], args[_TAKES_CTX:]
        failed_check = _checkify_internals.FailedCheckError
        if failed_check in enabled_errors:
            error = _merged_over_devices(error)
            error = _checkify_internals.assert_func(
                *ctx, error, jnp.logical_not(jnp.all(pred)),
                failed_check(_checkify_internals.get_traceback(), msg))
        return error, []

    _checkify_internals.error_checks[check_p] = _checkify_rule


# Open collections, innermost last: the checks of a per-shard body (sharding.py), which are
# reported outside its shard_map (jax 0.10's checkify of a shard_map fails on sharded inputs).
_collections: list[list] = []


@contextlib.contextmanager
def collected():
    """Within: ``check`` appends ``(pred, msg)`` to the yielded list instead of binding."""
    found: list = []
    _collections.append(found)
    try:
        yield found
    finally:
        _collections.pop()


def check(pred, msg: str) -> None:
    """Reports ``msg`` through ``checkify`` where ``pred`` (a bool array) is not all true."""
    if _collections:
        _collections[-1].append((jnp.all(jnp.asarray(pred, bool)), msg))
        return
    if _checkify_internals is None:
        checkify.debug_check(jnp.all(pred), msg)
    else:
        check_p.bind(jnp.asarray(pred, bool), msg=msg)


# A row id naming another batch shard's row, as a per-shard body sees it (``jaxkv.sharding.Ids``):
# outside [0, rows), so the kernels skip it.
ELSEWHERE = -(2**31)


def elsewhere(ids) -> jax.Array:
    """bool, like ``ids``: entries that another batch shard handles, which a check lets pass.
    Only inside a per-shard body: anywhere else ``ELSEWHERE`` is an id out of range like any."""
    if not _collections:
        return jnp.zeros(jnp.shape(ids), bool)
    return ids == ELSEWHERE
