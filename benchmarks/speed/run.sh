#!/usr/bin/env bash
# benchmarks/speed/: the one entry point. Each step is the command behind one docs/results/performance.md (or
# efficient-knnlm.md, npm.md, trime.md) figure, on this CPU; the file names below are the AVX-512 / 2-core ones, so
# on another CPU pass OUT= a name of its own. Every timed step refuses a busy machine (benchmarks/protocol.py; --force
# records it as not idle). Run from the repository root.
#   bash benchmarks/speed/run.sh STEP [extra arguments for that script]
# STEP: forward | default-vs-old | head-statistics | allocator | key-error | int8 | int8-profile | int8-exactness |
#       ppl-intervals | compile-cost | commands | vs-knn-transformers | knnlm-perf | search | train | efficient |
#       npm-trime | demo
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PY:-python}
S=benchmarks/speed
R=docs/results/speed
step=${1:?"usage: bash benchmarks/speed/run.sh STEP [arguments] (the steps are listed in this file's header)"}
shift
case $step in
  forward) $PY $S/run.py --tokens 20000 --datastore data/ev-intervals/ds50k --out "${OUT:-$R/forward_2core.json}" "$@" ;;
  default-vs-old) $PY $S/default_vs_old.py --out "${OUT:-$R/default_vs_old_avx512.json}" "$@" ;;
  head-statistics) $PY $S/head_statistics.py --out "${OUT:-$R/head_statistics.json}" "$@" ;;
  allocator) $PY $S/allocator.py --out "${OUT:-$R/allocator.json}" "$@" ;;
  key-error) $PY $S/key_error.py --tokens 2048 --int8-variants --out "${OUT:-$R/key_error_avx512_int8.json}" "$@" ;;
  int8) $PY $S/int8_w8a8.py --corpus wikitext2 --build-tokens 24000 --rows float32,int8,no-outliers,float32-again \
    --out "${OUT:-$R/int8_outliers_fused.json}" "$@" ;;
  int8-profile) $PY $S/int8_profile.py --out "${OUT:-$R/int8_profile.json}" "$@" ;;
  int8-exactness) $PY $S/int8_exactness.py "$@" ;;
  ppl-intervals) $PY $S/ppl_intervals.py --work data/ppl-intervals-s44 --out "${OUT:-$R/ppl_intervals_int8.json}" "$@" ;;
  compile-cost) $PY $S/compile_cost.py --out "${OUT:-$R/compile_cost.json}" "$@" ;;
  commands) $PY $S/profile_commands.py --datastore data/imdb/ds50k --out "${OUT:-$R/commands_profile.json}" "$@" ;;
  vs-knn-transformers)
    [[ -d data/knn-transformers ]] || git clone https://github.com/neulab/knn-transformers data/knn-transformers
    $PY $S/vs_knn_transformers.py --datastore data/ev-intervals/ds50k --knn-transformers data/knn-transformers \
      --work data/vs-kt --tokens 20000 --out "${OUT:-$R/vs_knn_transformers.json}" "$@" ;;
  knnlm-perf) $PY $S/bench_knnlm_perf.py --out runs/perf "$@" ;;
  search) $PY $S/bench_search.py "$@" ;;
  train) $PY $S/bench_train.py --json "${OUT:-docs/results/train_throughput.json}" "$@" ;;
  efficient)
    $PY $S/bench_efficient.py run --datastore ds/wt2-1m --setup-only --out docs/results/efficient_knnlm
    $PY $S/bench_efficient.py run --datastore ds/wt2-1m --configs base,knn,adaptive,pointer,pruned,compressed \
      --out docs/results/efficient_knnlm "$@" ;;
  npm-trime) bash $S/speed.sh "${1:-all}" ;;
  demo) bash $S/time_demo_fresh_home.sh "${1:-avx512}" ;;
  *) echo "unknown step: $step (the steps are listed in the header of $0)" >&2; exit 2 ;;
esac
