"""Strict test configuration, shared by the CPU (CI) and CUDA (H200) runs of the same suite."""

import importlib.metadata
import os
import re
import shutil
import tempfile


def _jaxlib_version() -> tuple:
    try:
        text = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


# Several emulated CPU devices for sharding tests; harmless on GPU. XLA:CPU compiles each
# program's code in one piece: split over threads, it competes with the other xdist worker for
# the 2 cores of CI's machine (12% more time).
_FLAGS = {"--xla_force_host_platform_device_count": "8",
          "--xla_cpu_parallel_codegen_split_count": "1"}
if _jaxlib_version() < (0, 11, 1):
    # Most of a CPU run is XLA compiling small programs: XLA:CPU's older LLVM IR emitters compile
    # them in 0.6x the time of its fusion emitters (the same HLO; docs/perf-notes.md). jaxlib
    # 0.11.1 removed them (an unknown flag aborts), and compiles about as fast as these.
    _FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f"{k}={v}" for k, v in _FLAGS.items() if k not in _given]).strip()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers on one GPU: each takes memory as it needs it, not 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import XLA_FALLBACK  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
if jax.default_backend() == "cpu":
    # Most of a CPU run is XLA compiling small programs. JAX's switch for when compiling costs
    # more than it saves: LLVM at -O0 for the code XLA:CPU generates. The compiled HLO (fusion,
    # copies, donation, loops: what the tests inspect) is the same; the kernels are compiled C++.
    jax.config.update("jax_disable_most_optimizations", True)
    # The xdist workers of one run compile many of the same small programs: one compilation
    # cache for the run (a folder the controller makes and removes, below), every entry kept.
    if os.environ.get("JAXKV_TEST_COMPILE_CACHE"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAXKV_TEST_COMPILE_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_jaxkv_cache", None):
        shutil.rmtree(config._jaxkv_cache, ignore_errors=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}"


def pytest_configure(config):
    if (jax.default_backend() == "cpu" and not os.environ.get("PYTEST_XDIST_WORKER")
            and getattr(config.option, "numprocesses", None)
            and "JAXKV_TEST_COMPILE_CACHE" not in os.environ):
        config._jaxkv_cache = tempfile.mkdtemp(prefix="jaxkv-test-xla-")
        os.environ["JAXKV_TEST_COMPILE_CACHE"] = config._jaxkv_cache  # the workers inherit it
    if os.environ.get("JAXKV_TEST_COMPILE_CACHE"):
        # JAX writes an entry in place, unlocked: a worker may read one another is still writing.
        # It then warns and compiles for itself (a truncated entry never decompresses), which is
        # right; only the warning is no error here.
        config.addinivalue_line(
            "filterwarnings", "ignore:Error reading persistent compilation cache entry:UserWarning")
    # The GPU script sets this so that a run that silently fell back to CPU cannot pass.
    if os.environ.get("JAXKV_REQUIRE_GPU") and jax.default_backend() != "gpu":
        raise pytest.UsageError(f"JAXKV_REQUIRE_GPU is set but the backend is {jax.default_backend()}")


def _mark_sweeps_long(items):
    """A parametrized test's fast part: its parameter sets in collection order while each adds a
    value of some parameter not yet run ("each choice" coverage: every dtype, kind, layout, size
    runs once; a seed counts as no parameter); the other combinations are marked long.
    Deterministic, so every xdist worker selects the same tests."""
    seen: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or "long" in item.keywords:
            continue
        # A seed is no choice of the contract: its other values are the property sweep.
        values = {(name, repr(value)) for name, value in spec.params.items() if name != "seed"}
        covered = seen.setdefault((item.module.__name__, item.originalname), set())
        if values <= covered and covered:
            item.add_marker(pytest.mark.long)
        covered |= values


def pytest_collection_modifyitems(config, items):
    # README's test command runs the contract; the long runs (marker long: fuzzing, property
    # sweeps, transformers parity, serving soaks, the other combinations of parametrized sweeps,
    # on CPU the tests sized for a CUDA kernel's paths) are the second command, `pytest -m long`.
    # Any -m expression selects for itself ("long or not long": everything), and so do tests
    # named on the command line (files or ids).
    if jax.default_backend() != "gpu":  # the CPU kernels take no other path at these sizes
        for item in items:
            if "gpu_sized" in item.keywords:
                item.add_marker(pytest.mark.long)
    _mark_sweeps_long(items)
    if not config.option.markexpr and not config.option.file_or_dir:
        long = [item for item in items if "long" in item.keywords]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if "long" not in item.keywords]
    if XLA_FALLBACK:  # the suite through jaxkv._fallback: the host tier needs the kernels
        no_host = pytest.mark.skip(reason="the host tier has no XLA formulation yet (JAXKV_KERNELS=xla; "
                                          "tests/test_fallback.py checks its clear error)")
        for item in items:
            if "host_tier" in item.keywords:
                item.add_marker(no_host)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs JAX on a CUDA GPU (runs in tools/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
