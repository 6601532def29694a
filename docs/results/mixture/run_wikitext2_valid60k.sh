#!/usr/bin/env bash
# docs/results/mixture.md's WikiText-2 table: the valid dump (the first ~60k WikiText-2 valid tokens, 18 articles) and
# the test dumps with every memory (and the cache), then memlm tune --mixture gate per row
# (benchmarks/quality/mixture_table.py). Run from the repository root, niced.
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-python}
echo "== $(date -u) evals"
nice -n 10 $PY benchmarks/quality/mixture_table.py --valid-max-tokens 60000 --evals-only
echo "== $(date -u) tune"
nice -n 10 $PY benchmarks/quality/mixture_table.py --valid-max-tokens 60000 --out docs/results/mixture/wikitext2_valid60k.json
echo "== $(date -u) done"
