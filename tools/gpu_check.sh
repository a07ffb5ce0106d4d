#!/usr/bin/env bash
# On a CUDA machine (the H200 of the device tool): build with the preinstalled toolchain, run the
# whole test suite on the GPU, then the benchmarks, then the demo for each cache kind against its
# XLA baseline. Logs go to $OUT (default /tmp/jaxkv-gpu), packed at the end into logs.tgz (the
# main ones also beside it). SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_DEMO=1
# / SKIP_SANITIZE=1 / SKIP_SOAK=1 / SKIP_BUILD=1 / SKIP_SERVE=1 (SKIP_SERVE_8B=1) skip parts
# (PREFILL_BLOCKS=0 skips the prefill tests' second run on a few persistent blocks); BENCH_OPS="op ..." limits the benchmark to those ops,
# BENCH_ARGS more arguments of the benchmark (e.g. "--match window"; "--no-fallback" leaves out the
# column of jaxkv's XLA fallback, whose slow loops take about half of a prefill row's time),
# MEMCHECK / RACECHECK="test files" replace the sanitizers' default test lists, RACECHECK_SELECT
# racecheck's -k expression, TESTS_BUDGET_S=N the tests file by file within N seconds (below).
# The output ends with a summary (each test file's line and failures, each sanitizer's line, the
# exit codes), so that the tail of a long call shows what decides it ($OUT/summary.log).
# WHEEL=path installs a wheel built on the CPU machine instead of
# building here (device time: the CUDA build takes minutes there, 1.5 here), then copies the
# tree's Python over it, so that only a change under ffi/ needs a new wheel. The run stops unless
# the hash beside the wheel (WHEEL.sources) is the tree's (tools/kernel_sources.sh).
#   PYENV_VERSION=3.12.1 PYTHON=python3.12 bash tools/build_wheel.sh build/gpu-wheel
#                                        # then: carry build/gpu-wheel, WHEEL=build/gpu-wheel/*.whl
#   bash tools/gpu_check.sh [pytest args...]
# WGMMA_PROBE=1 first builds and runs tools/probes/wgmma_probe.cu (the prefill's MMA shapes alone;
# $OUT/wgmma_probe.log).
# TIME_LIMIT_S=N: the tests, the benchmark and the serve runs are interrupted (SIGINT) once N
# seconds have passed since the start, so that a device call that would outrun its limit still
# packs and brings back what was measured.
# NO_NVCC=1 takes every CUDA folder off PATH for the import check and the tests, so that they run
# as on a user's machine without the toolkit (where the wheel of tools/build_wheel.sh must run);
# FlashInfer's JIT, the probe and every step after the tests keep nvcc.
set -uo pipefail
OUT=${OUT:-/tmp/jaxkv-gpu}
mkdir -p "$OUT"
: >"$OUT/summary.log"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
user_path=$PATH  # the import check's and the tests' PATH (as_user, in their subshells)
if [ -n "${NO_NVCC:-}" ]; then
  user_path=$(echo "$PATH" | tr : '\n' | grep -v -i cuda | paste -sd: -)
  echo "NO_NVCC: nvcc on the tests' PATH: $(PATH=$user_path command -v nvcc || echo none)" \
    | tee -a "$OUT/summary.log"
