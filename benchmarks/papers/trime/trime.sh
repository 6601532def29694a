#!/bin/bash
# TRIME (Zhong et al. 2022) in our setting, for docs/results/trime.md: one architecture (GPT-2 4x256, a byte-level BPE with
# 8,192 types trained on wiki+news train), one data set (wiki+news train) and one compute budget (STEPS updates of
# 16 x 256 tokens) for the vanilla LM, TrimeLM, TrimeLM_long and TrimeLM_ext, plus two ablations of TrimeLM_ext
# (random instead of BM25 batches; local-memory dropout p = 0 instead of 0.9). Then test perplexity with each memory,
# every hyper-parameter (M, tau, lambda, cache weight) tuned on valid. Every step resumes when rerun.
#   bash benchmarks/papers/trime/trime.sh [train|train-vanilla|train-main|train-ablations|eval|all|eval-2k|train-seeds|eval-seeds]
#   bash benchmarks/papers/trime/trime.sh train-only NAME...   (e.g. trimelm-s1 trimelm-ext-detach: one queue per core)
#   bash benchmarks/papers/trime/trime.sh eval-only NAME... / eval-appd NAME...   (the tables used EVAL_TOKENS=40000 DS_TOKENS=500000)
#   bash benchmarks/papers/trime/trime.sh knnlm-only vanilla vanilla-s1 ...   (kNN-LM + cache rows over each run's own datastore)
# train-seeds / eval-seeds: seeds 1 and 2 of the four main models, the 'w/o back-prop to
# memory' ablation (--detach-memory) and local-memory dropout p = 0.5 (p = 0.9 and 0 are trimelm-ext and
# trimelm-ext-p0); eval-seeds also scores the main models with App. D's overlapping windows over the documents read
# as one stream (--stream --context 127: exactly the windows and targets of the kNN-LM rows), into eval-NAME-appd/.
# eval-2k evaluates vanilla-2k, trimelm-2k, trimelm-long-2k and trimelm-ext-2k: the four models with the same settings but 2,000 updates,
# trained on a GPU (benchmarks/papers/trime/device_train.sh; the commands are in runs/trime/*-2k/final/device-command.txt):
#   memlm train --corpus wiki,news --from-scratch 4x256 --tokenizer runs/trime/tokenizer --n-positions 256 \
#     --seq-len 256 --batch-size 16 --steps 2000 --lr 1e-3 --eval-every 500 --valid-tokens 50000 --dtype bfloat16 \
#     --loss ce|trime|trime-long|trime-ext (+ the flags of train-main) --out runs/trime/NAME-2k
# (train-main and train-ablations can run side by side, one core each: OMP_NUM_THREADS=1; each TRIME model took about
# 20-30 min that way, the vanilla LM 8 min; the evaluation takes about 20 min)
set -euo pipefail
cd "$(dirname "$0")/../../.."
M=.venv/bin/memlm
R=${RUNS:-runs}/trime
STEPS=${STEPS:-400}
TOKENS=${EVAL_TOKENS:-60000}       # per split: leading documents of wiki+news valid / test
DS_TOKENS=${DS_TOKENS:-1000000}    # external memory / kNN-LM datastore: leading wiki+news train tokens
what=${1:-all}
mkdir -p "$R"

train() {  # name, extra flags
  local name=$1; shift
  [[ -d $R/$name/final ]] && return 0
  # the BPE of the first run is shared by all, so every model sees the same token sequence
  local tok=bpe:8192; [[ -d $R/tokenizer ]] && tok=$R/tokenizer
  $M train --out "$R/$name" --corpus wiki,news --from-scratch 4x256 --tokenizer "$tok" --n-positions 256 \
    --seq-len 256 --batch-size 16 --steps "$STEPS" --lr 1e-3 --eval-every 100 --save-every 50 \
    --valid-tokens 50000 --dtype bfloat16 "$@"
  [[ -d $R/tokenizer ]] || cp -r "$R/$name/tokenizer" "$R/tokenizer"
}

