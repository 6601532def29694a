#!/bin/bash
# Xu et al. (2023) ablations for docs/results/xu2023.md: (a) a GPT-2-style LM trained from scratch here on wiki+news with a
# datastore from its own training data; (b) SmolLM2-135M with a wiki datastore. Every step resumes when rerun.
#   bash benchmarks/papers/xu2023/analysis.sh [scratch|smollm2|all]     (scratch: ~7 min of training + ~20 min of analysis; smollm2: ~45 min, on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/../../.."
M=.venv/bin/memlm
R=${RUNS:-runs}
what=${1:-all}

if [[ $what == scratch || $what == all ]]; then
  # (a) the from-scratch GPT-2 (4 layers x 256, ~5M parameters, byte-level BPE with 8,192 types) that is also the
  # vanilla LM of docs/results/trime.md: benchmarks/papers/trime/trime.sh trains it (400 updates of 16 x 256 tokens of wiki+news train)
  [[ -d $R/trime/vanilla/final ]] || bash benchmarks/papers/trime/trime.sh train-vanilla
  for key in ffn_in final; do
    [[ -f $R/analysis/ds-scratch-$key/manifest.json ]] && continue
    $M datastore build --model $R/trime/vanilla/final --dtype bfloat16 --corpus wiki,news --split train \
      --max-tokens 300000 --key $key --window 256 --min-context 128 --batch-size 32 --no-index \
      --out $R/analysis/ds-scratch-$key
  done
  # learned W_ds trained until its valid memory-only loss plateaus; the earlier run swept
  # --learned-n 1,2,3,6 at --learned-steps 600 (one epoch, not converged)
  $M analyze --model $R/trime/vanilla/final --dtype bfloat16 \
    --datastore-att $R/analysis/ds-scratch-ffn_in --datastore-ffn $R/analysis/ds-scratch-final \
    --valid-corpus wiki,news --test-corpus wiki,news --max-tokens 20000 --window 256 --min-context 128 \
    --batch-size 16 --k 1024 --fractions 0.05,0.25,1 --learned-n 1 --learned-steps 30000 --learned-patience 3 \
    --out $R/analysis/scratch
fi

if [[ $what == smollm2 || $what == all ]]; then
  # (b) SmolLM2-135M with the 500k-entry wiki datastores of docs/results/knnlm.md (benchmarks/papers/knnlm/knnlm_sweeps.py builds them)
  $M analyze --model smollm2-135m --dtype bfloat16 \
    --datastore-att $R/knnlm/ds-wiki-ffn_in --datastore-ffn $R/knnlm/ds-wiki-final \
    --valid-corpus wiki --test-corpus wiki --window 512 --min-context 128 --batch-size 4 --k 1024 \
    --max-tokens 40000 --fractions 0.05,0.25,1 --learned-n 1 --learned-steps 300 --out $R/analysis/smollm2
fi
