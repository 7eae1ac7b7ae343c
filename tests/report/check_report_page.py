#!/usr/bin/env python3
# check_report_page.py: a short real training run (a few ds_tiny steps, with validation), `moetron report` on
# its dump folder, and the page rendered in headless Chromium: the DOM dumped after the page's script ran, with
# "#check" in the address so the page lists what each chart drew (elements placed, pixels painted in the
# plot area, pixels of each dataset's colour). Each chart is held to what metrics.jsonl says, read here
# independently: one point per record on every curve, the validation points, one bar per memory category, one
# heatmap cell per (MoE layer or expert, record), the plot areas of the heatmaps mostly painted. The run is
# drawn twice: with a trace analysis (the breakdown chart and the tables) and without ("no trace analysis").
# Python standard library only. Not a unit test of the data (test_run_data.cpp).
#
# Usage: check_report_page.py --moetron BIN --config CFG --workdir DIR --analysis FILE
# Exit 0 pass, 1 fail, 77 skip (Chromium or the npm-installed library missing outside CI; with CI=true both fail).
import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from chromium_finder import find_chromium  # noqa: E402

SKIP = 77
MAX_PAGE_BYTES = 400 * 1024


def in_ci():
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")




def render(chromium, page, workdir):
    """The DOM after the page's script ran, and the check JSON the page wrote."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--force-device-scale-factor=1", "--window-size=1400,2400",
           f"--user-data-dir={os.path.join(workdir, 'chromium-profile')}", "--dump-dom",
           "file://" + os.path.abspath(page) + "#check"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="check">(\{.*?)</pre>', r.stdout, re.S)
    if not m:
        raise RuntimeError(f"no <pre id=\"check\"> in the DOM of {page} (exit {r.returncode}): the page's script "
                           f"did not finish. stderr: {r.stderr[-1500:]}")
    return r.stdout, json.loads(html.unescape(m.group(1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--analysis", required=True)
    a = ap.parse_args()

    chromium = find_chromium()
    if not chromium:
        if in_ci():
            print("FAIL: Chromium not found and CI is set (scripts/setup.sh installs Debian 'chromium')")
            return 1
        print("SKIP: Chromium not found (apt-get install chromium; scripts/setup.sh installs it)")
        return SKIP

    shutil.rmtree(a.workdir, ignore_errors=True)
    run_dir = os.path.join(a.workdir, "run")
    steps = 6
    train = [a.moetron, "train", a.config, f"--training.steps={steps}", f"--job.dump_folder={run_dir}",
             "--metrics.log_interval=1", "--metrics.peak_tflops=1", "--training.val_interval=3",
             "--training.val_steps=1"]
    r = subprocess.run(train, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if r.returncode != 0:
        print(f"FAIL: {' '.join(train)} exited {r.returncode}: {r.stderr[-2000:]}")
        return 1
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    n = len(records)
    val = sum(1 for rec in records if "val_loss" in rec)
    ec = records[-1].get("expert_counts")
    if n != steps or val < 1 or not ec:
        print(f"FAIL: metrics.jsonl has {n} records ({val} with val_loss, expert_counts {ec!r}); the test expects "
              f"{steps}, at least one validation and the per-layer expert counts")
        return 1
    layers, cols = len(ec["layers"]), len(ec["counts"][0])
    mem_cats = sum(1 for b in records[-1]["mem_peak_by_category"].values() if b > 0)

    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    for with_analysis in (True, False):
        tag = "with analysis" if with_analysis else "without analysis"
        page = os.path.join(a.workdir, "with.html" if with_analysis else "without.html")
        cmd = [a.moetron, "report", run_dir, "-o", page] + (["--analysis", a.analysis] if with_analysis else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stdout, end="")
        if r.returncode != 0:
            if "npm ci" in r.stderr and not in_ci():
                print(f"SKIP: the plotting library is not installed: {r.stderr.strip()}")
                return SKIP
            print(f"FAIL: {' '.join(cmd)} exited {r.returncode}: {r.stderr}")
            return 1
        size = os.path.getsize(page)
        expect(size <= MAX_PAGE_BYTES, f"{tag}: page is {size} bytes (> {MAX_PAGE_BYTES})")
        text = open(page, encoding="utf-8").read()
        expect(not re.search(r'<(script|img|link|iframe)[^>]+(src|href)=', text),
               f"{tag}: the page references an outside file")
        dom, check = render(chromium, page, a.workdir)

        def chart(cid):
            c = check.get(cid)
            expect(c is not None, f"{tag}: chart {cid} was not drawn")
            return c or {"datasets": [], "painted_px": 0, "area_px": 1}

        loss = chart("chart-loss")
        sets = {d["label"]: d for d in loss["datasets"]}
        expect(sets.get("loss", {}).get("finite") == n, f"{tag}: loss curve has {sets.get('loss')} points, want {n}")
        # A curve over all the steps crosses the plot area: at least about one pixel of its colour per column.
        line_px = 0.5 * loss.get("area_w", 1000)
        expect(sets.get("loss", {}).get("colour_px", 0) >= line_px, f"{tag}: loss curve not visible: {sets.get('loss')}")
        expect(sets.get("validation loss", {}).get("finite") == val,
               f"{tag}: validation points {sets.get('validation loss')}, want {val}")
        expect(sets.get("validation loss", {}).get("colour_px", 0) >= 5,
               f"{tag}: validation points not visible: {sets.get('validation loss')}")
        for cid in ("chart-lr", "chart-gnorm", "chart-tps", "chart-mfu"):
            c = chart(cid)
            d = (c["datasets"] or [{}])[0]
            expect(d.get("finite") == n and d.get("colour_px", 0) >= 0.5 * c.get("area_w", 1000),
                   f"{tag}: {cid}: {d}, want {n} points joined by a visible line")
        mem = (chart("chart-memory")["datasets"] or [{}])[0]
        expect(mem.get("finite") == mem_cats and mem.get("colour_px", 0) >= 100,
               f"{tag}: memory bars {mem}, want {mem_cats} categories drawn")
        for cid, cells in (("chart-expert-layers", layers * n), ("chart-expert-detail", cols * n)):
            c = chart(cid)
            d = (c["datasets"] or [{}])[0]
            expect(d.get("finite") == cells, f"{tag}: {cid} has {d.get('finite')} cells, want {cells}")
            expect(c["painted_px"] >= 0.5 * c["area_px"],
                   f"{tag}: {cid} paints {c['painted_px']} of {c['area_px']} plot pixels")
        dead = (chart("chart-expert-dead")["datasets"] or [{}])[0]  # dead experts per layer and logged step
        expect(dead.get("finite") == layers * n, f"{tag}: chart-expert-dead has {dead.get('finite')} cells, want {layers * n}")
        expect("[model]" in html.unescape(dom) and 'id="config"' in dom, f"{tag}: the config is not on the page")
        if with_analysis:
            an = json.load(open(a.analysis))
            bd = chart("chart-breakdown")
            expect(len(bd["datasets"]) == 3, f"breakdown has {len(bd['datasets'])} datasets, want 3")
            for d in bd["datasets"]:
                expect(d["finite"] == len(an["ranks"]) and d["colour_px"] >= 20, f"breakdown dataset {d}")
            for k in an["top_kernels"][:3]:
                expect(f"<td>{k['name']}</td>" in dom, f"top kernel {k['name']} is not in the table")
            expect(f"straggler: rank {an['straggler_rank']}" in dom, "the straggler is not named")
        else:
            expect("no trace analysis" in dom and "chart-breakdown" not in check,
                   "without an analysis the page does not say 'no trace analysis'")
        print(f"{tag}: {size} bytes, charts drawn: " +
              ", ".join(f"{cid} ({sum(d['finite'] for d in c['datasets'])} elements)" for cid, c in check.items()))

    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        return 1
    print(f"PASS: {n} records, {layers} MoE layers x {cols} experts, every chart drawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
