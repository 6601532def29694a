"""The permanent adversarial suite: bad paths, bad numbers and bad files on every subcommand.

Each case runs ``memlm.cli.main(argv)`` in-process and must end with exit status 2, exactly one stderr line starting
``error:``, no traceback, and no change to any file that existed before (the fixture folder is hashed before and
after).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Doc, make_toy_docs

from memlm.cli import main
from memlm.errors import MemlmError


def _tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_lm):
    """A folder with everything a command may be pointed at: model, corpus, datastore, dumps, junk files."""
    from memlm.knnlm.table import TokenTable
    from memlm.knnlm.write import write_datastore
    from memlm.mixing.datastore import DatastoreComponent
    from memlm.trime.inference import TrimeScores

    root = tmp_path_factory.mktemp("adversarial")
    model, tok = tiny_lm
    (root / "model").mkdir()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    docs = make_toy_docs(12, seed=5)
    (root / "corpus").mkdir()
    for d in docs:
        (root / "corpus" / f"{d.id}.txt").write_text(d.text)
    write_datastore(model, tok, docs, root / "ds", window=32, min_context=8, progress=False)
    from memlm.storage.datastore import Datastore
    from memlm.storage.index import build_index

    ds = Datastore.open(root / "ds")
    build_index(ds.keys, ds.index_path, factory="Flat", metric="l2")
    _bad_calibration(root / "ds", root / "badcal", len(ds))
    # datastores whose indexes an `eval --index` of ds must refuse: the same documents in another
    # order (same size and dimension, other entries behind each id) and a larger one
    write_datastore(model, tok, docs[::-1], root / "ds_reordered", window=32, min_context=8, progress=False)
    more = [*docs, Doc("extra", make_toy_docs(1, seed=6)[0].text)]
    write_datastore(model, tok, more, root / "ds_larger", window=32, min_context=8, progress=False)
    for name in ("ds_reordered", "ds_larger"):
        other = Datastore.open(root / name)
        build_index(other.keys, other.index_path, factory="Flat", metric="l2")
    n = 20
    rng = np.random.default_rng(0)
    table = TokenTable(
        targets=rng.integers(0, 100, n), lm_logprob=-rng.random(n).astype(np.float32), doc_index=np.zeros(n, np.int32)
    )
    table.add(DatastoreComponent(None, 4), {"scores": -rng.random((n, 4)).astype(np.float32),
                                            "values": rng.integers(0, 100, (n, 4)).astype(np.int32)})  # fmt: skip
    table.save(root / "knn.npz")
    TrimeScores(
        targets=rng.integers(0, 100, n),
        doc_index=np.zeros(n, np.int32),
        segment_index=np.zeros(n, np.int32),
        target_logit=rng.random(n).astype(np.float32),
        logit_lse=(rng.random(n) + 5).astype(np.float32),
        mem_all=rng.random((n, 1, 3)).astype(np.float32),
        mem_hit=rng.random((n, 1, 3)).astype(np.float32),
        meta={"local_temperatures": [1.0]},
    ).save(root / "trime.npz")
    data = (root / "knn.npz").read_bytes()
    (root / "truncated.npz").write_bytes(data[: len(data) // 2])
    (root / "junk.npz").write_bytes(rng.bytes(3000))
    (root / "file.txt").write_text("a plain file\n")
    (root / "emptydir").mkdir()
    (root / "junkds").mkdir()
    (root / "junkds" / "manifest.json").write_bytes(rng.bytes(200))
    (root / "listds").mkdir()
    (root / "listds" / "manifest.json").write_text("[]")
    import shutil

    shutil.copytree(root / "ds", root / "ds2")  # another finished datastore
    (root / "shardedds").mkdir()
    (root / "shardedds" / "shards.json").write_text("{}")  # what marks a sharded datastore folder
    return root


def _bad_calibration(ds: Path, out: Path, count: int, **fields: float) -> None:
    """A copy of datastore ``ds`` whose manifest records a calibration whose stored mixture has ``fields`` (default
    its rule weight 1.5, outside [0, 1]), its checksum resealed as the API could have written it."""
    import math
    import shutil

    from memlm.storage.folder import manifest_digest

    shutil.copytree(ds, out)
    m = json.loads((out / "manifest.json").read_text())
    weight = fields.pop("knn", 1.5)
    mixture = {"fit": {}, "temperature": 1.0, "k": 4, "rule_weights": {"knn": weight}, **fields}
    m["calibration"] = {"k": 4, "tokens": 10, "count": count, "base_ppl": 9.0, "mixture": mixture}
    if all(math.isfinite(v) for v in fields.values()):
        m["manifest_sha256"] = manifest_digest(m)
    (out / "manifest.json").write_text(json.dumps(m))


M, C, DS = "{root}/model", "{root}/corpus", "{root}/ds"
F, D, NO = "{root}/file.txt", "{root}/emptydir", "{root}/no/such"
KD, TD, TR, JK = "{root}/knn.npz", "{root}/trime.npz", "{root}/truncated.npz", "{root}/junk.npz"

BUILD = ["datastore", "build", "--model", M, "--corpus", C, "--window", "32", "--min-context", "8"]
EVAL = ["eval", "--model", M, "--corpus", C, "--memory", DS, "--window", "32", "--min-context", "8", "--k", "4"]
TUNE = ["tune", "--valid", KD]
GEN = ["generate", "--model", M, "--memory", DS + "?k=4", "--prompt", "the cat"]
TRAIN = ["train", "--corpus", C, "--from-scratch", "1x32", "--tokenizer", M, "--steps", "1", "--out", "{root}/run"]
ANALYZE = ["analyze", "--model", M, "--datastore-att", DS, "--out", "{root}/an"]
NPMI = ["npm", "index", "--encoder", M, "--corpus", C, "--out", "{root}/pi"]
NPMP = ["npm", "predict", "--index", DS]
NPMC = ["npm", "classify", "--index", DS, "--labels", "a=x;b=y"]
NPME = ["npm", "eval", "--task", "bbc", "--index", DS]
TEV = ["trime-eval", "--model", M, "--corpus", C, "--seq-len", "16"]
TTU = ["trime-tune", "--valid", TD]

CASES: list[tuple[str, list[str]]] = [
    # top level
    ("no-command", []),
    ("bad-command", ["bogus"]),
    ("models-extra", ["models", "--x"]),
    ("corpora-extra", ["corpora", "--x"]),
    # ngram build / info (the ∞-gram memory)
    ("ngram-build-missing-corpus", ["ngram", "build", "--model", M, "--corpus", NO, "--out", "{root}/ng"]),
    ("ngram-build-empty-corpus", ["ngram", "build", "--model", M, "--corpus", D, "--out", "{root}/ng"]),
    ("ngram-build-no-out", ["ngram", "build", "--model", M, "--corpus", C]),
    ("ngram-build-into-datastore", ["ngram", "build", "--model", M, "--corpus", C, "--out", DS]),
    ("ngram-info-missing", ["ngram", "info", NO]),
    ("ngram-info-datastore", ["ngram", "info", DS]),
    ("eval-ngram-missing", [*EVAL, "--memory", "ngram:" + NO]),
    ("eval-ngram-datastore-folder", [*EVAL, "--memory", "ngram:" + DS]),
    ("lm-eval-k-0", ["lm-eval", "--tasks", "memlm_wikitext2", "--memory", DS + "?k=0"]),
    (
        "lm-eval-ngram-datastore-folder",
        ["lm-eval", "--model", M, "--tasks", "memlm_wikitext2", "--memory", "ngram:" + DS],
    ),
    ("lm-eval-old-flag", ["lm-eval", "--model", M, "--tasks", "memlm_wikitext2", "--datastore", DS]),
    ("generate-ngram-datastore-folder", ["generate", "--model", M, "--memory", f"{DS};ngram:{DS}", "--prompt", "a"]),
    # datastore build
    ("build-out-file", [*BUILD, "--out", F]),
    ("build-out-under-file", [*BUILD, "--out", F + "/ds"]),
    ("build-window-0", [*BUILD, "--out", "{root}/o", "--window", "0"]),
    ("build-window-neg", [*BUILD, "--out", "{root}/o", "--window", "-1"]),
    ("build-window-text", [*BUILD, "--out", "{root}/o", "--window", "abc"]),
    ("build-minctx-neg", [*BUILD, "--out", "{root}/o", "--min-context", "-1"]),
    ("build-minctx-ge-window", [*BUILD, "--out", "{root}/o", "--min-context", "32"]),
    ("build-batch-0", [*BUILD, "--out", "{root}/o", "--batch-size", "0"]),
    ("build-max-tokens-0", [*BUILD, "--out", "{root}/o", "--max-tokens", "0"]),
    ("build-max-tokens-neg", [*BUILD, "--out", "{root}/o", "--max-tokens", "-5"]),
    ("build-factory-garbage", [*BUILD, "--out", "{root}/o", "--factory", "IVFfoo"]),
    ("build-factory-pq-dim", [*BUILD, "--out", "{root}/o", "--factory", "PQ7"]),
    ("build-factory-empty", [*BUILD, "--out", "{root}/o", "--factory", ""]),
    ("build-key-bogus", [*BUILD, "--out", "{root}/o", "--key", "bogus"]),
    ("build-key-layer-text", [*BUILD, "--out", "{root}/o", "--key", "ffn_in@x"]),
    ("build-metric-bogus", [*BUILD, "--out", "{root}/o", "--metric", "cos"]),
    ("build-corpus-missing", [*BUILD, "--out", "{root}/o", "--corpus", NO]),
    ("build-corpus-empty-dir", [*BUILD, "--out", "{root}/o", "--corpus", D]),
    ("build-model-missing", [*BUILD, "--out", "{root}/o", "--model", NO]),
    # datastore info
    ("info-missing", ["datastore", "info", NO]),
    ("info-file", ["datastore", "info", F]),
    ("info-empty-dir", ["datastore", "info", D]),
    ("info-junk-manifest", ["datastore", "info", "{root}/junkds"]),
    ("info-list-manifest", ["datastore", "info", "{root}/listds"]),
    # datastore prune
    ("prune-missing", ["datastore", "prune", NO, "--out", "{root}/o"]),
    ("prune-file", ["datastore", "prune", F, "--out", "{root}/o"]),
    ("prune-out-file", ["datastore", "prune", DS, "--out", F]),
    ("prune-k-merge-0", ["datastore", "prune", DS, "--out", "{root}/o", "--k-merge", "0"]),
    ("prune-no-out", ["datastore", "prune", DS]),
    ("prune-junk-manifest", ["datastore", "prune", "{root}/junkds", "--out", "{root}/o"]),
    ("prune-out-other-datastore", ["datastore", "prune", DS, "--out", "{root}/ds2"]),  # replaced it, exit 0
    ("prune-sharded", ["datastore", "prune", "{root}/shardedds", "--out", "{root}/o"]),  # "not a memlm datastore"
    ("prune-seed-neg", ["datastore", "prune", DS, "--out", "{root}/o", "--seed", "-1"]),
    # datastore calibrate
    ("calibrate-missing", ["datastore", "calibrate", NO, "--corpus", C]),
    ("calibrate-own-text", ["datastore", "calibrate", DS, "--model", M, "--corpus", C]),
    ("calibrate-k-0", ["datastore", "calibrate", DS, "--corpus", C, "--k", "0"]),
    # gate train
    ("gate-dump-missing", ["gate", "train", "--dump", NO, "--out", "{root}/o.npz"]),
    ("gate-dump-trime", ["gate", "train", "--dump", TD, "--out", "{root}/o.npz"]),
    ("gate-dump-junk", ["gate", "train", "--dump", JK, "--out", "{root}/o.npz"]),
    ("gate-dump-no-entropy", ["gate", "train", "--dump", KD, "--out", "{root}/o.npz"]),
    ("gate-out-under-file", ["gate", "train", "--dump", KD, "--out", F + "/g.npz"]),
    ("gate-steps-0", ["gate", "train", "--dump", KD, "--out", "{root}/o.npz", "--steps", "0"]),
    # index build
    ("index-missing", ["index", "build", NO]),
    ("index-file", ["index", "build", F]),
    ("index-empty-dir", ["index", "build", D]),
    ("index-factory-garbage", ["index", "build", DS, "--factory", "IVFfoo"]),
    ("index-factory-pq-dim", ["index", "build", DS, "--factory", "PQ7"]),
    ("index-train-size-0", ["index", "build", DS, "--train-size", "0"]),
    ("index-junk-manifest", ["index", "build", "{root}/junkds"]),
    # eval
    ("eval-k-neg", [*EVAL, "--k", "-5"]),
    ("eval-adaptive-missing", [*EVAL, "--adaptive", NO]),
    ("eval-adaptive-junk", [*EVAL, "--adaptive", JK]),
    ("eval-adaptive-fraction-alone", [*EVAL, "--adaptive-fraction", "0.5"]),
    ("eval-adaptive-fraction-1.5", [*EVAL, "--adaptive", KD, "--adaptive-fraction", "1.5"]),
    ("eval-pointer-neg", [*EVAL, "--pointer-min", "-1"]),
    ("eval-pipeline-pointer", [*EVAL, "--pointer-min", "4", "--pipeline"]),
    ("eval-pointer-rule-without-min", [*EVAL, "--pointer-rule", "replace"]),
    ("eval-pointer-rule-bogus", [*EVAL, "--pointer-min", "4", "--pointer-rule", "bogus"]),
    ("eval-index-missing", [*EVAL, "--index", NO]),
    ("eval-index-of-same-size-datastore", [*EVAL, "--index", "{root}/ds_reordered/index.faiss"]),
    ("eval-index-of-same-size-datastore-mmap", [*EVAL, "--index", "{root}/ds_reordered/index.faiss", "--mmap-index"]),
    ("eval-index-of-larger-datastore", [*EVAL, "--index", "{root}/ds_larger/index.faiss"]),
    ("eval-k-0", [*EVAL, "--k", "0"]),
    ("eval-k-1e11", [*EVAL, "--k", "1e11"]),
    ("eval-k-huge", [*EVAL, "--k", "100000000000"]),
    ("eval-k-beyond-datastore", [*EVAL, "--k", "100000"]),
    ("eval-lambda-1.5", [*EVAL, "--lambda", "1.5"]),
    ("eval-lambda-neg", [*EVAL, "--lambda", "-0.1"]),
    ("eval-lambda-nan", [*EVAL, "--lambda", "nan"]),
    ("eval-temp-nan", [*EVAL, "--temperature", "nan"]),
    ("eval-temp-inf", [*EVAL, "--temperature", "inf"]),
    ("eval-temp-0", [*EVAL, "--temperature", "0"]),
    ("eval-temp-neg", [*EVAL, "--temperature", "-1"]),
    ("eval-cache-lambda-2", [*EVAL, "--memory", "cache", "--cache-lambda", "2"]),
    ("eval-cache-temp-0", [*EVAL, "--memory", "cache", "--cache-temperature", "0"]),
    ("eval-nprobe-0", [*EVAL, "--nprobe", "0"]),
    ("eval-batch-0", [*EVAL, "--batch-size", "0"]),
    ("eval-max-tokens-0", [*EVAL, "--max-tokens", "0"]),
    ("eval-window-eq-minctx", [*EVAL, "--window", "8", "--min-context", "8"]),
    ("eval-json-dir", [*EVAL, "--json", D]),
    ("eval-json-missing-parent", [*EVAL, "--json", NO + "/x.json"]),
    ("eval-json-under-file", [*EVAL, "--json", F + "/x.json"]),
    ("eval-dump-dir", [*EVAL, "--dump", D]),
    ("eval-dump-missing-parent", [*EVAL, "--dump", "{root}/no/such/dir/x.npz"]),
    ("eval-datastore-missing", [*EVAL, "--memory", NO]),
    ("eval-datastore-file", [*EVAL, "--memory", F]),
    ("eval-datastore-junk", [*EVAL, "--memory", "{root}/junkds"]),
    ("eval-calibration-lambda-1.5", [*EVAL, "--memory", "{root}/badcal"]),
    ("gen-calibration-lambda-1.5", [*GEN, "--memory", "{root}/badcal"]),
    ("eval-key-bogus", [*EVAL, "--key", "bogus"]),
    ("eval-key-other", [*EVAL, "--key", "final"]),
    ("eval-window-beyond-context", [*EVAL, "--window", "600"]),
    ("eval-split-bogus", [*EVAL, "--split", "bogus"]),
    ("build-window-beyond-context", [*BUILD, "--out", "{root}/o", "--window", "600"]),
    ("eval-search-bogus", [*EVAL, "--search", "fuzzy"]),
    ("eval-corpus-missing", [*EVAL, "--corpus", NO]),
    ("eval-model-missing", [*EVAL, "--model", NO]),
    # tune
    ("tune-valid-missing", ["tune", "--valid", NO]),
    ("tune-valid-dir", ["tune", "--valid", D]),
    ("tune-valid-junk", ["tune", "--valid", JK]),
    ("tune-valid-truncated", ["tune", "--valid", TR]),
    ("tune-valid-text", ["tune", "--valid", F]),
    ("tune-valid-trime-dump", ["tune", "--valid", TD]),
    ("tune-test-missing", [*TUNE, "--test", NO]),
    ("tune-test-truncated", [*TUNE, "--test", TR]),
    ("tune-k-neg", [*TUNE, "--k", "-3"]),
    ("tune-k-0", [*TUNE, "--k", "0"]),
    ("tune-lambdas-1.5", [*TUNE, "--lambdas", "1.5"]),
    ("tune-lambdas-nan", [*TUNE, "--lambdas", "0.1", "nan"]),
    ("tune-temps-0", [*TUNE, "--temperatures", "0"]),
    ("tune-temps-inf", [*TUNE, "--temperatures", "inf"]),
    ("tune-cache-lambdas-neg", [*TUNE, "--cache-lambdas", "-0.1"]),
    ("tune-json-dir", [*TUNE, "--json", D]),
    ("tune-json-under-file", [*TUNE, "--json", F + "/x.json"]),
    # generate
    ("gen-prompt-empty", [*GEN, "--prompt", ""]),
    ("gen-prompt-blank", [*GEN, "--prompt", "   "]),
    ("gen-max-new-0", [*GEN, "--max-new-tokens", "0"]),
    ("gen-max-new-neg", [*GEN, "--max-new-tokens", "-1"]),
    ("gen-k-0", [*GEN, "--memory", DS + "?k=0"]),
    ("gen-k-text", [*GEN, "--memory", DS + "?k=many"]),
    ("gen-memory-kind-bogus", [*GEN, "--memory", "bogus:" + DS]),
    ("gen-memory-option-bogus", [*GEN, "--memory", DS + "?colour=red"]),
    ("gen-no-memory", ["generate", "--model", M, "--prompt", "the cat"]),
    ("gen-mixture-weights-bogus", [*GEN, "--mixture", "knn=lots"]),
    ("gen-mixture-other-memory", [*GEN, "--mixture", "ngram=0.1/0.1"]),
    ("gen-lambda-1.5", [*GEN, "--lambda", "1.5"]),
    ("gen-temp-nan", [*GEN, "--temperature", "nan"]),
    ("gen-datastore-missing", [*GEN, "--memory", NO]),
    ("gen-datastore-file", [*GEN, "--memory", F]),
    ("gen-datastore-empty-dir", [*GEN, "--memory", D]),
    # train
    ("train-out-file", [*TRAIN, "--out", F]),
    ("train-out-under-file", [*TRAIN, "--out", F + "/run"]),
    ("train-steps-0", [*TRAIN, "--steps", "0"]),
    ("train-batch-0", [*TRAIN, "--batch-size", "0"]),
    ("train-grad-accum-0", [*TRAIN, "--grad-accum", "0"]),
    ("train-seq-len-0", [*TRAIN, "--seq-len", "0"]),
    ("train-lr-nan", [*TRAIN, "--lr", "nan"]),
    ("train-lr-neg", [*TRAIN, "--lr", "-1"]),
    ("train-wd-neg", [*TRAIN, "--weight-decay", "-1"]),
    ("train-warmup-neg", [*TRAIN, "--warmup", "-1"]),
    ("train-dropout-1.5", [*TRAIN, "--dropout", "1.5"]),
    ("train-drop-local-2", [*TRAIN, "--drop-local-p", "2"]),
    ("train-mask-budget-neg", [*TRAIN, "--mask-budget", "-0.1"]),
    ("train-ce-warmup-2", [*TRAIN, "--ce-warmup", "2"]),
    ("train-n-positions-0", [*TRAIN, "--n-positions", "0"]),
    ("train-stop-after-0", [*TRAIN, "--stop-after", "0"]),
    ("train-from-scratch-empty", [*TRAIN, "--from-scratch", ""]),
    ("train-corpus-missing", [*TRAIN, "--corpus", NO]),
    # analyze
    ("analyze-out-file", [*ANALYZE, "--out", F]),
    ("analyze-fractions-0", [*ANALYZE, "--fractions", "0"]),
    ("analyze-fractions-1.5", [*ANALYZE, "--fractions", "0.5,1.5"]),
    ("analyze-fractions-text", [*ANALYZE, "--fractions", "a,b"]),
    ("analyze-fig5-neg", [*ANALYZE, "--fig5-temperatures", "-1"]),
    ("analyze-learned-n-frac", [*ANALYZE, "--learned-n", "0.5"]),
    ("analyze-k-0", [*ANALYZE, "--k", "0"]),
    ("analyze-datastore-missing", [*ANALYZE, "--datastore-att", NO]),
    ("analyze-factory-garbage", [*ANALYZE, "--factory", "IVFfoo"]),
    ("analyze-window-eq-minctx", [*ANALYZE, "--window", "8", "--min-context", "8"]),
    ("analyze-skip-bogus", [*ANALYZE, "--skip", "bogus"]),
    ("analyze-skip-typo", [*ANALYZE, "--skip", "table1,learnd"]),
    # npm index
    ("npm-index-out-file", [*NPMI, "--out", F]),
    ("npm-index-batch-0", [*NPMI, "--batch-size", "0"]),
    ("npm-index-max-length-0", [*NPMI, "--max-length", "0"]),
    ("npm-index-factory-garbage", [*NPMI, "--factory", "IVFfoo"]),
    ("npm-index-max-tokens-0", [*NPMI, "--max-tokens", "0"]),
    # npm predict / classify / eval
    ("npm-predict-index-missing", ["npm", "predict", "--index", NO, "q [MASK]"]),
    ("npm-predict-index-file", ["npm", "predict", "--index", F, "q [MASK]"]),
    ("npm-predict-top-neg", [*NPMP, "--top", "-1", "q [MASK]"]),
    ("npm-predict-top-0", [*NPMP, "--top", "0", "q [MASK]"]),
    ("npm-predict-k-0", [*NPMP, "--k", "0", "q [MASK]"]),
    ("npm-predict-lmax-0", [*NPMP, "--l-max", "0", "q [MASK]"]),
    ("npm-predict-bm25-0", [*NPMP, "--bm25", "0", "q [MASK]"]),
    ("npm-predict-query-empty", [*NPMP, ""]),
    ("npm-predict-not-phrase-index", [*NPMP, "q [MASK]"]),
    ("npm-classify-tau-nan", [*NPMC, "--tau", "nan", "q [MASK]"]),
    ("npm-classify-tau-0", [*NPMC, "--tau", "0", "q [MASK]"]),
    ("npm-classify-one-label", ["npm", "classify", "--index", DS, "--labels", "a=x", "q [MASK]"]),
    ("npm-classify-empty-labels", ["npm", "classify", "--index", DS, "--labels", ";;", "q [MASK]"]),
    ("npm-eval-max-queries-0", [*NPME, "--max-queries", "0"]),
    ("npm-eval-distractors-neg", [*NPME, "--distractors", "-1"]),
    ("npm-eval-per-length-0", [*NPME, "--per-length", "0"]),
    ("npm-eval-json-dir", [*NPME, "--json", D]),
    ("npm-eval-work-file", [*NPME, "--work", F]),
    ("npm-eval-index-missing", ["npm", "eval", "--task", "bbc", "--index", NO]),
    ("npm-eval-ref-missing", [*NPME, "--reference-index", NO]),
    ("npm-eval-task-bogus", ["npm", "eval", "--task", "qa", "--index", DS]),
    # trime-eval
    ("trime-eval-seq-len-0", [*TEV, "--seq-len", "0"]),
    ("trime-eval-max-segments-neg", [*TEV, "--max-segments", "-1"]),
    ("trime-eval-local-temp-0", [*TEV, "--local-temperatures", "0"]),
    ("trime-eval-local-temp-text", [*TEV, "--local-temperatures", "a"]),
    ("trime-eval-local-temp-nan", [*TEV, "--local-temperatures", "1,nan"]),
    ("trime-eval-k-0", [*TEV, "--k", "0"]),
    ("trime-eval-batch-0", [*TEV, "--batch-size", "0"]),
    ("trime-eval-dump-dir", [*TEV, "--dump", D]),
    ("trime-eval-json-missing-parent", [*TEV, "--json", NO + "/x.json"]),
    ("trime-eval-datastore-missing", [*TEV, "--datastore", NO]),
    ("trime-eval-max-tokens-0", [*TEV, "--max-tokens", "0"]),
    # trime-tune
    ("trime-tune-knn-dump", ["trime-tune", "--valid", KD]),
    ("trime-tune-truncated", ["trime-tune", "--valid", TR]),
    ("trime-tune-junk", ["trime-tune", "--valid", JK]),
    ("trime-tune-missing", ["trime-tune", "--valid", NO]),
    ("trime-tune-test-knn-dump", [*TTU, "--test", KD]),
    ("trime-tune-segments-neg", [*TTU, "--segments", "-1"]),
    ("trime-tune-segments-frac", [*TTU, "--segments", "1.5"]),
    ("trime-tune-lambdas-1.5", [*TTU, "--lambdas", "1.5"]),
    ("trime-tune-temps-0", [*TTU, "--temperatures", "0"]),
    ("trime-tune-knn-temps-nan", [*TTU, "--knn-temperatures", "nan"]),
    ("trime-tune-local-temps-neg", [*TTU, "--local-temperatures", "-1"]),
    ("trime-tune-json-dir", [*TTU, "--json", D]),
    # demo
    ("demo-out-file", ["demo", "--out", F]),
    ("demo-out-under-file", ["demo", "--out", F + "/demo"]),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)`` with argparse's SystemExit folded into the exit status; returns (status, stderr)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def assert_one_error(code: int, err: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err, err
    assert code == 2, f"exit {code}: {err}"
    assert len(lines) == 1, err


@pytest.mark.parametrize(
    "name,argv",
    [pytest.param(n, a, id=n) for n, a in CASES],
)
def test_bad_input_is_one_error(name, argv, world, capsys, tmp_path):
    before = _tree_hash(world)
    code, err = run_cli([a.format(root=world) for a in argv], capsys)
    assert_one_error(code, err)
    after = _tree_hash(world)
    assert {k: v for k, v in after.items() if k in before} == before, "an existing file changed"
    created = set(after) - set(before)
    assert not {c for c in created if not c.startswith(("run", "o", "an", "pi"))}, created


def _subcommands() -> set[tuple[str, ...]]:
    """Every command line the real parser accepts, as its subcommand path: ('eval',), ('datastore', 'build'), ..."""
    from memlm.cli import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> set[tuple[str, ...]]:
        out: set[tuple[str, ...]] = set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out |= walk(sub, (*prefix, name)) or {(*prefix, name)}
        return out

    return walk(build_parser(), ())


def test_every_subcommand_has_rows():
    """Each subcommand of memlm.cli.build_parser (not a hand-kept list) has at least one row, so a new subcommand
    without bad-input rows fails here (`corpora` and `lm-eval` had none); row names are unique (they are test ids)."""
    subs = _subcommands()
    covered = {tuple(a[:2]) if tuple(a[:2]) in subs else tuple(a[:1]) for _, a in CASES}
    assert len(subs) >= 20 and ("datastore", "build") in subs  # the walk finds nested subcommands
    assert not subs - covered, f"subcommands with no row in CASES: {sorted(subs - covered)}"
    assert len({n for n, _ in CASES}) == len(CASES)


# ------------------------------------------------------------------------------------------ validated up front


def test_bad_arguments_fail_before_the_model_is_loaded(world, capsys, monkeypatch):
    """--factory, --dump, --json, --k are checked before any model is loaded (today they failed after the pass)."""
    import memlm.cli.common as cli

    def no_model(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load_model", no_model)
    for extra in (["--dump", "{root}/no/such/dir/x.npz"], ["--json", D], ["--k", "-5"], ["--temperature", "nan"]):
        code, err = run_cli([a.format(root=world) for a in [*EVAL, *extra]], capsys)
        assert_one_error(code, err)
    # an index of another datastore is refused before the model loads, naming both
    for other in ("ds_reordered", "ds_larger"):
        index = f"{world}/{other}/index.faiss"
        code, err = run_cli([a.format(root=world) for a in [*EVAL, "--index", index]], capsys)
        assert_one_error(code, err)
        assert index in err and f"datastore {world}/ds " in err and ("keys sha256" in err or "count" in err)
    code, err = run_cli([a.format(root=world) for a in [*ANALYZE, "--skip", "table1,learnd"]], capsys)
    assert_one_error(code, err)
    assert "'learnd'" in err and "table1, approx, temperature, learned" in err
    code, err = run_cli(
        [a.format(root=world) for a in [*BUILD, "--out", "{root}/o", "--factory", "IVF8,PQfoo"]], capsys
    )
    assert_one_error(code, err)
    assert "IVF8,PQfoo" in err and "20160" not in err


def test_bad_calibration_in_a_manifest_fails_before_the_model_loads(world, capsys, monkeypatch, tmp_path):
    """A calibrated rule weight > 1, τ <= 0 or NaN in a manifest is refused when the datastore is opened, naming the
    manifest (it passed the schema and failed only after the model loaded, with a message that did not name it)."""
    import memlm.cli.common as cli

    def no_model(*_a, **_k):
        raise AssertionError("the model was loaded before the manifest was checked")

    monkeypatch.setattr(cli, "_load_model", no_model)
    n = json.loads((world / "ds" / "manifest.json").read_text())["count"]
    cases = {"lam": {"knn": 1.5}, "tau0": {"knn": 0.5, "temperature": 0.0},
             "taunan": {"knn": 0.5, "temperature": float("nan")}}  # fmt: skip
    for name, fields in cases.items():
        _bad_calibration(world / "ds", tmp_path / name, n, **fields)
        for cmd, flag in ((EVAL, "--memory"), (GEN, "--memory")):
            code, err = run_cli([a.format(root=world) for a in cmd] + [flag, str(tmp_path / name)], capsys)
            assert_one_error(code, err)
            field = "rule_weights.knn" if name == "lam" else "temperature"
            assert str(tmp_path / name / "manifest.json") in err and f"calibration.mixture.{field}" in err, err


def test_an_index_of_another_datastore_is_refused_by_the_api_too(world):
    """DatastoreMemory / open_index check the sidecar against the datastore searched, not the index's own folder
    (it was checked against ds_reordered's manifest and passed), with and without mmap."""
    from memlm.retrieval import DatastoreMemory
    from memlm.storage.sharded import open_datastore

    for mmap in (False, True):
        ds = open_datastore(world / "ds", mmap_index=mmap)
        DatastoreMemory(ds, index_path=world / "ds" / "index.faiss")  # its own index still opens
        for other in ("ds_reordered", "ds_larger"):
            with pytest.raises(MemlmError, match="not built from the datastore") as e:
                DatastoreMemory(ds, index_path=world / other / "index.faiss")
            assert str(world / other / "index.faiss") in str(e.value) and str(world / "ds") in str(e.value)


def test_missing_data_package_in_corpora_is_one_error(monkeypatch, capsys):
    """`memlm corpora` with a data package missing lists the others and ends with one error (was KeyError 'docs')."""
    import memlm.data.corpora as corpora

    def missing(module, install, corpus, *parts):
        raise MemlmError(
            f"corpus '{corpus}' needs the Python package {module}, which is not installed: run `{install}`."
        )

    monkeypatch.setattr(corpora, "_package_file", missing)
    corpora._named.cache_clear()
    try:
        code, err = run_cli(["corpora"], capsys)
    finally:
        corpora._named.cache_clear()
    assert_one_error(code, err)
    assert "not installed" in err


def test_output_path_checks(tmp_path):
    from memlm.cli import validate as V

    (tmp_path / "f").write_text("x")
    for convert, path, problem in [
        (V.output_file, tmp_path, "is a folder"),
        (V.output_file, tmp_path / "f" / "x.json", "which is a file"),
        (V.output_file, tmp_path / "a" / "x.json", "does not exist"),
        (V.output_dir, tmp_path / "f", "is a file"),
        (V.output_dir, tmp_path / "f" / "a" / "b", "which is a file"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=problem):
            convert(str(path))
    V.output_file(str(tmp_path / "f"))  # an existing file is overwritten
    V.output_dir(str(tmp_path / "new" / "deeper"))  # created by the command
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------ --max-tokens


def test_max_tokens_is_honoured_inside_one_long_document(tiny_lm):
    """One document longer than --max-tokens is cut (it used to be kept whole: 253,669 tokens for 2,000)."""
    from memlm.data.windows import limit_documents, tokenize_documents

    _, tok = tiny_lm
    long_doc = Doc("long", " ".join(make_toy_docs(40, seed=1)[i].text for i in range(40)))
    full = sum(len(c.tokens) for c in tokenize_documents([long_doc], tok))
    assert full > 500
    for budget in (1, 2, 17, 100, 333):
        docs = limit_documents([long_doc, Doc("b", "more text")], tok, budget)
        n = sum(len(c.tokens) for c in tokenize_documents(docs, tok))
        assert len(docs) == 1 and docs[0].id == "long"
        assert 2 <= n <= budget or (budget == 1 and n == 2)  # at least one character + EOS
        assert long_doc.text.startswith(docs[0].text)
        if budget > 2:
            assert n >= budget - 2  # the longest prefix, not an arbitrary short one
    from memlm.npm.train_npm import limit_encoder_documents

    for budget in (1, 50, 333):  # the encoder variant (no EOS) and plain-string documents
        docs = limit_encoder_documents([long_doc.text, "more"], tok, budget)
        n = len(tok(docs[0], add_special_tokens=False)["input_ids"])
        assert len(docs) == 1 and long_doc.text.startswith(docs[0]) and max(budget - 2, 1) <= n <= budget
    short = [Doc("a", "the cat sat"), Doc("b", "on the mat")]
    assert limit_documents(short, tok, 1000) == short  # under the budget nothing changes
    with pytest.raises(MemlmError):
        limit_documents(short, tok, 0)


# ------------------------------------------------------------------------------------------ score dumps


def test_dumps_of_the_wrong_kind_or_truncated_are_refused(world):
    from memlm.knnlm.table import TokenTable
    from memlm.trime.inference import TrimeScores

    assert len(TokenTable.load(world / "knn.npz")) == 20
    assert len(TrimeScores.load(world / "trime.npz")) == 20
    with pytest.raises(MemlmError, match="TRIME dump"):
        TokenTable.load(world / "trime.npz")
    with pytest.raises(MemlmError, match="kNN-LM dump"):
        TrimeScores.load(world / "knn.npz")
    for bad in ("truncated.npz", "junk.npz", "file.txt"):
        with pytest.raises(MemlmError):
            TokenTable.load(world / bad)
        with pytest.raises(MemlmError):
            TrimeScores.load(world / bad)


def test_dump_with_inconsistent_arrays_is_refused(tmp_path):
    from memlm.knnlm.table import TokenTable

    np.savez(
        tmp_path / "x.npz",
        targets=np.zeros(5, np.int64),
        lm_logprob=np.zeros(4, np.float32),
        doc_index=np.zeros(5, np.int32),
        meta=np.array(json.dumps({})),
    )
    with pytest.raises(MemlmError, match="rows"):
        TokenTable.load(tmp_path / "x.npz")
    np.savez(
        tmp_path / "y.npz",
        targets=np.zeros(5, np.int64),
        lm_logprob=np.zeros(5, np.float32),
        doc_index=np.zeros(5, np.int32),
        knn_scores=np.zeros((5, 3), np.float32),
        meta=np.array(json.dumps([1])),
    )
    with pytest.raises(MemlmError):
        TokenTable.load(tmp_path / "y.npz")


def test_prune_refusals_name_the_problem(world, capsys):
    """`datastore prune` on a sharded datastore said "not a memlm datastore"; into another finished datastore it
    replaced it and exited 0. Both now say what is wrong and what to do (fails on the earlier code)."""
    code, err = run_cli([a.format(root=world) for a in ["datastore", "prune", "{root}/shardedds", "--out", "{root}/o"]],
                        capsys)  # fmt: skip
    assert_one_error(code, err)
    assert "sharded datastore" in err and "--shards" in err
    code, err = run_cli([a.format(root=world) for a in ["datastore", "prune", DS, "--out", "{root}/ds2"]], capsys)
    assert_one_error(code, err)
    assert "already holds a datastore" in err and "--overwrite" in err
