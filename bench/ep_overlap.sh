#!/usr/bin/env bash
# ep_overlap.sh: the 1F1B all-to-all overlap measured on emulated hosts with a shaped link (needs root: it uses
# tests/mpi/two_hosts.sh, see docs/multinode.md). ds_mini, pp 2 x dp 2 x ep 2 on 4 hosts of 1 rank each (so
# every EP exchange and pipeline message crosses a link of RATE), interleaved_1f1b, 4 steps, without and then
# with parallelism.ep_overlap. Prints per step the wall time, this rank's EP seconds (time inside dispatch /
# combine calls, both lanes), its measured exposed EP seconds (waits no lane's compute covered, see
# docs/pipeline.md) and the loss (bitwise equal in both runs), then the mean of steps 2.. and two figures of
# what the overlap hides: from the step times, (plain - overlap) / plain EP, and from the exposed time,
# 1 - exposed(overlap) / exposed(plain). The metrics are rank 0's. MPIRUN_ARGS is passed to two_hosts.sh.
# Usage: sudo bench/ep_overlap.sh [RATE]   (default 300mbit; MOETRON=path/to/moetron, OUT=folder, GBS=global batch
# in sequences (default 16: 4 micro-batches per pipeline), STEPS (default 4))
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
moetron=${MOETRON:-$root/build/moetron}
rate=${1:-300mbit}
out=${OUT:-/tmp/moetron_ep_overlap}
gbs=${GBS:-16}
steps=${STEPS:-4}
mkdir -p "$out"
for ov in false true; do
  dir="$out/overlap_${ov}_$rate"
  rm -rf "$dir"
  HOSTS=4 NP_PER_HOST=1 RATE=$rate "$root/tests/mpi/two_hosts.sh" "$moetron" train "$root/configs/ds_mini.toml" \
    --job.dump_folder="$dir" --training.steps=$steps --training.dataset=synthetic --training.val_interval=0 \
    --training.micro_batch_size=2 --training.global_batch_size=$gbs --training.threads=1 \
    --parallelism.pp=2 --parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.ranks_per_node=1 \
    --parallelism.pp_schedule=interleaved_1f1b --parallelism.ep_overlap=$ov --metrics.log_interval=1 \
    --metrics.peak_tflops=1 --checkpoint.enable=false --quiet >"$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
done
python3 - "$out" "$rate" <<'PY'
import json, sys
out, rate = sys.argv[1], sys.argv[2]
res = {}
for ov in ("false", "true"):
    rows = [json.loads(l) for l in open(f"{out}/overlap_{ov}_{rate}/metrics.jsonl")]
    prev, steps = 0.0, []
    for r in rows:
        e = r["ep"]
        steps.append((r["step"], r["time_s"] - prev, e["seconds_per_step"], e["exposed_seconds_per_step"], r["loss"]))
        prev = r["time_s"]
    res[ov] = steps
    print(f"ep_overlap = {ov} ({rate}):")
    for s, t, e, x, l in steps:
        print(f"  step {s}: {t:.2f} s, EP {e:.2f} s, exposed EP {x:.2f} s, loss {l!r}")
mean = lambda v: sum(v) / len(v)
tp, to = mean([s[1] for s in res["false"][1:]]), mean([s[1] for s in res["true"][1:]])
ep = mean([s[2] for s in res["false"][1:]])
xp, xo = mean([s[3] for s in res["false"][1:]]), mean([s[3] for s in res["true"][1:]])
same = all(a[4] == b[4] for a, b in zip(res["false"], res["true"]))
print(f"steps 2..: plain {tp:.2f} s/step (EP {ep:.2f} s, exposed {xp:.2f} s), overlap {to:.2f} s/step "
      f"(exposed {xo:.2f} s); losses bitwise equal: {same}")
print(f"hidden (step time) = (plain - overlap) / EP = {(tp - to) / ep:+.2f}; "
      f"hidden (exposed time) = 1 - exposed(overlap) / exposed(plain) = {1 - xo / xp:+.2f}")
PY
