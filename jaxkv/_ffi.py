"""Loads the compiled extension and registers its XLA FFI targets with JAX.

The extension exposes ``registrations()``: ``{platform: {target: capsule}}``. A CPU-only build has no
"CUDA" entry; importing jaxkv never fails because the CUDA part is absent.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import warnings

import jax
import jaxlib

from . import _fallback
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
WITH_SM90A: bool = bool(_jaxkv.with_sm90a)  # Hopper's kernels (the wgmma prefill) built
# Blocks a multiprocessor of the 16-bit tensor-core decode kernel (ffi: kDecodeResidentBlocks)
DECODE_RESIDENT_BLOCKS: int = int(_jaxkv.decode_resident_blocks)


def _runtime_ffi_api_minor() -> int | None:
    """The FFI API minor version of the running jaxlib (from the headers it ships), or None."""
    header = pathlib.Path(jaxlib.__file__).parent / "include/xla/ffi/api/c_api.h"
    try:
        found = re.search(r"#define XLA_FFI_API_MINOR (\d+)", header.read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _check_ffi_api() -> None:
    # Registering a handler built against newer headers than the running XLA takes the whole
    # backend down at its first use ("Unable to initialize backend"); refuse it here, clearly.
    built, running = _jaxkv.ffi_api_minor, _runtime_ffi_api_minor()
    if running is not None and built > running:
        raise ImportError(
            f"jaxkv was built against XLA FFI API 0.{built}, but jaxlib {jaxlib.__version__} "
            f"speaks 0.{running}: rebuild jaxkv against this jaxlib "
            "(`pip install --no-build-isolation --force-reinstall --no-deps .` from its source)."
        )


_check_ffi_api()

for _platform, _targets in _jaxkv.registrations().items():
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


KERNELS_MODES = ("auto", "xla", "require")
"""``JAXKV_KERNELS``: ``auto`` (default: jaxkv's kernels where this build has them for the
platform, the XLA formulation elsewhere, with one warning), ``xla`` (the XLA formulation
everywhere) or ``require`` (an error where the platform has no kernels)."""
_warned: set[str] = set()
_forced: str | None = None  # a mode set by `forced_kernels`, over JAXKV_KERNELS


@contextlib.contextmanager
def forced_kernels(mode: str):
    """``JAXKV_KERNELS=mode`` for the ops traced inside (the benchmark's fallback column traces
    the same op through its XLA formulation)."""
    global _forced
    if mode not in KERNELS_MODES:
        raise ValueError(f"mode must be one of {', '.join(KERNELS_MODES)}, got {mode!r}")
    before, _forced = _forced, mode
    try:
        yield
    finally:
        _forced = before


def _jax_platform() -> str:
    """The platform JAX runs on: cpu, cuda, rocm, tpu, ..."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = getattr(jax.devices()[0].client, "platform_version", "").lower()
    return "rocm" if "rocm" in version else "cuda"


def _why_no_kernels(target: str, platform: str) -> str:
    if platform == "cuda":
        return (f"jaxkv ({target}): JAX runs on a CUDA GPU, but this jaxkv was built without its "
                "CUDA kernels (no nvcc was found when pip built it). Install the wheel with the "
                "CUDA kernels (`bash tools/build_wheel.sh` builds it; no toolkit is needed where "
                "it is installed), or rebuild from source with nvcc on PATH: `JAXKV_CUDA=ON pip "
                "install --force-reinstall --no-deps .`. To run on the CPU instead: "
                "JAX_PLATFORMS=cpu.")
    return (f"jaxkv ({target}): jaxkv has no kernels for {platform} (CUDA and CPU only).")


def _mode() -> str:
    return (_forced or os.environ.get("JAXKV_KERNELS", "auto")).lower()


def kernel_selection() -> tuple:
    """What ``use_xla`` decides by, hashable: a program traced under another selection is not
    reused (``_eager``)."""
    return (_mode(), _jax_platform(), WITH_CUDA)


def use_xla(target: str) -> bool:
    """Whether ``target`` runs as its XLA formulation (``_fallback``), by ``JAXKV_KERNELS`` and
    the platform; ``require`` on a platform without kernels is a RuntimeError naming why."""
    mode = _mode()
    if mode not in KERNELS_MODES:
        raise ValueError(f"JAXKV_KERNELS must be one of {', '.join(KERNELS_MODES)}, got {mode!r}")
    if mode == "xla":
        return True
    platform = _jax_platform()
    if platform == "cpu" or (platform == "cuda" and WITH_CUDA):
        return False
    why = _why_no_kernels(target, platform)
    if mode == "require":
        raise RuntimeError(why + " JAXKV_KERNELS=require asked for kernels.")
    if platform not in _warned:
        _warned.add(platform)
        warnings.warn(why + " Every op runs its XLA formulation instead: correct and in place "
                      "where XLA allows, not tuned (JAXKV_KERNELS=xla says so quietly, "
                      "JAXKV_KERNELS=require makes this an error).", stacklevel=3)
    return True


def call(target: str, results, *args, input_output_aliases=None, result_inputs=None, **attrs):
    """One ``jax.ffi.ffi_call`` of a jaxkv target (results: ShapeDtypeStructs).

    Inside ``shard_map`` each output is typed as varying wherever the inputs it is computed from
    vary (an ``ffi_call`` output carries no varying axes, and an ``out_specs`` that forgot an
    axis would otherwise pass and silently return shard 0's value): an aliased output follows
    its input, output ``i`` the arguments ``result_inputs[i]`` when given, any other all inputs.
    """
    aliases = input_output_aliases or {}
    if use_xla(target):
        out = _fallback.call(target, results, *args, **attrs)
    else:
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
