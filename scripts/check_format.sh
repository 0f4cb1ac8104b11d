#!/usr/bin/env bash
# Fails when a tracked C, C++ or CUDA file is not formatted as .clang-format says
# (clang-format 14, Debian bookworm's). CI runs it as the clang_format test.
#   scripts/check_format.sh          check, listing each file that differs
#   scripts/check_format.sh --fix    format every file in place
# Files listed in scripts/format_pending.txt are skipped (and named): files that
# other branches were rewriting when the check came in; formatting them there
# would only have made merge conflicts. Once merged, run --fix and empty the list.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-$(command -v clang-format-14 || command -v clang-format || true)}
if [[ -z $CLANG_FORMAT ]] || ! command -v "$CLANG_FORMAT" >/dev/null; then
  echo "check_format.sh: cannot run clang-format (CLANG_FORMAT=${CLANG_FORMAT:-unset}): want" \
    "clang-format-14 on PATH, as scripts/setup.sh installs it, or CLANG_FORMAT naming it" >&2
  exit 1
fi
mapfile -t files < <(git ls-files -- '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' '*.cu' '*.cuh')
if [[ ${1:-} == --fix ]]; then
  "$CLANG_FORMAT" -i "${files[@]}"
  exit 0
fi
pending=()
if [[ -f scripts/format_pending.txt ]]; then
  mapfile -t pending < <(grep -v '^#' scripts/format_pending.txt | grep -v '^$')
fi
is_pending() {
  local p
  for p in "${pending[@]}"; do [[ $p == "$1" ]] && return 0; done
  return 1
}
bad=0
skipped=0
for f in "${files[@]}"; do
  if is_pending "$f"; then
    skipped=$((skipped + 1))
    continue
  fi
  if ! "$CLANG_FORMAT" --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: $f (scripts/check_format.sh --fix)"
    bad=1
  fi
done
echo "clang-format: $((${#files[@]} - skipped)) files checked, $skipped pending" \
  "(scripts/format_pending.txt), with $("$CLANG_FORMAT" --version)"
exit $bad
