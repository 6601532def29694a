#!/usr/bin/env bash
# ev-intervals (issue 33 item 3), second half: a 50k-token WikiText-2 train datastore, then ONE forward pass over the
# first ~20k WikiText-2 test tokens with the datastore and the ∞-gram (base, kNN-LM, LM + ∞-gram, all three), dumped.
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/ev-intervals/src
M="/work/main/.venv/bin/python -m memlm.cli"
D=/work/data/ev-intervals
cd /work/wt/ev-intervals
echo "== $(date -u) datastore build"
$M datastore build --model smollm2-135m --corpus wikitext2 --split train --max-tokens 50000 --out $D/ds50k 2>&1 | grep -v $'\r' || true
$M datastore info $D/ds50k > $D/ds50k_info.json 2>&1 || true
echo "== $(date -u) eval test knn+ngram, 20k tokens"
$M eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 20000 --ngram $D/wt2 \
  --datastore $D/ds50k --dump $D/test_knn_ngram.npz --json $D/eval_test_knn_ngram.json
echo "== $(date -u) done"
