"""``memlm ngram build|info``: ∞-gram indexes (memlm.ngram); the ∞-gram options of ``memlm eval`` and ``generate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memlm.cli import common
from memlm.cli import validate as V
from memlm.cli.common import add_corpus, add_model
from memlm.data.corpora import load_corpus_source
from memlm.errors import MemlmError
from memlm.io.locking import folder_lock
from memlm.knnlm.calibration import holdout_split
from memlm.leakage import document_record, shown_sources
from memlm.ngram.decontaminate import decontaminate_reference, decontamination_sets

EXCLUDED = (
    "the valid and test documents of every named corpus (memlm.data.corpora's document-level splits: a document "
    "is in one split only), so any of their test or valid splits can be evaluated against this index"
)


def decontaminate_documents(args: argparse.Namespace, docs: list, tok) -> tuple[list, dict[str, Any] | None]:
    """``--decontaminate``: drop the reference documents the infini-gram paper's rule finds in the evaluation sets
    (:func:`memlm.ngram.decontaminate.decontaminate_reference`: by default the valid and test splits of every named
    corpus); the record goes into the manifest's source (deterministic: resumable)."""
    names = decontamination_sets(args.corpus, args.split, args.decontaminate)
    kept, record = decontaminate_reference(
        docs, names, tok, n=args.decontaminate_n, threshold=args.decontaminate_threshold, progress=True
    )
    if record is not None:
        print(
            f"decontamination against {', '.join(names)}: dropped {record['dropped_documents']:,} of "
            f"{record['checked_documents']:,} documents ({record['dropped_tokens'] or 0:,} tokens) with >= "
            f"{args.decontaminate_threshold:g} of their {args.decontaminate_n}-grams in the evaluation text",
            file=sys.stderr,
        )
    return kept, record


def cmd_ngram_build(args: argparse.Namespace) -> None:
    from memlm.ngram.index import build_ngram_index

    model, tok = common._load_model(args.model, args.dtype)
    docs, source = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    source["excluded"] = EXCLUDED if args.split == "train" else "nothing: --split all (eval text may be indexed)"
    docs, record = decontaminate_documents(args, docs, tok)
    if record is not None:
        source["decontamination"] = record
    docs, held_out, source["holdout"] = holdout_split(docs, tok, args.holdout)
    source["document_hashes"] = document_record(docs)  # what eval's leakage check compares (memlm.leakage)
    with folder_lock(args.out, "build an ∞-gram index"):
        index = build_ngram_index(
            tok,
            docs,
            args.out,
            source=source,
            shard_tokens=args.shard_tokens,
            memory_gb=args.memory_gb,
            overwrite=args.overwrite,
        )
        m = index.manifest
        print(
            f"∞-gram index {index.path}: {m['tokens']:,} tokens, {m['documents']:,} documents, "
            f"{len(m['shards'])} shard(s), {m['token_dtype']}, {m['bytes_per_token']:.2f} bytes/token"
        )
        if args.no_calibrate or not held_out:
            why = "--no-calibrate" if args.no_calibrate else source["holdout"].get("reason")
            print(f"no calibration ({why}): eval falls back to λ_sparse=0.1, λ_dense=0.03", file=sys.stderr)
            return
        from memlm.knnlm.calibration import calibrate_index_holdout

        calibrate_index_holdout(model, tok, index, held_out, source["holdout"], window=args.window, stride=args.stride,
                                batch_size=args.batch_size)  # fmt: skip


def check_ngram_build(args: argparse.Namespace) -> None:
    """Before the model loads: the sort memory, and a --out that holds another kind of artifact or (--overwrite) files
    that are not the index's."""
    from memlm.ngram.index import check_memory_gb, check_out

    check_memory_gb(args.memory_gb)
    check_out(Path(args.out), args.overwrite)