train_named() {  # NAME[-sSEED][-2k-cpu]: every model of docs/results/trime.md by name; -sN trains the same model with --seed N,
  # -2k-cpu with the 2,000 updates of the GPU runs (NAME-2k), here
  local name=$1 base=$1 extra=()
  if [[ $base =~ ^(.*)-2k-cpu$ ]]; then  # the 2,000-update recipe of the GPU runs (eval-2k), trained here on the CPU
    base=${BASH_REMATCH[1]} extra=(--steps 2000 --eval-every 500)  # given after train's own: these win
  fi
  if [[ $base =~ ^(.*)-s([0-9]+)$ ]]; then base=${BASH_REMATCH[1]} extra+=(--seed "${BASH_REMATCH[2]}"); fi
  case $base in
    vanilla) train "$name" --loss ce "${extra[@]}" ;;
    trimelm) train "$name" --loss trime "${extra[@]}" ;;
    trimelm-long) train "$name" --loss trime-long --segments-per-doc 4 "${extra[@]}" ;;
    trimelm-ext) train "$name" --loss trime-ext --packing bm25 --drop-local-p 0.9 "${extra[@]}" ;;
    trimelm-ext-random) train "$name" --loss trime-ext --packing random --drop-local-p 0.9 "${extra[@]}" ;;
    trimelm-ext-p0) train "$name" --loss trime-ext --packing bm25 --drop-local-p 0 "${extra[@]}" ;;
    trimelm-ext-p05) train "$name" --loss trime-ext --packing bm25 --drop-local-p 0.5 "${extra[@]}" ;;
    trimelm-ext-detach) train "$name" --loss trime-ext --packing bm25 --drop-local-p 0.9 --detach-memory "${extra[@]}" ;;
    *) echo "trime.sh: no model named $name" >&2; return 1 ;;
  esac
}

datastore() {  # model run name
  local name=$1
  [[ -f $R/ds-$name/index.faiss ]] && return 0
  $M datastore build --model "$R/$name/final" --dtype bfloat16 --corpus wiki,news --split train \
    --max-tokens "$DS_TOKENS" --key ffn_in --window 256 --min-context 128 --batch-size 32 \
    --factory IVF1024,Flat --metric l2 --out "$R/ds-$name"
}

trime_eval() {  # run name, extra flags; dumps for valid and test, then tune on valid and apply to test
  local name=$1; shift
  local out=$R/eval-$name
  mkdir -p "$out"
  for split in valid test; do
    [[ -f $out/$split.npz ]] && continue
    $M trime-eval --model "$R/$name/final" --dtype bfloat16 --corpus wiki,news --split $split \
      --max-tokens "$TOKENS" --seq-len 256 --max-segments 8 --local-temperatures 0.5,1,2,4,8 --batch-size 16 \
      --dump "$out/$split.npz" --json "$out/$split.json" "$@"
  done
  $M trime-tune --valid "$out/valid.npz" --test "$out/test.npz" --json "$out/tuned.json"
}

trime_eval_appd() {  # run name, extra flags: App. D protocol with the kNN-LM rows' windows: the documents as one
  # stream, windows of 256 tokens, each scoring the targets after the previous window's with >= 128 tokens before them
  # (--context 127: the first scored target is predicted from 128 tokens, as memlm eval --window 256 --min-context 128)
  local name=$1; shift
  local out=$R/eval-$name-appd
  mkdir -p "$out"
  for split in valid test; do
    [[ -f $out/$split.npz ]] && continue
    $M trime-eval --model "$R/$name/final" --dtype bfloat16 --corpus wiki,news --split $split \
      --max-tokens "$TOKENS" --seq-len 256 --stream --context 127 --max-segments 8 \
      --local-temperatures 0.5,1,2,4,8 --batch-size 16 --dump "$out/$split.npz" --json "$out/$split.json" "$@"
  done
  $M trime-tune --valid "$out/valid.npz" --test "$out/test.npz" --json "$out/tuned.json"
}

