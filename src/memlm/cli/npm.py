"""``memlm npm index|predict|classify|eval``: NPM (Min et al. 2023) phrase indexes, masked-phrase prediction,
closed-set classification and the evaluation tasks (memlm.npm)."""

from __future__ import annotations

import argparse
from typing import Any

from memlm.cli import validate as V
from memlm.cli.common import add_corpus, write_json
from memlm.io.fileio import dumps_json

# memlm.npm imports torch: imported in the commands (see common.py)


def cmd_npm_index(args: argparse.Namespace) -> None:
    from memlm.experiments.npm_tasks import index_corpus

    pi = index_corpus(args.encoder, args.corpus, args.split, args.out, args.max_tokens, args.dtype,
                      max_length=args.max_length, batch_size=args.batch_size, factory=args.factory, progress=True,
                      overwrite=args.overwrite)  # fmt: skip
    m = pi.manifest
    print(
        f"phrase index {pi.path}: {len(pi)} token vectors, {pi.n_blocks} blocks of <= {m['block_tokens']} tokens, "
        f"dim {pi.dim}, index {m['index']['factory']} (encoder {m['encoder']['model']['name']})"
    )


def cmd_npm_predict(args: argparse.Namespace) -> None:
    from memlm.npm.inference import npm_predict, npm_single_predict
    from memlm.npm.phrase_index import open_with_encoder

    pi, model, tok = open_with_encoder(args.index, args.encoder, args.dtype)
    results = []
    for query in args.query:
        if args.single:
            preds = npm_single_predict(model, tok, pi, query, k=args.k, bm25_passages=args.bm25, top=args.top)
        else:
            preds = npm_predict(model, tok, pi, query, k=args.k, l_max=args.l_max, bm25_passages=args.bm25,
                                combine=args.combine, top=args.top)  # fmt: skip
        results.append((query, preds))
    if args.json:
        data = [{"query": q, "predictions": [p.summary() for p in preds]} for q, preds in results]
        print(dumps_json(data if len(data) > 1 else data[0], sort_keys=False))
        return
    for n, (query, preds) in enumerate(results):
        if n:
            print()
        print(f"query: {query}")
        if not preds:
            print("  (no candidate phrase retrieved)")
        for rank, p in enumerate(preds, 1):
            h = p.spans[0]
            print(f"{rank:3d}. {p.phrase!r:30s} score {p.score:.4g}  p={p.prob:.3f}  ({len(p.spans)} occurrences)")
            print(f"     [{h.doc_id} @ {h.position}] {h.context}")


def cmd_npm_classify(args: argparse.Namespace) -> None:
    from memlm.npm.inference import npm_classify
    from memlm.npm.phrase_index import open_with_encoder

    pi, model, tok = open_with_encoder(args.index, args.encoder, args.dtype)
    results = [
        {"query": query, **npm_classify(model, tok, pi, query, args.labels, single=args.single, k=args.k,
                                        l_max=args.l_max, tau=args.tau, bm25_passages=args.bm25).summary()}
        for query in args.query
    ]  # fmt: skip
    if args.json:
        print(dumps_json(results if len(results) > 1 else results[0], sort_keys=False))
        return
    for n, r in enumerate(results):
        if n:
            print()
        print(f"query: {r['query']}")
        for y, prob in sorted(r["probs"].items(), key=lambda kv: -kv[1]):
            print(f"  {y:20s} {prob:.4f}")
        note = "" if r["matched"] else " (no retrieved candidate matched a verbalizer: uniform)"
        print(f"label: {r['label']}{note}")


def cmd_npm_eval(args: argparse.Namespace) -> None:
    from memlm.experiments.npm_tasks import npm_eval

    res = npm_eval(args.task, args.index, encoder=args.encoder, mlm=args.mlm, dtype=args.dtype, single=args.single,
                   k=args.k, l_max=args.l_max, bm25_passages=args.bm25, tau=args.tau, max_queries=args.max_queries,
                   article_tokens=args.article_tokens, corpus=args.corpus, split=args.split,
                   reference_index=args.reference_index, per_length=args.per_length, distractors=args.distractors,
                   work=args.work, seed=args.seed, keep_predictions=args.predictions)  # fmt: skip
    _print_eval(res)
    write_json(args.json, res)


def _print_eval(res: dict[str, Any]) -> None:
    print(f"{res['task']}: {res['model']} (index {res['index']}, {res['index_tokens']} tokens)")
    if res["task"] in ("bbc", "cloze"):
        bbc = res["task"] == "bbc"
        key = "accuracy" if bbc else "em"
        print(f"  {'label' if bbc else 'tokens':15s} {'n':>5s} {'acc' if bbc else 'EM':>7s}")
        for name, r in [*res["per_label" if bbc else "by_length"].items(), ("all", {"n": res["n"], key: res[key]})]:
            print(f"  {name:15s} {r['n']:5d} {'-' if r[key] is None else format(r[key], '7.3f'):>7s}")
        note = f"no verbalizer matched: {res['unmatched']:.1%}" if bbc else f"macro over lengths {res['macro_em']:.3f}"
        print(f"  ({note})")
        speed = res["speed"]
    else:
        print(f"  {res['n']} probes, {res['passages']} passages ({res['distractors']} distractors)")
        print(f"  original corpus -> original answer  EM {res['original_em']:.3f}")
        print(f"  edited corpus   -> edited answer    EM {res['updated_em']:.3f}   (still the old answer: "
              f"{res['stale']:.3f})")  # fmt: skip
        speed = res["edited"]["speed"]
    print(f"  {speed['queries_per_second']:.2f} queries/s ({speed['ms_per_query']:.0f} ms/query), "
          f"peak RSS {speed['peak_rss_mb']:.0f} MiB")  # fmt: skip


