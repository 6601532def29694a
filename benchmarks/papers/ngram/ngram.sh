#!/usr/bin/env bash
# docs/results/ngram.md's measurements: SmolLM2-135M, an ∞-gram over WikiText-2 train, λ's tuned on the first
# ~10k WikiText-2 valid tokens, applied to the first ~20k test tokens (windows 1024, min-context 512, float32).
# With DS=/path/to/datastore (complete, with its index) the dumps also hold its neighbours: kNN-LM and the three-way
# mixture come from the same forward pass. Run from the repository root; heavy (an LM pass over ~35k tokens).
set -euo pipefail
M=smollm2-135m
DATA=${DATA:-data/ngram}
RES=docs/results/ngram
MEMLM=${MEMLM:-memlm}
mkdir -p "$DATA" "$RES"
$MEMLM ngram build --model $M --corpus wikitext2 --out "$DATA/wt2-train" --holdout 0 2>&1 | grep -v '\r'
$MEMLM ngram info "$DATA/wt2-train" > "$RES/index_wt2_train.json"
DSARG=()
if [ -n "${DS:-}" ] && [ -f "$DS/manifest.json" ] && [ ! -f "$DS/progress.json" ] && [ -f "$DS/index.faiss" ]; then
  DSARG=(--memory "$DS")
fi
for split in valid test; do
  n=$([ $split = valid ] && echo 10000 || echo 20000)
  $MEMLM eval --model $M --dtype float32 --corpus wikitext2 --split $split --max-tokens $n \
    ${DSARG[@]+"${DSARG[@]}"} --memory "ngram:$DATA/wt2-train" --dump "$DATA/$split.npz" --json "$RES/eval_$split.json"
done
$MEMLM tune --valid "$DATA/valid.npz" --test "$DATA/test.npz" --json "$DATA/tune.json"
${PYTHON:-python} benchmarks/papers/ngram/ngram_report.py --valid "$DATA/valid.npz" --test "$DATA/test.npz" --max-tokens 20000 \
  --out "$RES/report_wt2.json"
