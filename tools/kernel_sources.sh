#!/usr/bin/env bash
# One hash of the sources a wheel's compiled kernels come from (ffi/ and CMakeLists.txt: names and
# contents): tools/build_wheel.sh writes it beside the wheel, and tools/gpu_check.sh's WHEEL= run
# refuses a wheel whose hash is not the tree's, so that a GPU run never tests stale kernels
# under the tree's Python. Build outputs (objects, libraries, caches) are not sources, and the
# device's copy of the tree leaves them out. Not hashed: pyproject.toml, whose other changes
# (versions, dependencies) leave the kernels as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
find ffi CMakeLists.txt -type f -not -name '*.o' -not -name '*.so' -not -path '*/__pycache__/*' \
  -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40
