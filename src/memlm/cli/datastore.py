"""``memlm datastore build|info`` and ``memlm index build``: kNN-LM datastores (memlm.storage.datastore,
memlm.storage.sharded) and their FAISS indexes; a build also fits its mixture with the LM on a held-out slice
(memlm.knnlm.calibration)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memlm.cli import common
from memlm.cli import validate as V
from memlm.cli.common import add_corpus, add_model, add_ray, add_windows, window_kwargs
from memlm.core.config import DEFAULT_K, RetrievalConfig
from memlm.data.corpora import load_corpus_source
from memlm.errors import MemlmError
from memlm.io.locking import folder_lock
from memlm.knnlm.calibration import (
    OVERLAP_LIMIT,
    OVERLAP_NGRAM,
    calibrate,
    calibration_summary,
    text_overlap,
)
from memlm.leakage import shown_sources

# memlm.storage.datastore, .index, .keys, .sharded, .sharded_index import torch or faiss: imported in the commands
# (common.py)


def cmd_datastore_build(args: argparse.Namespace) -> None:
    """``memlm datastore build``: :func:`memlm.knnlm.build.build_datastore` (held-out slice, entries, index,
    calibration) with the flags' settings."""
    from memlm.knnlm.build import build_datastore

    ray, sharded = args.ray, args.shards is not None or args.ray is not None
    if sharded:  # build_sharded places the model; Ray workers load their own (this one calibrates)
        model, tok = common._load_model(args.model, "float32" if ray else args.dtype)
    else:
        model, tok = common._load_model(args.model, args.dtype, args)
        model = common.place_model(model, args.device)
        V.check_against_model(args, model)  # window vs context, factory vs key dimension: before the forward pass
    docs, source = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    ds = build_datastore(model, tok, docs, args.out, key=args.key, **window_kwargs(args), batch_size=args.batch_size,
                         source=source, append=args.append, overwrite=args.overwrite, holdout=args.holdout,
                         index=args.index, factory=args.factory, metric=args.metric,
                         calibration_k=args.calibration_k, shards=args.shards, ray=ray, ray_model=args.model,
                         dtype=args.dtype, device=args.device, cpus_per_worker=args.cpus_per_worker)  # fmt: skip
    if hasattr(ds, "shards"):
        print(f"sharded datastore {ds.path}: {len(ds)} entries in {len(ds.shards)} shards, key "
              f"{ds.key_spec.describe()}")  # fmt: skip
    else:
        print(f"datastore {ds.path}: {len(ds)} entries, key {ds.key_spec.describe()}, dim {ds.dim}")
    if args.index:
        _print_index(ds)


def cmd_datastore_calibrate(args: argparse.Namespace) -> None:
    """``memlm datastore calibrate DS --corpus FILE``: the mixture fitted on text the user names, outside the
    datastore."""
    from memlm.knnlm.build import say_calibrated
    from memlm.storage.sharded import open_datastore

    ds = open_datastore(args.dir)
    model, tok = common._load_model(args.model or ds.model_name or common.DEFAULT_MODEL, args.dtype)
    ds.check_compatible(model, tok)
    docs, source = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    if not docs:
        raise MemlmError(f"corpus {args.corpus} ({args.split}) has no text to calibrate on")
    own = [s for s in ds.manifest.get("sources", []) if s.get("fingerprint") == source["fingerprint"]]
    if own:
        raise MemlmError(
            f"{args.corpus} is the corpus datastore {ds.path} was built from (same text): calibrate on text outside "
            "the datastore, e.g. a valid split or a held-back file"
        )
    shared, spans = text_overlap(ds, docs, tok)
    if spans and shared > OVERLAP_LIMIT * spans:
        raise MemlmError(
            f"{shared:,} of the {spans:,} {OVERLAP_NGRAM}-token spans of {args.corpus} ({shared / spans:.1%}) are in "
            f"datastore {ds.path}: its mixture would be fitted on text it holds; calibrate on text outside it (at most "
            f"{OVERLAP_LIMIT:.0%} shared)"
        )
    text = {"named": True, **{k: source[k] for k in ("corpus", "split", "max_tokens", "fingerprint", "documents")},
            "shared_spans": [shared, spans]}  # fmt: skip
    with folder_lock(args.dir, "calibrate a datastore"):
        old = ds.manifest.get("calibration")
        cal = calibrate(model, tok, ds, docs, RetrievalConfig(k=args.k, nprobe=args.nprobe), batch_size=args.batch_size,
                        text=text)  # fmt: skip
        ds.record_calibration(cal)  # a slice under memlm.core.mixture.MIN_FIT_TOKENS: the fit's warning says so
    if old is not None:
        print(f"replaced the calibration of {old.get('tokens', 0):,} tokens", file=sys.stderr)
    say_calibrated(cal, ds)


