#!/usr/bin/env python3
"""check_sizes.py: no source file over 900 lines and no function over 150 lines in src/, include/ and tools/ (.cpp, .h, .cu, .cuh).

A function may run longer only with a reason on the line before its signature, a comment that starts with
"// long:" (say why one piece reads better than several). Files are counted in lines; a function from the line
of its signature to its closing brace. Comments and string literals are blanked before braces are matched, so
a brace in either does not count; lambdas and local classes count as part of the function around them.
Usage: check_sizes.py [--root DIR] [--max-file 900] [--max-function 150] [--list N]
Exit 0 when nothing is over, 1 otherwise (each offender as file:line, its length and its name).
Not a style checker: sizes only (tests/ and generated tables are outside its folders).
"""
import argparse
import os
import re
import sys

CONTAINER = re.compile(r"\b(namespace|struct|class|union|enum)\b[^;(){}]*$|\bextern\s+\"C\+\+\"\s*$")


def blank(text):
    """Comments and string / char literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (j + 1 - i)); i = j + 1
        else:
            out.append(c); i += 1
    return "".join(out)


def functions(text):
    """(first line, last line, name) of each outermost function body."""
    src = blank(text)
    res, stack, last = [], [], 0  # stack entries: "c" container, "f" function (with start), "b" other block
    for i, ch in enumerate(src):
        if ch == "{":
            head = src[last:i]
            in_fn = any(s[0] == "f" for s in stack)
            if in_fn:
                stack.append(("b",))
            elif CONTAINER.search(head.strip()) or head.strip().endswith("="):
                stack.append(("c",))
            elif re.search(r"\)\s*(const|noexcept|override|final|mutable|->\s*[\w:<>&*, ]+|\s)*$", head) or \
                    re.search(r"\)\s*:\s*[\s\S]*$", head):
                start = src.count("\n", 0, last + len(head) - len(head.lstrip())) + 1
                m = re.search(r"([\w:~<>]+)\s*\([^()]*(\([^()]*\)[^()]*)*\)[^()]*$", head)
                stack.append(("f", start, m.group(1) if m else "?"))
            else:
                stack.append(("b",))
            last = i + 1
        elif ch == "}":
            if stack:
                top = stack.pop()
                if top[0] == "f":
                    res.append((top[1], src.count("\n", 0, i) + 1, top[2]))
            last = i + 1
        elif ch == ";":
            last = i + 1
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("--max-file", type=int, default=900)
    ap.add_argument("--max-function", type=int, default=150)
    ap.add_argument("--list", type=int, default=0, help="also print the N longest functions")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    problems, longest, files = [], [], 0
    for top in ("src", "include", "tools"):
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in sorted(fs):
                if not f.endswith((".cpp", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root)
                text = open(path, errors="replace").read()
                lines = text.split("\n")
                files += 1
                if len(lines) - 1 > a.max_file:
                    problems.append(f"{rel}: {len(lines) - 1} lines (over {a.max_file}): split it by concern")
                for first, last, name in functions(text):
                    n = last - first + 1
                    longest.append((n, f"{rel}:{first}", name))
                    if n <= a.max_function:
                        continue
                    before = lines[first - 2].strip() if first >= 2 else ""
                    if before.startswith("// long:"):
                        continue
                    problems.append(f"{rel}:{first}: {name} is {n} lines (over {a.max_function}; split it, or say "
                                    "why not on the line before it in a '// long:' comment)")
    for n, where, name in sorted(longest, reverse=True)[:a.list]:
        print(f"{n:5d} {where} {name}")
    for p in problems:
        print(p)
    print(f"{files} files, {len(longest)} functions: {len(problems)} over the limits")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
