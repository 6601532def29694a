#!/bin/bash
# Speed: NPM vs the MLM (queries/s) and TRIME local vs external memory (tokens/s), each pair measured back
# to back in one process (docs/results/speed/README.md). The models follow benchmarks/papers/npm/npm.sh and benchmarks/papers/trime/trime.sh
# with a smaller training budget (speed does not depend on it; the EM / perplexity of these runs mean nothing):
# NPM encoder 40 updates (npm.sh: 250), MLM 20 (250), TrimeLM_ext 40 (trime.sh: 400); the phrase index (300k wiki-train
# tokens) and the TRIME datastore (~500k entries, IVF1024,Flat) are the documented ones. Steps whose output exists are
# skipped. THREADS=1 (torch and FAISS) because this 2-core machine is shared: with 2 threads under load, torch's
# OpenMP workers spin and an MLM query took 550 ms instead of 40 (docs/results/speed/README.md).
#   bash benchmarks/speed/speed.sh [prep|npm|trime|all]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
M=${MEMLM:-.venv/bin/memlm}
R=${RUNS:-runs}
D=docs/results/speed
THREADS=${THREADS:-1}
what=${1:-all}
mkdir -p "$D"

if [[ $what == prep || $what == all ]]; then
  [[ -d $R/npm/npm/final ]] || $M train --objective npm --model minilm-l6 --corpus wiki,news --out $R/npm/npm \
    --seq-len 128 --batch-size 32 --steps 40 --lr 1e-4 --weight-decay 0.01 --warmup 0.05 --dtype bfloat16 \
    --save-every 20 --valid-tokens 0
  [[ -d $R/npm/mlm/final ]] || $M train --objective mlm --model minilm-l6 --corpus wiki,news --out $R/npm/mlm \
    --seq-len 128 --batch-size 32 --steps 20 --lr 1e-4 --weight-decay 0.01 --warmup 0.05 --dtype bfloat16 \
    --save-every 20 --valid-tokens 0
  [[ -f $R/npm/idx-npm/manifest.json ]] || $M npm index --encoder $R/npm/npm/final --corpus wiki --split train \
    --max-tokens 300000 --batch-size 16 --out $R/npm/idx-npm
  [[ -d $R/trime/trimelm-ext/final ]] || $M train --out $R/trime/trimelm-ext --corpus wiki,news --from-scratch 4x256 \
    --tokenizer bpe:8192 --n-positions 256 --seq-len 256 --batch-size 16 --steps 40 --lr 1e-3 --eval-every 1000 \
    --save-every 50 --valid-tokens 50000 --dtype bfloat16 --loss trime-ext --packing bm25 --drop-local-p 0.9
  # 510k train tokens give 499,701 entries (docs/results/trime.md's datastore: 499,860)
  [[ -f $R/trime/ds-500k/index.faiss ]] || $M datastore build --model $R/trime/trimelm-ext/final --dtype bfloat16 \
    --corpus wiki,news --split train --max-tokens 510000 --key ffn_in --window 256 --min-context 128 \
    --batch-size 32 --factory IVF1024,Flat --metric l2 --out $R/trime/ds-500k
  # an alternative index over the same keys, for the speed / recall comparison only
  [[ -f $R/trime/ds-500k/index-ivf4096.faiss ]] || PYTHONPATH=src $PY -c "
from memlm.storage.datastore import Datastore
from memlm.storage.index import build_index, expected_source
ds = Datastore.open('$R/trime/ds-500k')
build_index(ds.keys, ds.path / 'index-ivf4096.faiss', factory='IVF4096,Flat', metric='l2',
            source=expected_source(ds.index_path), progress=False)"
fi

if [[ $what == npm || $what == all ]]; then
  PYTHONPATH=src $PY benchmarks/speed/bench_npm_speed.py --index $R/npm/idx-npm --mlm $R/npm/mlm/final --max-queries 100 \
    --threads "$THREADS" --json $D/npm_vs_mlm.json
fi

if [[ $what == trime || $what == all ]]; then
  PYTHONPATH=src $PY benchmarks/speed/bench_trime_speed.py --model $R/trime/trimelm-ext/final --datastore $R/trime/ds-500k \
    --max-tokens 10000 --repeats 2 --legacy --nprobes 16 8 4 --dot-index \
    --alt-index $R/trime/ds-500k/index-ivf4096.faiss --alt-nprobes 32 16 --exact-recall --threads "$THREADS" \
    --json $D/trime_local_vs_external.json
fi