def _print_index(ds, path=None) -> None:
    from memlm.storage.index import read_index_meta

    if hasattr(ds, "shards"):
        desc = json.loads(Path(f"{ds.index_path}.json").read_text())
        print(f"sharded index {ds.index_path}.json ({desc['factory']}, {desc['metric']}, {len(desc['shards'])} shards)")
        return
    meta = read_index_meta(path or ds.index_path)
    print(f"index {path or ds.index_path} ({meta['factory']}, {meta['metric']})")


def _build_index(ds, factory: str | None, metric: str, train_size: int | None, ray: str | None = None,
                 out: str | None = None) -> None:  # fmt: skip
    from memlm.knnlm.build import build_index

    _print_index(ds, build_index(ds, factory, metric, train_size, ray=ray, out=out))


def cmd_datastore_info(args: argparse.Namespace) -> None:
    from memlm.storage.index import read_index_meta
    from memlm.storage.sharded import open_datastore

    ds = open_datastore(args.dir, verify=args.verify)
    m = ds.manifest
    calibration = {"calibration": calibration_summary(ds)} if "calibration" in m else {}  # the fit summarised
    if hasattr(ds, "shards"):  # a sharded datastore: its manifest lists the shards (each a datastore)
        keys = ("model", "tokenizer", "key", "count", "window", "min_context", "sources", "sharded")
        print(json.dumps({**{k: m[k] for k in keys if k in m}, "sources": shown_sources(m["sources"]), **calibration},
                         indent=2))  # fmt: skip
        if args.verify:
            print(f"checksums OK ({ds.checksum()[:16]}): every shard's manifest, sizes and full SHA-256")
        return
    keys = ("model", "tokenizer", "key", "count", "window", "min_context", "sources")
    info = {k: m[k] for k in keys if k in m}
    info.update(sources=shown_sources(m["sources"]), **calibration, build_id=m.get("build_id"))
    problem = ds.index_problem()
    if not ds.index_path.exists():
        info["index"] = None
    else:
        meta = read_index_meta(ds.index_path) if problem is None else None
        info["index"] = {k: meta.get(k) for k in ("factory", "metric", "n", "d")} if meta else {}
        info["index"].update(usable=problem is None, **({"problem": problem} if problem else {}))
    print(json.dumps(info, indent=2))
    if args.verify:
        if problem is not None and ds.index_path.exists():
            raise MemlmError(f"datastore files OK, but its index cannot be used: {problem}")
        checked = "manifest, sizes, values range and full SHA-256 of every file"
        if ds.index_path.exists():
            ds.load_index(verify=True)
            checked += ", and the index (full SHA-256, header, datastore identity)"
        print(f"checksums OK ({ds.checksum()[:16]}): {checked}")


def cmd_index_build(args: argparse.Namespace) -> None:
    from memlm.storage.sharded import open_datastore

    open_datastore(args.dir)  # a clear error before the folder is touched
    with folder_lock(args.dir, "build an index"):
        _build_index(open_datastore(args.dir), args.factory, args.metric, args.train_size, ray=args.ray, out=args.out)


