#!/usr/bin/env bash
# SASS of jaxkv's kernels on a machine without a GPU: compiles one CUDA file for sm_90a, with the
# flags and definitions CMakeLists.txt gives the kernels, and prints
# the machine code of the kernels whose mangled name contains PATTERN (with instruction counts),
# so that a kernel change can be read at the instruction level before it costs device time.
# cuobjdump is not in this machine's CUDA toolkit; the first call fetches NVIDIA's
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels from the package index into
# build/cuobjdump (ignored by git).
#   bash tools/sass.sh ffi/cuda/quantize.cu 'quantize_kernel_fixedILNS_6FormatE1ELS2_3ELi128'
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: tools/sass.sh FILE.cu PATTERN}
pattern=${2:?usage: tools/sass.sh FILE.cu PATTERN}
tool=build/cuobjdump/nvidia/cu13/bin/cuobjdump
if [ ! -x "$tool" ]; then
  mkdir -p build/cuobjdump
  python3 -m pip download -q --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d build/cuobjdump
  for w in build/cuobjdump/*.whl; do python3 -m zipfile -e "$w" build/cuobjdump; done
  chmod +x build/cuobjdump/nvidia/cu13/bin/*
fi
inc=ffi/third_party  # the XLA FFI headers the build compiles against
obj=build/sass.o
# The build's flags (CMakeLists.txt); a compile error stops here with its messages.
if ! nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DJAXKV_WITH_CUDA=1 -DJAXKV_SM90A=1 \
    -Iffi/include -isystem "$inc" -c "$src" -o "$obj" 2> build/sass.log; then
  grep -v "warning #\|^ *^\|^$\|Remark" build/sass.log >&2 || true
  exit 1
fi
"$tool" -sass "$obj" | awk -v p="$pattern" '
  function done() { if (show) print "  (" n " instructions)"; show = 0 }
  /Function :/ { done(); show = index($0, p) > 0; n = 0; if (show) print; next }
  /^[ \t]+\/\*[0-9a-f]+\*\// { if (show) { n++; print } }
  END { done() }'
