#!/usr/bin/env bash
# benchmarks/quality/: the one entry point. Each step writes the committed files of one docs/results table with the
# command recorded beside it; a step whose datastore or dumps exist reuses them. Run from the repository root with
# memlm importable (PYTHONPATH=src or an installed venv).
#   bash benchmarks/quality/run.sh [wikitext2-table|intervals|mixture|precision|prune|all]
#   wikitext2-table  docs/results/knnlm.md "WikiText-2" (lm-eval's protocol; builds data/wt2/ds-wt2-train first)
#   intervals        docs/results/knnlm.md and ngram.md "Intervals over documents" (docs/results/evidence/)
#   mixture          docs/results/mixture.md: the stdlib case, the WikiText-2 table (needs intervals' data), IMDB
#   precision        docs/results/performance.md: bf16 body vs float32 (docs/results/precision_bf16_vs_fp32.json)
#   prune            docs/results/efficient-knnlm.md "Pruning" (docs/results/prune_sweep/; builds ds/wt2-300k first)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
MEMLM=${MEMLM:-memlm}
Q=benchmarks/quality
what=${1:-all}

step() { [[ $what == "$1" || $what == all ]]; }

if step wikitext2-table; then
  [[ -f data/wt2/ds-wt2-train/manifest.json ]] || $MEMLM datastore build --corpus wikitext2 --split train \
    --dtype bfloat16 --window 1024 --min-context 128 --batch-size 4 --holdout 0 --out data/wt2/ds-wt2-train
  $PY $Q/wikitext2_table.py --corpus wikitext2 --datastore wt2=data/wt2/ds-wt2-train --valid-max-tokens 30000 \
    --work data/wt2/work --json docs/results/wikitext2/table_wikitext2.json
fi
if step intervals; then
  bash $Q/intervals.sh
fi
if step mixture; then
  $PY $Q/mixture_stdlib.py --stdlib /usr/lib/python3.11 --work data/mixture --out docs/results/mixture/stdlib.json
  $PY $Q/mixture_table.py --valid-max-tokens 60000 --evals-only
  $PY $Q/mixture_table.py --valid-max-tokens 60000 --out docs/results/mixture/wikitext2_valid60k.json
  $PY $Q/mixture_imdb.py --work data/imdb --out docs/results/mixture/imdb.json
fi
if step precision; then
  OMP_NUM_THREADS=2 $PY $Q/precision.py --out docs/results/precision_bf16_vs_fp32.json
fi
if step prune; then
  [[ -f ds/wt2-300k/manifest.json ]] || $MEMLM datastore build --model smollm2-135m --corpus wikitext2 --split train \
    --max-tokens 310000 --window 1024 --stride 1024 --block-start skip --holdout 0 --out ds/wt2-300k \
    --factory IVF2048,PQ64
  W=${WORK:-data/prune}
  $PY $Q/prune_sweep.py --forward-only --model smollm2-135m --key ffn_in --work "$W" --valid-tokens 12288 \
    --test-tokens 20000
  $PY $Q/prune_sweep.py --datastore ds/wt2-300k --work "$W" --out docs/results/prune_sweep/wt2-300k.json \
    --k-merge 8 16 32 64 128 256 --valid-tokens 12288 --test-tokens 20000
fi
