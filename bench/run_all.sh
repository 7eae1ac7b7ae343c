#!/usr/bin/env bash
# run_all.sh: every benchmark, one after the other, on an otherwise idle machine. Each Google Benchmark
# executable first measures this machine's limits (bf16 matmul, memcpy) in the same process, so its ratios
# are same-run ratios. Output: one file per benchmark in OUT (default bench-results/).
# Usage: bench/run_all.sh [OUT]      (env: BUILD=build, MIN_TIME=0.3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$root/build}
out=${1:-$root/bench-results}
mt=${MIN_TIME:-0.3}
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for b in bench_gemm bench_grouped_gemm bench_attention bench_elementwise bench_router bench_loss bench_optim_fp8; do
  echo "== $b (load $(cut -d' ' -f1 /proc/loadavg))"
  "$build/bench/$b" --benchmark_min_time="$mt" | tee "$out/$b.txt"
done
if [ -x "$build/bench/mpi_bench_dispatch" ]; then
  echo "== mpi_bench_dispatch (4 ranks, 1 thread each, on $(nproc) cores)"
  OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun --oversubscribe -np 4 "$build/bench/mpi_bench_dispatch" | tee "$out/mpi_bench_dispatch.txt"
fi
echo "== train_vs_torch"
MOETRON="$build/moetron" ROUNDS=${ROUNDS:-2} "$root/bench/train_vs_torch.sh" | tee "$out/train_vs_torch.txt"
