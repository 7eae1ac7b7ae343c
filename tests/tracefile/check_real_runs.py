#!/usr/bin/env python3
"""check_real_runs.py: `moetron trace analyze | diff` on traces of real training runs (ds_tiny, a few steps).

  * on every rank of every run, each term of the breakdown (compute, exposed communication, idle) is counted again
    here from the raw trace events and must be analyze's; rank 0's mean step over the profiled steps must be the
    trainer's own step time (metrics.jsonl) within 2 %;
  * a 4-rank EP run with one rank made late (this script stops and resumes that rank's process throughout the run):
    the analysis must name it the straggler, and the other ranks must wait longer than it on average; the all-to-alls are
    matched on every rank with a 4 x 4 byte matrix;
  * a 4-rank PP run: one pipeline group of 4 ranks whose per-rank busy times are the pipeline record's (within
    1 %) and whose bubbles, per rank and for the group, are pp_vis's for the same run (`schedule compare --run`,
    within 10 points: the traces' clocks are aligned by a barrier, the record's is the host's shared steady_clock);
  * recompute on / off (one rank, same steps): `trace diff` puts the change in compute, the kernels' FLOPs per
    step rise by the recomputed forward, and the layers' recompute modules are new in B.

Not a benchmark: the times are a shared machine's, and only what a wrong analysis would break is held.

Usage: check_real_runs.py --moetron BIN --config ds_tiny.toml --workdir DIR [--mpiexec mpirun] [--only ep|pp|recompute]
Prints PASS lines; exits non-zero on the first failed check.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

STEPS = 3  # the trainer profiles steps 2..3 (the first step warms caches)
LATE_RANK = 3  # the EP run's rank made late
LATE_RUN_S, LATE_STOP_S = 0.010, 0.040  # it runs 10 ms, then stands stopped 40 ms, over and over (stopped 20 ms, a
# loaded machine, two builds beside the run, once made another rank the straggler)


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write("command failed: %s\n%s\n%s" % (" ".join(cmd), p.stdout[-3000:], p.stderr[-3000:]))
        sys.exit(1)
    return p.stdout


def check(cond, what):
    if not cond:
        print("FAIL: " + what)
        sys.exit(1)
    print("PASS: " + what)


def train(args, name, np, extra, late_rank=None):
    out = os.path.join(args.workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [args.moetron, "train", args.config, "--training.steps=%d" % STEPS, "--job.dump_folder=" + out,
           "--trace", os.path.join(out, "trace")] + extra
    if late_rank is not None:
        cmd = [sys.executable, os.path.abspath(__file__), "--late-rank", str(late_rank), "--"] + cmd
    if np > 1:
        cmd = [args.mpiexec, "-np", str(np), "--oversubscribe", "--bind-to", "none"] + cmd
    run(cmd, env)
    return out


def run_late(late_rank, cmd):
    """Under mpirun: run cmd; on rank late_rank, stop and resume it (SIGSTOP / SIGCONT) every LATE_RUN_S +
    LATE_STOP_S seconds until it exits, so that it reaches every collective late. Other ranks run cmd as is."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1")))
    if rank != late_rank:
        os.execvp(cmd[0], cmd)
    p = subprocess.Popen(cmd)
    try:
        while p.poll() is None:
            time.sleep(LATE_RUN_S)
            os.kill(p.pid, signal.SIGSTOP)
            time.sleep(LATE_STOP_S)
            os.kill(p.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    sys.exit(p.wait())


def analyze(args, run_dir):
    return json.loads(run([args.moetron, "trace", "analyze", os.path.join(run_dir, "trace"), "--json"]))


def metrics_step_times(run_dir):
    """Per-step seconds from metrics.jsonl (time_s is cumulative over the run)."""
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    rows = [r for r in rows if "time_s" in r and "step" in r]
    times, prev = {}, 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        times[r["step"]] = r["time_s"] - prev
        prev = r["time_s"]
    return times


def union(iv):
    """The intervals' union as sorted, disjoint (a, b) pairs."""
    out = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length_in(iv, lo, hi):
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in iv)


def recount(trace_file):
    """One rank's compute, exposed communication and idle seconds, each the mean over its step windows, counted
    from the raw events without analyze's code: on each track a moment belongs to the open kernel or comm event
    that started last (the innermost; at one start the shorter); the moment is compute when that event is a kernel
    on some track, exposed communication when it is a comm on some track and a kernel on none, and idle when no
    kernel or comm event is open on any track. Step time is the window's length."""
    evs = [e for e in json.load(open(trace_file))["traceEvents"] if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["cat"] == "step")
    tracks = {}
    for e in evs:
        if e["cat"] in ("kernel", "comm") and e["dur"] > 0:
            tracks.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    kern, comm = [], []
    for lst in tracks.values():
        cuts = sorted({x for a, b, _ in lst for x in (a, b)})
        lst.sort(key=lambda x: (x[0], -(x[1] - x[0])))
        nxt, open_ = 0, []
        for a, b in zip(cuts, cuts[1:]):
            while nxt < len(lst) and lst[nxt][0] <= a:
                open_.append(lst[nxt])
                nxt += 1
            open_ = [x for x in open_ if x[1] > a]
            if open_:
                inner = max(open_, key=lambda x: (x[0], -(x[1] - x[0])))
                (kern if inner[2] == "kernel" else comm).append((a, b))
    kern, busy = union(kern), union(kern + comm)
    n = len(windows)
    step = sum(b - a for a, b in windows) / n
    compute = sum(length_in(kern, a, b) for a, b in windows) / n
    covered = sum(length_in(busy, a, b) for a, b in windows) / n
    us = 1e-6
    return {"step_time_s": step * us, "compute_s": compute * us, "exposed_comm_s": (covered - compute) * us,
            "idle_s": (step - covered) * us}


