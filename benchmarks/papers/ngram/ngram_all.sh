#!/usr/bin/env bash
# docs/results/ngram.md's second reference: an ∞-gram over the train splits of all six offline corpora (valid and test
# documents of each kept out), swapped into benchmarks/papers/ngram/ngram.sh's dumps (no second LM pass), λ's tuned on valid.
set -euo pipefail
DATA=${DATA:-data/ngram}
RES=docs/results/ngram
MEMLM=${MEMLM:-memlm}
PY=${PYTHON:-python}
$MEMLM ngram build --model smollm2-135m --corpus wiki,news,brown,bbc,wikitext2,imdb --out "$DATA/all-train" \
  --holdout 0 2>&1 | grep -v $'\r'
$MEMLM ngram info "$DATA/all-train" > "$RES/index_all_train.json"
$PY benchmarks/papers/ngram/ngram_swap.py --dump "$DATA/valid.npz" --index "$DATA/all-train" --split valid --max-tokens 10000 \
  --out "$DATA/valid_all.npz"
$PY benchmarks/papers/ngram/ngram_swap.py --dump "$DATA/test.npz" --index "$DATA/all-train" --split test --max-tokens 20000 \
  --out "$DATA/test_all.npz"
$PY benchmarks/papers/ngram/ngram_report.py --valid "$DATA/valid_all.npz" --test "$DATA/test_all.npz" --max-tokens 20000 \
  --out "$RES/report_all_train.json"
