#!/usr/bin/env bash
# train_vs_torch.sh: moetron vs PyTorch eager on ds_mini, same machine, same micro-batch (8 x 256), same threads,
# same compute dtype. Not a correctness test (bench/torch_ds_mini.py checks its own MoE variants).
#
# Each round runs A (build/moetron train configs/ds_mini.toml, synthetic data) and then B (bench/torch_ds_mini.py)
# once per torch MoE variant, A B B B A B B B ... (ROUNDS rounds, default 2), each for WARMUP + STEPS optimizer
# steps of one micro-batch. Reports tokens/s over the steps after the warm-up for every run, the best and median
# of moetron and of each torch variant, the ratio moetron / best torch variant, torch's own 2048^3 fp32 torch.mm
# GFLOPS and both sides' model FLOP rates against it (moetron's FLOP count: 3 x forward, causal attention), and
# the fastest single timed step of each side (on a shared machine the least disturbed figure).
# moetron's figure comes from its metrics.jsonl (cumulative time_s per step, validation excluded).
#
# env:
#   DTYPE=fp32|bf16   compute dtype of both sides (moetron --training.compute_dtype, torch --dtype). Unset: the
#                     first moetron run gets "auto" and the dtype it resolves to (its "compute dtype:" line; fp32
#                     on CPUs without native bf16) is used for everything after it.
#   TORCH_MOE="loop sorted padded"   torch MoE variants to run (see torch_ds_mini.py --moe).
#   CAP_AVX2=1        cap both sides at AVX2: moetron DNNL_MAX_CPU_ISA=AVX2 MOETRON_ISA=avx2; torch
#                     ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell.
#   ROUNDS=2 STEPS=4 WARMUP=2 THREADS=2 MOETRON=build/moetron TORCH_PYTHON=/usr/bin/python3
# Usage: bench/train_vs_torch.sh        e.g. ROUNDS=2 MOETRON=/path/to/moetron CAP_AVX2=1 bench/train_vs_torch.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cli=${MOETRON:-$root/build/moetron}
py=${TORCH_PYTHON:-/usr/bin/python3}
rounds=${ROUNDS:-2}
steps=${STEPS:-4}
warmup=${WARMUP:-2}
threads=${THREADS:-2}
variants=${TORCH_MOE:-loop sorted padded}
dtype=${DTYPE:-}
total=$((steps + warmup))
die() { echo "train_vs_torch.sh: $*" >&2; exit 1; }
[ -x "$cli" ] || die "$cli not found (ninja -C build moetron_cli, or set MOETRON)"
case "$dtype" in ""|fp32|bf16) ;; *) die "DTYPE=$dtype: use fp32 or bf16 (or leave unset for moetron's auto)" ;; esac
for v in $variants; do
  case "$v" in loop|sorted|padded) ;; *) die "TORCH_MOE: unknown variant '$v' (loop, sorted, padded)" ;; esac
done
[ "$warmup" -ge 1 ] || die "WARMUP=$warmup: need at least 1 (the first step is not timed)"
menv=(env) tenv=(env)
case "${CAP_AVX2:-0}" in
  1) menv+=(DNNL_MAX_CPU_ISA=AVX2 MOETRON_ISA=avx2)
     tenv+=(ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell) ;;
  0) ;;
  *) die "CAP_AVX2=${CAP_AVX2}: use 0 or 1" ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=$threads

run_moetron() {  # prints tokens/s over steps warmup+1..total; sets nothing (dtype goes through $tmp/dtype)
  local out="$tmp/moetron.$1" want=${dtype:-auto}
  "${menv[@]}" "$cli" train "$root/configs/ds_mini.toml" --training.dataset=synthetic --training.steps=$total \
    --training.global_batch_size=8 --training.micro_batch_size=8 --training.threads=$threads \
    --training.compute_dtype=$want --metrics.log_interval=1 --metrics.peak_tflops=1 --checkpoint.enable=false \
    --job.dump_folder="$out" > "$tmp/moetron.$1.log" 2>&1 || { cat "$tmp/moetron.$1.log" >&2; return 1; }
  local line got
  line=$(grep '^compute dtype:' "$tmp/moetron.$1.log" || true)
  [ -n "$line" ] || { echo "moetron printed no 'compute dtype:' line" >&2; return 1; }
  got=$(echo "$line" | awk '{print $3}')
  [ "$want" = auto ] || [ "$got" = "$want" ] || { echo "moetron ran $got, asked $want" >&2; return 1; }
  echo "$got" > "$tmp/dtype"
  echo "    $line" >&2
  echo "    $(grep -o 'isa=[^ ]* threads=[^ ]* onednn=[^ ,]*' "$tmp/moetron.$1.log" | head -1)" >&2
  "$py" - "$out/metrics.jsonl" "$warmup" "$tmp/steps.moetron" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
w = int(sys.argv[2])
tok = 8 * 256 * (len(rows) - w)
print(f"{tok / (rows[-1]['time_s'] - rows[w - 1]['time_s']):.1f}")
print("    per step (tokens/s): " + " ".join(f"{r['tokens_per_s']:.0f}" for r in rows), file=sys.stderr)
with open(sys.argv[3], "a") as f:
    f.write("".join(f"{r['tokens_per_s']:.1f}\n" for r in rows[w:]))
PY
}
run_torch() {  # $1 tag, $2 variant, $3 --no-check or empty; prints tokens/s, leaves the log in $tmp/torch.$1.log
  local log="$tmp/torch.$1.log" chk=${3:-}
  "${tenv[@]}" "$py" "$root/bench/torch_ds_mini.py" --config "$root/configs/ds_mini.toml" --steps $steps \
    --warmup $warmup --threads $threads --dtype "$dtype" --moe "$2" $chk > "$log" 2>&1 || { cat "$log" >&2; return 1; }
  grep -E '^(torch |isa caps|check:|mm_gflops)' "$log" | sed 's/^/    /' >&2
  echo "    per step (tokens/s): $(sed -n 's/.* s  \([0-9]*\) tok\/s$/\1/p' "$log" | tr '\n' ' ')" >&2
  sed -n 's/^step .*  \([0-9.]*\) s  [0-9]* tok\/s$/\1/p' "$log" | tail -n +$((warmup + 1)) |
    awk -v n=$((8 * 256)) '{printf "%.1f\n", n / $1}' >> "$tmp/steps.$2"
  sed -n 's/^tokens_per_s: //p' "$log"
}

