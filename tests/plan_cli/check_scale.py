#!/usr/bin/env python3
"""check_scale.py: `moetron plan scale --json` against `moetron plan time` of the layouts it reports.

A row's efficiency is its tokens/s per GPU over the first world's, so the first row's efficiency is 1 by
definition and checking it says nothing. This check holds what could be wrong instead:
  - every row's efficiency equals its tokens/s per GPU divided by the first row's (relative 1e-12);
  - every row's tokens/s per GPU and step time equal what `moetron plan time` projects for the row's layout
    (parsed from the row's layout string) at the row's world (relative 1e-9): the scaling run and a plain
    projection of the same layout are one computation.
Usage: check_scale.py --moetron BIN --config CFG --hw NAME --worlds 8,16,32 --global-batch-tokens N
Exit 0 when every row holds, 1 otherwise. Not a check of the projection's accuracy (docs/planner.md).
"""
import argparse
import json
import re
import subprocess
import sys


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return p.stdout


def layout_flags(layout):
    """'tp1 cp1 pp2 vpp2 ep8 dp8 zero1 interleaved_1f1b+a2a_overlap mbs8 m16 ac=none' -> overrides."""
    words = layout.split()
    kv = {}
    for w in words:
        m = re.fullmatch(r"(tp|cp|pp|vpp|ep|dp|zero|mbs|m|etp)(\d+)", w)
        if m:
            kv[m.group(1)] = int(m.group(2))
        elif w.startswith("ac="):
            kv["ac"] = w[3:]
        elif "1f1b" in w or w in ("gpipe", "zb1p", "zbv", "dualpipev"):
            kv["schedule"] = w
    sched = kv.get("schedule", "1f1b")
    flags = [f"--parallelism.tp={kv.get('tp', 1)}", f"--parallelism.cp={kv.get('cp', 1)}",
             f"--parallelism.pp={kv.get('pp', 1)}", f"--parallelism.ep={kv.get('ep', 1)}",
             f"--parallelism.zero={kv.get('zero', 0)}",
             f"--parallelism.pp_schedule={sched.replace('+a2a_overlap', '')}",
             f"--parallelism.pp_virtual_stages={kv.get('vpp', 1)}",
             f"--training.micro_batch_size={kv['mbs']}",
             f"--training.global_batch_size={kv['mbs'] * kv['m'] * kv['dp']}",
             ]
    # ac=none | full | selective(attention_core,moe_act,...): the mode, and the modules when selective
    ac = re.fullmatch(r"(\w+)(?:\(([\w,]*)\))?", kv.get("ac", "none"))
    flags.append(f"--activation_checkpoint.mode={ac.group(1)}")
    if ac.group(2) is not None:
        mods = ",".join(f'"{x}"' for x in ac.group(2).split(",") if x)
        flags.append(f"--activation_checkpoint.modules=[{mods}]")
    if "+a2a_overlap" in sched:
        flags.append("--parallelism.ep_overlap=true")
    if "etp" in kv:
        flags.append(f"--parallelism.expert_tp={kv['etp']}")
    if "sp" in words:
        flags.append("--parallelism.sequence_parallel=true")
    return flags


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for a in ("--moetron", "--config", "--hw", "--worlds", "--global-batch-tokens"):
        ap.add_argument(a, required=True)
    a = ap.parse_args()
    rows = json.loads(run([a.moetron, "plan", "scale", a.config, "--hw", a.hw, "--worlds", a.worlds,
                           "--global-batch-tokens", a.global_batch_tokens, "--json"]))
    fails = []
    worlds = [int(w) for w in a.worlds.split(",")]
    if [r["world"] for r in rows] != worlds:
        fails.append(f"rows for worlds {[r['world'] for r in rows]}, asked {worlds}")
    base = rows[0]["tokens_per_s_per_gpu"]
    for r in rows:
        eff = r["tokens_per_s_per_gpu"] / base
        if abs(r["efficiency"] - eff) > 1e-12 * eff:
            fails.append(f"world {r['world']}: efficiency {r['efficiency']} but tokens/s per GPU ratio {eff}")
        t = json.loads(run([a.moetron, "plan", "time", a.config, "--hw", a.hw, "--world", str(r["world"]),
                            *layout_flags(r["layout"]), "--json"]))
        for key in ("tokens_per_s_per_gpu", "step_time_s"):
            if abs(t[key] - r[key]) > 1e-9 * abs(r[key]):
                fails.append(f"world {r['world']} ({r['layout']}): scale says {key} {r[key]}, plan time {t[key]}")
        print(f"world {r['world']}: {r['layout']}: {r['tokens_per_s_per_gpu']:.1f} tokens/s/GPU, "
              f"efficiency {r['efficiency']:.4f}, plan time {t['tokens_per_s_per_gpu']:.1f}")
    for f in fails:
        print(f"FAIL: {f}")
    if not fails:
        print(f"PASS: {len(rows)} rows equal plan time of their layouts")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
