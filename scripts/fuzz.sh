#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) into build-fuzz/ and fuzzes
# Attach and SelectPages validation, starting from tests/fuzz/corpus.
#   scripts/fuzz.sh                  # 5 s per target (what CI runs)
#   scripts/fuzz.sh 3600             # an hour per target
#   EPS_FUZZ_RUNS=1000000 scripts/fuzz.sh 0   # 10^6 executions per target, no time limit
# A crash leaves its reproducer as build-fuzz/fuzz-<target>/crash-*, and the
# script fails. Replay one: build-fuzz/tests/fuzz/<target>_fuzz <file>.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-5}
RUNS=${EPS_FUZZ_RUNS:--1}
# libFuzzer reads its flags with atoi: "1h" would be 1 second and "abc" 0, no limit at all.
if [[ $# -gt 1 || ! $SECONDS_PER_TARGET =~ ^[0-9]+$ ]]; then
  echo "fuzz.sh: want one argument, whole seconds per target (5, 3600, 0 for no limit);" \
    "got: $*" >&2
  exit 2
fi
if [[ ! $RUNS =~ ^(-1|[0-9]+)$ ]]; then
  echo "fuzz.sh: EPS_FUZZ_RUNS=$RUNS: want a count of executions, or -1 for no limit" >&2
  exit 2
fi
BUILD_DIR=${EPS_FUZZ_BUILD_DIR:-build-fuzz}
CLANG=${EPS_CLANG:-clang-14}
CLANGXX=${EPS_CLANGXX:-clang++-14}

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER="$CLANG" -DCMAKE_CXX_COMPILER="$CLANGXX" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPS_FUZZ=ON -DEPS_WITH_CUDA=OFF -DEPS_BUILD_TESTS=ON \
  -DEPS_BUILD_BENCH=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target attach_fuzz select_pages_fuzz

status=0
for target in attach select_pages; do
  # New inputs go to a scratch corpus; the committed seeds stay as they are.
  work="$BUILD_DIR/fuzz-$target"
  mkdir -p "$work/corpus"
  args=(-max_total_time="$SECONDS_PER_TARGET" -runs="$RUNS" -rss_limit_mb=2048
        -malloc_limit_mb=1024 -timeout=10 -print_final_stats=1 -artifact_prefix="$work/")
  if [[ "$SECONDS_PER_TARGET" == 0 ]]; then args[0]=-max_total_time=0; fi
  echo "fuzz: $target ${args[*]}"
  if ! ASAN_OPTIONS=detect_leaks=1 "$BUILD_DIR/tests/fuzz/${target}_fuzz" "${args[@]}" \
      "$work/corpus" "tests/fuzz/corpus/$target" 2>"$work/log"; then
    status=1
    tail -n 60 "$work/log"
  fi
  grep -E "^stat::|Done [0-9]+ runs" "$work/log" || true
done
exit $status
