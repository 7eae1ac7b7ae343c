#!/usr/bin/env python3
"""ep_pair_exposure.py: what the lanes do while an overlapped FB pair shows no compute, from a profiled run's traces.

Inside every FB action of a rank (tid 0 runs the forward half, tid 2 the backward half) the time is cut into
pieces by what each lane is doing: computing (a kernel scope, except the EP scopes `*.ep.*`, which hold the
exchange calls), exchanging (an EP collective: all_to_all / exchange on an "ep" communicator), done (after the
lane's last event in the pair) or neither (between kernels: waiting for the compute turn, bookkeeping). The time
no lane computes is the pair's exposure, split by the lanes' states:
  both exchanging | one exchanging, the other done | one exchanging, the other neither | no exchange.
Also printed: each lane's compute and exchange seconds inside pairs. Not the EP wait split into peer lateness and
transfer (bench/ep_peer_lateness.py) and not a general trace analysis (`moetron trace analyze`).

Usage: bench/ep_pair_exposure.py TRACE_DIR   (a run with --trace and [profiling] steps, ep_overlap = true)
"""
import collections
import glob
import json
import os
import sys


def union(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def covered(iv, t):  # iv: sorted disjoint
    lo, hi = 0, len(iv)
    while lo < hi:
        mid = (lo + hi) // 2
        if iv[mid][0] <= t: lo = mid + 1
        else: hi = mid
    return lo > 0 and t < iv[lo - 1][1]


def clip(iv, s, e):
    return [(max(a, s), min(b, e)) for a, b in iv if b > s and a < e]


def rank_figures(meta, events):
    groups = meta.get("groups", {})
    def is_ep(e):
        g = e.get("args", {}).get("group", "")
        return groups.get(g, {}).get("name", g.split("@")[0]).split(".")[0] == "ep"
    fb = [(e["ts"], e["ts"] + e["dur"]) for e in events
          if e.get("cat") == "action" and e.get("name") == "FB" and e.get("ph") == "X"]
    lanes = {}
    for tid in (0, 2):
        comp = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("tid") == tid and e.get("ph") == "X" and
                e.get("cat") == "kernel" and ".ep." not in e.get("name", "")]
        ex = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("tid") == tid and e.get("ph") == "X" and
              e.get("cat") == "comm" and e.get("name") in ("all_to_all", "exchange") and is_ep(e)]
        every = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("tid") == tid and e.get("ph") == "X" and
                 e.get("cat") in ("kernel", "comm", "module")]
        lanes[tid] = (comp, ex, every)
    tot = collections.Counter()
    for s, e in fb:
        state = {}
        cuts = {s, e}
        for tid, (comp, ex, every) in lanes.items():
            c, x = union(clip(comp, s, e)), union(clip(ex, s, e))
            inside = clip(every, s, e)
            end = max((b for _, b in inside), default=s)
            state[tid] = (c, x, end)
            for a, b in c + x: cuts.update((a, b))
            cuts.add(end)
            tot[f"lane {tid} compute"] += sum(b - a for a, b in c)
            tot[f"lane {tid} exchange"] += sum(b - a for a, b in x)
        pts = sorted(t for t in cuts if s <= t <= e)
        for a, b in zip(pts, pts[1:]):
            m = (a + b) / 2
            st = {}
            for tid, (c, x, end) in state.items():
                st[tid] = "compute" if covered(c, m) else "exchange" if covered(x, m) else "done" if m >= end else "neither"
            if "compute" in st.values():
                continue
            n_ex = sum(v == "exchange" for v in st.values())
            other = [v for v in st.values() if v != "exchange"]
            key = ("both exchanging" if n_ex == 2 else
                   f"one exchanging, the other {other[0]}" if n_ex == 1 else "no exchange")
            tot[key] += b - a
        tot["pairs"] += 1
        tot["pair time"] += e - s
    return tot


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: ep_pair_exposure.py TRACE_DIR")
    rows = []
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
            meta, events = d["moetron"], d["traceEvents"]
        except (ValueError, KeyError):
            continue
        if meta.get("format") != "moetron-trace":
            continue
        rows.append((meta["rank"], rank_figures(meta, events)))
    if not rows:
        sys.exit(f"no moetron traces in {sys.argv[1]}")
    keys = ["both exchanging", "one exchanging, the other done", "one exchanging, the other neither", "no exchange"]
    print("seconds over the profiled steps, inside FB pairs (lane 0 forward half, lane 2 backward half)")
    print("rank  pairs  pair time  lane0 compute/exchange  lane2 compute/exchange  exposed: " + " | ".join(keys))
    for r, t in sorted(rows):
        us = lambda k: t[k] / 1e6
        print(f"{r:4d}  {t['pairs']:5d}  {us('pair time'):9.2f}  {us('lane 0 compute'):8.2f} / {us('lane 0 exchange'):6.2f}"
              f"       {us('lane 2 compute'):8.2f} / {us('lane 2 exchange'):6.2f}       "
              + " | ".join(f"{us(k):.2f}" for k in keys))


if __name__ == "__main__":
    main()
