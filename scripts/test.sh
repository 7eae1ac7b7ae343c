#!/usr/bin/env bash
# test.sh: set up (packages + build), then run the whole test suite with CTest.
# The last lines are CTest's summary ("N% tests passed, N tests failed out of N").
set -euo pipefail
cd "$(dirname "$0")/.."
# The CUDA backend is compiled whenever an nvcc is on PATH (no GPU needed), so a break in the CUDA sources shows
# in CI; its GPU tests then report "no CUDA device" (docs/gpu.md). MOETRON_CUDA=OFF (or ON) overrides. CMake is
# given that same nvcc (CUDACXX), so its ptxas and headers are the ones PATH resolves.
if [[ -z "${MOETRON_CUDA:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1; then MOETRON_CUDA=ON; else MOETRON_CUDA=OFF; fi
fi
if [[ $MOETRON_CUDA == ON && -z "${CUDACXX:-}" ]] && command -v nvcc >/dev/null 2>&1; then
  export CUDACXX=$(command -v nvcc)
fi
echo "test: MOETRON_CUDA=$MOETRON_CUDA (nvcc: $(command -v nvcc || echo none))"
export MOETRON_CUDA
scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Two tests run at once, each with two OpenMP threads, on two cores: OpenMP threads that spin while they wait
# would take the cycles the other test needs (one FP8 test took 8-111 s instead of 1 s that way), so waiting
# threads sleep. Timings belong to bench/, not here.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j 2 "$@"
