#!/bin/bash
# multinode.sh: the multi-node demonstration on one machine (docs/multinode.md). Emulated hosts are network
# namespaces joined by veth pairs through a bridge, with tc shaping the links (tests/mpi/two_hosts.sh); MPI
# runs over TCP between them and over shared memory inside each. In sequence:
#   (a) equivalence tests across hosts: by default mpi_train_tests (data-parallel training against one
#       process) and mpi_tests (communicator, mesh and EP dispatch tests; their hierarchical cases use
#       ranks_per_node = world / 2 = ranks per host) on 2 hosts x 2 ranks;
#   (b) hierarchical against flat EP dispatch (mpi_bench_dispatch --rpn NP) on 2 hosts x 4 ranks, once per
#       link rate (unshaped, 1gbit, 300mbit by default): inter-node bytes and time per dispatch + combine;
#   (c) a summary: pass/fail, the bytes against the expected reduction, times and ratios per rate, and the
#       veth byte counters against the bytes the benchmark counted (proof that the traffic crossed the link).
# Needs root, iproute2 and python3. Not in CTest (it changes the network configuration; everything is removed
# on exit). Exit status: 0 if every test passed and every check held, 1 otherwise, 2 for usage errors.
#
#   scripts/multinode.sh                                   # everything, defaults below
#   scripts/multinode.sh --stages equiv --test 'tests/mpi/mpi_tests --gtest_filter=MpiEp.*' --test-np 4
#   scripts/multinode.sh --stages dispatch --rates 'none 500mbit' --bench-args '--tokens 512 --iters 3'
#
# Options:
#   --build DIR        build directory (default build); programs given relative are looked up there first
#   --out DIR          logs + summary.md (default /tmp/moetron_multinode)
#   --stages LIST      comma-separated subset of equiv,dispatch,train (default all three)
#   --test 'CMD ...'   a stage (a) command; repeatable; the first one replaces the default list. Any MPI
#                      program: it runs on --test-hosts x --test-np ranks and its exit status decides
#   --test-hosts N     hosts for stage (a) (default 2)      --test-np N     ranks per host (default 2)
#   --test-rate R      link rate for stage (a) (default unshaped)
#   --rates 'R ...'    link rates for stage (b); 'none' = unshaped (default 'none 1gbit 300mbit')
#   --bench-hosts N    hosts for stage (b) (default 2)      --bench-np N    ranks per host (default 4)
#   --bench-args '...' extra mpi_bench_dispatch arguments (default '--tokens 1024 --hidden 512 --topk 6
#                      --experts 64 --iters 4 --warmup 1'); --rpn is always the ranks per host
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=build
OUT=/tmp/moetron_multinode
STAGES=equiv,dispatch,train
TRAIN_RATES="none 300mbit"
TESTS=()
TEST_HOSTS=2
TEST_NP=2
TEST_RATE=
RATES="none 1gbit 300mbit"
BENCH_HOSTS=2
BENCH_NP=4
BENCH_ARGS="--tokens 1024 --hidden 512 --topk 6 --experts 64 --iters 4 --warmup 1"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --test) TESTS+=("$2"); shift 2 ;;
    --test-hosts) TEST_HOSTS=$2; shift 2 ;;
    --test-np) TEST_NP=$2; shift 2 ;;
    --test-rate) TEST_RATE=$2; shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --bench-hosts) BENCH_HOSTS=$2; shift 2 ;;
    --bench-np) BENCH_NP=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "multinode.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ ${#TESTS[@]} -gt 0 ]] || TESTS=("tests/mpi/mpi_train_tests" "tests/mpi/mpi_tests" "tests/mpi/mpi_layout_tests")
command -v python3 >/dev/null || { echo "multinode.sh: needs python3 (for the summary)" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "multinode.sh: needs root (network namespaces, veth, tc); run it with sudo" >&2; exit 2; }
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.veth "$OUT"/results.tsv
RESULTS=$OUT/results.tsv   # kind name hosts np rate rc seconds log veth-file
HOSTS_SH=$ROOT/tests/mpi/two_hosts.sh

