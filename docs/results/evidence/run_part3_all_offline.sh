#!/usr/bin/env bash
# the all-offline ∞-gram (benchmarks/ngram_all.sh's index) swapped into this run's test dump, for the interval of
# "all offline text vs WikiText-2 train alone" (docs/results/ngram.md)
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/ev-intervals/src
M="/work/main/.venv/bin/python -m memlm.cli"
D=/work/data/ev-intervals
cd /work/wt/ev-intervals
echo "== $(date -u) ngram build all-train"
$M ngram build --model smollm2-135m --corpus wiki,news,brown,bbc,wikitext2,imdb --out $D/all-train --holdout 0 2>&1 | grep -v $'\r' || true
$M ngram info $D/all-train > $D/index_all_train.json
echo "== $(date -u) swap"
/work/main/.venv/bin/python benchmarks/ngram_swap.py --dump $D/test_ngram.npz --index $D/all-train --split test --max-tokens 20000 --out $D/test_ngram_all.npz
echo "== $(date -u) done"
