"""Loads the compiled extension and registers its XLA FFI targets with JAX.

The extension exposes ``registrations()``: ``{platform: {target: capsule}}``. A CPU-only build has no
"CUDA" entry; importing jaxkv never fails because the CUDA part is absent.
"""

from __future__ import annotations

import jax

from ._shard_map import mark_varying, varying_axes

try:
    from . import _jaxkv
except ImportError as e:  # most often: the source checkout shadows the installed package
    raise ImportError(
        f"jaxkv: the compiled extension jaxkv._jaxkv is not next to {__file__}. If that is a "
        "source checkout in the current directory, it shadows the installed package: run from "
        "another directory, use `python3 -P`, or install it with `pip install -e .`."
    ) from e

WITH_CUDA: bool = bool(_jaxkv.with_cuda)

for _platform, _targets in _jaxkv.registrations().items():
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def call(target: str, results, *args, input_output_aliases=None, result_inputs=None, **attrs):
    """One ``jax.ffi.ffi_call`` of a jaxkv target (results: ShapeDtypeStructs).

    Inside ``shard_map`` each output is typed as varying wherever the inputs it is computed from
    vary (an ``ffi_call`` output carries no varying axes, and an ``out_specs`` that forgot an
    axis would otherwise pass and silently return shard 0's value): an aliased output follows
    its input, output ``i`` the arguments ``result_inputs[i]`` when given, any other all inputs.
    """
    aliases = input_output_aliases or {}
    out = jax.ffi.ffi_call(
        target,
        results,
        input_output_aliases=aliases,
        vmap_method="sequential",
    )(*args, **attrs)
    every = set().union(*(varying_axes(a) for a in args))
    if not every:
        return out
    sources = {o: (i,) for i, o in aliases.items()} | dict(result_inputs or {})
    single = not isinstance(out, (list, tuple))
    marked = []
    for o, x in enumerate([out] if single else out):
        axes = set().union(*(varying_axes(args[i]) for i in sources[o])) if o in sources else every
        marked.append(mark_varying(x, sorted(axes)))
    return marked[0] if single else type(out)(marked)
