#!/usr/bin/env bash
# On a CUDA machine (the H200 of the device tool): build with the preinstalled toolchain, run the
# whole test suite on the GPU, then the benchmarks, then the demo for each cache kind against its
# XLA baseline. Logs go to $OUT (default /tmp/jaxkv-gpu). SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_DEMO=1
# skip parts.
#   bash tools/gpu_check.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/jaxkv-gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"

echo "== build" | tee "$OUT/build.log"
JAXKV_CUDA=ON JAXKV_CUDA_ARCHITECTURES=90 python3 -m pip install --no-build-isolation --no-deps \
  --no-index . >>"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
(cd /tmp && python3 -c "import jax, jaxkv._ffi as f; assert f.WITH_CUDA, 'built without CUDA'; \
  assert jax.default_backend() == 'gpu', jax.default_backend(); print('CUDA build ok, backend gpu')") || exit 1

tests_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== tests"
  # From tests/ so that `import jaxkv` is the installed package, not the source folder.
  (cd tests && JAXKV_REQUIRE_GPU=1 python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1) | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
fi

if [ -z "${SKIP_BENCH:-}" ] && (cd /tmp && python3 -c "import jaxkv.bench" 2>/dev/null); then
  echo "== benchmarks"
  explain="$PWD/benchmarks/explanations.json"  # measured reasons for rows that miss a target
  (cd /tmp && python3 -m jaxkv.bench --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
    --explain "$explain" 2>&1) \
    | tee "$OUT/bench.log"
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -ge 2 ]; then  # sharded ops: per-device bandwidth on every GPU against one
    (cd /tmp && python3 -m jaxkv.bench --devices "$ngpu" --json "$OUT/bench_devices.json" 2>&1) \
      | tee "$OUT/bench_devices.log"
  fi
fi
if [ -z "${SKIP_DEMO:-}" ]; then
  echo "== demo (tokens/s for jaxkv vs --baseline xla)"
  {
    for cache in linear manager paged; do
      (cd /tmp && python3 -m jaxkv demo --cache "$cache" --baseline xla 2>&1)
    done
    # A GPU-sized stream: more sequences, a longer shared prompt, bf16.
    for cache in linear paged; do
      (cd /tmp && python3 -m jaxkv demo --cache "$cache" --baseline xla --dtype bfloat16 \
        --requests 256 --max-batch 64 --system-len 512 --max-new-tokens 128 --show 0 2>&1)
    done
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # a cache sharded over 2 GPUs (KV heads)
      (cd /tmp && python3 -m jaxkv demo --cache paged --mesh tp=2 --baseline xla 2>&1)
    fi
    # One jitted step per Python call: the dispatch cost a step pays, jaxkv vs XLA.
    (tool="$PWD/tools/evict_call_cost.py"; cd /tmp && python3 "$tool" 2>&1)
  } | tee "$OUT/demo.log"
fi
exit "$tests_rc"