def check_npm_index(args: argparse.Namespace) -> None:
    V.check_factory(args.factory, "ip")


def add_parsers(sub) -> None:
    npm = sub.add_parser("npm", help="NPM (Min et al. 2023): phrase index, masked-phrase prediction, classification")
    nsub = npm.add_subparsers(dest="sub", required=True)
    ni = nsub.add_parser("index", help="encode every token of a corpus into a phrase index (rerun to resume)")
    ni.add_argument("--encoder", default="minilm-l6", help="named encoder, HF id or folder (default minilm-l6)")
    add_corpus(ni, "train")
    ni.add_argument("--out", type=V.output_dir, required=True, help="phrase-index folder")
    ni.add_argument("--overwrite", action="store_true", help="replace a phrase index built with other settings")
    ni.add_argument("--factory", default=None, help="FAISS factory string (default Flat for small corpora)")
    ni.add_argument(
        "--max-length", type=V.positive_int, default=None, help="encoder input length (default: the encoder's)"
    )
    ni.add_argument("--batch-size", type=V.positive_int, default=16)
    ni.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ni.set_defaults(func=cmd_npm_index, check=check_npm_index)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--index", type=V.existing_dir, required=True, help="phrase-index folder (memlm npm index)")
        p.add_argument("--encoder", default=None, help="encoder (default: the one the index was built with)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--k", type=V.neighbours, default=4096, help="start and end tokens retrieved (default 4096)")
        p.add_argument(
            "--l-max", type=V.positive_int, default=10, help="longest candidate phrase in tokens (default 10)"
        )
        p.add_argument("--single", action="store_true", help="NPM SINGLE: one [MASK], single-token predictions")
        p.add_argument(
            "--bm25",
            type=V.positive_int,
            nargs="?",
            const=3,
            default=None,
            metavar="N",
            help="search only the top-N BM25 passages of the query (default N 3, as §6.3)",
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.add_argument("query", nargs="+", type=V.nonempty_text, help="text with exactly one [MASK]")

    npr = nsub.add_parser("predict", help="fill the [MASK] of a query with ranked corpus phrases")
    common(npr)
    npr.add_argument("--top", type=V.positive_int, default=10, help="phrases to print (default 10)")
    npr.add_argument("--combine", default="a1", choices=["a1", "sum"], help="span score: App. A.1 (a1) or §3.1 sum")
    npr.set_defaults(func=cmd_npm_predict)
    nc = nsub.add_parser("classify", help="closed-set label probabilities (fuzzy verbalizers, App. A.4)")
    common(nc)
    nc.add_argument("--labels", type=V.labels, required=True,
                    help="label=verbalizer,verbalizer;label=... e.g. 'pos=great,good;neg=bad,awful'")  # fmt: skip
    nc.add_argument("--tau", type=V.positive_float, default=5.0, help="temperature of the candidate scores (default 5)")
    nc.set_defaults(func=cmd_npm_classify)
    ne = nsub.add_parser("eval", help="evaluation tasks: BBC topics (closed set), wiki cloze probes, corpus update")
    ne.add_argument("--task", required=True, choices=["bbc", "cloze", "update"])
    ne.add_argument(
        "--index",
        type=V.existing_dir,
        required=True,
        help="phrase index (memlm npm index); its corpus is the reference",
    )
    ne.add_argument("--encoder", default=None, help="encoder (default: the one the index was built with)")
    ne.add_argument("--mlm", default=None, metavar="MODEL", help="evaluate the MLM baseline (train --objective mlm)")
    ne.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ne.add_argument("--k", type=V.neighbours, default=4096, help="start and end tokens retrieved (default 4096)")
    ne.add_argument("--l-max", type=V.positive_int, default=10, help="longest candidate phrase in tokens (default 10)")
    ne.add_argument("--single", action="store_true", help="NPM SINGLE: one [MASK], single-token predictions")
    ne.add_argument("--bm25", type=V.positive_int, nargs="?", const=3, default=None, metavar="N",
                    help="search only the top-N BM25 passages of each query (default N 3, as §6.3)")  # fmt: skip
    ne.add_argument(
        "--tau", type=V.positive_float, default=5.0, help="bbc: temperature of the candidate scores (default 5)"
    )
    ne.add_argument("--max-queries", type=V.positive_int, default=None,
                    help="bbc: N test articles, a seeded sample (default all); cloze: N probes (500); update: N "
                    "probes (50)")  # fmt: skip
    ne.add_argument("--article-tokens", type=V.positive_int, default=256,
                    help="bbc: the query keeps at most this many article tokens before the template (default 256), "
                    "so [MASK] sits at about this position: keep it within the sequence length the encoder was "
                    "trained at")  # fmt: skip
    ne.add_argument("--corpus", default=None, help="documents to query (default: bbc; cloze: the index's corpus)")
    ne.add_argument("--split", default="test", help="split of --corpus (default test)")
    ne.add_argument(
        "--reference-index",
        type=V.existing_dir,
        default=None,
        help="cloze: keep probes whose answer occurs in this index's corpus (default --index)",
    )
    ne.add_argument("--per-length", type=V.positive_int, default=None, help="cloze: at most N probes per answer length")
    ne.add_argument("--distractors", type=V.nonneg_int, default=200, help="update: other passages in the small indexes")
    ne.add_argument(
        "--work", type=V.output_dir, default=None, help="update: folder of the original/edited indexes (INDEX.update)"
    )
    ne.add_argument("--seed", type=int, default=0, help="seed of the probe / article sample")
    ne.add_argument("--predictions", action="store_true", help="keep every query's prediction in the JSON")
    ne.add_argument("--json", type=V.output_file, default=None, metavar="OUT", help="write the results as JSON")
    ne.set_defaults(func=cmd_npm_eval)
