#!/usr/bin/env bash
# docs/results/ngram.md, "Domain adaptation without a forward pass: IMDB": an ∞-gram over all of IMDB train, its
# λ_sparse, λ_dense tuned on the first 10k IMDB valid tokens and applied to the first 30k IMDB test tokens (SmolLM2-135M,
# float32). Run from the repository root; WORK (default data/ngram/imdb) holds the index and the dumps.
#   bash benchmarks/papers/ngram/ngram_imdb.sh
set -euo pipefail
MEMLM=${MEMLM:-memlm}
W=${WORK:-data/ngram/imdb}
R=docs/results/ngram/imdb
mkdir -p "$W" "$R"
$MEMLM ngram build --model smollm2-135m --corpus imdb --out "$W/imdb-train" --holdout 0
$MEMLM ngram info "$W/imdb-train" > "$R/index_imdb_train.json"
for split in valid test; do
  n=$([ $split = valid ] && echo 10000 || echo 30000)
  $MEMLM eval --model smollm2-135m --dtype float32 --corpus imdb --split $split --max-tokens $n --memory "ngram:$W/imdb-train" \
    --dump "$W/$split.npz" --json "$R/eval_$split.json"
done
$MEMLM tune --valid "$W/valid.npz" --test "$W/test.npz" --json "$R/tune.json"
