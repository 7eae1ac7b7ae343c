#!/usr/bin/env bash
# gen_refs.sh: regenerate tests/data/ref/<variant>.safetensors, the PyTorch references of
# tests/unit/test_reference.cpp. For each tests/data/ref/<variant>.toml:
#   build/moetron debug dump-init <variant>.toml /tmp/...dump   (the engine's initial parameters + a batch)
#   /usr/bin/python3 tools/torch_ref/moetron_ref.py gen DUMP OUT (float64 forward/backward + 5 AdamW steps)
# Needs the moetron CLI built (ninja -C build moetron_cli) and Debian's python3-torch (/usr/bin/python3).
# Usage: tools/torch_ref/gen_refs.sh [variant ...]   (default: every tests/data/ref/*.toml)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cli=${MOETRON_CLI:-$root/build/moetron}
py=${TORCH_PYTHON:-/usr/bin/python3}
[ -x "$cli" ] || { echo "gen_refs.sh: $cli not found (ninja -C build moetron_cli)" >&2; exit 1; }
"$py" -c 'import torch' 2>/dev/null || { echo "gen_refs.sh: $py has no torch (apt install python3-torch)" >&2; exit 1; }
if [ $# -eq 0 ]; then
  set -- $(cd "$root/tests/data/ref" && ls *.toml | sed 's/\.toml$//')
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in "$@"; do
  "$cli" debug dump-init "$root/tests/data/ref/$v.toml" "$tmp/$v.dump.safetensors" >/dev/null
  "$py" "$root/tools/torch_ref/moetron_ref.py" gen "$tmp/$v.dump.safetensors" "$root/tests/data/ref/$v.safetensors" \
    "$root/tests/data/ref/$v.toml"
done
