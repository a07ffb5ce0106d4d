"""Loads the compiled extension and registers its XLA FFI targets with JAX.

The extension exposes ``registrations()``: ``{platform: {target: capsule}}``. A CPU-only build has no
"CUDA" entry; importing jaxkv never fails because the CUDA part is absent.
"""

from __future__ import annotations

import jax

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


def call(target: str, results, *args, input_output_aliases=None, **attrs):
    """One ``jax.ffi.ffi_call`` of a jaxkv target (results: ShapeDtypeStructs)."""
    return jax.ffi.ffi_call(
        target,
        results,
        input_output_aliases=input_output_aliases or {},
        vmap_method="sequential",
    )(*args, **attrs)
