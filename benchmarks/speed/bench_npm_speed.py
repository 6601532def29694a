"""NPM vs the parametric MLM: queries/s on the cloze probes of ``memlm npm eval --task cloze`` (docs/results/npm.md,
Performance), measured back to back in one process.

The probes are the ones ``memlm npm eval --task cloze --index IDX --max-queries N`` draws (same corpus, seed and
filter); every predictor answers one query at a time as the CLI does (:func:`memlm.experiments.npm_tasks.npm_predictor`,
top-1, no contexts; :func:`memlm.experiments.npm_tasks.mlm_predictor`). The probes are cut into chunks and every chunk
is answered by each predictor in turn (MLM, NPM, and with ``--legacy`` the NPM code as it was at commit 8f5a147), so a
change in the machine's load hits all of them alike. Each predictor answers one untimed warm-up query first (it loads
the FAISS index). ``--legacy`` also checks that the current and the legacy NPM give the same top-1 phrase for every
probe. ``--project-group`` adds NPM with :func:`vectorised_group` in place of ``inference._group`` (a projection of a
change to that function's body, which this benchmark does not make in memlm).

    PYTHONPATH=src python benchmarks/speed/bench_npm_speed.py --index runs/npm/idx-npm --mlm runs/npm/mlm/final \\
        --max-queries 200 --legacy --json docs/results/speed/npm_vs_mlm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from memlm.data.corpora import load_corpora
from memlm.experiments import npm_tasks as tasks
from memlm.models.resources import load_encoder
from memlm.npm import inference as inf
from memlm.npm.encoder import encode_query
from memlm.npm.mlm import load_mlm
from memlm.npm.phrase_index import FILES, PhraseIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import load_average, machine, save_result  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# NPM as it was at commit 8f5a147: np.memmap columns, two one-query searches, the span loop, every
# distinct span decoded anew for each query


def legacy_index(pi: PhraseIndex) -> PhraseIndex:
    """The same index with np.memmap columns (how PhraseIndex.open held them) and the same FAISS index."""
    n, d = len(pi), pi.dim
    cols = {name: np.memmap(pi.path / f"{name}.bin", dtype=dt, mode="r", shape=(n, d) if name == "vectors" else (n,))
            for name, dt in FILES.items()}  # fmt: skip
    return PhraseIndex(pi.path, pi.manifest, doc_ids=pi.doc_ids, _faiss=pi.faiss_index(), **cols)


def legacy_candidate_spans(pi, starts, ends, l_max):
    n = len(pi)
    block = np.asarray(pi.block)
    out: set[tuple[int, int]] = set()
    for s in {int(x) for x in starts}:
        for j in range(s, min(s + l_max, n)):
            if block[j] != block[s]:
                break
            out.add((s, j))
    for e in {int(x) for x in ends}:
        for i in range(e, max(e - l_max, -1), -1):
            if block[i] != block[e]:
                break
            out.add((i, e))
    return np.array(sorted(out), dtype=np.int64).reshape(-1, 2)


def legacy_retrieve(pi, q, k):
    scores, ids = pi.search(np.asarray(q, dtype=np.float32)[None], k)
    keep = ids[0] >= 0
    return scores[0][keep] / np.sqrt(pi.dim), ids[0][keep]


def legacy_predictor(model, tok, pi, k, l_max):
    def predict(query):
        q_s, q_e = encode_query(model, tok, query)
        _, starts = legacy_retrieve(pi, q_s, k)
        _, ends = legacy_retrieve(pi, q_e, k)
        spans = legacy_candidate_spans(pi, starts, ends, l_max)
        preds = inf._group(pi, tok, spans, inf.span_log_scores(pi, spans, q_s, q_e), 1, False, 32)
        return preds[0].phrase if preds else None

    return predict


# ----------------------------------------------------------------------------------------------------------------
# A projection, not memlm code: inference._group with its per-span and per-phrase Python loops vectorised (its body
# is being moved to a shared module by another change, so it is left alone here). Same phrases, scores equal up to
# the summation order of the log-sum-exp; used only to show what that change would be worth.


def vectorised_group(pi, tokenizer, spans, log_scores, top, contexts, context_window):
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if not len(spans):
        return []
    dec = inf._cached_decode(tokenizer)
    tid = np.asarray(pi.token_ids)
    length = spans[:, 1] - spans[:, 0] + 1
    width = int(length.max())
    cols = np.arange(width)
    mat = np.where(cols < length[:, None], tid[np.minimum(spans[:, :1] + cols, len(tid) - 1)], -1).astype(np.int64)
    keys, inv = np.unique(mat, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    phrase_of: dict[str, int] = {}
    key_phrase = np.array([phrase_of.setdefault(dec.decode(row[row >= 0].tolist()).strip(), len(phrase_of))
                           for row in keys])  # fmt: skip
    phrases = list(phrase_of)
    g = key_phrase[inv]
    n = len(phrases)
    mx = np.full(n, -np.inf)
    np.maximum.at(mx, g, log_scores)
    acc = np.zeros(n)
    np.add.at(acc, g, np.exp(log_scores - mx[g]))
    lse = mx + np.log(acc)
    total = float(np.logaddexp.reduce(log_scores))
    order = sorted(range(n), key=lambda a: (-lse[a], phrases[a]))
    out = []
    for a in order[:top] if top is not None else order:
        rows = np.flatnonzero(g == a)
        rows = rows[np.argsort(-log_scores[rows], kind="stable")]
        hits = []
        for r in rows:
            i, j = (int(x) for x in spans[r])
            ctx = pi.context(tokenizer, i, j, context_window) if contexts else None
            hits.append(inf.SpanHit(i, j, pi.doc_ids[int(pi.doc[i])], int(pi.position[i]), float(np.exp(log_scores[r])),
                                    ctx))  # fmt: skip
        ls = float(lse[a])
        out.append(inf.PhrasePrediction(phrases[a], float(np.exp(ls)), float(np.exp(ls - total)), ls, tuple(hits)))
    return out


def projected_predictor(model, tok, pi, k, l_max):
    def predict(query):
        q_s, q_e = encode_query(model, tok, query)
        spans = inf._npm_spans(pi, q_s, q_e, k, l_max, None)
        preds = vectorised_group(pi, tok, spans, inf.span_log_scores(pi, spans, q_s, q_e), 1, False, 32)
        return preds[0].phrase if preds else None

    return predict


# ----------------------------------------------------------------------------------------------------------------


def stage_times(model, tok, pi, probes, k, l_max) -> dict[str, float]:
    """Mean ms per query of each stage of the current NPM path (encode, search, spans, span scores, grouping)."""
    t = dict.fromkeys(("encode", "search", "spans", "scores", "group"), 0.0)
    dec = inf._cached_decode(tok)
    for p in probes:
        t0 = time.perf_counter()
        q_s, q_e = encode_query(model, tok, p.query)
        t1 = time.perf_counter()
        (_, starts), (_, ends) = inf.retrieve_batch(pi, [q_s, q_e], k)
        t2 = time.perf_counter()
        spans = inf.candidate_spans(pi, starts, ends, l_max)
        t3 = time.perf_counter()
        logs = inf.span_log_scores(pi, spans, q_s, q_e)
        t4 = time.perf_counter()
        inf._group(pi, dec, spans, logs, 1, False, 32)
        t5 = time.perf_counter()
        for name, a, b in (("encode", t0, t1), ("search", t1, t2), ("spans", t2, t3), ("scores", t3, t4),
                           ("group", t4, t5)):  # fmt: skip
            t[name] += b - a
    return {name: 1000.0 * v / len(probes) for name, v in t.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True, help="NPM phrase index (memlm npm index); its encoder is used")
    p.add_argument("--mlm", required=True, help="the MLM baseline (memlm train --objective mlm)")
    p.add_argument("--max-queries", type=int, default=200)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--l-max", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=20, help="probes per turn of each predictor")
    p.add_argument("--legacy", action="store_true", help="also time the earlier NPM code (commit 8f5a147)")
    p.add_argument(
        "--project-group",
        action="store_true",
        help="also time NPM with a vectorised _group (a projection, see vectorised_group)",
    )
    p.add_argument("--stages", type=int, default=0, help="time the stages of the current NPM on N probes")
    p.add_argument("--dtype", default="float32", help="as memlm npm eval (default float32)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and FAISS (OpenMP) threads (default: theirs); on a loaded machine 1 avoids spin-waits",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)

    load0 = load_average()
    pi = PhraseIndex.open(args.index)
    model, tok = load_encoder(pi.manifest["encoder"]["model"]["name"], dtype=args.dtype)
    pi.check_encoder(model, tok)
    mlm, mlm_tok = load_mlm(args.mlm, dtype=args.dtype)
    docs = load_corpora(pi.manifest["corpus"]["corpus"], "test")
    probes = tasks.cloze_probes(docs, tasks.index_documents(pi, tok), tok, n=args.max_queries, seed=args.seed)
    predictors = {
        "mlm": tasks.mlm_predictor(mlm, mlm_tok),
        "npm": tasks.npm_predictor(model, tok, pi, k=args.k, l_max=args.l_max),
    }
    if args.legacy:
        predictors["npm_legacy"] = legacy_predictor(model, tok, legacy_index(pi), args.k, args.l_max)
    if args.project_group:
        predictors["npm_projected"] = projected_predictor(model, tok, pi, args.k, args.l_max)
    stats = {name: tasks.QueryStats() for name in predictors}
    answers: dict[str, list] = {name: [] for name in predictors}
    for fn in predictors.values():
        fn(probes[0].query)  # warm-up: loads the FAISS index, first-call allocations
    for s in range(0, len(probes), args.chunk):
        for name, fn in predictors.items():
            answers[name] += [stats[name].timed(fn, q.query) for q in probes[s : s + args.chunk]]
        done = "  ".join(f"{n} {st.queries_per_second:.2f} q/s" for n, st in stats.items())
        print(f"{min(s + args.chunk, len(probes)):4d}/{len(probes)} {done}", file=sys.stderr)
    speed = {name: st.as_dict() for name, st in stats.items()}
    qps = {name: st.queries_per_second for name, st in stats.items()}
    result = {
        "command": "PYTHONPATH=src python benchmarks/speed/bench_npm_speed.py " + " ".join(argv or sys.argv[1:]),
        "index": str(args.index),
        "index_tokens": len(pi),
        "index_factory": pi.manifest["index"]["factory"],
        "encoder": pi.manifest["encoder"]["model"]["name"],
        "mlm": args.mlm,
        "queries": len(probes),
        "k": args.k,
        "l_max": args.l_max,
        "queries_per_second": qps,
        "mlm_over_npm": qps["mlm"] / qps["npm"],
        "speed": speed,
        "em": {
            name: float(
                np.mean([tasks.exact_match(tok, a, pr.answer) for a, pr in zip(answers[name], probes, strict=True)])
            )
            for name in ("npm", *(["npm_legacy"] if args.legacy else []))
        },  # fmt: skip
        "loadavg_before": load0,
        "loadavg_after": load_average(),
        "machine": machine(),
    }
    if args.legacy:
        result["mlm_over_npm_legacy"] = qps["mlm"] / qps["npm_legacy"]
        result["npm_speedup_vs_legacy"] = qps["npm"] / qps["npm_legacy"]
        result["same_top1_as_legacy"] = sum(a == b for a, b in zip(answers["npm"], answers["npm_legacy"], strict=True))
    if args.project_group:
        result["mlm_over_npm_projected"] = qps["mlm"] / qps["npm_projected"]
        result["projected_same_top1"] = sum(
            a == b for a, b in zip(answers["npm"], answers["npm_projected"], strict=True)
        )
    if args.stages:
        result["npm_stage_ms"] = stage_times(model, tok, pi, probes[: args.stages], args.k, args.l_max)
    print(json.dumps(result, indent=2))
    save_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
