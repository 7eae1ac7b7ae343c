#!/usr/bin/env python3
"""ep_peer_lateness.py: where a rank's EP exchange time goes, from a profiled run's per-rank traces.

For every EP collective (all_to_all / exchange on a communicator whose kind is "ep", matched over its members by
group and sequence number, docs/profiling.md) it splits each member's call into
  - peer wait: from this member's call to the last member's call (the group cannot move before all have called),
  - transfer: from the last member's call to this member's return (the data moving, and MPI's progress),
and sums them per rank, apart for calls inside an overlapped FB action (by lane: tid 0 runs the forward half,
tid 2 the backward half) and outside one (unpaired actions). Not a timing of the link itself (bench/ep_overlap.sh
and mpi_bench_dispatch do that) and not a general trace analysis (`moetron trace analyze`).

Usage: bench/ep_peer_lateness.py TRACE_DIR   (the folder of a run with --trace / [profiling]; steps as profiled)
"""
import collections
import glob
import json
import os
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    return d["moetron"], d["traceEvents"]


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: ep_peer_lateness.py TRACE_DIR")
    files = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))
    calls = collections.defaultdict(dict)  # (group, seq) -> rank -> (start, end, tid, in_fb)
    ranks = []
    for path in files:
        try:
            meta, events = load(path)
        except (ValueError, KeyError):
            continue
        if meta.get("format") != "moetron-trace":
            continue
        r = meta["rank"]
        ranks.append(r)
        groups = meta.get("groups", {})
        fb = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "action" and e.get("name") == "FB" and e.get("ph") == "X")
        def inside(t):
            lo, hi = 0, len(fb)
            while lo < hi:  # the last FB span starting at or before t
                mid = (lo + hi) // 2
                if fb[mid][0] <= t: lo = mid + 1
                else: hi = mid
            return lo > 0 and t < fb[lo - 1][1]
        for e in events:
            if e.get("cat") != "comm" or e.get("name") not in ("all_to_all", "exchange") or e.get("ph") != "X":
                continue
            a = e.get("args", {})
            g = a.get("group", "")
            if groups.get(g, {}).get("name", g.split("@")[0]).split(".")[0] != "ep":
                continue
            calls[(g, a.get("seq"))][r] = (e["ts"], e["ts"] + e["dur"], e.get("tid", 0), inside(e["ts"]))
    if not ranks:
        sys.exit(f"no moetron traces in {sys.argv[1]}")
    # per rank: [where][0 = peer wait, 1 = transfer, 2 = calls]
    tot = {r: collections.defaultdict(lambda: [0.0, 0.0, 0]) for r in ranks}
    unmatched = 0
    for key, by_rank in calls.items():
        if len(by_rank) < 2:
            unmatched += 1
            continue
        last = max(s for s, _, _, _ in by_rank.values())
        for r, (s, e, tid, in_fb) in by_rank.items():
            where = ("pair, forward lane" if tid == 0 else "pair, backward lane") if in_fb else "unpaired"
            t = tot[r][where]
            t[0] += (last - s) / 1e6
            t[1] += (e - last) / 1e6
            t[2] += 1
    print(f"{len(calls)} EP collectives over ranks {sorted(ranks)} ({unmatched} without a peer's record)")
    print("rank  where                 calls  peer wait s  transfer s  peer wait share")
    for r in sorted(ranks):
        for where in ("pair, forward lane", "pair, backward lane", "unpaired"):
            w, x, n = tot[r][where]
            if n:
                print(f"{r:4d}  {where:20s} {n:6d}  {w:11.2f}  {x:10.2f}  {w / (w + x) if w + x > 0 else 0:15.0%}")


if __name__ == "__main__":
    main()
