#!/usr/bin/env bash
# ep_overlap.sh: the 1F1B all-to-all overlap measured on emulated hosts with a shaped link (needs root: it uses
# tests/mpi/two_hosts.sh, see docs/multinode.md). ds_mini, pp 2 x dp 2 x ep 2 on 4 hosts of 1 rank each (so
# every EP exchange and pipeline message crosses a link of RATE), interleaved_1f1b, 4 steps, without and then
# with parallelism.ep_overlap. Prints per step the wall time, this rank's EP seconds (time inside dispatch /
# combine calls, both lanes), its measured exposed EP seconds (waits no lane's compute covered, see
# docs/pipeline.md) and the loss (bitwise equal in both runs), then the mean of steps 2.. and two figures of
# what the overlap hides: from the step times, (plain - overlap) / plain EP, and from the exposed time,
# 1 - exposed(overlap) / exposed(plain). The metrics are rank 0's. MPIRUN_ARGS is passed to two_hosts.sh.
# BATONS="turn free" runs the overlap once per lane order (parallelism.ep_baton, docs/pipeline.md); default free. An
# entry "turn-paced" runs the turns with the paced link (parallelism.ep_link = paced: one exchange in flight per
# rank); "free" and "turn" run parallelism.ep_pair_backward = b (one full backward per pair); "free-iw" /
# "free-iwfill" run a pair's backward as input then weight half, the latter with the weight gradients also run
# inside the exchange waits, and "free-iwcarry" (what the engine's default, auto, runs here) with every backward's
# weight half carried into later exchange waits (parallelism.ep_pair_backward, docs/pipeline.md). The keys go to
# the overlapped runs as --section.key=value overrides (older versions of this script set environment variables).
# BASELINE=1 also runs every side on unshaped links (the same hosts, no rate limit) and prints a third figure, the
# link's cost hidden: 1 - (overlap(RATE) - overlap(unshaped)) / (plain(RATE) - plain(unshaped)). It leaves out
# what the second lane gains that is not EP (it fills pipeline bubbles and P2P waits on fast links too).
# Usage: sudo bench/ep_overlap.sh [RATE]   (default 300mbit; RATE=unshaped: no limit; MOETRON=path/to/moetron,
# OUT=folder, GBS=global batch in sequences (default 16: 4 micro-batches per pipeline), STEPS (default 4),
# DISPATCHER=alltoall|sync_free|hierarchical (parallelism.ep_dispatcher, default alltoall), TRAIN_ARGS=more
# --section.key=value overrides for every run, word-split, e.g. "--comm.mpi_wait=spin" or "--comm.mpi_max_nap_us=1000")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
moetron=${MOETRON:-$root/build/moetron}
rate=${1:-300mbit}
out=${OUT:-/tmp/moetron_ep_overlap}
gbs=${GBS:-16}
steps=${STEPS:-4}
dispatcher=${DISPATCHER:-alltoall}
mkdir -p "$out"
batons=${BATONS:-free}
runs="plain"
for b in $batons; do runs="$runs $b"; done
rates=$rate
[[ ${BASELINE:-0} == 1 && $rate != unshaped ]] && rates="$rate unshaped"
for link in $rates; do
for run in $runs; do
  shaped=$link
  [[ $link == unshaped ]] && shaped=""
  ov=true
  [[ $run == plain ]] && ov=false
  dir="$out/overlap_${run}_$link"
  rm -rf "$dir"
  # the machine's CPU counters once a second, for the busy share over the timed steps (printed below)
  (while :; do echo "$(date +%s.%N) $(head -1 /proc/stat)"; sleep 1; done) >"$dir.cpu" &
  sampler=$!
  for attempt in 1 2 3; do  # the emulated hosts sometimes fail to start (docs/multinode.md): retry
  rm -rf "$dir"
  baton=${run%%-*}
  ep_link=shared
  [[ $run == *-paced ]] && ep_link=paced
  pair=b
  [[ $run == *-iw ]] && pair=iw
  [[ $run == *-iwfill ]] && pair=iwfill
  [[ $run == *-iwcarry ]] && pair=iwcarry
  lanes=()  # the plain run has no lanes (the keys would only be noted as moot)
  [[ $run != plain ]] && lanes=(--parallelism.ep_baton=$baton --parallelism.ep_link=$ep_link
                                --parallelism.ep_pair_backward=$pair)
  if HOSTS=4 NP_PER_HOST=1 RATE=$shaped MPIRUN_ARGS="${MPIRUN_ARGS:-}" \
    "$root/tests/mpi/two_hosts.sh" "$moetron" train "$root/configs/ds_mini.toml" ${lanes[@]+"${lanes[@]}"} \
    --job.dump_folder="$dir" --training.steps=$steps --training.dataset=synthetic --training.val_interval=0 \
    --training.micro_batch_size=2 --training.global_batch_size=$gbs --training.threads=1 \
    --parallelism.pp=2 --parallelism.dp_shard=2 --parallelism.ep=2 --parallelism.ep_dispatcher=$dispatcher --parallelism.ranks_per_node=1 \
    --parallelism.pp_schedule=interleaved_1f1b --parallelism.ep_overlap=$ov --metrics.log_interval=1 \
    --metrics.peak_tflops=1 --checkpoint.enable=false ${TRAIN_ARGS:-} --quiet >"$dir.log" 2>&1; then break; fi
  echo "run $run, attempt $attempt failed:" >&2; tail -5 "$dir.log" >&2
  [[ $attempt == 3 ]] && { kill $sampler; exit 1; }
  done
  kill $sampler