def check_breakdown(a, run_dir, label):
    # Analyze's terms against the recount. 2 us a term: the recount has no tolerance for events that touch within
    # analyze's kTouchUs; both read the same microsecond timestamps. A term that took another's time (a comm inside
    # a kernel counted as compute, a gap counted as communication) moves two terms by the gap, milliseconds here.
    for r in a["ranks"]:
        mine = recount(os.path.join(run_dir, "trace", "rank%d.trace.json" % r["rank"]))
        for k in ("step_time_s", "compute_s", "exposed_comm_s", "idle_s"):
            check(abs(r[k] - mine[k]) <= 2e-6, "%s rank %d: %s %.6f s, counted from the raw events %.6f s"
                  % (label, r["rank"], k, r[k], mine[k]))
    trace0 = json.load(open(os.path.join(run_dir, "trace", "rank0.trace.json")))
    first, last = trace0["moetron"]["steps"]
    times = metrics_step_times(run_dir)
    measured = sum(times[s] for s in range(first, last + 1)) / (last - first + 1)
    traced = a["ranks"][0]["step_time_s"]
    err = abs(traced - measured) / measured
    # 2 %: the two clocks time the same steps (the trace's step scope sits inside the trainer's timed window); what
    # lies between them is the step's bookkeeping outside the scope. It would miss a trace that loses less than 2 %
    # of the step.
    check(err <= 0.02, "%s rank 0: traced step %.4f s against the trainer's %.4f s (steps %d..%d): %.2f %% apart"
          % (label, traced, measured, first, last, 100 * err))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mpiexec", default="mpirun")
    ap.add_argument("--only", choices=["ep", "pp", "recompute"], help="one part of the checks (default: all)")
    if len(sys.argv) > 3 and sys.argv[1] == "--late-rank" and sys.argv[3] == "--":
        run_late(int(sys.argv[2]), sys.argv[4:])
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if args.only in (None, "ep"):
        check_ep(args)
    if args.only in (None, "pp"):
        check_pp(args)
    if args.only in (None, "recompute"):
        check_recompute(args)
    print("PASS: all checks")


def check_ep(args):
    ep = train(args, "ep4", 4, ["--parallelism.ep=4", "--parallelism.dp_shard=4", "--training.global_batch_size=16"],
               late_rank=LATE_RANK)
    a = analyze(args, ep)
    check_breakdown(a, ep, "EP run")
    check(a["unmatched_collectives"] == 0 and a["matched_collectives"] > 0,
          "EP run: %d collectives matched across ranks, none unmatched" % a["matched_collectives"])
    a2a = [t for t in a["all_to_all"] if t["group_name"] == "ep"]
    check(len(a2a) == 1 and len(a2a[0]["matrix_bytes"]) == 4 and a2a[0]["imbalance"] >= 1.0,
          "EP run: all-to-all byte matrix 4 x 4, size imbalance %.3f" % (a2a[0]["imbalance"] if a2a else 0))
    # The rank made late reaches the collectives last: it is charged with the others' waiting, and waits least.
    late = a["ranks"][LATE_RANK]
    check(a["straggler_rank"] == LATE_RANK, "EP run: straggler rank %d, the rank made late %d (it caused %.2f ms of "
          "waiting per step)" % (a["straggler_rank"], LATE_RANK, 1e3 * late["wait_caused_s"]))
    # The others wait for it: on average longer than it does. Not every one of them: four ranks share two cores,
    # and on a loaded machine (a CI run beside a build) one of the others was itself descheduled and waited 25 ms
    # against the late rank's 31 ms; the straggler check above is the firm one.
    others = [r["comm_wait_s"] for r in a["ranks"] if r["rank"] != LATE_RANK]
    check(sum(others) / len(others) > late["comm_wait_s"], "EP run: the other ranks waited %.2f ms per step in "
          "collectives on average (%s), the late rank %.2f ms" % (1e3 * sum(others) / len(others),
                                                                ", ".join("%.2f" % (1e3 * w) for w in others),
                                                                1e3 * late["comm_wait_s"]))


