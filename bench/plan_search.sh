#!/usr/bin/env bash
# plan_search.sh: the planner's search speed (docs/benchmarks.md, "Planner search"): DeepSeek-V3 on 1,024 MI300X
# at a 16M-token global batch, and the 2T proxy on 65,536. Prints each run's summary line (layouts enumerated,
# seconds, layouts per second). Usage: [THREADS=n] bench/plan_search.sh [runs=3] (THREADS: the search's --threads;
# default: the machine's hardware threads)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${MOETRON_CLI:-build/moetron}
runs=${1:-3}
threads=()
[[ -n ${THREADS:-} ]] && threads=(--threads "$THREADS")
for i in $(seq "$runs"); do
  /usr/bin/time -f "  wall %e s" "$bin" plan search configs/deepseek_v3.toml --hw mi300x --world 1024 \
    --global-batch-tokens 16777216 "${threads[@]}" 2>&1 | grep -E "layouts enumerated|wall"
done
for i in $(seq "$runs"); do
  /usr/bin/time -f "  wall %e s" "$bin" plan search configs/moe_2t.toml --hw mi300x --world 65536 \
    --global-batch-tokens 134217728 "${threads[@]}" 2>&1 | grep -E "layouts enumerated|wall"
done