fi
deadline=$(($(date +%s) + ${TIME_LIMIT_S:-1000000}))
limited() { local left=$((deadline - $(date +%s))); timeout -s INT -k 15 $((left > 1 ? left : 1)) "$@"; }
as_user() { export PATH=$user_path; [ -z "${NO_NVCC:-}" ] || unset CUDA_HOME; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"

if [ -n "${WHEEL:-}" ]; then  # a wheel built beforehand (below), its Python replaced by the tree's
  wheel=$(compgen -G "$WHEEL" | head -1)  # a pattern is fine: build/gpu-wheel/*.whl
  [ -n "$wheel" ] || { echo "gpu_check: no wheel matches $WHEEL" | tee -a "$OUT/summary.log"; exit 1; }
  built=$(cat "$wheel.sources" 2>/dev/null || echo "none (no $wheel.sources)")
  if [ "$built" != "$(bash tools/kernel_sources.sh)" ]; then
    echo "gpu_check: $wheel was built from other kernel sources than the tree's (its hash: $built);" \
      "rebuild it with tools/build_wheel.sh" | tee -a "$OUT/summary.log"
    exit 1
  fi
  echo "== install $wheel" | tee "$OUT/build.log"
  python3 -m pip install --no-deps --no-index --force-reinstall "$wheel" >>"$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  site=$(cd /tmp && python3 -c "import jaxkv, os; print(os.path.dirname(jaxkv.__file__))")
  find "$site" -name "*.py" -delete  # no module the tree has moved or removed stays importable
  cp -r jaxkv/* "$site/"
elif [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: a second call on a warm machine
  echo "== build" | tee "$OUT/build.log"
  JAXKV_CUDA=ON JAXKV_CUDA_ARCHITECTURES=90a python3 -m pip install --no-build-isolation --no-deps \
    --no-index . >>"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
(as_user; cd /tmp && python3 -c "import jax, jaxkv._ffi as f; assert f.WITH_CUDA, 'built without CUDA'; \
  assert jax.default_backend() == 'gpu', jax.default_backend(); print('CUDA build ok, backend gpu')") || exit 1

# FlashInfer beside the attention rows (--peers; a note where it does not import):
# PEER_WHEELS=/path/to/shared/peer-wheels installs it, and its JIT modules for those rows build
# in the background while the tests run (minutes of nvcc that the benchmark would wait for).
# FlashInfer's FA3 prefill beside them too: PEER_WHEELS=build/peer-wheels-fa3, the folder
# tools/flashinfer_fa3_wheel.py makes (carried to the machine; 28 MB).
warm_pid=
if [ -n "${PEER_WHEELS:-}" ] && [ -z "${SKIP_BENCH:-}" ]; then
  eval "$(bash "$PEER_WHEELS/setup_on_gpu.sh" "$PEER_WHEELS")"
  (tool="$PWD/tools/flashinfer_warm.py"; cd /tmp && limited python3 "$tool" >"$OUT/flashinfer_warm.log" 2>&1) &
  warm_pid=$!
fi

if [ -n "${WGMMA_PROBE:-}" ]; then
  { nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/cuda tools/probes/wgmma_probe.cu \
      -o /tmp/wgmma_probe && /tmp/wgmma_probe; } >"$OUT/wgmma_probe.log" 2>&1
  echo "wgmma probe (exit $?): $(tail -1 "$OUT/wgmma_probe.log")" | tee -a "$OUT/summary.log"
fi

tests_rc=0
# TESTS_BUDGET_S=N: the test files given (default: all) one pytest each, a summary line per file;
# files not started within N seconds are listed as NOT RUN, for the next call (the whole suite
# takes longer than one device call of 600 s).
test_files() {
  local start rest=() files=("$@") f t0 line rc
  [ "${#files[@]}" -gt 0 ] || mapfile -t files < <(cd tests && ls test_*.py)
  start=$(date +%s)
  for f in "${files[@]}"; do
    if [ $(($(date +%s) - start)) -gt "$TESTS_BUDGET_S" ]; then rest+=("$f"); continue; fi
    t0=$(date +%s)
    (as_user; cd tests && JAXKV_REQUIRE_GPU=1 limited python3 -m pytest -q -rs -p no:cacheprovider "$f" 2>&1) >"$OUT/file.log"
    rc=$?
    cat "$OUT/file.log" >>"$OUT/tests.log"
    line=$(grep -E "^=* ?[0-9]+ (passed|failed|skipped|error)" "$OUT/file.log" | tail -1)
    echo "$f ($(($(date +%s) - t0)) s, exit $rc): $line" | tee -a "$OUT/summary.log"
    grep -E "^(FAILED|ERROR) " "$OUT/file.log" >>"$OUT/summary.log"
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || tests_rc=1  # 5: nothing collected
  done
  echo "NOT RUN: ${rest[*]:-none}" | tee -a "$OUT/summary.log"
}
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== tests"
  if [ -n "${TESTS_BUDGET_S:-}" ]; then
    : >"$OUT/tests.log"
    test_files "$@"
  else
    # From tests/ so that `import jaxkv` is the installed package, not the source folder.
    # every test, the long runs too (a -m in the arguments comes later and wins)
    (as_user; cd tests && JAXKV_REQUIRE_GPU=1 limited python3 -m pytest -q -rs -p no:cacheprovider -m "long or not long" "$@" 2>&1) | tee "$OUT/tests.log"
    tests_rc=${PIPESTATUS[0]}
    grep -E "^(FAILED|ERROR) |^=* ?[0-9]+ (passed|failed)" "$OUT/tests.log" >>"$OUT/summary.log"
  fi
  # The wgmma prefill's persistent blocks each take several items only where the items outnumber
  # the multiprocessors, which the tests' small problems do not: their prefill tests again on
  # PREFILL_BLOCKS blocks (default 3; 0: not run).
  if [ "${PREFILL_BLOCKS:-3}" != 0 ]; then
    (as_user; cd tests && JAXKV_PREFILL_BLOCKS=${PREFILL_BLOCKS:-3} JAXKV_REQUIRE_GPU=1 limited python3 -m pytest \
      -q -rs -p no:cacheprovider -n 8 -k prefill test_attention.py test_hybrid_attention.py \
      test_quantized.py test_windowed_prefix.py test_ring_cache.py 2>&1) >"$OUT/tests_blocks.log" || tests_rc=1
    echo "prefill tests on ${PREFILL_BLOCKS:-3} blocks: $(grep -E "^=* ?[0-9]+ (passed|failed)" "$OUT/tests_blocks.log" | tail -1)" \
      | tee -a "$OUT/summary.log"
    grep -E "^(FAILED|ERROR) " "$OUT/tests_blocks.log" >>"$OUT/summary.log"
  fi
  # The quantizing kernels' scale quotient against the division, for every float (seconds).
  command -v nvcc >/dev/null || export PATH="$PATH:/usr/local/cuda/bin"
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
  if nvcc -O3 -std=c++17 -arch="sm_$cap" -Iffi/cuda tools/scale_quotient_check.cu \
      -o /tmp/scale_quotient_check >"$OUT/scale_quotient.log" 2>&1; then
    /tmp/scale_quotient_check >>"$OUT/scale_quotient.log" 2>&1 || tests_rc=1
  else
    tests_rc=1
  fi
  tail -1 "$OUT/scale_quotient.log" | tee -a "$OUT/summary.log"
fi

# compute-sanitizer over the kernel tests. Every buffer its own cudaMalloc (the platform
# allocator, no preallocated pool), so an access past a buffer leaves its allocation and memcheck
# sees it; no command buffers, so every launch is a plain launch the tool instruments. Fails on any
# finding: --error-exitcode, and the summary line must read 0.
# One compute-sanitizer process over the test ids given, its output appended to LOG; clean: exit 0
# and its own summary line reads 0 (counted in `runs_clean`). Sets `run_exit` and `run_summary`.
sanitize_run() {  # sanitize_run TOOL LOG ids...
  local tool=$1 log=$2; shift 2
  local part="$log.part"
  # JAXKV_PREFILL_BLOCKS: the wgmma prefill's blocks each take several items (as the second test
  # run; 0: one a multiprocessor).
  (cd tests && JAXKV_PREFILL_BLOCKS=${PREFILL_BLOCKS:-3} XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0 --xla_force_host_platform_device_count=8" \
    JAXKV_REQUIRE_GPU=1 compute-sanitizer --tool "$tool" --error-exitcode 99 \
    --kernel-regex kns=jaxkv ${SANITIZER_ARGS:-} \
    python3 -m pytest -q -p no:cacheprovider "$@" 2>&1) >"$part"
  run_exit=$?
  cat "$part" >>"$log"
  run_summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$part" | tail -1)
  rm -f "$part"
  [ "$run_exit" -eq 0 ] && echo "$run_summary" | grep -qE "SUMMARY: 0 (errors|hazards)" || return 1
  runs_clean=$((runs_clean + 1))
}
sanitize() {  # sanitize TOOL LOG pytest-args...
  # Batches of $SANITIZE_BATCH tests (memcheck 8, racecheck 4), one sanitizer process each: compute-sanitizer itself
  # segfaults after a few dozen of jax's tests in one process (seen on the H200 with memcheck over
  # test_attention.py and test_reuse.py; every test passes with 0 errors in a smaller batch), and
  # now and then in a batch of 4-8 (exit 139): such a batch runs again a test at a time, and is
  # clean when each of them is.
  # Only jaxkv's kernels are instrumented (--kernel-regex): XLA's own kernels are not ours to check.
  local tool=$1 log=$2; shift 2
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not found (PATH=$PATH)"; return 1
  fi
  echo "== compute-sanitizer --tool $tool: $*"
  : >"$log"
  local ids rc=0 batch=${SANITIZE_BATCH:-8} crashed=0
  runs_clean=0
  [ "$tool" = racecheck ] && batch=${SANITIZE_BATCH:-4}  # heavier: 8 still crashed once
  mapfile -t ids < <(cd tests && python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null \
    | grep "::" | sed 's#^tests/##')  # ids relative to the rootdir; the batches run in tests/
  local i id clean
  for ((i = 0; i < ${#ids[@]}; i += batch)); do
    sanitize_run "$tool" "$log" "${ids[@]:i:batch}" && continue
    if [ "$run_exit" -eq 139 ] && [ "$batch" -gt 1 ]; then  # the sanitizer's own crash
      echo "batch $((i / batch)): exit 139 (${run_summary:-no summary line}); again a test at a time"
      crashed=$((crashed + 1)) clean=1
      for id in "${ids[@]:i:batch}"; do
        sanitize_run "$tool" "$log" "$id" \
          || { echo "  $id: exit $run_exit; ${run_summary:-no summary line}"; clean=0; }
      done
      [ "$clean" -eq 1 ] && continue
    else
      echo "batch $((i / batch)): exit $run_exit; ${run_summary:-no summary line}: ${ids[*]:i:batch}"
    fi
    rc=1
  done
  echo "compute-sanitizer $tool: ${#ids[@]} tests in batches of $batch ($crashed crashed, rerun a test at a time); $runs_clean clean runs; $(grep -hE "^[0-9]+ passed" "$log" | awk '{s += $1} END {print s + 0}') passed" \
    | tee -a "$OUT/summary.log"
  [ "${#ids[@]}" -gt 0 ] && [ "$rc" -eq 0 ]
}
sanitize_rc=0
if [ -z "${SKIP_SANITIZE:-}" ]; then
  command -v compute-sanitizer >/dev/null || export PATH="$PATH:/usr/local/cuda/bin"
  # memcheck: every kernel (the hostile inputs of the property tests included); racecheck: the
  # kernels with shared memory, compaction (its move schedule) through every caller and attention
  # (the cp.async ring, the merge of the warps, the tensor-core prefill), the 8-bit decode over
  # every cache kind and both scalings (test_quantized's long rows), the 8-bit wgmma prefill's
  # shared scales (its V scales growing along a row).
  # shellcheck disable=SC2086  # word splitting of the lists is intended
  sanitize memcheck "$OUT/memcheck.log" ${MEMCHECK:-test_compact.py test_linear.py \
    test_manager.py test_reuse.py test_paged_ops.py test_paged.py test_bad_input.py \
    test_properties.py test_attention.py test_host_transfer.py test_quantized.py} || sanitize_rc=1
  # shellcheck disable=SC2086
  sanitize racecheck "$OUT/racecheck.log" ${RACECHECK:-test_attention.py test_compact.py \
    test_quantized.py::test_attention_over_long_rows_head_dims_and_groups \
    test_quantized.py::test_prefill_with_v_scales_growing_along_the_row \
    test_linear.py test_manager.py} -k "${RACECHECK_SELECT:-compact or evict or attention or decode or prefill}" \
    || sanitize_rc=1
fi

# The long soak: 10,000 random steps per cache kind against a host-side model.
soak_rc=0
if [ -z "${SKIP_SOAK:-}" ]; then
  echo "== soak"
  (soak="$PWD/tools/soak.py"; cd /tmp && python3 "$soak" --steps 10000 --check-every 100 2>&1) \
    | tee "$OUT/soak.log"
  soak_rc=${PIPESTATUS[0]}
fi

if [ -z "${SKIP_BENCH:-}" ] && (cd /tmp && python3 -c "import jaxkv.bench" 2>/dev/null); then
  echo "== benchmarks"
  if [ -n "$warm_pid" ]; then wait "$warm_pid"; cat "$OUT/flashinfer_warm.log"; fi
  explain="$PWD/benchmarks/explanations.json"  # measured reasons for rows that miss a target
  ops=(); for op in ${BENCH_OPS:-}; do ops+=(--op "$op"); done
  if [ "${BENCH_OPS:-}" != none ]; then  # BENCH_OPS=none: only the host tier's benchmark
    (cd /tmp && limited python3 -m jaxkv.bench "${ops[@]}" --json "$OUT/bench.json" \
      --markdown "$OUT/bench.md" --explain "$explain" --peers ${BENCH_ARGS:-} 2>&1) \
      | tee "$OUT/bench.log"
  fi
  # The host tier: swap_out / swap_in of 2 GiB against the pinned copy bandwidth of the same run
  # (not where BENCH_OPS names other ops).
  if [ -z "${BENCH_OPS:-}" ] || [ "$BENCH_OPS" = none ]; then
    (cd /tmp && limited python3 -m jaxkv.bench --swap --json "$OUT/bench_swap.json" 2>&1) \
      | tee "$OUT/bench_swap.log"
  fi
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
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # sharded over 2 GPUs: KV heads, then the batch
      for axes in tp=2 dp=2; do
        (cd /tmp && python3 -m jaxkv demo --cache paged --mesh "$axes" --baseline xla 2>&1)
      done
    fi
    # One jitted step per Python call: the dispatch cost a step pays, jaxkv vs XLA.
    (tool="$PWD/tools/evict_call_cost.py"; cd /tmp && python3 "$tool" 2>&1)
  } | tee "$OUT/demo.log"
fi
if [ -z "${SKIP_SERVE:-}" ]; then
  {
    if [ -z "${SKIP_SERVE_8B:-}" ]; then
      echo "== serve: prefix caching on and off (8B, chat stream), the index's cost at 8B sizes"
      (tool="$PWD/tools/prefix_cost.py"; cd /tmp && python3 "$tool" 2>&1)
      (cd /tmp && python3 -m jaxkv serve --preset 8b --stream "${SERVE_STREAM:-chat}" \
        --engines paged --prefix-cache ${SERVE_ARGS:-} --json "$OUT/serving-8b-${SERVE_STREAM:-chat}.json" 2>&1)
    fi
    # SERVE_HYBRID="gemma3-12b ...": models with sliding windows, window pages released against
    # every layer's tokens kept (SERVE_HYBRID_ARGS: more options, e.g. the 8-bit engines).
    for preset in ${SERVE_HYBRID:-}; do
      echo "== serve: $preset, KV per sequence and the engines with and without window pages"
      (tool="$PWD/tools/hybrid_pages.py"; cd /tmp && limited python3 "$tool" --preset "$preset" \
        --json "$OUT/pages-$preset.json" 2>&1)
      (cd /tmp && limited python3 -m jaxkv serve --preset "$preset" ${SERVE_HYBRID_ARGS:-} \
        --json "$OUT/serving-$preset.json" 2>&1)
    done
  } | tee "$OUT/serve.log"
fi
# The device tool brings back at most 8 files of $OUT: every log goes into logs.tgz, and only the
# files read most stay beside it (a call of 2026-11-26 lost its test log among 16 files).
keep="summary.log tests.log bench.md bench.json bench.log serve.log"
# (tar's status is not waited on: a log still being written, such as a caller's redirection into
# $OUT, makes it exit 1 though the archive is complete.)
(cd "$OUT" && { tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null; true; } && for f in *; do
  case " $keep logs.tgz " in *" $f "*) ;; *) rm -rf -- "$f" ;; esac
done)
# The lines that decide the call again, last, so that the tail of a long run still shows them.
echo "== summary ($(date -u '+%Y-%m-%d %H:%M UTC'))"
cat "$OUT/summary.log" 2>/dev/null
echo "gpu_check: tests exit $tests_rc, sanitizers $sanitize_rc, soak $soak_rc"
[ "$tests_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ] && [ "$soak_rc" -eq 0 ]
