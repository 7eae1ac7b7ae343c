#!/usr/bin/env bash
# exit_codes.sh: proves that the command-line tests check exit codes. It swaps the built `moetron` binary for a
# wrapper that runs the real binary (same output) but
#   (a) always exits 0:        every refusal test (a name with refuse / reject / unknown / wrong / absurd / missing /
#                              bad / invalid / error) must fail;
#   (b) always exits non-zero: every other test that runs the binary must fail;
# runs the CTest entries whose command mentions the binary under each wrapper, restores the binary (also on
# Ctrl-C or an error) and prints every test that survived its mutation. Exit 0 when none did.
# Not part of the suite (it runs the binary's tests twice); run it after a change to tests/CMakeLists.txt.
# Usage: tests/mutation/exit_codes.sh [BUILD_DIR] [CTEST_ARGS...]   (default build; e.g. -j2, -LE mpi)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=$(realpath "${1:-build}")
shift || true
bin="$build/moetron"
[[ -x $bin && ! -e $bin.real ]] || { echo "exit_codes.sh: need $bin (and no leftover $bin.real)"; exit 2; }
work=$(mktemp -d)
restore() { [[ -e $bin.real ]] && mv -f "$bin.real" "$bin"; rm -rf "$work"; }
trap restore EXIT INT TERM

# The tests that run the binary, split by name into refusals and the rest.
ctest --test-dir "$build" --show-only=json-v1 >"$work/tests.json"
python3 - "$work/tests.json" "$bin" "$work" <<'PY'
import json, re, sys
tests, binary, work = json.load(open(sys.argv[1]))["tests"], sys.argv[2], sys.argv[3]
refusal = re.compile(r"refuse|reject|unknown|wrong|absurd|missing|bad|invalid|error")
uses = [t["name"] for t in tests if any(binary in a for a in t.get("command", []))]
ref = [n for n in uses if refusal.search(n)]
rest = [n for n in uses if not refusal.search(n)]
for name, names in (("refusal", ref), ("success", rest)):
    with open(f"{work}/{name}.regex", "w") as f:
        f.write("^(" + "|".join(re.escape(n) for n in names) + ")$")
    with open(f"{work}/{name}.names", "w") as f:
        f.write("\n".join(names) + "\n")
print(f"{len(uses)} tests run the binary: {len(ref)} refusals, {len(rest)} expecting success")
PY

run_mutant() {  # $1: a|b, $2: the tests that must fail
  local mutant=$1 set=$2
  shift 2
  mv "$bin" "$bin.real"
  if [[ $mutant == a ]]; then
    printf '#!/bin/sh\n"%s" "$@"\nexit 0\n' "$bin.real" >"$bin"
  else
    printf '#!/bin/sh\n"%s" "$@"\nexit 3\n' "$bin.real" >"$bin"
  fi
  chmod +x "$bin"
  ctest --test-dir "$build" -R "$(cat "$work/$set.regex")" --output-junit "$work/$mutant.xml" "$@" \
    >"$work/$mutant.log" 2>&1 || true
  mv -f "$bin.real" "$bin"
}
run_mutant a refusal "$@"
run_mutant b success "$@"

python3 - "$work" <<'PY'
import sys, xml.etree.ElementTree as ET
work = sys.argv[1]
bad = 0
for mutant, set_, what in (("a", "refusal", "always exits 0"), ("b", "success", "always exits non-zero")):
    want = [n for n in open(f"{work}/{set_}.names").read().split() if n]
    seen = {c.get("name"): c for c in ET.parse(f"{work}/{mutant}.xml").getroot().iter("testcase")}
    survivors, skipped, absent = [], [], []
    for n in want:
        c = seen.get(n)
        if c is None:
            absent.append(n)
        elif c.get("status") == "run" and c.find("failure") is None:
            survivors.append(n)
        elif c.get("status") in ("disabled", "notrun") or c.find("skipped") is not None:
            skipped.append(n)
    print(f"mutant ({mutant}) {what}: {len(want)} {set_} tests, {len(want) - len(survivors) - len(skipped) - len(absent)}"
          f" failed as they must, {len(survivors)} survived, {len(skipped)} skipped, {len(absent)} not run")
    for n in survivors:
        print(f"  SURVIVED: {n}")
    for n in skipped + absent:
        print(f"  not exercised: {n}")
    bad += len(survivors) + len(absent)
sys.exit(1 if bad else 0)
PY
