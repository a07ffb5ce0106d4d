#!/usr/bin/env bash
# The CPU handlers built with AddressSanitizer, then the test suite over them.
#
# A separate venv (.venv-asan) and build dir (build/asan) so the normal build is not touched.
# Python itself is not instrumented, so libasan (and libstdc++) are preloaded; leak detection is
# off (the interpreter and XLA keep memory until exit). Any ASan report aborts the test process, so a
# clean run is a pytest exit status of 0 with no "ERROR: AddressSanitizer" in the log.
#   bash tools/asan_check.sh [pytest args...]      (default: the whole suite, 2 workers)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ASAN_VENV:-.venv-asan}
LOG=${ASAN_LOG:-/tmp/jaxkv-asan.log}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q jax==0.10.2 nanobind scikit-build-core ninja pytest pytest-xdist \
    hypothesis
fi
# -O1 and frame pointers: readable ASan stacks at a modest cost.
flags="-fsanitize=address -fno-omit-frame-pointer -O1 -g"
JAXKV_CUDA=OFF "$VENV/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall \
  -C build-dir=build/asan -C cmake.build-type=RelWithDebInfo \
  -C "cmake.define.CMAKE_CXX_FLAGS=$flags" \
  -C "cmake.define.CMAKE_SHARED_LINKER_FLAGS=-fsanitize=address" .

libasan=$(${CXX:-g++} -print-file-name=libasan.so)
[ -f "$libasan" ] || { echo "libasan.so not found ($libasan)"; exit 1; }
# libstdc++ right after it: python does not link it, and without it the runtime's __cxa_throw
# interceptor finds no real function and aborts at jaxlib's first C++ exception.
preload="$libasan:$(${CXX:-g++} -print-file-name=libstdc++.so)"
export JAX_PLATFORMS=cpu  # the CPU handlers are the ones under test; no plugin probing
(cd /tmp && LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 "$OLDPWD/$VENV/bin/python" -c \
  "import jaxkv._jaxkv as m, subprocess; \
   out = subprocess.run(['nm', '-D', m.__file__], capture_output=True, text=True).stdout; \
   assert '__asan' in out, 'the extension is not instrumented'; print('instrumented:', m.__file__)")

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-q -n 2 -p no:cacheprovider)
start=$(date +%s)
# From tests/ so that `import jaxkv` is the instrumented install, not the source folder.
set +e
(cd tests && LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  "../$VENV/bin/python" -m pytest "${args[@]}") 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
echo "asan_check: pytest exit $rc in $(( $(date +%s) - start )) s; log $LOG"
if grep -q "ERROR: AddressSanitizer" "$LOG"; then
  echo "asan_check: AddressSanitizer reported an error"
  exit 1
fi
exit "$rc"
