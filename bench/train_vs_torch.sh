#!/usr/bin/env bash
# train_vs_torch.sh: moetron vs PyTorch eager on ds_mini, same machine, same micro-batch (8 x 256), 2 threads.
# Runs A (build/moetron train configs/ds_mini.toml, synthetic data) and B (bench/torch_ds_mini.py, bf16
# autocast) alternately, A B A B ... (ROUNDS rounds, default 2), each for WARMUP + STEPS optimizer steps of
# one micro-batch, and reports tokens/s over the steps after the warm-up for every run, the best of each side
# and the ratio moetron / torch. moetron's figure comes from its metrics.jsonl (cumulative time_s per step).
# Usage: bench/train_vs_torch.sh   (env: ROUNDS=2 STEPS=4 WARMUP=2 THREADS=2 MOETRON=build/moetron)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cli=${MOETRON:-$root/build/moetron}
py=${TORCH_PYTHON:-/usr/bin/python3}
rounds=${ROUNDS:-2}
steps=${STEPS:-4}
warmup=${WARMUP:-2}
threads=${THREADS:-2}
total=$((steps + warmup))
[ -x "$cli" ] || { echo "train_vs_torch.sh: $cli not found (ninja -C build moetron_cli)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=$threads

run_moetron() {  # prints tokens/s over steps warmup+1..total
  local out="$tmp/moetron.$1"
  "$cli" train "$root/configs/ds_mini.toml" --quiet --training.dataset=synthetic --training.steps=$total \
    --training.global_batch_size=8 --training.micro_batch_size=8 --training.threads=$threads \
    --metrics.log_interval=1 --metrics.peak_tflops=1 --checkpoint.enable=false --job.dump_folder="$out" >&2
  "$py" - "$out/metrics.jsonl" "$warmup" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
w = int(sys.argv[2])
tok = 8 * 256 * (len(rows) - w)
print(f"{tok / (rows[-1]['time_s'] - rows[w - 1]['time_s'] if w > 0 else rows[-1]['time_s']):.1f}")
print("    per step (tokens/s): " + " ".join(f"{r['tokens_per_s']:.0f}" for r in rows), file=sys.stderr)
PY
}
run_torch() {
  "$py" "$root/bench/torch_ds_mini.py" --config "$root/configs/ds_mini.toml" --steps $steps --warmup $warmup \
    --threads $threads > "$tmp/torch.$1.log"
  echo "    per step (tokens/s): $(sed -n 's/.* s  \([0-9]*\) tok\/s$/\1/p' "$tmp/torch.$1.log" | tr '\n' ' ')" >&2
  sed -n 's/^tokens_per_s: //p' "$tmp/torch.$1.log"
}

echo "ds_mini, micro-batch 8 x 256, $threads threads, $warmup warm-up + $steps timed steps per run, $rounds rounds"
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
A=() ; Bv=()
for r in $(seq 1 "$rounds"); do
  a=$(run_moetron "$r" 2>"$tmp/a.err") || { cat "$tmp/a.err" >&2; exit 1; }
  A+=("$a"); echo "round $r  A moetron  $a tokens/s"; cat "$tmp/a.err"
  b=$(run_torch "$r" 2>"$tmp/b.err") || { cat "$tmp/b.err" >&2; exit 1; }
  Bv+=("$b"); echo "round $r  B torch    $b tokens/s"; cat "$tmp/b.err"
done
"$py" - "${A[*]}" "${Bv[*]}" <<'PY'
import sys, statistics as st
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
print(f"moetron tokens/s: best {max(a):.1f}  median {st.median(a):.1f}  runs {a}")
print(f"torch   tokens/s: best {max(b):.1f}  median {st.median(b):.1f}  runs {b}")
print(f"ratio moetron / torch: best/best {max(a) / max(b):.2f}x  median/median {st.median(a) / st.median(b):.2f}x")
PY
echo "load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
