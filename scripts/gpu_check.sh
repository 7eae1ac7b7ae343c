#!/usr/bin/env bash
# gpu_check.sh: issue 32's device check, for the minutes when an H100/H200 machine is lent (CUDA 13, cuBLAS, CMake,
# ninja, PyTorch; no apt, no network). In one call, under 8 minutes: a GPU-only build (MOETRON_CUDA=ON, no MPI, no
# benchmarks; the Debian libraries the image lacks come as .deb files unpacked with dpkg -x into /tmp/mtdeps, never
# /), the CUDA op tests (op_harness --device cuda, test and grad modes per family, perf mode with every case's
# time in the table), the micro-benchmark (bench/cuda_bench.cpp)
# and the PyTorch proxy (bench/torch_gpu_proxy.py, eager and torch.compile). Logs go to $OUT (the device tool brings
# them back); a short table is printed last. Not a training check: the trainer does not run on the GPU yet.
# Before the call, here:   scripts/gpu_debs.sh            (fills .gpu_debs/, ~9 MiB)
# The call (device tool):  run(command="bash scripts/gpu_check.sh", carry=[".gpu_debs"], timeout_s=560)
# Env: GPU_CHECK_JOBS (build jobs, default nproc), GPU_CHECK_SKIP_TORCH=1, GPU_CHECK_ARCH (default 90).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
declare -a ROWS
row() { ROWS+=("$(printf '%-38s %s' "$1" "$2")"); }
say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
left() { echo $((470 - ($(date +%s) - T0))); }  # seconds left of the 8-minute budget, with a margin

say "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  command -v nvcc && nvcc --version | tail -n 1; cmake --version | head -n 1; ninja --version
  command -v g++ && g++ --version | head -n 1; nproc; python3 -c "import torch; print('torch', torch.__version__)"
} 2>&1 | tee -a "$LOG"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
row "device" "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"

