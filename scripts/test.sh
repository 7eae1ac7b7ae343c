#!/usr/bin/env bash
# test.sh: set up (packages + build), then run the whole test suite with CTest.
# The last lines are CTest's summary ("N% tests passed, N tests failed out of N").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j 2 "$@"