eval_named() {  # NAME [appd]: trime-eval with every memory (segments, or App. D's windows with appd); a TrimeLM_ext
  # model (trimelm-ext*) also gets its own datastore as external memory
  local name=$1 how=${2:-segments} ds=()
  if [[ $name == trimelm-ext* ]]; then datastore "$name"; ds=(--datastore "$R/ds-$name"); fi
  if [[ $how == appd ]]; then trime_eval_appd "$name" "${ds[@]}"; else trime_eval "$name" "${ds[@]}"; fi
}

knnlm_eval() {  # [vanilla run]: + continuous cache, + kNN-LM (+ cache), with the kNN-LM machinery
  local name=${1:-vanilla}
  local out=$R/eval-$name-knnlm
  mkdir -p "$out"
  for split in valid test; do
    [[ -f $out/$split.npz ]] && continue
    $M eval --model "$R/$name/final" --dtype bfloat16 --corpus wiki,news --split $split --max-tokens "$TOKENS" \
      --memory "$R/ds-$name" --memory cache --k 1024 --window 256 --min-context 128 --batch-size 16 \
      --dump "$out/$split.npz" --json "$out/$split.json"
  done
  # the datastore's λ and the cache's λc fitted together by EM (memlm tune's rule), τ and τc the most likely
  $M tune --valid "$out/valid.npz" --test "$out/test.npz" --cache-temperatures 0.5 1 2 --json "$out/knnlm-cache.json"
}

if [[ $what == train-vanilla ]]; then  # the vanilla LM alone (benchmarks/papers/xu2023/analysis.sh scratch)
  train_named vanilla
fi
if [[ $what == train || $what == all || $what == train-main ]]; then
  for name in vanilla trimelm trimelm-long trimelm-ext; do train_named $name; done
fi
if [[ $what == train || $what == all || $what == train-ablations ]]; then  # may run beside train-main
  for name in trimelm-ext-random trimelm-ext-p0; do train_named $name; done
fi
if [[ $what == train-only ]]; then  # train-only NAME...: these models, in this order (a queue per core)
  shift
  for name in "$@"; do train_named "$name"; done
fi

if [[ $what == eval || $what == all ]]; then
  datastore vanilla
  knnlm_eval
  for name in vanilla trimelm trimelm-long trimelm-ext trimelm-ext-random trimelm-ext-p0; do eval_named $name; done
fi

if [[ $what == eval-2k ]]; then
  trime_eval vanilla-2k
  trime_eval trimelm-2k
  trime_eval trimelm-long-2k
  datastore vanilla-2k
  knnlm_eval vanilla-2k
  datastore trimelm-ext-2k
  trime_eval trimelm-ext-2k --datastore "$R/ds-trimelm-ext-2k"
fi

if [[ $what == train-seeds ]]; then
  for seed in 1 2; do
    for name in vanilla trimelm trimelm-long trimelm-ext; do train_named $name-s$seed; done
  done
  for name in trimelm-ext-detach trimelm-ext-p05; do train_named $name; done
fi
if [[ $what == eval-seeds ]]; then
  for name in vanilla trimelm trimelm-long trimelm-ext; do eval_named $name appd; done
  for seed in 1 2; do
    for name in vanilla trimelm trimelm-long trimelm-ext; do eval_named $name-s$seed; done
  done
  for name in trimelm-ext-detach trimelm-ext-p05; do eval_named $name; done
fi
if [[ $what == knnlm-only ]]; then  # knnlm-only NAME...: these vanilla runs (vanilla, vanilla-s1, ...) with a kNN-LM
  # over their own datastore and the continuous cache (App. D's windows, as every kNN-LM row)
  shift
  for name in "$@"; do datastore "$name"; knnlm_eval "$name"; done
fi
if [[ $what == eval-only || $what == eval-appd ]]; then  # eval-only|eval-appd NAME...: these trained models
  how=segments; [[ $what == eval-appd ]] && how=appd
  shift
  for name in "$@"; do eval_named "$name" $how; done
fi
