#!/usr/bin/env python3
"""check_layers.py: the includes of src/, include/ and tools/ (.cpp, .h, .cu, .cuh) against the layer rule in docs/architecture.md.

The rule is the table under "## Layering" in docs/architecture.md: one row per folder of src/ (and tools/),
its layer's name and the layers it may include. A header in include/moetron/ belongs to the folder that holds
the .cpp of the same name (moetron/comm.h -> src/comm/comm.cpp), to the folder named by its subfolder
(moetron/plan/*.h -> src/plan), or to the folder the table's "headers" column gives it. A "may include" item can
name the only headers of a folder it may use: `src/job` [`kernel_sizes.h` `job_enums.h`]. A source or header
that includes a header of a layer its row does not list is an upward (or sideways) include: the check prints
each one as file:line and exits 1. A folder or header with no row, or a row naming no folder, is an error too,
so a new folder or header has to be placed in the rule.

Usage: check_layers.py [--root DIR]       (default: the repository this script lives in)
Not a compiler: it reads `#include "..."` lines only (system headers are not layers).
"""
import argparse
import os
import re
import sys


def parse_rule(doc):
    """Rows of the layer table: folder -> (may-include set, extra headers)."""
    text = open(doc).read()
    sec = text.split("## Layering", 1)
    if len(sec) < 2:
        sys.exit(f"{doc}: no '## Layering' section")
    rows = {}
    for line in sec[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        folder = cells[0].strip("`")
        # an item is a folder, or a folder with the only headers of it allowed: `src/job` [`kernel_sizes.h`]
        may = {}
        for c in cells[2].split(","):
            m = re.match(r"\s*`([^`]+)`\s*(?:\[(.*)\])?\s*$", c)
            if m:
                only = {h.strip().strip("`") for h in m.group(2).split()} if m.group(2) else None
                may[m.group(1)] = only
            elif c.strip() == "*":
                may["*"] = None
        headers = {h.strip().strip("`") for h in cells[3].split(",") if h.strip() and h.strip() != "-"}
        rows[folder] = (may, headers)
    if not rows:
        sys.exit(f"{doc}: the Layering section has no rule table")
    return rows


def layer_of_path(rel, rows):
    """src/comm/x.cpp -> src/comm; tools/cmd_x.cpp -> tools."""
    parts = rel.split("/")
    key = parts[0] if parts[0] == "tools" else "/".join(parts[:2])
    return key if key in rows else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    rows = parse_rule(os.path.join(root, "docs", "architecture.md"))
    errors = []
    # which folder owns each public header
    cpp_home = {}  # basename -> folders holding a .cpp of that name (two folders: the table must say which)
    for d, _, fs in os.walk(os.path.join(root, "src")):
        for f in fs:
            if f.endswith((".cpp", ".cu")):
                cpp_home.setdefault(f.rsplit(".", 1)[0], set()).add(os.path.relpath(d, root))
    owner = {}
    for folder, (_, headers) in rows.items():
        for h in headers:
            owner[h] = folder
    inc_dir = os.path.join(root, "include", "moetron")
    for d, _, fs in os.walk(inc_dir):
        for f in fs:
            if not f.endswith(".h"):
                continue
            rel = os.path.relpath(os.path.join(d, f), inc_dir)
            if rel in owner:
                continue
            sub = rel.split("/")[0] if "/" in rel else None
            homes = cpp_home.get(f[:-2], set())
            home = f"src/{sub}" if sub and f"src/{sub}" in rows else next(iter(homes)) if len(homes) == 1 else None
            if len(homes) > 1 and not sub:
                errors.append(f"include/moetron/{rel}: .cpp files of that name are in {', '.join(sorted(homes))}: "
                              "name its folder in a row's headers in docs/architecture.md, Layering")
                continue
            if home is None or home not in rows:
                errors.append(f"include/moetron/{rel}: no folder owns this header (add it to a row's headers in "
                              "docs/architecture.md, Layering)")
                continue
            owner[rel] = home
    for folder in rows:
        if folder != "tools" and not os.path.isdir(os.path.join(root, folder)):
            errors.append(f"docs/architecture.md: the Layering table names {folder}, which does not exist")
    # every include of every file
    checked = 0
    for top in ("src", "include", "tools"):
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in sorted(fs):
                if not f.endswith((".cpp", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root)
                if top == "include":
                    me = owner.get(os.path.relpath(path, inc_dir))
                    if me is None:
                        continue  # reported above
                elif top == "tools" and "/" in os.path.relpath(path, os.path.join(root, "tools")):
                    continue  # tools/torch_ref and other non-C++ helpers
                else:
                    me = layer_of_path(rel, rows)
                    if me is None:
                        errors.append(f"{rel}: its folder has no row in docs/architecture.md, Layering")
                        continue
                may = rows[me][0]
                checked += 1
                for n, line in enumerate(open(path, errors="replace"), 1):
                    m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if not m:
                        continue
                    h = m.group(1)
                    if h.startswith("moetron/"):
                        target = owner.get(h[len("moetron/"):])
                    elif "/" in h and f"src/{h.split('/')[0]}" in rows:
                        target = f"src/{h.split('/')[0]}"
                    else:
                        target = me if top != "include" else None  # a file beside it
                    if target is None:
                        errors.append(f"{rel}:{n}: includes \"{h}\", which no layer owns")
                    elif target != me and "*" not in may and (
                            target not in may or (may[target] is not None and h.split("/")[-1] not in may[target])):
                        allowed = ", ".join(k + (f" [{' '.join(sorted(v))}]" if v else "") for k, v in sorted(may.items()))
                        errors.append(f"{rel}:{n}: {me} includes \"{h}\" of {target}, which its row does not allow "
                                      f"(may include: {allowed or 'nothing'})")
    for e in errors:
        print(e)
    print(f"{checked} files checked against {len(rows)} layers: {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
