#!/usr/bin/env bash
# gpu_debs.sh: fetch (here, with apt-get download; nothing is installed) the Debian packages that the GPU-only build
# of scripts/gpu_check.sh needs and the device machine's image lacks: oneDNN, toml++, nlohmann-json, CLI11,
# GoogleTest/GoogleMock, sentencepiece, and the OpenCL loader oneDNN links. About 9 MiB, into .gpu_debs/ (ignored
# by git); a device call names `.gpu_debs` in carry and gpu_check.sh unpacks them with dpkg -x into /tmp/mtdeps.
# MPI is not among them: the GPU build is configured with MOETRON_WITH_MPI=OFF (one process, one GPU).
# Usage: scripts/gpu_debs.sh    (in the checkout whose working tree the device call sends)
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(libdnnl2 libdnnl-dev ocl-icd-libopencl1 libtomlplusplus3 libtomlplusplus-dev nlohmann-json3-dev libcli11-dev
      libgtest-dev libgmock-dev libsentencepiece0 libsentencepiece-dev)
mkdir -p .gpu_debs
cd .gpu_debs
rm -f ./*.deb
apt-get download "${PKGS[@]}" >/dev/null
ls -la ./*.deb | awk '{s += $5; print $5, $9} END {printf "gpu_debs: %.1f MiB in .gpu_debs/\n", s / 1048576}'
