#!/usr/bin/env bash
# more test articles for the intervals: the same run as run_part2.sh's eval over the first ~60k WikiText-2 test tokens
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/ev-intervals/src
M="/work/main/.venv/bin/python -m memlm.cli"
D=/work/data/ev-intervals
cd /work/wt/ev-intervals
echo "== $(date -u) eval test knn+ngram, 60k tokens"
$M eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 60000 --ngram $D/wt2 \
  --datastore $D/ds50k --dump $D/test60k_knn_ngram.npz --json $D/eval_test60k_knn_ngram.json
echo "== $(date -u) done"
