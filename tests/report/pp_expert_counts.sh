#!/bin/sh
# pp_expert_counts.sh: under pipeline parallelism rank 0 holds only its stages' MoE layers; the metrics.jsonl
# record gathers every stage's expert counts (src/train/train_report.cpp). A 2-stage ds_tiny run must log the
# same per-layer counts, for every MoE layer, as the single-process run.
# Usage: pp_expert_counts.sh MOETRON CONFIG WORKDIR MPIEXEC
set -eu
bin=$1 cfg=$2 work=$3 mpiexec=$4
rm -rf "$work"
common="--training.steps=2 --metrics.log_interval=1 --metrics.peak_tflops=1"
OMP_NUM_THREADS=1 "$bin" train "$cfg" $common --job.dump_folder="$work/one" >/dev/null
OMP_NUM_THREADS=1 "$mpiexec" -np 2 --oversubscribe --bind-to none "$bin" train "$cfg" $common \
  --parallelism.pp=2 --job.dump_folder="$work/pp2" >/dev/null
python3 - "$work/one/metrics.jsonl" "$work/pp2/metrics.jsonl" <<'PY'
import json, sys
one, pp = ([json.loads(l)["expert_counts"] for l in open(p) if l.strip()] for p in sys.argv[1:3])
if len(one) != 2 or one != pp:
    sys.exit(f"FAIL: expert_counts differ:\n  single {one}\n  pp=2   {pp}")
print(f"PASS: pp=2 logs the counts of layers {pp[0]['layers']}, equal to the single-process run")
PY
