#!/bin/sh
# export_roundtrip.sh: `moetron viz pipeline --export-primus` then `--primus` on the export draws the same
# blocks: the <g class="blocks"> sections of the two SVGs (every rect, label and tooltip) are byte-identical.
# Not the unit round trip (tests/schedule/test_ppvis.cpp compares the Block structs).
# Usage: export_roundtrip.sh MOETRON WORKDIR VIZ_ARGS...
set -eu
bin=$1 dir=$2
shift 2
rm -rf "$dir"
"$bin" viz pipeline "$@" --out "$dir/sim.html" --export-primus "$dir/dump" >/dev/null
"$bin" viz pipeline --primus "$dir/dump" --out "$dir/dump.html" >/dev/null
blocks() { sed -n '/<g class="blocks">/,/<\/g>/p' "$1"; }
blocks "$dir/sim.svg" >"$dir/sim.blocks"
blocks "$dir/dump.svg" >"$dir/dump.blocks"
n=$(grep -c 'class="blk ' "$dir/sim.blocks")
[ "$n" -gt 0 ] || { echo "FAIL: no blocks in $dir/sim.svg"; exit 1; }
cmp "$dir/sim.blocks" "$dir/dump.blocks" || { echo "FAIL: the re-imported dump draws different blocks"; exit 1; }
echo "PASS: $n blocks identical after export and import"
