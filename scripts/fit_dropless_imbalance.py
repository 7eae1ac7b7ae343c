#!/usr/bin/env python3
# fit_dropless_imbalance.py: the FITTED kDroplessEpImbalance (include/moetron/plan/published.h). For each forced-
# balance / dropless throughput pair of Megatron-MoE-ModelZoo's Qwen3-235B long-context table (best_practice/Qwen3/
# readme.md, H100, 32 nodes, TP 4, PP 8, VPP 4, EP 8, GBS 256, DeepEP, selective recompute), the routing imbalance F
# with which `moetron plan time` reproduces the pair's ratio, by bisection; then their mean. Not a test and not a
# comparison: the pairs are no rows of tests/data/published_moe_runs.csv. Run from the repository root after a build:
#   python3 scripts/fit_dropless_imbalance.py [path/to/moetron]
import re
import subprocess
import sys

MOETRON = sys.argv[1] if len(sys.argv) > 1 else "build/moetron"
pairs = [(16384, 1, 295, 237), (32768, 2, 335, 277), (65536, 4, 368, 320), (131072, 8, 389, 357)]
def step(seq, cp, F):
    cmd = [MOETRON, 'plan', 'time', 'configs/qwen3_235b_a22b.toml', '--hw', 'h100', '--world', '256',
           '--ep-imbalance', str(F), '--parallelism.tp=4', '--parallelism.cp=%d' % cp, '--parallelism.pp=8',
           '--parallelism.pp_virtual_stages=4', '--parallelism.pp_schedule=interleaved_1f1b', '--parallelism.ep=8',
           '--parallelism.ep_dispatcher=hierarchical', '--training.seq_len=%d' % seq, '--training.micro_batch_size=1',
           '--training.global_batch_size=256', '--activation_checkpoint.mode=selective',
           '--activation_checkpoint.modules=[norm,moe_act]']
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return float(re.search(r'step ([0-9.]+) s', out).group(1)), float(re.search(r'([0-9.]+) TFLOPS/GPU', out).group(1))
Fs = []
for seq, cp, forced, dropless in pairs:
    s1, tf1 = step(seq, cp, 1.0)
    want = forced / dropless
    lo, hi = 1.0, 4.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if step(seq, cp, mid)[0] / s1 < want: lo = mid
        else: hi = mid
    Fs.append((lo + hi) / 2)
    print('seq %6d cp %d: published %d / %d = %.3f; planner forced %.1f TFLOPS (%+.1f %%); F = %.3f' % (
        seq, cp, forced, dropless, want, tf1, 100 * (tf1 / forced - 1), Fs[-1]))
print('mean F %.3f' % (sum(Fs) / len(Fs)))