def cmd_ngram_info(args: argparse.Namespace) -> None:
    from memlm.knnlm.calibration import calibration_summary
    from memlm.ngram.index import NgramIndex

    index = NgramIndex.open(args.index, verify=args.verify)
    m = index.manifest
    keys = (
        "tokens",
        "documents",
        "token_dtype",
        "bytes",
        "bytes_per_token",
        "shards",
        "tokenizer",
        "sources",
        "calibration",
        "build_seconds",
        "infini_gram_version",
        "created",
    )
    shown = {"sources": shown_sources(m["sources"]), "calibration": calibration_summary(index)}  # the fit summarised
    print(json.dumps({**{k: m.get(k) for k in keys}, **shown}, indent=2, ensure_ascii=False))
    print(f"checksums {index.integrity['note']}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ memlm eval --ngram


def add_eval_args(p: argparse.ArgumentParser, selection: bool = True) -> None:
    """``--ngram DIR`` (more than once for several indexes; without ``selection``: not, ``memlm eval`` takes the
    indexes as ``--memory``) and its weights for ``memlm eval``, ``generate`` and ``lm-eval``."""
    g = p.add_argument_group("∞-gram (docs/results/ngram.md)")
    if not selection:
        _add_ngram_weights(g)
        return
    g.add_argument(
        "--ngram",
        type=V.existing_dir,
        default=None,
        metavar="DIR",
        action="append",
        help="an ∞-gram index (memlm ngram build) to interpolate, alone or with --datastore; give it again for "
        "several indexes, each with its own weights",
    )
    _add_ngram_weights(g)


def _add_ngram_weights(g) -> None:
    g.add_argument(
        "--ngram-lambda-sparse",
        type=V.probability,
        nargs="+",
        default=None,
        metavar="λ",
        help="weight of P∞ where it is sparse: one value, or one per ∞-gram index in order (default: each index's "
        "calibrated mixture's mean weight there, else 0.1)",
    )
    g.add_argument(
        "--ngram-lambda-dense",
        type=V.probability,
        nargs="+",
        default=None,
        metavar="λ",
        help="weight of P∞ elsewhere: one value, or one per ∞-gram index (default: each index's calibrated "
        "mixture's mean weight there, else 0.03)",
    )
    g.add_argument(
        "--ngram-max-n",
        type=V.positive_int,
        default=None,
        metavar="N",
        help="a fixed-n n-gram (back-off included) instead of the ∞-gram: effective n <= N",
    )


def open_ngram(args: argparse.Namespace, tokenizer):
    """The ``--ngram`` memory of ``memlm eval``, checked against the model's tokenizer, or None: an
    :class:`~memlm.ngram.memory.NgramMemory`, or for several ``--ngram`` an :class:`~memlm.ngram.memory.NgramMemories`.
    """
    paths = getattr(args, "ngram", None)
    if not paths:
        return None
    from memlm.ngram.index import NgramIndex
    from memlm.ngram.memory import NgramMemories, NgramMemory

    paths = [paths] if isinstance(paths, str) else list(paths)
    seen = [Path(p).resolve() for p in paths]
    if len(set(seen)) < len(seen):
        raise MemlmError(f"--ngram names the same index twice ({', '.join(paths)}): give each index once")
    memories = []
    for path in paths:
        index = NgramIndex.open(path)
        print(f"∞-gram index {path}: checksums {index.integrity['note']}", file=sys.stderr)
        index.check_tokenizer(tokenizer)
        memories.append(NgramMemory(index, max_n=args.ngram_max_n))
    return memories[0] if len(memories) == 1 else NgramMemories(memories)


def ngram_weights(args: argparse.Namespace, memory) -> list[tuple[float, float, str]]:
    """Each ∞-gram index's ``(λ_sparse, λ_dense, origin)`` of ``memlm eval``: the flags' values (one for every index,
    or one per index in the order of ``--memory``), else the index's calibrated mixture's
    (:func:`memlm.knnlm.calibration.ngram_parameters`)."""
    from memlm.knnlm.calibration import ngram_parameters
    from memlm.ngram.mixture import per_index_lambdas

    memories = getattr(memory, "memories", [memory])
    names = ("--ngram-lambda-sparse", "--ngram-lambda-dense")
    given = per_index_lambdas(args.ngram_lambda_sparse, args.ngram_lambda_dense, len(memories), names)
    return [ngram_parameters(m.index, *g) for m, g in zip(memories, given, strict=True)]


def note_approximate(step) -> None:
    """A line on stderr when generation's P∞ was not exact over the vocabulary at some step."""
    from memlm.ngram.generate import approximation_note

    if (note := approximation_note(step)) is not None:
        print(note, file=sys.stderr)


def print_sources(args: argparse.Namespace, memories, tok, prompt: list[int], text: str) -> None:
    """``--show-sources N``: under the generated text, each token's longest matched suffix and up to N documents;
    with several indexes, one line per index (``[i:folder]``, in the order of the ∞-gram memories)."""
    from memlm.ngram.generate import token_sources

    if not args.show_sources:
        return
    full = prompt + list(tok(text, add_special_tokens=False)["input_ids"])
    per_index = [token_sources(m, full, len(prompt), args.show_sources) for m in memories]
    labels = [""] if len(memories) == 1 else [f"[{i + 1}:{Path(m.index.path).name}] " for i, m in enumerate(memories)]
    for recs in zip(*per_index, strict=True):
        for i, rec in enumerate(recs):
            docs = ", ".join(f"doc {d['doc_ix']} ({d['id']}) @ {d['offset']}" for d in rec["documents"]) or "-"
            token = f"{tok.decode([rec['token']])!r:>16}" if i == 0 else " " * 16
            print(f"{token}  {labels[i]}suffix {rec['suffix_len']:3d} tokens, {rec['count']:,} occurrences: {docs}")


def add_parsers(sub) -> None:
    ng = sub.add_parser("ngram", help="∞-gram indexes (infini-gram): a memory built by sorting, no forward pass")
    nsub = ng.add_subparsers(dest="ngram_cmd", required=True)
    b = nsub.add_parser("build", help="index a corpus with the model's tokenizer (suffix array), calibrate its mixture")
    add_model(b, required=True)
    add_corpus(b, "train")
    b.set_defaults(split="train")
    for action in b._actions:
        if action.dest == "split":
            action.choices = ["train", "all"]
            action.help = (
                "train (default: the valid and test documents of each named corpus stay out) or all "
                "(files are always read whole)"
            )
    b.add_argument("--out", type=V.output_dir, required=True, help="index folder")
    b.add_argument(
        "--holdout",
        type=float,
        default=0.02,
        help="share of the corpus's tokens held out to fit the index's mixture with the LM (0: none)",
    )
    b.add_argument("--no-calibrate", action="store_true", help="hold out the slice but do not calibrate (no LM pass)")
    b.add_argument(
        "--decontaminate",
        default=None,
        metavar="SETS",
        help="drop reference documents that copy evaluation text, by the infini-gram paper's rule (App. B: >= 80%% "
        "of a document's 13-grams in the evaluation documents), always against the valid and test splits of every "
        "named corpus in --corpus (not with --split all) and also against SETS: comma-separated CORPUS:SPLIT, "
        "CORPUS (its valid and test splits) or files (e.g. wikitext2:test,imdb); none: no decontamination at all; "
        "the manifest records what was dropped",
    )
    b.add_argument("--decontaminate-n", type=V.positive_int, default=13, help="n of the n-grams (default 13)")
    b.add_argument(
        "--decontaminate-threshold",
        type=V.probability,
        default=0.8,
        help="share of a document's n-grams in the evaluation text that drops it (default 0.8)",
    )
    b.add_argument(
        "--shard-tokens",
        type=V.positive_int,
        default=None,
        help="start a new shard (its own suffix array) after this many tokens",
    )
    b.add_argument(
        "--memory-gb", type=V.finite_float, default=4.0, help="GiB of RAM the suffix-array sort may use (default 4)"
    )
    b.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the folder's index (only its own files: a folder holding anything else is refused)",
    )
    b.add_argument("--window", type=V.positive_int, default=1024, help="LM window of the calibration pass")
    b.add_argument("--stride", type=V.positive_int, default=512, help="LM stride of the calibration pass")
    b.add_argument("--batch-size", type=V.positive_int, default=4)
    b.set_defaults(func=cmd_ngram_build, check=check_ngram_build)
    i = nsub.add_parser("info", help="describe an ∞-gram index (and check every byte with --verify)")
    i.add_argument("index", type=V.existing_dir)
    i.add_argument("--verify", action="store_true", help="compare the full SHA-256 of every file")
    i.set_defaults(func=cmd_ngram_info)
