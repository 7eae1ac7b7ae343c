#!/usr/bin/env bash
# pp_bubble.sh: the measured pipeline bubble per rank against the timed simulator fed the run's own op
# durations (issue: within 5 points absolute at pp 4). Trains ds_mini under mpirun with pp = 4 (4 ranks,
# oversubscribed on this machine's cores: ranks share cores, so the ratio is what is compared, not a
# speed-up), profiled so every step after the first is recorded, for 1f1b and interleaved_1f1b, then prints
# `moetron schedule compare --run` for each and writes the measured pictures next to the records.
# Usage: bench/pp_bubble.sh [extra train overrides...]   (MOETRON=path/to/moetron, OUT=folder, STEPS=n)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
moetron=${MOETRON:-$root/build/moetron}
out=${OUT:-/tmp/moetron_pp_bubble}
steps=${STEPS:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$out"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) cores)"
for sch in 1f1b interleaved_1f1b; do
  dir="$out/$sch"
  rm -rf "$dir"
  mpirun -np 4 --oversubscribe --bind-to none "$moetron" train "$root/configs/ds_mini.toml" \
    --job.dump_folder="$dir" --training.steps="$steps" --training.dataset=synthetic --training.val_interval=0 \
    --training.global_batch_size=16 --training.micro_batch_size=2 --parallelism.pp=4 \
    --parallelism.pp_schedule="$sch" --profile "$@" >"$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  echo "== $sch (ds_mini, pp 4, 8 micro-batches of 2 x 256 tokens, $steps steps, steps 2..$steps recorded)"
  "$moetron" schedule compare --run "$dir"
  "$moetron" viz pipeline --run "$dir" --out "$dir/measured.html" | head -1
done
