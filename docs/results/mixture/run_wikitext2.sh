#!/usr/bin/env bash
# Issue 35's WikiText-2 table (docs/results/mixture.md): the valid and test dumps with every memory (and the cache), then
# memlm tune --mixture gate per row (benchmarks/quality/mixture_table.py). Run from the repository root, niced: the machine's
# 2 cores were shared.
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=/work/main/.venv/bin/python
echo "== $(date -u) evals"
nice -n 10 $PY benchmarks/quality/mixture_table.py --evals-only
echo "== $(date -u) tune"
nice -n 10 $PY benchmarks/quality/mixture_table.py --stdlib /work/data/mixture
echo "== $(date -u) done"
