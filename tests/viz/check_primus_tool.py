#!/usr/bin/env python3
# check_primus_tool.py: exports every schedule moetron generates as a Primus pp_vis dump
# (`moetron viz pipeline ... --export-primus DIR`), loads each dump with Primus's own tool (the functions of
# tools/visualization/pp_vis/vis.py from AMD-AGI/Primus, given by path, driven headless with matplotlib's Agg
# backend) and checks that the tool reads it, computes per rank a bubble that is non-negative and equal to
# the one moetron printed (within the printed rounding), and draws it without error, one non-overlapping
# rectangle per event on each rank's row. It also reads the dump back with moetron and checks that the
# printed bubbles are the same again. Not a copy of Primus's tool (it is loaded from the path given) and not
# the unit test of the dump format (tests/schedule/test_ppvis.cpp).
#
# Usage: check_primus_tool.py --moetron BIN --vis PATH/vis.py --workdir DIR
# Exit 0 pass, 1 fail, 77 skip (no --vis, the file is missing, or matplotlib, numpy or yaml is not installed).
import argparse
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import traceback
import warnings

SKIP = 77

# (name, `moetron viz pipeline` arguments). Micro-batch counts are multiples of pp: Primus's tool draws a dump
# with vp_size > 1 only then (its default colour table has num_mbs // pp_size groups per chunk).
CASES = [
    ("gpipe", ["--schedule", "gpipe", "--pp", "4", "--microbatches", "8"]),
    ("1f1b", ["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]),
    ("interleaved_1f1b", ["--schedule", "interleaved_1f1b", "--pp", "4", "--vpp", "2", "--microbatches", "8"]),
    ("interleaved_1f1b_vpp3", ["--schedule", "interleaved_1f1b", "--pp", "2", "--vpp", "3", "--microbatches", "4"]),
    ("interleaved_1f1b_ep_overlap",
     ["--schedule", "interleaved_1f1b", "--ep-overlap", "--pp", "4", "--vpp", "2", "--microbatches", "8"]),
    ("zb1p", ["--schedule", "zb1p", "--pp", "4", "--microbatches", "8"]),
    ("zbv", ["--schedule", "zbv", "--pp", "4", "--microbatches", "8"]),
    ("dualpipev", ["--schedule", "dualpipev", "--pp", "4", "--microbatches", "8"]),
    ("dualpipev_m12", ["--schedule", "dualpipev", "--pp", "4", "--microbatches", "12"]),
]
# F, B (full backward), W, P2P, A2A: unequal, so that F&B pairs, splits and waits all have odd lengths.
DURATIONS = "1.25,2.5,1.125,0.1,0.375"
PRINTED = 0.005 + 1e-9  # moetron prints bubbles in % with two decimals


def skip(msg):
    print(f"SKIP: {msg}")
    sys.exit(SKIP)


def load_tool(path):
    """Primus's vis.py as a module, with matplotlib on the Agg backend (no window, no web server)."""
    try:
        import matplotlib
        import numpy  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as e:
        skip(f"Primus's pp_vis tool needs matplotlib, numpy and yaml ({e}; {sys.executable})")
    matplotlib.use("Agg")
    spec = importlib.util.spec_from_file_location("primus_pp_vis", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("get_task_data", "draw"):
        if not hasattr(mod, name):
            raise SystemExit(f"FAIL: {path} has no function '{name}' (not Primus's pp_vis tool?)")
    return mod


def moetron_bubbles(text, what):
    """Per-rank bubbles in % from `moetron viz pipeline` output ("rank R: busy X, bubble Y%")."""
    found = {int(r): float(b) for r, b in re.findall(r"^rank (\d+): busy \S+, bubble (-?[0-9.]+)%", text, re.M)}
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"{what}: no per-rank bubbles in moetron's output:\n{text}")
    return [found[r] for r in range(len(found))]


def run_moetron(binary, args, what):
    p = subprocess.run([binary, "viz", "pipeline", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise ValueError(f"{what}: moetron exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p.stdout


def tool_bubbles(tool, dump, name):
    """Primus's get_task_data on the dump; returns (task data, per-rank bubbles in %, the tool's table)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        data = tool.get_task_data([{"title": name, "iter_to_vis": [0], "log_path": dump}])
    it = data[0]["iters_dict"][0]
    pp = data[0]["config"]["pp_size"]
    return data, [it[r]["bubble"] for r in range(pp)], out.getvalue()


def drawn_rows(fig, pp):
    """Per rank row, the (x, width) of the event rectangles Primus's tool drew (its labels have no fill)."""
    import matplotlib.patches as patches
    rows = {r: [] for r in range(pp)}
    for ax in fig.findobj(lambda o: hasattr(o, "patches") and hasattr(o, "set_xlim")):
        for p in ax.patches:
            if isinstance(p, patches.Rectangle) and p.get_fill() and p.get_facecolor()[3] > 0:
                rank = pp - 1 - int(round(p.get_y()))
                rows[rank].append((p.get_x(), p.get_width()))
    return rows


def check_drawing(tool, data, name, png):
    import matplotlib.pyplot as plt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Agg's "non-interactive, cannot show" from plt.show()
        tool.draw(data)
        fig = plt.gcf()
        fig.savefig(png, dpi=60)
    pp, n = data[0]["config"]["pp_size"], data[0]["config"]["vp_size"] * data[0]["config"]["num_mbs"]
    rows = drawn_rows(fig, pp)
    plt.close("all")
    problems = []
    it = data[0]["iters_dict"][0]
    for r in range(pp):
        want = 2 * n + (n if len(it[0].get("wgrad_start", [])) > 0 else 0)
        if len(rows[r]) != want:
            problems.append(f"rank {r}: {len(rows[r])} rectangles drawn, {want} expected")
        spans = sorted((x, x + w) for x, w in rows[r] if w > 0)
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            if s1 < e0 - 1e-9 * max(1.0, e0):
                problems.append(f"rank {r}: rectangles [{s0:g}, {e0:g}] and [{s1:g}, {e1:g}] overlap")
                break
    return problems


def check_case(binary, tool, workdir, name, args):
    """Returns a list of problems (empty: pass) and a one-line summary."""
    d = os.path.join(workdir, name)
    dump = os.path.join(d, "dump")
    sim = run_moetron(binary, [*args, "--durations", DURATIONS, "--out", os.path.join(d, "sim.html"),
                               "--export-primus", dump], name)
    ours = moetron_bubbles(sim, name)
    back = moetron_bubbles(run_moetron(binary, ["--primus", dump, "--out", os.path.join(d, "dump.html")],
                                       name + " (read back)"), name + " (read back)")
    problems = []
    if back != ours:
        problems.append(f"moetron reads its dump back with bubbles {back}, simulated {ours}")
    try:
        data, theirs, table = tool_bubbles(tool, dump, name)
    except Exception as e:  # the tool's own failure is the finding
        where = traceback.extract_tb(e.__traceback__)[-1]
        return [f"Primus's tool failed reading {dump}: {type(e).__name__}: {e} "
                f"(vis.py line {where.lineno}, in {where.name})"], f"{name}: tool failed"
    for r, (a, b) in enumerate(zip(ours, theirs)):
        if b < -1e-9:
            problems.append(f"rank {r}: Primus's tool prints a negative bubble {b:.4f}% (moetron {a:.2f}%)")
        elif abs(a - b) > PRINTED:
            problems.append(f"rank {r}: Primus's tool {b:.4f}% differs from moetron's {a:.2f}%")
    if len(theirs) != len(ours):
        problems.append(f"Primus's tool has {len(theirs)} ranks, moetron {len(ours)}")
    if problems:
        problems.append("Primus's table:\n" + table.rstrip())
    try:
        problems += check_drawing(tool, data, name, os.path.join(d, "primus.png"))
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        problems.append(f"Primus's tool failed drawing {dump}: {type(e).__name__}: {e} "
                        f"(vis.py line {where.lineno}, in {where.name})")
    pairs = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(ours, theirs))
    return problems, f"{name}: bubble % moetron/Primus per rank: {pairs}"


def main():
    ap = argparse.ArgumentParser(description="Primus's pp_vis tool on moetron's Primus export of every schedule")
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--vis", help="Primus's tools/visualization/pp_vis/vis.py")
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    if not a.vis:
        skip("--vis PATH_TO_vis.py not given (Primus's pp_vis tool)")
    if not os.path.isfile(a.vis):
        skip(f"--vis {a.vis}: no such file")
    tool = load_tool(a.vis)
    os.makedirs(a.workdir, exist_ok=True)
    failed = 0
    for name, args in CASES:
        try:
            problems, summary = check_case(a.moetron, tool, a.workdir, name, args)
        except ValueError as e:
            problems, summary = [str(e)], f"{name}: moetron failed"
        print(("ok   " if not problems else "FAIL ") + summary)
        for p in problems:
            print("     " + p.replace("\n", "\n     "))
        failed += bool(problems)
    if failed:
        print(f"FAIL: {failed} of {len(CASES)} dumps are not read as moetron wrote them by {a.vis}")
        return 1
    print(f"PASS: Primus's pp_vis reads and draws all {len(CASES)} dumps with moetron's bubbles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