done
done
python3 - "$out" "$rate" "${BASELINE:-0}" $runs <<'PY'
import json, sys
out, rate, baseline, runs = sys.argv[1], sys.argv[2], sys.argv[3] == "1" and sys.argv[2] != "unshaped", sys.argv[4:]
def load(run, link):
    rows = [json.loads(l) for l in open(f"{out}/overlap_{run}_{link}/metrics.jsonl")]
    prev, steps = 0.0, []
    for r in rows:
        steps.append(r["time_s"] - prev)
        prev = r["time_s"]
    return sum(steps[1:]) / len(steps[1:])
res = {}
for run in runs:
    rows = [json.loads(l) for l in open(f"{out}/overlap_{run}_{rate}/metrics.jsonl")]
    prev, steps = 0.0, []
    for r in rows:
        e = r["ep"]
        steps.append((r["step"], r["time_s"] - prev, e["seconds_per_step"], e["exposed_seconds_per_step"], r["loss"],
                      e.get("exposed_paired_seconds_per_step", 0.0), e.get("wgrad_fill_seconds_per_step", 0.0)))
        prev = r["time_s"]
    res[run] = steps
    print("ep_overlap = false" if run == "plain" else f"ep_overlap = true, ep_baton = {run.split('-')[0]}"
          + (", ep_link = paced" if run.endswith("-paced") else "")
          + (f", ep_pair_backward = {run.split('-')[1]}" if run.endswith(("-iw", "-iwfill", "-iwcarry")) else ""), f"({rate}):")
    for s, t, e, x, l, xp, wf in steps:
        print(f"  step {s}: {t:.2f} s, EP {e:.2f} s, exposed EP {x:.2f} s (in F&B pairs {xp:.2f} s), loss {l!r}"
              + (f", weight gradients run inside waits {wf:.2f} s" if wf > 0 else ""))
mean = lambda v: sum(v) / len(v)
tail = lambda run, k: mean([s[k] for s in res[run][1:]])
def busy(run, link):
    # The CPU's busy share over steps 2.. (the last sum-of-steps seconds before metrics.jsonl was last written).
    import os
    d = f"{out}/overlap_{run}_{link}"
    end = os.path.getmtime(f"{d}/metrics.jsonl")
    start = end - sum(s[1] for s in res[run][1:])
    rows = []
    for line in open(f"{d}.cpu"):
        f = line.split()
        if len(f) < 6 or f[1] != "cpu": continue
        v = [int(x) for x in f[2:]]
        rows.append((float(f[0]), sum(v), v[3] + v[4]))  # total, idle + iowait
    a = [r for r in rows if r[0] <= start][-1:] or rows[:1]
    b = [r for r in rows if r[0] <= end + 1][-1:] or rows[-1:]
    tot, idle = b[0][1] - a[0][1], b[0][2] - a[0][2]
    return 1 - idle / tot if tot > 0 else float("nan")
tp, ep, xp = tail("plain", 1), tail("plain", 2), tail("plain", 3)
ub = busy("plain", rate)
print(f"steps 2..: plain {tp:.2f} s/step (EP {ep:.2f} s, exposed {xp:.2f} s); CPU busy {ub:.0%}")
# If the overlap did the plain run's CPU work with no idle core, a step would take ub * plain: the most it could
# hide on these cores is (1 - ub) * plain / EP.
print(f"  the cores' bound (an estimate: the plain run's CPU work with no core idle): at most {(1 - ub) * tp / ep:+.2f} of the EP time hidden by step time")
for run in runs[1:]:
    to, xo, xpo = tail(run, 1), tail(run, 3), tail(run, 5)
    same = all(a[4] == b[4] for a, b in zip(res["plain"], res[run]))
    print(f"  overlap ({run}): {to:.2f} s/step (exposed {xo:.2f} s, {xpo:.2f} s of it in F&B pairs; CPU busy {busy(run, rate):.0%}); losses bitwise equal: {same}; "
          f"hidden (step time) = (plain - overlap) / EP = {(tp - to) / ep:+.2f}; "
          f"hidden (exposed time) = 1 - exposed(overlap) / exposed(plain) = {1 - xo / xp:+.2f}")
if baseline:
    up = load("plain", "unshaped")
    print(f"unshaped links, steps 2..: plain {up:.2f} s/step; the link's cost in the plain run {tp - up:.2f} s")
    for run in runs[1:]:
        uo, to = load(run, "unshaped"), tail(run, 1)
        print(f"  overlap ({run}): {uo:.2f} s/step unshaped, the link's cost {to - uo:.2f} s; "
              f"hidden (link cost) = 1 - (overlap({rate}) - overlap(unshaped)) / (plain({rate}) - plain(unshaped)) "
              f"= {1 - (to - uo) / (tp - up):+.2f}")
PY