resolve() {  # program path: as given if it exists, else under the build directory
  if [[ -x "$1" && ! -d "$1" ]]; then echo "$1"; elif [[ -x "$BUILD/$1" ]]; then echo "$BUILD/$1"; else echo "$1"; fi
}

# run KIND NAME HOSTS NP RATE CMD... : one two_hosts.sh run, its log, its veth counters and one results line.
run() {
  local kind=$1 name=$2 hosts=$3 np=$4 rate=$5; shift 5
  local log=$OUT/$name.log veth=$OUT/$name.veth t0 t1 rc=0
  echo "== $name: $hosts hosts x $np ranks, link ${rate:-unshaped}: $*"
  t0=$(date +%s.%N)
  HOSTS=$hosts NP_PER_HOST=$np RATE=$rate VETH_STATS=$veth "$HOSTS_SH" "$@" > "$log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  grep -E '^\[ +(info|FAILED) |^\[  (PASSED|FAILED)  \]|^\[rank|^dispatcher|^(alltoall|sync_free|hierarchical) |^\[two_hosts\]|^two_hosts.sh:|^#' "$log" \
    | sed 's/\x1b\[[0-9;]*m//g; s/^/   /'
  echo "   exit $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s, log $log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$kind" "$name" "$hosts" "$np" "${rate:-none}" "$rc" \
    "$(python3 -c "print(f'{$t1 - $t0:.1f}')")" "$log" "$veth" >> "$RESULTS"
}

echo "# multinode.sh $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ ",$STAGES," == *,equiv,* ]]; then
  i=0
  for t in "${TESTS[@]}"; do
    read -r -a words <<< "$t"
    words[0]=$(resolve "${words[0]}")
    run test "test$i-$(basename "${words[0]}")" "$TEST_HOSTS" "$TEST_NP" "$TEST_RATE" "${words[@]}"
    i=$((i + 1))
  done
fi
if [[ ",$STAGES," == *,dispatch,* ]]; then
  BENCH=$(resolve bench/mpi_bench_dispatch)
  read -r -a bargs <<< "$BENCH_ARGS"
  for r in $RATES; do
    rate=$r
    [[ "$r" == none ]] && rate=
    run bench "bench-$r" "$BENCH_HOSTS" "$BENCH_NP" "$rate" "$BENCH" "${bargs[@]}" --rpn "$BENCH_NP"
  done
fi
# Training steps, hierarchical against flat: ds_mini with its 64 experts over ep = 8 (2 hosts x 4 ranks,
# ranks_per_node = 4), micro-batch 2, 3 steps, alltoall then hierarchical at each of TRAIN_RATES. The
# trainer reports rank 0's EP bytes per step to other nodes / inside its node and the EP time.
if [[ ",$STAGES," == *,train,* ]]; then
  MT=$(resolve moetron)
  for r in $TRAIN_RATES; do
    rate=$r
    [[ "$r" == none ]] && rate=
    for disp in alltoall hierarchical; do
      run train "train-$disp-$r" 2 4 "$rate" "$MT" train "$ROOT/configs/ds_mini.toml" --training.dataset=synthetic \
        --training.steps=3 --training.micro_batch_size=2 --training.global_batch_size=16 --checkpoint.enable=false \
        --training.val_interval=0 --metrics.log_interval=1000 --job.dump_folder="$OUT/train-$disp-$r" \
        --parallelism.dp_shard=8 --parallelism.ep=8 --parallelism.ranks_per_node=4 --parallelism.ep_dispatcher=$disp
    done
  done
fi

# (c) Summary (also written to $OUT/summary.md).
python3 - "$RESULTS" "$BENCH_ARGS" > "$OUT/summary.md" <<'PY'
import sys, re, math
results, bench_args = sys.argv[1], sys.argv[2].split()
rows = [l.rstrip("\n").split("\t") for l in open(results)] if __import__("os").path.exists(results) else []
def arg(name, default):
    return int(bench_args[bench_args.index(name) + 1]) if name in bench_args else default
