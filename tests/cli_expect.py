#!/usr/bin/env python3
"""cli_expect.py: runs one command-line test and holds it to both its exit code and its output.

    cli_expect.py --expect ok|refuse [--match REGEX ...] [--absent REGEX ...] -- COMMAND [ARG ...]
    cli_expect.py --expect ok|refuse [--match REGEX ...] --sh 'SHELL LINE'

`ok` needs exit status 0; `refuse` needs an ordinary failure, status 1 to 125 (a crash, a signal or the
shell's 126 / 127 for a missing program is not a refusal). Every --match must be found in the command's
stdout and stderr together (Python `re.search` with DOTALL, so `.*` spans lines); no --absent may be. The
output is echoed so CTest's log shows it. Exit 0 when everything holds, 1 otherwise with a line saying what
failed.

Not a test runner and not a place for logic about one command: the CTest entry (tests/CMakeLists.txt) says
what is run and what is expected; scripts that check a run's files stay in their own folders.
"""
import argparse
import re
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect", choices=["ok", "refuse"], required=True)
    ap.add_argument("--match", action="append", default=[], help="a regex the output must contain")
    ap.add_argument("--absent", action="append", default=[], help="a regex the output must not contain")
    ap.add_argument("--sh", help="run this line with /bin/sh -c instead of the command after --")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if bool(a.sh) == bool(cmd):
        ap.error("give either --sh LINE or -- COMMAND, not both or neither")
    argv = ["/bin/sh", "-c", a.sh] if a.sh else cmd
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        print(f"FAIL: cannot run {argv[0]}: {e}")
        return 1
    out = p.stdout.decode("utf-8", errors="replace")
    sys.stdout.write(out)
    if out and not out.endswith("\n"):
        sys.stdout.write("\n")
    rc = p.returncode
    failures = []
    if a.expect == "ok" and rc != 0:
        failures.append(f"exit status {rc}, expected 0")
    if a.expect == "refuse" and not 1 <= rc <= 125:
        failures.append(f"exit status {rc}, expected a refusal (1 to 125)" +
                        (": the command succeeded" if rc == 0 else ": a crash or a signal is not a refusal"))
    for rx in a.match:
        if not re.search(rx, out, re.DOTALL):
            failures.append(f"output does not match {rx!r}")
    for rx in a.absent:
        m = re.search(rx, out, re.DOTALL)
        if m:
            failures.append(f"output contains {m.group(0)!r} (matches {rx!r})")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
