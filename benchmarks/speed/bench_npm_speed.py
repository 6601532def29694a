"""NPM vs the parametric MLM: queries/s on the cloze probes of ``memlm npm eval --task cloze`` (docs/results/npm.md,
Performance), measured back to back in one process.

The probes are the ones ``memlm npm eval --task cloze --index IDX --max-queries N`` draws (same corpus, seed and
filter); every predictor answers one query at a time as the CLI does (:func:`memlm.experiments.npm_tasks.npm_predictor`,
top-1, no contexts; :func:`memlm.experiments.npm_tasks.mlm_predictor`). The probes are cut into chunks and every chunk
is answered by each predictor in turn, so a change in the machine's load hits both alike. Each predictor answers one
untimed warm-up query first (it loads the FAISS index). ``--stages N`` adds the mean time of each stage of NPM
(encode, search, candidate spans, span scores, grouping into phrases) on N probes.

    PYTHONPATH=src python benchmarks/speed/bench_npm_speed.py --index runs/npm/idx-npm --mlm runs/npm/mlm/final \\
        --max-queries 100 --threads 1 --json docs/results/speed/npm_vs_mlm.json
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
from memlm.npm.phrase_index import PhraseIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import load_average, machine, save_result  # noqa: E402


def stage_times(model, tok, pi, probes, k, l_max) -> dict[str, float]:
    """Mean ms per query of each stage of the current NPM path (encode, search, spans, span scores, grouping)."""
    t = dict.fromkeys(("encode", "search", "spans", "scores", "group"), 0.0)
    dec = inf.cached_decoder(tok)
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
        inf.group_phrases(pi, dec, spans, logs, 1, False, 32)
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
            for name in ("npm",)
        },  # fmt: skip
        "loadavg_before": load0,
        "loadavg_after": load_average(),
        "machine": machine(),
    }
    if args.stages:
        result["npm_stage_ms"] = stage_times(model, tok, pi, probes[: args.stages], args.k, args.l_max)
    print(json.dumps(result, indent=2))
    save_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
