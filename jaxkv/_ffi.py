"""Loads the compiled extension and registers its XLA FFI targets with JAX.

The extension exposes ``registrations()``: ``{platform: {target: capsule}}``. A CPU-only build has no
"CUDA" entry; importing jaxkv never fails because the CUDA part is absent.
"""

from __future__ import annotations

import jax

from . import _jaxkv

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
