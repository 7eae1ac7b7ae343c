#!/usr/bin/env bash
# setup_cuda.sh: OPTIONAL set-up for compiling moetron's CUDA backend (-DMOETRON_CUDA=ON) on a Debian 12
# (bookworm) machine without a GPU. It enables Debian's non-free component in a sources file of its own
# (/etc/apt/sources.list.d/moetron-nonfree.sources; the system's own sources are not edited) and installs
# `nvidia-cuda-toolkit` (CUDA 11.8: nvcc, cudart, cuBLAS/cuBLASLt headers and libraries).
# It is NOT part of the default set-up: scripts/setup.sh, scripts/test.sh and CI stay CPU-only; CI compiles the
# CUDA sources only where an nvcc is already on the machine (scripts/test.sh, MOETRON_CUDA=auto).
# It installs no GPU driver (no runtime use is possible here) and is idempotent.
# Usage: scripts/setup_cuda.sh        (as root or with sudo; ~2 GB download)
set -euo pipefail
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
. /etc/os-release
if [[ "${VERSION_CODENAME:-}" != bookworm ]]; then
  echo "setup_cuda: this script knows Debian 12 (bookworm); found '${PRETTY_NAME:-unknown}'" >&2
  exit 2
fi
SRC=/etc/apt/sources.list.d/moetron-nonfree.sources
# g++-11: the newest GCC that nvcc 11.8 accepts as host compiler; Debian's nvcc wrapper looks for it first (else
# clang-14..., whichever apt picked to satisfy the package's alternatives).
PKGS=(nvidia-cuda-toolkit g++-11)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ ! -f $SRC ]]; then
    echo "setup_cuda: adding $SRC (Debian bookworm contrib + non-free)"
    $SUDO tee "$SRC" >/dev/null <<'SOURCES'
# moetron: Debian's contrib/non-free components, for nvidia-cuda-toolkit (scripts/setup_cuda.sh).
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  fi
  echo "setup_cuda: installing ${missing[*]} (large download)"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's nvcc 11.8 is /usr/bin/nvcc; it drives a host compiler it supports (gcc <= 11) through its own
# nvcc.profile. Another nvcc earlier on PATH (e.g. /usr/local/cuda) wins in scripts/test.sh; to build with this
# one: cmake -DMOETRON_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/bin/nvcc ...
/usr/bin/nvcc --version | tail -n 2
