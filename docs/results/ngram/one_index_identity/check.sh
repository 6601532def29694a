#!/bin/bash
# usage: check.sh WT OUTDIR   -- one --ngram: generate text (+sources) and lm-eval values, for a before/after diff
set -e
WT=$1; OUT=$2; mkdir -p $OUT
export HF_HUB_OFFLINE=1 PYTHONPATH=$WT/src
PY=/work/main/.venv/bin/python
NG=/work/data/ngram/wt2-train; DS=/work/data/eff/wt2-100k
$PY -m memlm.cli generate --model smollm2-135m --ngram $NG --prompt "The history of" --max-new-tokens 20 --show-sources 1 > $OUT/gen_sample.txt 2> $OUT/gen_sample.err
$PY -m memlm.cli generate --model smollm2-135m --ngram $NG --prompt "The history of" --max-new-tokens 20 --greedy --ngram-lambda-sparse 0.5 --ngram-lambda-dense 0.1 > $OUT/gen_greedy.txt 2> $OUT/gen_greedy.err
$PY -m memlm.cli generate --model smollm2-135m --datastore $DS --ngram $NG --prompt "The history of" --max-new-tokens 20 --show-sources 1 --k 64 > $OUT/gen_knn.txt 2> $OUT/gen_knn.err
$PY - > $OUT/lmeval.txt 2> $OUT/lmeval.err <<PYEOF
from memlm.lmeval.model import MemlmLM
lm = MemlmLM(model="smollm2-135m", ngram="$NG", window=256, min_context=128, dtype="float32")
enc = lm.tok_encode
ctx, cont = enc("The history of the city begins"), enc(" in the 12th century , when a castle was built")
print(repr(lm._loglikelihood_tokens([(("a", "b"), ctx, cont)])))
print(repr(float(lm.rolling_token_logprobs(enc("The game was released in Japan in 2011 and in North America later that year .")).sum())))
lm2 = MemlmLM(model="smollm2-135m", ngram="$NG", datastore="$DS", lam=0.25, k=64, cache=True, window=256, min_context=128, dtype="float32", ngram_lambda_sparse=0.4, ngram_lambda_dense=0.05)
print(repr(lm2._loglikelihood_tokens([(("a", "b"), ctx, cont)])))
print(repr(float(lm2.rolling_token_logprobs(enc("The game was released in Japan in 2011 and in North America later that year .")).sum())))
print(lm2.memory_settings)
PYEOF
echo done
