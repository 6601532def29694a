#!/bin/bash
# issue 26 item 4: IMDB test with an IMDB ∞-gram (domain adaptation without a forward pass); untimed
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/work/wt/bench/src
M=/work/main/.venv/bin/memlm
W=/work/data/ngram/imdb
mkdir -p $W
while pgrep -f "max-tokens 1100000" >/dev/null; do sleep 10; done
cd /work/wt/bench
$M ngram build --model smollm2-135m --corpus imdb --out $W/imdb-train --holdout 0 2>&1 | tr '\r' '\n' | grep -v "it/s\]$"
$M ngram info $W/imdb-train > $W/index_imdb_train.json
for split in valid test; do
  n=$([ $split = valid ] && echo 10000 || echo 30000)
  $M eval --model smollm2-135m --dtype float32 --corpus imdb --split $split --max-tokens $n --ngram $W/imdb-train \
    --dump $W/$split.npz --json $W/eval_$split.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$"
done
$M tune --valid $W/valid.npz --test $W/test.npz --json $W/tune.json 2>&1 | tail -20
echo "imdb done $(date -u +%T)"
