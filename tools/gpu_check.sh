#!/usr/bin/env bash
# The GPU check as one command, run from anywhere on a machine with NVIDIA GPUs:
#
#   tools/gpu_check.sh OUT [--wheels DIR] [--quick] [--dry-run] [--checks a,b] [--budget-s S]
#
# OUT receives report.json (every figure) and the launches' records; the table goes to
# stdout. PYTHON selects the interpreter (default: python3). See docs/engines.md, "On GPUs".
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: tools/gpu_check.sh OUT [--wheels DIR] [--quick] [--dry-run] [--checks a,b]" >&2
    exit 2
fi
out="$1"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" -m bench.gpu --out "$out" "$@"
