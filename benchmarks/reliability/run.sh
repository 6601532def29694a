#!/usr/bin/env bash
# benchmarks/reliability/: the one entry point (docs/reference/guarantees.md). Both campaigns use the tests' tiny random GPT-2
# and a toy corpus, so they run on a busy machine. Run from the repository root.
#   bash benchmarks/reliability/run.sh [concurrent|kill|all]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PY:-python}
what=${1:-all}
if [[ $what == concurrent || $what == all ]]; then
  $PY benchmarks/reliability/concurrent_builds.py --trials 5 --out docs/results/reliability/concurrent_builds.json
fi
if [[ $what == kill || $what == all ]]; then
  $PY benchmarks/reliability/kill_campaign.py --trials 8 --seed 0 --out docs/results/reliability/kill_campaign.json
fi
