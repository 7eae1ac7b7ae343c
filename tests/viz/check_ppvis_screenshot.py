#!/usr/bin/env python3
# check_ppvis_screenshot.py: renders a `moetron viz pipeline` page in headless Chromium and checks the
# screenshot's pixels against the SVG it came from: per rank lane, the pixels of the F, B/I and W fill
# colours cover about the area of that kind's blocks, and the first forward block starts where the SVG puts
# it (optionally: later on each following rank, the 1F1B staircase). Python standard library only (the PNG
# is decoded with zlib). Not a unit test of the SVG text (tests/schedule/test_ppvis.cpp does that).
#
# Usage: check_ppvis_screenshot.py --moetron BIN --workdir DIR [--expect-staircase] -- VIZ_ARGS...
# Exit 0 pass, 1 fail, 77 skip (Chromium missing outside CI; in CI, CI=true, a missing Chromium fails).
import argparse
import os
import re
import struct
import subprocess
import sys
import zlib
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from chromium_finder import find_chromium  # noqa: E402

SKIP = 77




def read_png(path):
    """Returns (width, height, rows) with rows[y] a bytes object of RGB triples."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos, idat, width = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or ctype not in (2, 6) or interlace != 0:
                raise ValueError(f"{path}: unsupported PNG (depth {depth}, colour type {ctype}, interlace {interlace})")
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(height):
        ftype, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if ftype == 1:
                line[x] = (line[x] + a) & 255
            elif ftype == 2:
                line[x] = (line[x] + b) & 255
            elif ftype == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            elif ftype != 0:
                raise ValueError(f"{path}: bad filter type {ftype}")
        prev = line
        if bpp == 4:
            rgb = bytearray(width * 3)
            rgb[0::3], rgb[1::3], rgb[2::3] = line[0::4], line[1::4], line[2::4]
            rows.append(bytes(rgb))
        else:
            rows.append(bytes(line))
    return width, height, rows


def hex_rgb(h):
    return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))


def parse_svg(text):
    w, h = (float(v) for v in re.search(r'<svg [^>]*width="([0-9.]+)" height="([0-9.]+)"', text).groups())
    lanes = [tuple(float(v) for v in m.groups()) for m in re.finditer(
        r'<rect class="lane" x="([0-9.]+)" y="([0-9.]+)" width="([0-9.]+)" height="([0-9.]+)"', text)]
    blocks = []
    for m in re.finditer(r'<rect class="blk k-([FBIW]) c-([0-9]+)" x="([0-9.]+)" y="([0-9.]+)" '
                         r'width="([0-9.]+)" height="([0-9.]+)" fill="(#[0-9a-f]{6})"', text):
        k, c, x, y, bw, bh, fill = m.groups()
        blocks.append(dict(group="F" if k == "F" else "W" if k == "W" else "B", x=float(x), y=float(y),
                           w=float(bw), h=float(bh), fill=fill))
    return w, h, lanes, blocks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetron", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--expect-staircase", action="store_true")
    ap.add_argument("viz_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    viz_args = a.viz_args[1:] if a.viz_args[:1] == ["--"] else a.viz_args

    chromium = find_chromium()
    if not chromium:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            print("FAIL: Chromium not found and CI is set (scripts/setup.sh installs Debian 'chromium')")
            return 1
        print("SKIP: Chromium not found (apt-get install chromium; scripts/setup.sh installs it)")
        return SKIP

    os.makedirs(a.workdir, exist_ok=True)
    html = os.path.join(a.workdir, "page.html")
    run = subprocess.run([a.moetron, "viz", "pipeline", *viz_args, "--out", html], capture_output=True, text=True)
    print(run.stdout, end="")
    if run.returncode != 0:
        print(f"FAIL: moetron viz pipeline exited {run.returncode}: {run.stderr}")
        return 1
    svg_w, svg_h, lanes, blocks = parse_svg(open(os.path.join(a.workdir, "page.svg")).read())
    if not lanes or not blocks:
        print("FAIL: the SVG has no lanes or no blocks")
        return 1

    png = os.path.join(a.workdir, "page.png")
    if os.path.exists(png):
        os.remove(png)
    win_w, win_h = int(svg_w) + 64, int(svg_h) + 64
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--user-data-dir={os.path.join(a.workdir, 'chromium-profile')}",
           f"--window-size={win_w},{win_h}", f"--screenshot={png}", "file://" + os.path.abspath(html)]
    shot = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if not os.path.exists(png):
        print(f"FAIL: no screenshot from {' '.join(cmd)} (exit {shot.returncode}): {shot.stderr[-2000:]}")
        return 1
    width, height, rows = read_png(png)
    print(f"screenshot {png}: {width}x{height}")

    def close(p, q, tol=8):
        return abs(p[0] - q[0]) <= tol and abs(p[1] - q[1]) <= tol and abs(p[2] - q[2]) <= tol

    def pixel(x, y):
        r = rows[y]
        return r[3 * x], r[3 * x + 1], r[3 * x + 2]

    # Where the SVG sits in the page: the first lane's top rows (above the blocks, which start 2 px lower) are
    # idle grey across the plot except under the thin grid lines. Its top is the first pixel row that is mostly
    # lane colour; its left edge the start of the first run of lane pixels in that row (a grid line may blend
    # the very first pixel, hence the 2 px tolerance of the position checks below).
    lane_rgb = hex_rgb("#eceff3")
    need = 0.5 * lanes[0][2]
    top = None
    for y in range(height):
        if sum(1 for x in range(width) if close(pixel(x, y), lane_rgb, 2)) >= need:
            top = y
            break
    if top is None:
        print("FAIL: no lane (idle grey) rows: the timeline is not on the page")
        return 1
    left = next(x for x in range(width - 5) if all(close(pixel(x + i, top), lane_rgb, 2) for i in range(5)))
    dx, dy = left - lanes[0][0], top - lanes[0][1]
    print(f"SVG origin in the page: ({dx:.0f}, {dy:.0f})")
    if not (0 <= dx <= 60 and 0 <= dy <= 60):
        print("FAIL: the timeline is not where the page puts it (body margin 16 px)")
        return 1

    colours = {}
    for b in blocks:
        colours.setdefault(b["group"], set()).add(b["fill"])
    failures = []
    first_f = []
    for r, (lx, ly, lw, lh) in enumerate(lanes):
        y0, y1 = int(round(ly + dy)), int(round(ly + lh + dy))
        x0, x1 = int(round(lx + dx)), int(round(lx + lw + dx))
        mine = [b for b in blocks if ly <= b["y"] < ly + lh]
        report = [f"rank {r}:"]
        for group in ("F", "B", "W"):
            want = sum(b["w"] * b["h"] for b in mine if b["group"] == group)
            if want == 0:
                continue
            rgbs = [hex_rgb(c) for c in colours[group]]
            got, lo = 0, None
            for y in range(max(y0, 0), min(y1, height)):
                for x in range(max(x0, 0), min(x1, width)):
                    p = pixel(x, y)
                    if any(close(p, c) for c in rgbs):
                        got += 1
                        if lo is None or x < lo:
                            lo = x
            report.append(f"{group} {got} px (blocks {want:.0f} px)")
            # Labels and the thin white block borders cover part of each block; anti-aliased edges blend.
            if not 0.55 * want <= got <= 1.05 * want + 20:
                failures.append(f"rank {r}: {group} pixels {got} vs block area {want:.0f}")
            if group == "F":
                want_x = min(b["x"] for b in mine if b["group"] == "F") + dx
                report.append(f"first F at x={lo} (SVG {want_x:.1f})")
                if lo is None or abs(lo - want_x) > 2:
                    failures.append(f"rank {r}: first F pixel at x={lo}, the SVG puts it at {want_x:.1f}")
                first_f.append(lo if lo is not None else -1)
        print(" ".join(report))
    if a.expect_staircase:
        for r in range(1, len(first_f)):
            if not first_f[r] > first_f[r - 1]:
                failures.append(f"staircase: rank {r} starts at x={first_f[r]}, not after rank {r - 1} "
                                f"(x={first_f[r - 1]})")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        return 1
    print(f"PASS: {len(lanes)} rank lanes, {len(blocks)} blocks visible in the screenshot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
