#!/usr/bin/env bash
# The interval tables (docs/results/ngram.md and docs/results/knnlm.md, "Intervals over documents"): SmolLM2-135M on the
# first ~20k WikiText-2 test tokens (windows 1024 / 512, float32), the protocol of benchmarks/papers/ngram/ngram.sh (∞-gram over
# all of WikiText-2 train, --holdout 0: the fallback weights λ_sparse 0.1, λ_dense 0.03, which ngram.sh's tuning on
# valid also chose), and a kNN-LM datastore over the first 50k WikiText-2 train tokens (~30 min to build on 2
# CPU cores), both in one forward pass; then benchmarks/quality/intervals_report.py on the dumps.
# Run from the repository root (the logs of the run behind the committed files: docs/results/evidence/run_part*.log).
set -euo pipefail
D=${DATA:-data/ev-intervals}
RES=docs/results/evidence
MEMLM=${MEMLM:-memlm}
PY=${PYTHON:-python}
mkdir -p "$D" "$RES"
$MEMLM ngram build --model smollm2-135m --corpus wikitext2 --out "$D/wt2" --holdout 0 2>&1 | grep -v $'\r'
$MEMLM ngram info "$D/wt2" > "$RES/index_wt2.json"
$MEMLM eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 20000 --memory "ngram:$D/wt2" \
  --dump "$D/test_ngram.npz" --json "$RES/eval_test_ngram.json"
$MEMLM datastore build --model smollm2-135m --corpus wikitext2 --split train --max-tokens 50000 --out "$D/ds50k" 2>&1 \
  | grep -v $'\r'
$MEMLM datastore info "$D/ds50k" > "$RES/ds50k_info.json"
$MEMLM eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 20000 --memory "knn:$D/ds50k" \
  --memory "ngram:$D/wt2" --dump "$D/test_knn_ngram.npz" --json "$RES/eval_test_knn_ngram.json"
# the all-offline ∞-gram (benchmarks/papers/ngram/ngram_all.sh's index) swapped into the same dump: paired against WikiText-2 train
$MEMLM ngram build --model smollm2-135m --corpus wiki,news,brown,bbc,wikitext2,imdb --out "$D/all-train" --holdout 0 \
  2>&1 | grep -v $'\r'
$MEMLM ngram info "$D/all-train" > "$RES/index_all_train.json"
$PY benchmarks/papers/ngram/ngram_swap.py --dump "$D/test_ngram.npz" --index "$D/all-train" --split test --max-tokens 20000 \
  --out "$D/test_ngram_all.npz"
$PY benchmarks/quality/intervals_report.py --dump "$D/test_ngram.npz" --result "$RES/eval_test_ngram.json" \
  --out "$RES/wt2_test_ngram.json" --without-formatting --max-tokens 20000 --other-dump "$D/test_ngram_all.npz"
$PY benchmarks/quality/intervals_report.py --dump "$D/test_knn_ngram.npz" --result "$RES/eval_test_knn_ngram.json" \
  --out "$RES/wt2_test_knn_ngram.json" --without-formatting --max-tokens 20000
# the same eval over the first ~60k test tokens (11 articles), for intervals over more documents
$MEMLM eval --model smollm2-135m --dtype float32 --corpus wikitext2 --split test --max-tokens 60000 --memory "knn:$D/ds50k" \
  --memory "ngram:$D/wt2" --dump "$D/test60k_knn_ngram.npz" --json "$RES/eval_test60k_knn_ngram.json"
$PY benchmarks/quality/intervals_report.py --dump "$D/test60k_knn_ngram.npz" --result "$RES/eval_test60k_knn_ngram.json" \
  --out "$RES/wt2_test60k_knn_ngram.json" --without-formatting --max-tokens 60000