def cmd_datastore_prune(args: argparse.Namespace) -> None:
    from memlm.knnlm.prune import prune_datastore
    from memlm.storage.datastore import Datastore
    from memlm.storage.index import read_index_meta
    from memlm.storage.sharded import is_sharded

    if is_sharded(args.dir):
        raise MemlmError(
            f"{args.dir} is a sharded datastore; memlm datastore prune merges the entries of one datastore folder: "
            "build the corpus without --shards to prune it"
        )
    src = Datastore.open(args.dir)
    pruned = prune_datastore(
        src, args.out, k_merge=args.k_merge, nprobe=args.nprobe, seed=args.seed, overwrite=args.overwrite
    )
    print(f"{args.out}: {len(pruned):,} of {len(src):,} entries kept ({len(pruned) / max(1, len(src)):.1%})")
    meta = read_index_meta(src.index_path)
    with folder_lock(args.out, "build an index"):
        _build_index(
            pruned, args.factory or (meta["factory"] if meta else None), meta["metric"] if meta else "l2", None
        )


def check_datastore_build(args: argparse.Namespace) -> None:
    from memlm.models.keys import KeySpec

    KeySpec.parse(args.key)
    V.check_windows(args)
    if args.shards is None and args.ray is None:  # a sharded build refuses a folder that is not empty itself
        from memlm.storage.datastore import FOLDER

        FOLDER.check_out(Path(args.out), args.overwrite)
    if args.index:
        V.check_factory(args.factory, args.metric)


def check_index_build(args: argparse.Namespace) -> None:
    from memlm.storage.sharded import open_datastore

    ds = open_datastore(args.dir)  # a single or a sharded datastore (README: `memlm index build ds/wiki-8`)
    V.check_factory(args.factory, args.metric, ds.dim)