def check_pp(args):
    # seq 128 and d_model 128: a step of about 40 ms, so that the clocks' few-ms misalignment (below) moves the
    # bubbles less; at ds_tiny's own size (a 13-19 ms step) a CI run once saw them 5.4 points apart.
    pp = train(args, "pp4", 4, ["--parallelism.pp=4", "--model.n_layers=4", "--training.global_batch_size=16",
                                "--training.seq_len=128", "--model.d_model=128"])
    a = analyze(args, pp)
    check_breakdown(a, pp, "PP run")
    groups = [g for g in a["pipeline"] if len(g["ranks"]) == 4]
    check(len(groups) == 1, "PP run: one pipeline group of 4 ranks (%d groups)" % len(a["pipeline"]))
    # pp_vis's measured bubble of the same run (its pipeline record). The busy times are the same actions timed by
    # two recorders: within 1 % per rank. The spans differ by the clocks: the record's is the host's steady_clock,
    # shared by its processes (docs/pipeline.md, Measured runs), the traces' are aligned by a barrier, which four
    # ranks on two cores leave a few ms apart, and misaligned clocks widen the group's span: the traces' bubbles
    # come out higher.
    # Why 10 points: the bound was 5 until two CI runs on loaded machines came out 5.4 and 6.0 points apart (0.8-2.9
    # on the idle machine); it was widened to 10 then, after those failures, and the step was made longer (40 ms)
    # so that the misalignment weighs less. What it misses: a bubble wrong by less than 10 points (at a bubble of
    # 20-40 %, an error of a quarter to a half of it); the busy times' 1 % is the firm check on the same data, and
    # a wrong span (the other half of the bubble) is seen only beyond 10 points.
    rec = json.loads(run([args.moetron, "schedule", "compare", "--run", pp, "--json"]))
    check(abs(groups[0]["bubble"] - rec["total"]["measured"]) < 0.10, "PP run: group bubble %.2f %%, pp_vis "
          "(schedule compare --run) %.2f %%" % (100 * groups[0]["bubble"], 100 * rec["total"]["measured"]))
    busy = record_busy(os.path.join(pp, "pipeline_record.json"))
    for r, m in zip(groups[0]["ranks"], rec["ranks"]):
        b = busy[r["rank"]]
        check(abs(r["busy_s"] - b) <= 0.01 * b, "PP run rank %d: busy %.3f ms in the trace, %.3f ms in the pipeline "
              "record" % (r["rank"], 1e3 * r["busy_s"], 1e3 * b))
        check(abs(r["bubble"] - m["measured"]) < 0.10, "PP run rank %d: bubble %.2f %%, pp_vis (schedule compare "
              "--run) %.2f %%" % (r["rank"], 100 * r["bubble"], 100 * m["measured"]))


def record_busy(path):
    """Per pipeline rank, the mean over the recorded steps of its compute actions' seconds (pipeline_record.json:
    each rank's ops are [index into its lowered CSV row, start, end])."""
    r = json.load(open(path))
    rows = [[a.strip() for a in line.split(",")] for line in r["lowered_csv"].strip().split("\n")]
    busy = {}
    for st in r["steps"]:
        for x in st["ranks"]:
            acts = rows[x["rank"]]
            t = sum(e - s for i, s, e in x["ops"] if "SEND" not in acts[i] and "RECV" not in acts[i])
            busy[x["rank"]] = busy.get(x["rank"], 0.0) + t / len(r["steps"])
    return busy


def check_recompute(args):
    # Large enough a step (1024 tokens) that the recomputed forward stands out of the timing noise.
    size = ["--training.seq_len=128", "--training.micro_batch_size=8", "--training.global_batch_size=8"]
    off = train(args, "recompute_off", 1, size + ["--activation_checkpoint.mode=none"])
    on = train(args, "recompute_on", 1, size + ["--activation_checkpoint.mode=full"])
    d = json.loads(run([args.moetron, "trace", "diff", os.path.join(off, "trace"), os.path.join(on, "trace"), "--json"]))
    # Times on a shared machine swing by tens of percent between two runs: what the check holds is the category
    # the change lands in (the largest), the work (kernel FLOPs: the recomputed forward adds a third to a half)
    # and the recompute modules; the compute time delta is reported. The category replaced a time bound (compute
    # grew by at least 5 % of A's and by more than the exposed communication moved) when kernel FLOPs came in:
    # it misses a compute delta of the wrong size, which the FLOPs bound holds instead.
    cat = {c["name"]: c["delta"] for c in d["categories"]}
    check(d["largest_category"] == "compute",
          "recompute on / off: the step changes most in compute: compute %+.4f s per step (exposed comm %+.4f, idle "
          "%+.4f)" % (cat["compute"], cat["exposed_comm"], cat["idle"]))
    f = d["flops"]
    # 1.2-1.7: full recompute re-runs each layer's forward, at most a third of a step's FLOPs without it (forward 1,
    # backward 2), less what is not recomputed (the embedding, head and loss): +26 % on this run. The band misses an
    # error in the counted recompute FLOPs of under 6 points down or 44 up.
    check(1.2 * f["a"] < f["b"] < 1.7 * f["a"], "recompute on / off: kernel FLOPs per step %.4g -> %.4g (%+.1f %%)"
          % (f["a"], f["b"], 100 * f["delta"] / f["a"]))
    check(any(o.startswith("module:") and o.endswith(".recompute") for o in d["new_ops"]),
          "recompute on / off: new ops %s" % d["new_ops"])


if __name__ == "__main__":
    main()
