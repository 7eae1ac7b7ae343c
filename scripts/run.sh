#!/usr/bin/env bash
# run.sh: set up (packages + build), then run moetron's main job on its embedded default: train the
# ds_mini MoE (configs/ds_mini.toml) on the Brown corpus (prepared on first use), with progress and a
# final summary. Each run gets a fresh dump folder under runs/; extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${BUILD_DIR:-build}"/moetron train configs/ds_mini.toml --job.dump_folder="runs/ds_mini-$(date +%Y%m%d-%H%M%S)" "$@"
