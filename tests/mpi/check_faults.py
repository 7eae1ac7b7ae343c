#!/usr/bin/env python3
"""check_faults.py: injected faults in real 4-rank `moetron train` runs of ds_tiny (docs/reliability.md).

  * kill-<layout> (dp, fsdp, ep, pp): run A trains 8 steps uninterrupted, checkpointing every 3 steps. Run B
    is the same command with MOETRON_FAULT=kill:rank=2:step=5:phase=backward: rank 2 dies by SIGKILL after
    the checkpoint of step 3. The job must end (non-zero) within 60 s with a message naming rank 2. The
    same command again resumes from step 3 and trains to 8: its losses for steps 4..8 must be bitwise A's.
  * watchdog-delay: [comm] timeout_s = 2 and rank 1 sleeps 30 s before step 3's forward. The others wait in
    the step's first collective; their watchdogs dump and end the job within 20 s; rank 1 dumps on seeing
    theirs; `moetron trace flight` names rank 1 as the one that never scheduled that collective.
  * watchdog-delay-pp: the same delay under pp = 4: the others wait in point-to-point receives; `trace flight`
    reports the receive whose send rank 1 never posted and rank 1 as the rank inside no call.
  * watchdog-mismatch: rank 1 enters a barrier where the others enter an all_reduce (mismatch fault); the
    watchdog ends the job and `moetron trace flight` reports the disagreement on kind at that sequence number.

Usage: check_faults.py --moetron BIN --config ds_tiny.toml --workdir DIR --mpiexec mpirun --only PART
Prints PASS lines; exits non-zero on the first failed check.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

LAYOUTS = {
    "dp": ["--parallelism.dp_shard=4", "--training.global_batch_size=16"],
    "fsdp": ["--parallelism.dp_shard=4", "--parallelism.zero=3", "--training.global_batch_size=16"],
    "ep": ["--parallelism.dp_shard=4", "--parallelism.ep=4", "--training.global_batch_size=16"],
    "pp": ["--parallelism.pp=4", "--model.n_layers=4", "--training.global_batch_size=16"],
}


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def train(args, dump, extra, fault=None, timeout=90):
    cmd = [args.mpiexec, "-np", "4", "--oversubscribe", "--bind-to", "none", args.moetron, "train", args.config,
           "--quiet", "--job.dump_folder=" + dump, "--metrics.peak_tflops=1", "--metrics.log_interval=1",
           "--training.threads=1"] + extra
    env = dict(os.environ)
    env.pop("MOETRON_FAULT", None)
    if fault:
        env["MOETRON_FAULT"] = fault
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout, time.time() - t0


def losses(dump):
    """The loss of each step in metrics.jsonl (a resumed run appends: the last record of a step wins)."""
    out = {}
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            out[r["step"]] = r["loss"]
    return out


def check_kill(args, layout):
    base = os.path.join(args.workdir, "kill_" + layout)
    shutil.rmtree(base, ignore_errors=True)
    a, b = os.path.join(base, "a"), os.path.join(base, "b")
    extra = LAYOUTS[layout] + ["--training.steps=8", "--checkpoint.enable=true", "--checkpoint.interval=3"]
    rc, out, _ = train(args, a, extra)
    if rc != 0:
        fail(f"{layout}: uninterrupted run failed ({rc}):\n{out}")
    rc, out, dt = train(args, b, extra, fault="kill:rank=2:step=5:phase=backward")
    if rc == 0:
        fail(f"{layout}: the run with a killed rank exited 0:\n{out}")
    if dt > 60:
        fail(f"{layout}: the job took {dt:.1f} s to end after the kill (limit 60 s)")
    # mpirun's own report (OpenMPI 4): "mpirun noticed that process rank 2 with PID ... exited on signal 9 (Killed)."
    if "process rank 2" not in out or "signal 9" not in out:
        fail(f"{layout}: no message names the lost rank 2 and its signal:\n{out}")
    print(f"PASS {layout}: rank 2 killed at step 5: the job ended in {dt:.1f} s (exit {rc}), rank 2 named")
    ck = sorted(os.listdir(os.path.join(b, "checkpoint")))
    if "step-3" not in ck or "step-6" in ck:
        fail(f"{layout}: checkpoints after the kill: {ck} (expected step-3 and nothing after step 4)")
    rc, out, _ = train(args, b, extra)
    if rc != 0:
        fail(f"{layout}: the restarted run failed ({rc}):\n{out}")
    la, lb = losses(a), losses(b)
    for s in range(4, 9):
        if s not in lb or la[s] != lb[s]:
            fail(f"{layout}: step {s}: loss {lb.get(s)} after the restart, {la[s]} uninterrupted")
    print(f"PASS {layout}: restarted from step 3; losses of steps 4..8 bitwise those of the uninterrupted run")


def flight_report(args, folder):
    p = subprocess.run([args.moetron, "trace", "flight", folder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if p.returncode != 0:
        fail(f"trace flight {folder} failed:\n{p.stdout}")
    return p.stdout


def check_watchdog(args, part):
    dump = os.path.join(args.workdir, part)
    shutil.rmtree(dump, ignore_errors=True)
    extra = LAYOUTS["pp" if part == "watchdog-delay-pp" else "dp"] + ["--training.steps=6", "--comm.timeout_s=2"]
    fault = ("mismatch:rank=1:step=2:phase=optimizer" if part == "watchdog-mismatch"
             else "delay:rank=1:step=3:phase=forward:ms=30000")
    rc, out, dt = train(args, dump, extra, fault=fault, timeout=60)
    if rc == 0:
        fail(f"{part}: the run exited 0:\n{out}")
    if dt > 20:
        fail(f"{part}: the job took {dt:.1f} s to end (timeout_s = 2)")
    if "watchdog" not in out or "comm.timeout_s = 2" not in out:
        fail(f"{part}: no watchdog message:\n{out}")
    folder = os.path.join(dump, "flight")
    dumps = sorted(f for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []
    if dumps != ["rank0.json", "rank1.json", "rank2.json", "rank3.json"]:
        fail(f"{part}: dumps {dumps}, expected one per rank\n{out}")
    print(f"PASS {part}: the watchdog ended the job in {dt:.1f} s (exit {rc}); every rank wrote its dump")
    rep = flight_report(args, folder)
    if part == "watchdog-delay":
        line = [l for l in rep.splitlines() if l.startswith("NOT JOINED:")]
        if not line or "never scheduled by rank(s) 1\n" not in line[0] + "\n" or "started by rank(s) 0, 2, 3" not in line[0]:
            fail(f"{part}: trace flight did not name rank 1:\n{rep}")
    elif part == "watchdog-delay-pp":
        line = [l for l in rep.splitlines() if l.startswith("NOT SENT: rank 0 waits")]
        if not line or "from rank 1 on pp@0; rank 1 never posted it" not in line[0] or \
                "rank(s) 1 were inside no communication call" not in rep:
            fail(f"{part}: trace flight did not name rank 1's missing send:\n{rep}")
    else:
        line = [l for l in rep.splitlines() if l.startswith("DISAGREE:")]
        if not line or "rank 1 barrier" not in line[0] or "rank 0 all_reduce" not in line[0] or "world@0" not in line[0]:
            fail(f"{part}: trace flight did not report the barrier / all_reduce disagreement:\n{rep}")
    print(f"PASS {part}: trace flight: {line[0]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mpiexec", default="mpirun")
    ap.add_argument("--only", required=True,
                    choices=[f"kill-{k}" for k in LAYOUTS] + ["watchdog-delay", "watchdog-delay-pp", "watchdog-mismatch"])
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if args.only.startswith("kill-"):
        check_kill(args, args.only[5:])
    else:
        check_watchdog(args, args.only)


if __name__ == "__main__":
    main()