iters, warmup = arg("--iters", 8), arg("--warmup", 2)
k, E, D = arg("--topk", 6), arg("--experts", 64), arg("--hidden", 512)
ok = True
def veth(path):
    tx = rx = 0
    try:
        for l in open(path):
            f = l.split()
            tx += int(f[f.index("tx_bytes") + 1]); rx += int(f[f.index("rx_bytes") + 1])
    except (OSError, ValueError):
        return None
    return tx, rx
print("## Summary\n")
print("| run | hosts x ranks | link | result | seconds | veth bytes between hosts (sum of tx) |")
print("| --- | --- | --- | --- | ---: | ---: |")
for kind, name, h, np_, rate, rc, sec, log, vf in rows:
    v = veth(vf)
    res = "pass" if rc == "0" else f"FAIL (exit {rc})"
    if rc != "0": ok = False
    print(f"| {name} | {h} x {np_} | {rate} | {res} | {sec} | {v[0] if v else '-'} |")

bench = [r for r in rows if r[0] == "bench" and r[5] == "0"]
if bench:
    P = int(bench[0][2]) * int(bench[0][3]); L = int(bench[0][3]); n = P // L
    # Expected inter-node reduction for uniform routing over k distinct experts: flat sends every slot whose
    # expert is on another node, hierarchical one row per (token, other node touched).
    per_node = E // n
    p_untouched = math.prod((E - per_node - i) / (E - i) for i in range(k))
    rows_ratio = (k / n) / (1 - p_untouched)
    def rup(x, m): return (x + m - 1) // m * m
    def expected(payload):
        dp, cp = payload.split("/")
        pb = {"f32": 4 * D, "bf16": 2 * D, "e4m3": 4 * ((D + 127) // 128) + D}[dp]
        cb = 2 * D if cp == "bf16" else 4 * D
        rec, rec1 = 16 + rup(pb, 16), rup(4 + 8 * k, 16) + rup(pb, 16)
        return rows_ratio * (rec + cb) / (rec1 + cb)
    tables = {}
    for kind, name, h, np_, rate, rc, sec, log, vf in bench:
        t = {}
        col = {}
        for l in open(log):
            f = l.split()
            if f and f[0] == "dispatcher":  # the table header names the columns
                col = {name: i for i, name in enumerate(f)}
            elif col and len(f) >= len(col) and f[0] in ("alltoall", "alltoall+direct", "sync_free", "hierarchical"):
                mb, inter = float(f[col["MB/rank"]]), float(f[col["inter%"]].rstrip("%")) / 100
                t[(f[0], f[1])] = dict(ms=float(f[col["ms_best"]]), med=float(f[col["ms_med"]]), mb=mb,
                                       inter_mb=P * mb * inter, total_mb=P * mb)
        tables[rate] = (t, vf)
    print(f"\n### Inter-node bytes per dispatch + combine ({n} hosts x {L} ranks, top-{k} of {E} experts, D = {D}; "
          f"MB summed over ranks, from the benchmark's counts)\n")
    print("| payload | flat (alltoall) inter MB | hierarchical inter MB | flat / hier | expected | "
          "flat total MB | hier total MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    t0 = next(iter(tables.values()))[0]
    for pl in ("f32/f32", "bf16/bf16", "e4m3/bf16"):
        f, hh = t0.get(("alltoall", pl)), t0.get(("hierarchical", pl))
        if f and hh:
            print(f"| {pl} | {f['inter_mb']:.1f} | {hh['inter_mb']:.1f} | {f['inter_mb'] / hh['inter_mb']:.2f} | "
                  f"{expected(pl):.2f} | {f['total_mb']:.1f} | {hh['total_mb']:.1f} |")
    print(f"\nExpected = (k / nodes) / P(a given other node is touched) = {k}/{n} / {1 - p_untouched:.4f} = "
          f"{rows_ratio:.3f} rows, times the record sizes (flat record 16 B + payload, hierarchical stage-1 record "
          f"{rup(4 + 8 * k, 16)} B + payload; combine rows equal).")
    def bits_per_s(rate):
        m = re.fullmatch(r"([0-9.]+)([kmg]?)(bit|bps)", rate.lower())
        if not m: return None
        v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
        return v if m.group(3) == "bit" else 8 * v
    print("\n### Milliseconds per dispatch + combine (best of the iterations; median in brackets)\n")
    print("link bound = the inter-node bytes of one direction (half the total: uniform routing) / the link rate, "
          "i.e. the time the link alone needs.\n")
    print("| link | payload | alltoall | sync_free | hierarchical | alltoall / hier | sync_free / hier | "
          "link bound flat / hier |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rate, (t, vf) in tables.items():
        bps = bits_per_s(rate)
        for pl in ("f32/f32", "bf16/bf16", "e4m3/bf16"):
            a, s, hh = t.get(("alltoall", pl)), t.get(("sync_free", pl)), t.get(("hierarchical", pl))
            if a and s and hh:
                lb = "-"
                if bps:
                    lb = f"{a['inter_mb'] / 2 * 8e6 / bps * 1e3:.0f} / {hh['inter_mb'] / 2 * 8e6 / bps * 1e3:.0f}"
                print(f"| {rate} | {pl} | {a['ms']:.1f} ({a['med']:.1f}) | {s['ms']:.1f} ({s['med']:.1f}) | "
                      f"{hh['ms']:.1f} ({hh['med']:.1f}) | {a['ms'] / hh['ms']:.2f} | {s['ms'] / hh['ms']:.2f} | {lb} |")
    print("\n### Did the traffic cross the veth links?\n")
    print("Counted = what the benchmark says crossed hosts: per configuration (1 sizing + warmup + iters) "
          "dispatch + combine calls, plus warmup + iters raw MPI_Alltoall exchanges of the same bytes per rank, "
          "once whole and once split into the dispatcher's number of rounds, plus the f32 floor's raw "
          f"all-to-all of the rows both ways ({P - L} of {P} peers on other hosts). veth = sum over hosts of the "
          "host side's tx bytes (TCP/IP headers and MPI's own traffic included).\n")
    print("| link | counted MB | veth tx MB | veth rx MB | veth / counted |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rate, (t, vf) in tables.items():
        counted = sum(c["inter_mb"] * (1 + warmup + iters) + 2 * c["total_mb"] * (P - L) / P * (warmup + iters)
                      for c in t.values())
        tokens = arg("--tokens", 2048)
        if any(key[1].startswith("f32") for key in t):  # the floor's raw exchange: N k D fp32 rows, both ways
            counted += P * tokens * k * D * 8 / 1e6 * (P - L) / P * (warmup + iters)
        v = veth(vf)
        if not v or not counted:
            ok = False; print(f"| {rate} | {counted:.1f} | - | - | - |"); continue
        r = v[0] / 1e6 / counted
        flag = "" if 0.97 <= r <= 1.15 else " **MISMATCH**"
        if flag: ok = False
        print(f"| {rate} | {counted:.1f} | {v[0] / 1e6:.1f} | {v[1] / 1e6:.1f} | {r:.3f}{flag} |")
print(f"\nOverall: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
rc=$?
if grep -q "^train" "$RESULTS"; then
  {
    echo
    echo "## Training steps: ds_mini, ep = 8 over 2 hosts x 4 ranks (rank 0's EP traffic per step)"
    echo
    echo "| link | dispatcher | exit | tokens/s | EP s (3 steps) | inter-node / step | intra-node / step |"
    echo "|---|---|---|---|---|---|---|"
    while IFS=$'\t' read -r kind name hosts np rate trc secs log veth; do
      [[ $kind == train ]] || continue
      [[ $trc == 0 ]] || rc=1
      tps=$(grep -o 'summary:.*' "$log" | sed -E 's/.* ([0-9.]+) tokens\/s.*/\1/')
      ep=$(grep -o 'EP ([^)]*): .*' "$log" | sed -E 's/EP \(([^)]*)\): ([0-9.]+) s .* sent ([0-9.]+ [MG]iB) to other nodes, ([0-9.]+ [MG]iB) inside.*/\2|\3|\4/')
      IFS='|' read -r eps inter intra <<< "$ep"
      echo "| $rate | ${name#train-} | $trc | $tps | $eps | $inter | $intra |"
    done < "$RESULTS"
  } >> "$OUT/summary.md"
fi
echo
cat "$OUT/summary.md"
echo "(summary also in $OUT/summary.md)"
exit $rc