say "dependencies: dpkg -x .gpu_debs/*.deb -> /tmp/mtdeps"
DEPS=/tmp/mtdeps
mkdir -p $DEPS
n=0
for f in .gpu_debs/*.deb; do [[ -f $f ]] && dpkg -x "$f" $DEPS && n=$((n + 1)); done
say "$n packages unpacked"
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

say "configure + build (op_harness, cuda_bench)"
BUILD=build-gpu
B0=$(date +%s)
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOETRON_CUDA=ON -DMOETRON_CUDA_ARCHS="${GPU_CHECK_ARCH:-90}" \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DMOETRON_WITH_MPI=OFF -DMOETRON_BUILD_BENCH=OFF -DMOETRON_ISA_CAP_TESTS=OFF \
  -DCMAKE_PREFIX_PATH=$DEPS/usr -DCMAKE_CXX_FLAGS="-isystem $DEPS/usr/include" >"$OUT/configure.log" 2>&1
cfg=$?
grep -E "moetron: CUDA" "$OUT/configure.log" | tee -a "$LOG"
build=1
if [[ $cfg -eq 0 ]]; then
  timeout $(($(left) - 200)) cmake --build $BUILD -j "${GPU_CHECK_JOBS:-$(nproc)}" --target cuda_bench op_harness \
    >"$OUT/build.log" 2>&1
  build=$?
fi
row "build (s)" "$(( $(date +%s) - B0 )) configure rc=$cfg build rc=$build"
if [[ $cfg -ne 0 || $build -ne 0 ]]; then
  say "BUILD FAILED"; tail -n 40 "$OUT/configure.log" "$OUT/build.log" 2>/dev/null | tee -a "$LOG"
fi

if [[ -x $BUILD/tests/op_harness ]]; then
  # One process per family in test and grad modes (a device fault in one family cannot take the others' results
  # with it) with MOETRON_CUDA_SYNC=1 (a fault is reported at its kernel); every CUDA case runs, the new families
  # (router, permute, loss, attention, fp8) included. Failures get a row each.
  FAMS=$($BUILD/tests/op_harness --device cuda --list 2>/dev/null | grep -E '^[a-z0-9_]+/' | cut -d/ -f1 | sort -u | tr '\n' ' ')
  say "families: $FAMS"
  for mode in test grad; do
    say "op_harness --device cuda --mode $mode (per family), $(left) s left"
    : >"$OUT/ops_$mode.log"
    np=0 nf=0
    for fam in $FAMS; do
      budget=$(( $(left) - 150 )); (( budget > 60 )) && budget=60
      if (( budget < 10 )); then say "  $fam: skipped (time)"; row "ops $mode $fam" "SKIPPED (time)"; continue; fi
      MOETRON_CUDA_SYNC=1 timeout $budget $BUILD/tests/op_harness --device cuda --mode $mode --family "$fam" \
        >"$OUT/ops_${mode}_$fam.log" 2>&1
      rc=$?
      cat "$OUT/ops_${mode}_$fam.log" >>"$OUT/ops_$mode.log"
      p=$(grep -c '^PASS' "$OUT/ops_${mode}_$fam.log"); f=$(grep -c '^FAIL' "$OUT/ops_${mode}_$fam.log")
      np=$((np + p)); nf=$((nf + f))
      grep -E "^(FAIL|    FAIL|    error)|seed=" "$OUT/ops_${mode}_$fam.log" | tee -a "$LOG"
      [[ $rc -ne 0 ]] && row "ops $mode $fam" "rc=$rc pass=$p fail=$f"
      while read -r _ cname _; do row "  FAIL $mode" "$cname"; done < <(grep '^FAIL' "$OUT/ops_${mode}_$fam.log")
    done
    row "ops $mode" "$np passed, $nf failed"
  done
  budget=$(( $(left) - 60 )); (( budget > 150 )) && budget=150
  if (( budget >= 20 )); then
    say "op_harness --device cuda --mode perf, $budget s"
    timeout $budget $BUILD/tests/op_harness --device cuda --mode perf >"$OUT/ops_perf.log" 2>&1
    row "ops perf" "rc=$?"
    grep -E "PERF|error" "$OUT/ops_perf.log" | tee -a "$LOG"
    # every case's time in the table: name, median ms, GFLOPS or GB/s
    while read -r _ cname ms _ rest; do row "perf $cname" "$ms ms ${rest}"; done < <(grep '^PERF' "$OUT/ops_perf.log")
  else
    row "ops perf" "SKIPPED (time)"
  fi
fi

if [[ -x $BUILD/cuda_bench ]]; then
  say "cuda_bench, $(left) s left"
  budget=$(( $(left) - 70 )); (( budget > 120 )) && budget=120; (( budget < 10 )) && budget=10
  timeout $budget $BUILD/cuda_bench >"$OUT/bench.log" 2>&1
  row "cuda_bench" "rc=$?"
  tee -a "$LOG" <"$OUT/bench.log" >/dev/null
  while read -r _ name val unit rest; do row "$name" "$val $unit ${rest:0:40}"; done < <(grep '^BENCH' "$OUT/bench.log")
fi

if [[ "${GPU_CHECK_SKIP_TORCH:-0}" != 1 && $(left) -gt 60 ]]; then
  say "PyTorch proxy (eager, compile), $(left) s left"
  PYTHONUNBUFFERED=1 timeout $(left) python3 bench/torch_gpu_proxy.py --layers 4 --seq 4096 --steps 5 \
    >"$OUT/torch_proxy.log" 2>&1
  row "torch proxy" "rc=$?"
  tee -a "$LOG" <"$OUT/torch_proxy.log" >/dev/null
  while read -r _ mode rest; do row "torch $mode" "${rest:0:70}"; done < <(grep '^PROXY' "$OUT/torch_proxy.log")
fi

echo
echo "==== gpu_check: $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - T0 )) s ===="
printf '%s\n' "${ROWS[@]}" | tee "$OUT/table.txt"
