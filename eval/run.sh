#!/usr/bin/env bash
# Selection-quality evaluation (issue 8): eval/run.sh [--quick] --out=DIR
# Builds libeps_eval (the shipped core/ behind a C ABI) if needed and runs eps_eval.run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${EPS_BUILD_DIR:-$root/build}"
if [[ ! -x "$root/.venv/bin/python3" ]]; then bash "$root/scripts/setup.sh"; fi
# Configured with the project's defaults where no build exists (only eps_eval is built): a
# cached EPS_WITH_CUDA=OFF would turn the GPU targets off for every later scripts/build.sh.
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DEPS_BUILD_TESTS=OFF -DEPS_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$build" -j2 --target eps_eval >/dev/null
export EPS_EVAL_LIB="$build/eval/libeps_eval.so"
cd "$root/eval"
exec "$root/.venv/bin/python3" -m eps_eval.run "$@"
