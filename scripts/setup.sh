#!/usr/bin/env bash
# Installs everything a fresh Debian bookworm machine needs to build and test epsd.
# Idempotent: skips apt-get when every package is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev prometheus-cpp-dev nlohmann-json3-dev clang-format-14
  libssl-dev zlib1g-dev python3 python3-pip python3-venv
  prometheus  # promtool, which checks a real /metrics scrape in tests/service/observability_test.py
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Python tools for the tests, in a venv of the repository's own (.venv), from PyPI.
# Re-installs only when scripts/requirements-ci.txt changed.
VENV=${EPS_VENV:-.venv}
REQ=scripts/requirements-ci.txt
stamp="$VENV/.requirements.sha256"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [[ ! -x "$VENV/bin/python3" ]]; then
  python3 -m venv "$VENV"
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "setup: pip install -r $REQ into $VENV"
  "$VENV/bin/python3" -m pip install -q --disable-pip-version-check -r "$REQ"
  echo "$want" >"$stamp"
fi
# The eps-client package's dependencies as wheels, for the check that installs the package
# into a fresh venv and runs its example offline (client/python/tools/fresh_venv_example.py).
WHEELS="$VENV/wheelhouse"
if [[ ! -f "$WHEELS/.stamp" || "$(cat "$WHEELS/.stamp")" != "$want" ]]; then
  echo "setup: pip download the client's dependencies into $WHEELS"
  mkdir -p "$WHEELS"
  "$VENV/bin/python3" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    -d "$WHEELS" $(grep -E '^(grpcio|protobuf|numpy)==' "$REQ")
  echo "$want" >"$WHEELS/.stamp"
fi
echo "setup: done"
