#!/usr/bin/env bash
# test.sh: set up (packages + build), then run the whole test suite with CTest.
# The last lines are CTest's summary ("N% tests passed, N tests failed out of N").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Two tests run at once, each with two OpenMP threads, on two cores: OpenMP threads that spin while they wait
# would take the cycles the other test needs (one FP8 test took 8-111 s instead of 1 s that way), so waiting
# threads sleep. Timings belong to bench/, not here.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j 2 "$@"