echo "ds_mini, micro-batch 8 x 256, $threads threads, $warmup warm-up + $steps timed steps per run, $rounds rounds," \
     "dtype ${dtype:-auto (moetron resolves)}, torch MoE variants: $variants, CAP_AVX2=${CAP_AVX2:-0}"
echo "moetron: $cli"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg) at start"
A=() ; res=() ; chk=  # the first torch run checks the MoE variants against each other
for r in $(seq 1 "$rounds"); do
  a=$(run_moetron "$r" 2>"$tmp/a.err") || { cat "$tmp/a.err" >&2; exit 1; }
  A+=("$a"); echo "round $r  A moetron       $a tokens/s  (load $(cut -d' ' -f1 /proc/loadavg))"; cat "$tmp/a.err"
  if [ -z "$dtype" ]; then dtype=$(cat "$tmp/dtype"); echo "    compute dtype resolved by moetron: $dtype"; fi
  for v in $variants; do
    b=$(run_torch "$r.$v" "$v" $chk 2>"$tmp/b.err") || { cat "$tmp/b.err" >&2; exit 1; }
    chk=--no-check
    res+=("$v:$b:$(sed -n 's/^mm_gflops: \([0-9.]*\).*/\1/p' "$tmp/torch.$r.$v.log")")
    printf 'round %s  B torch %-7s %s tokens/s  (load %s)\n' "$r" "$v" "$b" "$(cut -d' ' -f1 /proc/loadavg)"
    cat "$tmp/b.err"
  done
done
fpt=$(sed -n 's/.*, \([0-9.]*\) GFLOP per trained token.*/\1/p' "$tmp/torch.1.${variants%% *}.log")
"$py" - "$dtype" "$fpt" "${A[*]}" "${res[*]}" "$tmp" <<'PY'
import os, sys, statistics as st
dtype, fpt, tmp = sys.argv[1], float(sys.argv[2]), sys.argv[5]
a = [float(x) for x in sys.argv[3].split()]
runs, peaks = {}, []
for item in sys.argv[4].split():
    v, tps, pk = item.split(":")
    runs.setdefault(v, []).append(float(tps))
    if pk:
        peaks.append(float(pk))
print(f"summary ({dtype}, tokens/s over the timed steps; model FLOPs {fpt:.3f} GFLOP per token, moetron's count):")
print(f"  moetron        best {max(a):8.1f}  median {st.median(a):8.1f}  runs {a}")
for v, b in runs.items():
    print(f"  torch {v:<8} best {max(b):8.1f}  median {st.median(b):8.1f}  runs {b}")
bv = max(runs, key=lambda v: max(runs[v]))
b = runs[bv]
print(f"best torch variant: {bv}")
print(f"ratio moetron / torch {bv}: best/best {max(a) / max(b):.2f}x  median/median {st.median(a) / st.median(b):.2f}x")
def steps(name):  # tokens/s of every timed step of every run of one side
    return [float(x) for x in open(os.path.join(tmp, "steps." + name))]
sm = steps("moetron")
sb = {v: steps(v) for v in runs}
bs = max(sb, key=lambda v: max(sb[v]))
print(f"fastest single timed step (least disturbed by other load): moetron {max(sm):.1f}, "
      + ", ".join(f"torch {v} {max(x):.1f}" for v, x in sb.items())
      + f"; ratio moetron / torch {bs} {max(sm) / max(sb[bs]):.2f}x")
if peaks:
    pk = max(peaks)
    print(f"torch 2048^3 fp32 torch.mm: best {pk:.1f} GFLOPS (over {len(peaks)} runs, median {st.median(peaks):.1f})")
    for name, t in (("moetron", max(a)), (f"torch {bv}", max(b))):
        print(f"  {name:<14} model {t * fpt:6.1f} GFLOPS = {100 * t * fpt / pk:5.1f}% of that torch.mm rate")
PY
echo "load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
