#!/usr/bin/env python3
# rep_stats.py: runs a Google Benchmark binary N times (each with --benchmark_format=json) and prints, per
# benchmark, the min / median / max of its GBps (or GFLOPS) counter over the runs, as measured (wall clock) and
# per CPU-second of the running thread (rate * real_time / cpu_time: for 1-thread runs on a shared machine, where
# other jobs steal the core). Also prints pct_memcpy's median where the benchmark reports it. Not a benchmark
# itself, and it never changes the binary's arguments beyond the output format.
# usage: rep_stats.py N cmd [args...]      (--benchmark_repetitions=K in args: N x K samples per benchmark)
# The environment is passed through (MOETRON_ISA, OMP_NUM_THREADS).
import json, os, statistics, subprocess, sys

n = int(sys.argv[1])
cmd = sys.argv[2:]
runs, order, limits = {}, [], []
for i in range(n):
    out = subprocess.run(cmd + ['--benchmark_format=json'], capture_output=True, text=True, env=os.environ).stdout
    head = out[:out.index('{')].strip()
    if head: limits.append(head.splitlines()[-1])
    for b in json.loads(out[out.index('{'):])['benchmarks']:
        if b.get('run_type') == 'aggregate': continue  # --benchmark_repetitions: keep the single runs
        key = 'GBps' if 'GBps' in b else 'GFLOPS' if 'GFLOPS' in b else None
        if key is None: continue
        name = b['name']
        if name not in runs: runs[name], _ = [], order.append(name)
        runs[name].append((b[key], b[key] * b['real_time'] / b['cpu_time'], b.get('pct_memcpy'), key))
for l in limits: print(l)
print(f"{'benchmark':64s} {'unit':6s} {'min':>7s} {'median':>7s} {'max':>7s} | per cpu-s: {'median':>7s} {'max':>7s} | %memcpy(median)")
for name in order:
    r = runs[name]
    wall = [x[0] for x in r]; cpu = [x[1] for x in r]; pm = [x[2] for x in r if x[2] is not None]
    pms = f"{statistics.median(pm):6.1f}" if pm else "     -"
    print(f"{name:64s} {r[0][3]:6s} {min(wall):7.2f} {statistics.median(wall):7.2f} {max(wall):7.2f} |"
          f"            {statistics.median(cpu):7.2f} {max(cpu):7.2f} | {pms}")
