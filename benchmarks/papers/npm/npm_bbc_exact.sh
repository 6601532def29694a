#!/bin/bash
# The BBC closed-set task with exact-token verbalizer matching (App. A.4), for the
# encoder before training and for NPM and NPM SINGLE, each with the inference of npm.sh (k = 1,024, tau 5, the
# 300k-token wiki-train reference), plus what each query retrieves (benchmarks/papers/npm/npm_topk.py: the top-k tokens per query).
# Training and indexing use exactly the flags of benchmarks/papers/npm/npm.sh (250 updates of 32 x 128 wiki+news tokens per
# encoder); every step is skipped when its output exists and `memlm train` / `memlm npm index` resume, so rerunning
# continues where it stopped. Results go to docs/results/npm/bbc_exact_verbalizers/.
#   bash benchmarks/papers/npm/npm_bbc_exact.sh [untrained|trained|all]
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
R=${RUNS:-runs}/npm
D=${RESULTS:-docs/results/npm/bbc_exact_verbalizers}
K=${K:-1024}
REF_TOKENS=${REF_TOKENS:-300000}
what=${1:-all}
mkdir -p "$R" "$D"

train() {  # objective (the flags of npm.sh's train)
  [[ -d $R/$1/final ]] && return 0
  $PY -m memlm.cli train --objective "$1" --model minilm-l6 --corpus wiki,news --out "$R/$1" --seq-len 128 \
    --batch-size 32 --steps 250 --lr 1e-4 --weight-decay 0.01 --warmup 0.05 --dtype bfloat16 --save-every 25 \
    --valid-tokens 20000
}

index() {  # encoder, name (the flags of npm.sh's index)
  [[ -f $R/idx-$2/manifest.json ]] && return 0
  $PY -m memlm.cli npm index --encoder "$1" --corpus wiki --split train --max-tokens "$REF_TOKENS" --batch-size 16 \
    --out "$R/idx-$2"
}

bbc() {  # result name, index name, extra flags
  local out=$D/bbc-$1.json idx=$2; shift 2
  [[ -f $out ]] || $PY -m memlm.cli npm eval --task bbc --index "$R/idx-$idx" --k "$K" --predictions --json "$out" "$@"
}

topk() {  # result name, encoder, index name, extra flags
  local out=$D/topk-$1.json enc=$2 idx=$3; shift 3
  [[ -f $out ]] || $PY benchmarks/papers/npm/npm_topk.py --encoder "$enc" --index "$R/idx-$idx" --k "$K" --json "$out" "$@"
}

if [[ $what == untrained || $what == all ]]; then
  index minilm-l6 untrained
  bbc untrained untrained
  bbc untrained-single untrained --single
  topk untrained minilm-l6 untrained
  topk untrained-single minilm-l6 untrained --single
fi

if [[ $what == trained || $what == all ]]; then
  train npm
  train npm-single
  index "$R/npm/final" npm
  index "$R/npm-single/final" npm-single
  bbc npm npm
  bbc npm-single npm-single --single
  topk npm "$R/npm/final" npm
  topk npm-single "$R/npm-single/final" npm-single --single
  # the [MASK] inside the 128 positions the encoders were trained on (about 106 instead of 262)
  bbc npm-article100 npm --article-tokens 100
  bbc npm-single-article100 npm-single --single --article-tokens 100
fi
