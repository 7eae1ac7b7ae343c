#!/bin/bash
# mpi_train_scaling.sh: ds_mini tokens/s on 1, 2 and 4 ranks, data parallel and expert parallel, side by side
# in one run. All ranks share this machine's cores (2 on the project's machines): one process gets
# every core (OpenMP), under mpirun each rank gets cores / ranks threads (at least 1). So the figures
# measure the parallel runtime's overhead on a fixed machine, not a speed-up: ideal is the 1-rank figure.
# Same model, same global batch (16 sequences of 256), micro-batch 4, synthetic data, STEPS steps.
#
#   bench/mpi_train_scaling.sh            # after the build; prints a markdown table
#   STEPS=6 LAYOUTS="1:dp 2:dp 2:ep2 4:dp 4:ep4" bench/mpi_train_scaling.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moetron}
STEPS=${STEPS:-6}
LAYOUTS=${LAYOUTS:-"1:dp 2:dp 2:ep2 4:dp 4:ep2 4:ep4"}
CORES=$(nproc)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=$(mktemp -d /tmp/mt_scaling_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
COMMON=(configs/ds_mini.toml --training.dataset=synthetic --training.steps="$STEPS" --training.micro_batch_size=4
        --training.global_batch_size=16 --checkpoint.enable=false --training.val_interval=0 --metrics.log_interval=1000)
echo "| ranks | layout | threads/rank | tokens/s | vs 1 rank | EP s/step | peak mem/rank |"
echo "|---|---|---|---|---|---|---|"
base=""
for L in $LAYOUTS; do
  np=${L%%:*}; kind=${L#*:}
  thr=$(( CORES / np )); (( thr >= 1 )) || thr=1
  args=("${COMMON[@]}" --job.dump_folder="$OUT/$L" --parallelism.dp_shard="$np")
  [[ $kind == ep* ]] && args+=(--parallelism.ep="${kind#ep}")
  if [[ $np == 1 ]]; then
    OMP_NUM_THREADS=$thr "$BIN" train "${args[@]}" > "$OUT/log" 2>&1
  else
    mpirun -np "$np" --oversubscribe --bind-to none -x OMP_NUM_THREADS="$thr" "$BIN" train "${args[@]}" > "$OUT/log" 2>&1
  fi
  tps=$(grep -o 'summary:.*' "$OUT/log" | sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
  mem=$(grep -o 'memory peak [0-9.]* [GM]iB' "$OUT/log" | head -1 | sed 's/memory peak //')
  ep=$(grep -o 'EP ([^)]*): [0-9.]* s' "$OUT/log" | sed -E 's/.*: ([0-9.]+) s/\1/' || true)
  [[ -n $ep ]] && ep=$(awk -v e="$ep" -v s="$STEPS" 'BEGIN{printf "%.2f", e/s}') || ep="-"
  [[ -n $base ]] || base=$tps
  ratio=$(awk -v a="$tps" -v b="$base" 'BEGIN{printf "%.2f", a/b}')
  echo "| $np | $kind | $thr | $tps | $ratio | $ep | $mem |"
done
