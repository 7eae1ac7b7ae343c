#!/usr/bin/env bash
# run.sh: set up (packages + build), then run moetron's main job on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${BUILD_DIR:-build}"/moetron selfcheck "$@"