def add_parsers(sub) -> None:
    ds = sub.add_parser("datastore", help="build or inspect a kNN-LM datastore").add_subparsers(
        dest="sub", required=True
    )
    b = ds.add_parser("build", help="one forward pass over a corpus -> (key, next token) datastore (+ index)")
    add_model(b, required=True)
    common.add_compute_path(b)
    add_corpus(b, "train")
    b.add_argument(
        "--out", type=V.output_dir, required=True, help="datastore folder (rerun the same command to resume)"
    )
    b.add_argument(
        "--key",
        default="ffn_in",
        help="key role[@layer]: ffn_in, final, ffn_out, attn_out, attn_in, block_out, ffn_in_raw (FFN input before "
        "its layer norm) (default ffn_in = last layer's FFN input after layer norm)",
    )
    add_windows(b)
    b.add_argument("--append", action="store_true", help="add this corpus to an existing datastore")
    b.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the datastore (and index) already in --out, or an unfinished build with other settings (only "
        "its own files: a folder holding anything else is refused)",
    )
    b.add_argument(
        "--no-index",
        dest="index",
        action="store_false",
        help="do not build the FAISS index afterwards (nor calibrate the mixture, which needs it)",
    )
    b.add_argument(
        "--holdout",
        type=V.holdout_fraction,
        default=0.02,
        help="share of the corpus's tokens held out of the datastore to fit its mixture on after the build (default "
        "0.02; 0 = none). The slice holds max(share, 4,096) scored tokens, at most 8,192 (a standard error of "
        "~0.01 nats on the held-out log-likelihood) and never more than 20%% of the corpus: whole documents first "
        "(in the order of a hash of id and text), then, when that falls short (one .txt file, a few long "
        "documents), the tail of the longest document(s), at most half of each, cut where a paragraph "
        "(else a line, sentence, word) starts; the head stays in the datastore. Deterministic (a rerun resumes), "
        "recorded in the manifest (sources[].holdout) and part of the settings a rerun compares; the guarded mixture "
        "of the LM and the datastore fitted there (memlm datastore info shows it) is what eval, generate and lm-eval "
        "apply when no weight is given",
    )
    b.add_argument(
        "--calibration-k",
        type=V.neighbours,
        default=1024,
        help="neighbours per held-out token (default 1024, as memlm eval; runs with another k are told so)",
    )
    b.add_argument("--factory", default=None, help="FAISS factory string (default: chosen from the datastore size)")
    b.add_argument("--metric", default="l2", choices=["l2", "ip"])
    common.add_device(b)
    b.add_argument(
        "--shards",
        type=V.positive_int,
        default=None,
        help="split the corpus by documents into N shards (docs/results/scaling.md)",
    )
    add_ray(b, "build the shards as Ray tasks")
    b.add_argument("--cpus-per-worker", type=V.positive_int, default=1, help="CPUs (torch threads) per Ray build task")
    b.set_defaults(func=cmd_datastore_build, check=check_datastore_build)
    c = ds.add_parser(
        "calibrate",
        help="fit a datastore's default mixture on text you name (outside it), e.g. one built without --holdout",
    )
    c.add_argument("dir", type=V.existing_dir, help="the datastore folder")
    add_model(c)
    add_corpus(c, "valid")
    c.add_argument(
        "--k",
        type=V.neighbours,
        default=DEFAULT_K,
        help=f"neighbours per token (default {DEFAULT_K}, as memlm eval and memlm generate)",
    )
    c.add_argument("--nprobe", type=V.positive_int, default=32)
    c.add_argument("--batch-size", type=V.positive_int, default=4)
    c.set_defaults(func=cmd_datastore_calibrate)
    i = ds.add_parser("info", help="print a datastore's manifest")
    i.add_argument("dir", type=V.existing_dir)
    i.add_argument(
        "--verify",
        action="store_true",
        help="also check the full SHA-256 of every file and of the index (opening always checks sizes, sampled "
        "checksums, the manifest's own checksum and the values' range)",
    )
    i.set_defaults(func=cmd_datastore_info)

    ix = sub.add_parser("index", help="FAISS index over a datastore").add_subparsers(dest="sub", required=True)
    ib = ix.add_parser("build", help="build (or rebuild) the index of a datastore folder")
    ib.add_argument("dir", type=V.existing_dir)
    ib.add_argument("--factory", default=None, help="FAISS factory string, e.g. Flat, IVF4096,PQ64, HNSW32")
    ib.add_argument("--metric", default="l2", choices=["l2", "ip"])
    ib.add_argument("--train-size", type=V.positive_int, default=None)
    ib.add_argument("--out", type=V.output_file, default=None,
                    help="write this index file instead of the datastore's index.faiss (e.g. a compressed "
                    "OPQ32_128,IVF4096,PQ32 one to search with memlm eval --index)")  # fmt: skip
    add_ray(ib, "fill a sharded datastore's shard indexes as Ray tasks")
    ib.set_defaults(func=cmd_index_build, check=check_index_build)

    pr = ds.add_parser("prune", help="merge near-duplicate entries with the same value (He et al. 2021)")
    pr.add_argument("dir", type=V.existing_dir)
    pr.add_argument("--out", type=V.output_dir, required=True, help="the pruned datastore's folder")
    pr.add_argument(
        "--k-merge",
        type=V.positive_int,
        default=8,
        help="each entry's k_merge + 1 nearest entries (itself passed over) are merged into it when they have its "
        "value and are neither merged nor have absorbed anything (He et al. 2021's greedy merging; default 8)",
    )
    pr.add_argument(
        "--seed",
        type=V.nonneg_int,
        default=0,
        help="entries are visited in a random order drawn with this seed, recorded in the manifest (default 0)",
    )
    pr.add_argument("--overwrite", action="store_true", help="replace a datastore already in --out")
    pr.add_argument("--nprobe", type=V.positive_int, default=32)
    pr.add_argument("--factory", default=None, help="the pruned datastore's index (default: its source's factory)")
    pr.set_defaults(func=cmd_datastore_prune)
