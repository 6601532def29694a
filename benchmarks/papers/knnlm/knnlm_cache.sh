#!/usr/bin/env bash
# Khandelwal et al. Table 1 on SmolLM2: base, +kNN-LM, +continuous cache, +both, tuned on wiki valid, applied to test.
# Needs the wiki datastore of benchmarks/papers/knnlm/knnlm_sweeps.py (runs/knnlm/ds-wiki-ffn_in). ~4 min on 2 cores.
set -e
mkdir -p runs/cache
DS=runs/knnlm/ds-wiki-ffn_in
COMMON="--memory $DS --dtype bfloat16 --window 512 --min-context 128 --k 1024 --memory cache"
memlm eval --corpus wiki --split valid --max-tokens 15000 $COMMON --dump runs/cache/valid.npz
memlm eval --corpus wiki --split test --max-tokens 30000 $COMMON --dump runs/cache/test.npz
# λ and λc fitted together by EM (the rule), τ and τc the most likely of these
memlm tune --valid runs/cache/valid.npz --test runs/cache/test.npz --temperatures 1 2 3 5 \
  --cache-temperatures 1 3 10 30 100 --json runs/cache/tuned.json
