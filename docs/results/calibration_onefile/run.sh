#!/bin/bash
# issue 24 must-show: a one-file corpus evaluated with no λ/τ flags vs λ, τ tuned on held-out text (helper A, branch cal)
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/cal/src PYTHONUNBUFFERED=1
PY=/work/main/.venv/bin/python
D=/work/data/cal-onefile
R=/work/wt/cal/docs/results/calibration_onefile
echo "start $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg) commit $(git -C /work/wt/cal rev-parse --short HEAD)"
$PY - <<'PYEOF'
from memlm.data.corpora import load_documents
docs = load_documents("wikitext2", "train")
open("/work/data/cal-onefile/wikitext2-train.txt", "w", encoding="utf-8").write("\n\n".join(d.text for d in docs) + "\n")
print(f"wrote wikitext2-train.txt: {len(docs)} articles as one file")
PYEOF
$PY -m memlm.cli datastore build --model smollm2-135m --corpus $D/wikitext2-train.txt --max-tokens 300000 --out $D/ds
echo "built $(date -u +%FT%TZ)"
$PY -m memlm.cli eval --corpus wikitext2 --split test --max-tokens 20000 --datastore $D/ds --json $D/eval_test_no_flags.json --dump $D/test.npz
$PY -m memlm.cli eval --corpus wikitext2 --split valid --max-tokens 20000 --datastore $D/ds --json $D/eval_valid_no_flags.json --dump $D/valid.npz
$PY -m memlm.cli tune --valid $D/valid.npz --test $D/test.npz --json $D/tune_valid_to_test.json
mkdir -p $R
cp $D/eval_test_no_flags.json $D/eval_valid_no_flags.json $R/
cp $D/ds/manifest.json $R/datastore_manifest.json
$PY - <<'PYEOF'
import json
d = "/work/data/cal-onefile"
a = json.load(open(f"{d}/eval_test_no_flags.json"))
t = json.load(open(f"{d}/tune_valid_to_test.json"))
out = {"valid_best": t["valid"], "test": t["test"]}
json.dump(out, open("/work/wt/cal/docs/results/calibration_onefile/tune_valid_to_test.json", "w"), indent=1)
base = a["base_ppl"]
ga, gb = 1 - a["knn_ppl"] / base, 1 - t["test"]["knn_ppl"] / t["test"]["base_ppl"]
print(f"base {base:.4f}; (a) no flags λ={a['lambda']} τ={a['temperature']}: {a['knn_ppl']:.4f} ({ga:.2%}); "
      f"(b) tuned on valid λ={t['valid']['best']['lambda']} τ={t['valid']['best']['temperature']}: "
      f"{t['test']['knn_ppl']:.4f} ({gb:.2%}); gap {100 * (gb - ga):.2f} points")
PYEOF
echo "end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
