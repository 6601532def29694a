#!/usr/bin/env bash
# (ev-intervals note: this script was stopped after its ∞-gram eval, before its datastore step; the datastore and the
# kNN + ∞-gram eval come from run_part2.sh, with 50k train tokens: the machine was too loaded for 150k)
# ev-intervals (issue 33 item 3): real dumps for the interval tables. Run from anywhere; logs beside.
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/ev-intervals/src
M="/work/main/.venv/bin/python -m memlm.cli"
D=/work/data/ev-intervals
cd /work/wt/ev-intervals
echo "== $(date -u) ngram build"
$M ngram build --model smollm2-135m --corpus wikitext2 --out $D/wt2 --holdout 0 2>&1 | grep -v $'\r' || true
$M ngram info $D/wt2 > $D/index_wt2.json
echo "== $(date -u) eval test ngram"
$M eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 20000 --ngram $D/wt2 \
  --dump $D/test_ngram.npz --json $D/eval_test_ngram.json
echo "== $(date -u) datastore build"
$M datastore build --model smollm2-135m --corpus wikitext2 --split train --max-tokens 150000 --out $D/ds150k 2>&1 | grep -v $'\r' || true
$M datastore info $D/ds150k > $D/ds150k_info.json 2>&1 || true
echo "== $(date -u) eval test knn+ngram"
$M eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 20000 --ngram $D/wt2 \
  --datastore $D/ds150k --dump $D/test_knn_ngram.npz --json $D/eval_test_knn_ngram.json
echo "== $(date -u) done"
