"""``memlm lm-eval``: EleutherAI's lm-evaluation-harness tasks on a model + memory (memlm.lmeval)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memlm.cli import validate as V
from memlm.cli.common import DEFAULT_MODEL, add_allow_overlap, add_model
from memlm.cli.memories import add_memory_args, checked_mixture, cli_mixture, memory_spec_of
from memlm.errors import MemlmError
from memlm.io.fileio import atomic_write_json
from memlm.lmeval import TASK_CORPORA, TASKS, task_manager


def cmd_lm_eval(args: argparse.Namespace) -> None:
    try:  # an optional dependency (memlm[lmeval]), slow to import: only here
        import lm_eval
        from lm_eval.utils import make_table
    except ImportError as error:
        raise MemlmError(
            "memlm lm-eval needs EleutherAI's lm-evaluation-harness: pip install 'memlm[lmeval]' (lm_eval==0.4.13)"
        ) from error
    from memlm.knnlm.memories import open_memories
    from memlm.lmeval.model import MemlmLM  # imports lm_eval and torch

    samples = None
    if args.samples:
        try:
            samples = json.loads(args.samples)
        except json.JSONDecodeError as error:
            raise MemlmError(
                f"--samples is not valid JSON ({error.msg}): write it like '{{\"memlm_wikitext2\": [0, 1, 2]}}'"
            ) from error
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = task_manager(include_defaults=args.lm_eval_tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise MemlmError(
            f"unknown lm-eval task(s) {unknown}: memlm's offline tasks are {', '.join(TASKS)}; add "
            "--lm-eval-tasks for lm_eval's own tasks (they download their data from the dataset hub)"
        )
    mixture = checked_mixture(args)
    components = open_memories(memory_spec_of(args) or None)
    lm = MemlmLM(
        model=args.model or DEFAULT_MODEL,
        memories=components,
        mixture=cli_mixture(args, components, mixture),
        window=args.window,
        min_context=args.min_context,
        max_length=args.max_length,
        batch_size=args.batch_size,
        dtype=args.dtype,
        progress=True,
    )
    leakage = _check_leakage(args, tasks, lm)
    print(f"memlm lm-eval: {json.dumps(lm.memory_settings)}", file=sys.stderr)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=args.limit, samples=samples, log_samples=False
    )
    print(make_table(out))
    if lm.memory_settings["approximate"]:  # P∞ over the vocabulary left some mass unassigned (MemlmLM's docstring)
        print(f"note: approximate ∞-gram results: {json.dumps(lm.memory_settings['approximate'])}", file=sys.stderr)
    if args.out:
        record = {
            "command": "memlm " + " ".join(sys.argv[1:]),
            "results": out["results"],
            "n-samples": out.get("n-samples"),
            "memlm": {**lm.memory_settings, "model": args.model or DEFAULT_MODEL, "dtype": args.dtype},
            "samples": samples,
            "limit": args.limit,
            "lm_eval_version": out.get("lm_eval_version"),
            "seconds": time.perf_counter() - t0,
            "leakage": leakage,
        }
        atomic_write_json(Path(args.out), record)
        print(f"wrote {args.out}")


def _check_leakage(args: argparse.Namespace, tasks: list[str], lm) -> dict:
    """Each of memlm's offline tasks (its named corpus and split, :data:`memlm.lmeval.TASK_CORPORA`) against the
    model's memories (memlm.leakage), refused unless ``--allow-overlap``; lm_eval's own tasks are not checked (their
    documents come from the dataset hub), and the record says so."""
    from memlm.data.corpora import corpus_fingerprint, load_documents
    from memlm.leakage import Evaluated, check_leakage

    out: dict = {}
    if not lm.datastores and not lm.ngrams:
        return out
    for task in tasks:
        if task not in TASK_CORPORA:
            out[task] = {"checked": False, "why": "not one of memlm's offline tasks (its documents are lm_eval's)"}
            continue
        corpus, split = TASK_CORPORA[task]
        docs = load_documents(corpus, split)
        ev = Evaluated(docs, corpus, split, corpus_fingerprint(docs), label=f"task {task} ({corpus}, split {split})")
        checks = [check_leakage(ev, ds, lm.ngrams if i == 0 else None, lm.tokenizer, args.allow_overlap)
                  for i, ds in enumerate(lm.datastores or [None])]  # fmt: skip
        out[task] = {**checks[0], **{k: [x for c in checks for x in c[k]] for k in ("overlap", "notes", "memories")}}
    return out


def add_parsers(sub) -> None:
    le = sub.add_parser(
        "lm-eval",
        help="EleutherAI lm-evaluation-harness tasks on a model + memory (memlm_wikitext2, memlm_imdb, ...)",
    )
    add_model(le)
    le.add_argument("--tasks", required=True, help="comma-separated: memlm_wikitext2, memlm_imdb, memlm_bbc_topic")
    add_memory_args(le)
    le.add_argument(
        "--window", type=V.positive_int, default=1024, help="sliding window of rolling log-likelihoods (tokens)"
    )
    le.add_argument(
        "--min-context", type=V.min_context, default=512, help="context every rolling target keeps (tokens)"
    )
    le.add_argument(
        "--max-length", type=V.positive_int, default=None, help="tokens of a loglikelihood request (default window)"
    )
    le.add_argument("--batch-size", type=V.positive_int, default=4)
    add_allow_overlap(le)
    le.add_argument("--limit", type=float, default=None, help="first N documents per task (or a fraction)")
    le.add_argument("--samples", default=None, help="document indices per task, JSON: '{\"memlm_wikitext2\": [0, 9]}'")
    le.add_argument("--out", default=None, help="write the results and settings as JSON here")
    le.add_argument(
        "--lm-eval-tasks", action="store_true", help="also offer lm_eval's built-in tasks (they need the dataset hub)"
    )
    le.set_defaults(func=cmd_lm_eval)
