"""``memlm`` command line: a thin layer over the Python API (every command maps to one or two library calls)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from memlm import validate as V
from memlm.errors import MemlmError
from memlm.fileio import dumps_json

DEFAULT_MODEL = "smollm2-135m"


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        from memlm.fileio import atomic_write_json

        atomic_write_json(Path(path), data)
        print(f"wrote {path}", file=sys.stderr)


def _documents(corpus: str, split: str | None, tokenizer, max_tokens: int | None):
    from memlm.corpora import corpus_fingerprint
    from memlm.train_lm import load_corpora
    from memlm.windows import limit_documents

    docs = limit_documents(load_corpora(corpus, split), tokenizer, max_tokens)
    source = {
        "corpus": corpus,
        "split": split,
        "documents": len(docs),
        "fingerprint": corpus_fingerprint(docs),
        "max_tokens": max_tokens,
    }
    return docs, source


def _load_model(name: str, dtype: str):
    from memlm.resources import load_causal_lm

    return load_causal_lm(name, dtype=dtype)


# ------------------------------------------------------------------------------------------------- commands


def cmd_models(args: argparse.Namespace) -> None:
    from memlm.resources import MODELS

    for name, spec in MODELS.items():
        print(f"{name:16s} {spec.kind:10s} {spec.description}")


def cmd_corpora(args: argparse.Namespace) -> None:
    from memlm.corpora import describe_corpora

    print(f"{'name':9s} {'train':>6s} {'valid':>6s} {'test':>6s} {'chars':>11s}  description (documents per split)")
    missing = []
    for row in describe_corpora():
        if "docs" not in row:  # its data package is missing or unreadable: listed, then one error at the end
            missing.append(row)
            print(f"{row['name']:9s} {'-':>6s} {'-':>6s} {'-':>6s} {'-':>11s}  {row['description']} (unavailable)")
            continue
        d = row["docs"]
        print(
            f"{row['name']:9s} {d['train']:6d} {d['valid']:6d} {d['test']:6d} {row['chars']['all']:11,d}  "
            f"{row['description']}"
        )
    if missing:
        raise MemlmError("; ".join(f"corpus {row['name']} is unavailable: {row.get('error', '?')}" for row in missing))


def cmd_datastore_build(args: argparse.Namespace) -> None:
    from memlm.calibration import holdout_split
    from memlm.datastore import build_datastore
    from memlm.keys import KeySpec
    from memlm.locking import folder_lock

    if args.shards is not None or args.ray is not None:
        return _build_sharded(args)
    key = KeySpec.parse(args.key)
    model, tok = _load_model(args.model, args.dtype)
    if args.device != "cpu":
        model.to(args.device)
    V.check_against_model(args, model)  # window vs context, factory vs key dimension: before the forward pass
    docs, source = _documents(args.corpus, args.split, tok, args.max_tokens)
    docs, held_out, source["holdout"] = holdout_split(docs, tok, args.holdout)
    with folder_lock(args.out, "build a datastore"):  # held through the index build too
        ds = build_datastore(
            model,
            tok,
            docs,
            args.out,
            key=key,
            **_window_kwargs(args),
            batch_size=args.batch_size,
            source=source,
            append=args.append,
            overwrite=args.overwrite,
        )
        print(f"datastore {ds.path}: {len(ds)} entries, key {ds.key_spec.describe()}, dim {ds.dim}")
        if args.index:
            _ensure_index(ds, args.factory, args.metric)
        _calibrate(model, tok, ds, held_out, source["holdout"], args)


def _calibrate(model, tok, ds, held_out, holdout: dict, args: argparse.Namespace) -> None:
    """Tune λ and τ on the build's held-out slice and record them with the datastore (memlm.calibration)."""
    from memlm.calibration import calibrate

    if not held_out:
        print(f"no calibration: nothing held out ({holdout.get('reason')}); eval falls back to λ=0.25, τ=1",
              file=sys.stderr)  # fmt: skip
        return
    cal = ds.manifest.get("calibration")
    if cal is not None and cal.get("count") == len(ds) and cal.get("holdout_ids") == holdout.get("ids_sha256"):
        print(f"calibration already recorded: λ={cal['lambda']:g}, τ={cal['temperature']:g}", file=sys.stderr)
        return
    print(f"calibrating λ and τ on {holdout['tokens']:,} held-out tokens ({holdout['documents']} documents)",
          file=sys.stderr)  # fmt: skip
    cal = calibrate(model, tok, ds, held_out, k=args.calibration_k, batch_size=args.batch_size)
    cal["holdout_ids"] = holdout.get("ids_sha256")
    ds.record_calibration(cal)
    print(f"calibrated: λ={cal['lambda']:g}, τ={cal['temperature']:g} (held-out ppl {cal['base_ppl']:.3f} -> "
          f"{cal['knn_ppl']:.3f}); recorded in {ds.path}", file=sys.stderr)  # fmt: skip


def _ensure_index(ds, factory: str | None, metric: str) -> None:
    """Build the datastore's index unless a valid one with the same factory and metric is there already."""
    from memlm.index import plan_index, read_index_meta

    problem = ds.index_problem()
    if problem is not None:
        if ds.index_path.exists():
            print(f"rebuilding the index: {problem}", file=sys.stderr)
        _build_index(ds, factory, metric, None)
        return
    meta = read_index_meta(ds.index_path)
    want = plan_index(len(ds), ds.dim, factory, metric).factory
    if (meta["factory"], meta["metric"]) != (want, metric):
        raise MemlmError(
            f"datastore {ds.path} already has an index {meta['factory']} ({meta['metric']}), not {want} ({metric}) as "
            f"asked: rebuild it with `memlm index build {ds.path} --factory '{want}' --metric {metric}`, or rerun "
            "with the index's --factory and --metric"
        )
    print(f"index {ds.index_path} already built ({meta['factory']}, {metric})", file=sys.stderr)


def _build_sharded(args: argparse.Namespace) -> None:
    """``datastore build --shards N [--ray ADDRESS|local]``: memlm.sharded.build_sharded (+ the sharded index)."""
    from memlm.calibration import holdout_split
    from memlm.keys import KeySpec
    from memlm.sharded import build_sharded

    model, tok = _load_model(args.model, "float32" if args.ray else args.dtype)  # Ray workers load their own
    docs, source = _documents(args.corpus, args.split, tok, args.max_tokens)
    docs, held_out, source["holdout"] = holdout_split(docs, tok, args.holdout)
    ds = build_sharded(
        args.model if args.ray else model,
        docs,
        args.out,
        args.shards or 1,
        tokenizer=tok,
        key=KeySpec.parse(args.key),
        window=args.window,
        min_context=args.min_context,
        batch_size=args.batch_size,
        source=source,
        ray=args.ray,
        dtype=args.dtype,
        device=args.device,
        cpus_per_worker=args.cpus_per_worker,
    )
    print(f"sharded datastore {ds.path}: {len(ds)} entries in {len(ds.shards)} shards, key {ds.key_spec.describe()}")
    if args.index and not (ds.path / "index.faiss.json").exists():
        _build_index(ds, args.factory, args.metric, None, ray=args.ray)
    if args.index:
        _calibrate(model, tok, ds, held_out, source["holdout"], args)


def _build_index(ds, factory: str | None, metric: str, train_size: int | None, ray: str | None = None) -> None:
    from memlm.index import read_index_meta

    if hasattr(ds, "shards"):  # a sharded datastore: train once, one index per shard
        from memlm.sharded_index import build_sharded_index

        desc = build_sharded_index(ds, factory=factory, metric=metric, train_size=train_size, ray=ray)
        print(f"sharded index {ds.index_path}.json ({desc['factory']}, {metric}, {len(desc['shards'])} shards)")
        return

    ds.build_index(factory=factory, metric=metric, train_size=train_size)  # prints its plan
    print(f"index {ds.index_path} ({read_index_meta(ds.index_path)['factory']}, {metric})")


def cmd_datastore_info(args: argparse.Namespace) -> None:
    from memlm.index import read_index_meta
    from memlm.sharded import open_datastore

    ds = open_datastore(args.dir, verify=args.verify)
    m = ds.manifest
    if hasattr(ds, "shards"):  # a sharded datastore: its manifest lists the shards (each a datastore)
        keys = ("model", "tokenizer", "key", "count", "window", "min_context", "sources", "sharded")
        print(json.dumps({k: m[k] for k in keys if k in m}, indent=2))
        if args.verify:
            print(f"checksums OK ({ds.checksum()[:16]}): every shard's manifest, sizes and full SHA-256")
        return
    info = {k: m[k] for k in ("model", "tokenizer", "key", "count", "window", "min_context", "sources") if k in m}
    info["build_id"] = m.get("build_id")
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
    from memlm.locking import folder_lock
    from memlm.sharded import open_datastore

    open_datastore(args.dir)  # a clear error before the folder is touched
    with folder_lock(args.dir, "build an index"):
        _build_index(open_datastore(args.dir), args.factory, args.metric, args.train_size, ray=args.ray)


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.calibration import knn_parameters
    from memlm.evaluate import perplexities, score_tokens
    from memlm.keys import KeySpec
    from memlm.sharded import open_datastore

    ds = open_datastore(args.datastore, ray=args.ray, mmap_index=args.mmap_index) if args.datastore else None
    model_name = args.model or (ds.model_name if ds else None) or DEFAULT_MODEL
    model, tok = _load_model(model_name, args.dtype)
    if ds is not None:
        ds.check_compatible(model, tok, KeySpec.parse(args.key) if args.key else None)
    V.check_against_model(args, model)
    docs, source = _documents(args.corpus, args.split, tok, args.max_tokens)
    ts = score_tokens(
        model,
        tok,
        docs,
        ds,
        k=args.k,
        **_window_kwargs(args),
        batch_size=args.batch_size,
        search=args.search,
        scores=args.scores,
        nprobe=args.nprobe,
        drop_self_matches=args.drop_self_matches,
        cache=args.cache,
        meta={"model": model_name, "source": source},
    )
    if args.dump:
        ts.save(args.dump)
        print(f"wrote {args.dump}", file=sys.stderr)
    lam, temperature, origin = 0.0, args.temperature or 1.0, None
    if ds is not None:
        lam, temperature, origin = knn_parameters(ds, args.lam, args.temperature)
        if args.cache and args.lam is None and lam + args.cache_lambda > 1:
            lam = 1.0 - args.cache_lambda  # the calibrated λ was tuned without the cache: leave the cache its weight
            print(f"λ lowered to {lam:g} so that λ + --cache-lambda <= 1", file=sys.stderr)
    res = perplexities(
        ts,
        lam=lam,
        temperature=temperature,
        cache_lambda=args.cache_lambda if args.cache else 0.0,
        cache_temperature=args.cache_temperature,
    )
    res.update(
        model=model_name,
        corpus=args.corpus,
        split=args.split,
        **({"parameters_from": origin} if origin else {}),
        **{
            k: v for k, v in ts.meta.items() if k.startswith("seconds") or k in ("datastore", "key", "search", "scores")
        },
    )
    _print_result(res)
    _write_json(args.json, res)


def _print_result(res: dict[str, Any]) -> None:
    fmt = {float: "{:.4g}"}
    for k, v in res.items():
        print(f"{k:22s} {fmt.get(type(v), '{}').format(v)}")


def cmd_tune(args: argparse.Namespace) -> None:
    from memlm.evaluate import TokenScores, perplexities, tune

    valid = TokenScores.load(args.valid)
    result = tune(
        valid,
        lambdas=args.lambdas,
        temperatures=args.temperatures,
        k=args.k,
        cache_lambdas=args.cache_lambdas,
        cache_temperatures=args.cache_temperatures,
    )
    best = result["best"]
    out: dict[str, Any] = {"valid": {"best": best, "grid_points": len(result["grid"])}}
    print(
        f"best on valid: lambda={best['lambda']} temperature={best['temperature']} "
        f"cache_lambda={best['cache_lambda']} ppl={best['ppl']:.4f}"
    )
    if args.test:
        res = perplexities(
            TokenScores.load(args.test),
            lam=best["lambda"],
            temperature=best["temperature"],
            k=args.k,
            cache_lambda=best["cache_lambda"],
            cache_temperature=best["cache_temperature"],
        )
        out["test"] = res
        _print_result(res)
    out["grid"] = result["grid"]
    _write_json(args.json, out)


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from memlm.calibration import knn_parameters
    from memlm.generate import KNNLogitsProcessor, NeighbourStreamer, SourceLookup, generate_text
    from memlm.sharded import open_datastore

    ds = open_datastore(args.datastore, ray=args.ray)
    model, tok = _load_model(args.model or ds.model_name or DEFAULT_MODEL, args.dtype)
    ds.check_compatible(model, tok)
    lam, temperature, _ = knn_parameters(ds, args.lam, args.temperature)
    torch.manual_seed(args.seed)
    knn = KNNLogitsProcessor(model, ds, k=args.k, lam=lam, temperature=temperature, record=args.show_neighbours > 0)
    lookup = SourceLookup(ds, tok) if args.show_neighbours > 0 else None
    streamer = NeighbourStreamer(tok, knn, lookup, n_neighbours=args.show_neighbours)
    print(args.prompt, end="" if lookup is None else "\n", flush=True)
    generate_text(
        model,
        tok,
        [args.prompt],
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy,
        streamer=streamer,
        processor=knn,
    )


def cmd_lm_eval(args: argparse.Namespace) -> None:
    import time

    try:
        import lm_eval
        from lm_eval.utils import make_table
    except ImportError as error:
        raise MemlmError(
            "memlm lm-eval needs EleutherAI's lm-evaluation-harness: pip install 'memlm[lmeval]' (lm_eval==0.4.13)"
        ) from error
    from memlm.fileio import atomic_write_json
    from memlm.lmeval import TASKS, task_manager
    from memlm.lmeval.model import MemlmLM

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
    lm = MemlmLM(
        model=args.model or DEFAULT_MODEL,
        datastore=args.datastore,
        lam=args.lam,
        temperature=args.temperature,
        k=args.k,
        nprobe=args.nprobe,
        cache=args.cache,
        cache_lambda=args.cache_lambda,
        cache_temperature=args.cache_temperature,
        window=args.window,
        min_context=args.min_context,
        max_length=args.max_length,
        batch_size=args.batch_size,
        dtype=args.dtype,
        progress=True,
    )
    print(f"memlm lm-eval: {json.dumps(lm.memory_settings)}", file=sys.stderr)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=args.limit, samples=samples, log_samples=False
    )
    print(make_table(out))
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
        }
        atomic_write_json(Path(args.out), record)
        print(f"wrote {args.out}")


def cmd_train(args: argparse.Namespace) -> None:
    from memlm.train import TrainConfig
    from memlm.train_lm import train_lm

    if args.objective != "lm":
        return _train_npm(args)
    config = TrainConfig(
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
        max_steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        dtype=args.dtype,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        warmup_loss_steps=args.ce_warmup if args.loss != "ce" else 0,
        device=args.device,
    )
    extra = {}
    if args.loss != "ce":
        from memlm.train import causal_lm_loss
        from memlm.trime.training import trime_objective

        options = {"seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed}
        if args.loss == "trime-long":
            options["segments_per_doc"] = args.segments_per_doc
        if args.loss == "trime-ext":
            options.update(drop_local_p=args.drop_local_p, packing=args.packing)
        loss_fn, batches = trime_objective(args.loss, **options)
        extra = {"loss_fn": loss_fn, "batches": batches, "warmup_loss": causal_lm_loss}
    result = train_lm(
        args.out,
        args.corpus,
        config,
        scratch=args.from_scratch,
        model=args.model,
        tokenizer=args.tokenizer or "bpe:8192",
        valid_corpus=args.valid_corpus,
        valid_tokens=args.valid_tokens,
        n_positions=args.n_positions,
        dropout=args.dropout,
        resume=not args.no_resume,
        stop_after=args.stop_after,
        **extra,
    )
    if result.final_dir is None:
        print(f"stopped at update {result.step}: rerun the same command to continue", file=sys.stderr)
        return
    ppl = result.valid_ppl
    print(f"trained {result.step} updates -> {result.final_dir}" + (f" (valid ppl {ppl:.3f})" if ppl else ""))


def _train_npm(args: argparse.Namespace) -> None:
    from memlm.npm.train_npm import DEFAULT_ENCODER, train_npm
    from memlm.train import TrainConfig

    if args.loss != "ce":
        raise MemlmError(f"--loss {args.loss} is for causal LMs; --objective {args.objective} has its own loss")
    if args.from_scratch and args.model:
        raise MemlmError("give --from-scratch SIZE or --model ENCODER, not both")
    if args.tokenizer and args.tokenizer.startswith("bpe:"):
        raise MemlmError(
            "--objective npm uses an encoder's WordPiece tokenizer: give --tokenizer ENCODER (folder/name)"
        )
    if args.from_scratch and args.tokenizer and args.model is None:
        encoder = args.tokenizer  # from scratch: the tokenizer of this encoder
    else:
        encoder = args.model or DEFAULT_ENCODER
    config = TrainConfig(
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
        max_steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        dtype=args.dtype,
        eval_every=0,
        save_every=args.save_every,
        seed=args.seed,
        device=args.device,
    )
    common = {"encoder": encoder, "scratch": args.from_scratch, "valid_corpus": args.valid_corpus,
              "valid_tokens": args.valid_tokens, "n_positions": args.n_positions, "dropout": args.dropout,
              "resume": not args.no_resume, "stop_after": args.stop_after}  # fmt: skip
    if args.objective == "mlm":
        from memlm.npm.mlm import train_mlm

        if args.max_span is not None:
            raise MemlmError("--max-span is for NPM's span masking; --objective mlm masks single tokens")
        result = train_mlm(args.out, args.corpus, config, prob=args.mask_budget, **common)
    else:
        result = train_npm(args.out, args.corpus, config, objective=args.objective, budget=args.mask_budget,
                           max_span=args.max_span, **common)  # fmt: skip
    if result.final_dir is None:
        print(f"stopped at update {result.step}: rerun the same command to continue", file=sys.stderr)
        return
    vl = result.valid_loss
    unit = "masked token" if args.objective != "npm" else "masked span"
    print(
        f"trained {result.step} updates ({args.objective}) -> {result.final_dir}"
        + (f" (valid loss {vl:.4f} per {unit})" if vl is not None else "")
    )


def cmd_npm_index(args: argparse.Namespace) -> None:
    from memlm.npm.phrase_index import build_phrase_index
    from memlm.npm.train_npm import limit_encoder_documents
    from memlm.resources import load_encoder
    from memlm.train_lm import load_corpora

    model, tok = load_encoder(args.encoder, dtype=args.dtype)
    docs = limit_encoder_documents(load_corpora(args.corpus, args.split), tok, args.max_tokens)
    # (the phrase index records its own corpus fingerprint)
    source = {"corpus": args.corpus, "split": args.split, "documents": len(docs), "max_tokens": args.max_tokens}
    pi = build_phrase_index(
        model,
        tok,
        docs,
        args.out,
        max_length=args.max_length,
        batch_size=args.batch_size,
        factory=args.factory,
        source=source,
        progress=True,
        overwrite=args.overwrite,
    )
    m = pi.manifest
    print(
        f"phrase index {pi.path}: {len(pi)} token vectors, {pi.n_blocks} blocks of <= {m['block_tokens']} tokens, "
        f"dim {pi.dim}, index {m['index']['factory']} (encoder {m['encoder']['model']['name']})"
    )


def _open_phrase_index(args: argparse.Namespace):
    from memlm.npm.phrase_index import PhraseIndex
    from memlm.resources import load_encoder

    pi = PhraseIndex.open(args.index)
    encoder = args.encoder or (pi.manifest.get("encoder") or {}).get("model", {}).get("name")
    if not encoder:
        raise MemlmError(f"phrase index {args.index} records no encoder name: pass --encoder")
    model, tok = load_encoder(encoder, dtype=args.dtype)
    pi.check_encoder(model, tok)
    return pi, model, tok


def _hit_json(h) -> dict[str, Any]:
    return {"doc_id": h.doc_id, "position": h.position, "score": h.score, "context": h.context}


def cmd_npm_predict(args: argparse.Namespace) -> None:
    from memlm.npm.inference import npm_predict, npm_single_predict

    pi, model, tok = _open_phrase_index(args)
    results = []
    for query in args.query:
        if args.single:
            preds = npm_single_predict(model, tok, pi, query, k=args.k, bm25_passages=args.bm25, top=args.top)
        else:
            preds = npm_predict(model, tok, pi, query, k=args.k, l_max=args.l_max, bm25_passages=args.bm25,
                                combine=args.combine, top=args.top)  # fmt: skip
        results.append((query, preds))
    if args.json:
        data = [
            {
                "query": q,
                "predictions": [
                    {
                        "phrase": p.phrase,
                        "score": p.score,
                        "prob": p.prob,
                        "log_score": p.log_score,
                        "occurrences": len(p.spans),
                        "top_span": _hit_json(p.spans[0]),
                    }  # fmt: skip
                    for p in preds
                ],
            }
            for q, preds in results
        ]
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


def _parse_labels(text: str) -> dict[str, list[str]]:
    """``'business=business,finance;sport=sports,football'`` -> label -> verbalizers."""
    labels: dict[str, list[str]] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, words = part.partition("=")
        name = name.strip()
        verbal = [w.strip() for w in words.split(",") if w.strip()] if sep else [name]
        if not name or not verbal:
            raise MemlmError(f"bad --labels entry {part!r}: write label=word,word;label=word")
        if name in labels:
            raise MemlmError(f"label {name!r} is given twice in --labels")
        labels[name] = verbal
    if len(labels) < 2:
        raise MemlmError(f"--labels needs at least two labels (label=word,word;label=word), got {text!r}")
    return labels


def cmd_npm_classify(args: argparse.Namespace) -> None:
    from memlm.npm.inference import npm_classify

    labels = _parse_labels(args.labels)
    pi, model, tok = _open_phrase_index(args)
    results = []
    for query in args.query:
        res = npm_classify(model, tok, pi, query, labels, single=args.single, k=args.k, l_max=args.l_max,
                           tau=args.tau, bm25_passages=args.bm25)  # fmt: skip
        logs = {y: v if math.isfinite(v) else None for y, v in res.log_scores.items()}
        results.append(
            {"query": query, "label": res.label, "probs": res.probs, "matched": res.matched, "log_scores": logs}
        )
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


def _eval_model(args: argparse.Namespace):
    """``(phrase index, model, tokenizer, label)`` of ``memlm npm eval``: NPM / NPM SINGLE with the index's encoder
    (checked), or the MLM baseline (``--mlm``; the index then only names the reference corpus)."""
    from memlm.npm.phrase_index import PhraseIndex

    if args.mlm:
        from memlm.npm.mlm import load_mlm

        if args.single or args.bm25 is not None or args.encoder:
            raise MemlmError("--mlm predicts one token without retrieval: --single, --bm25 and --encoder do not apply")
        model, tok = load_mlm(args.mlm, dtype=args.dtype)
        return PhraseIndex.open(args.index), model, tok, f"mlm {args.mlm}"
    pi, model, tok = _open_phrase_index(args)
    kind = "npm-single" if args.single else "npm"
    bm25 = f" +bm25 top-{args.bm25}" if args.bm25 is not None else ""
    return pi, model, tok, f"{kind}{bm25} {model.config.memlm_name}"


def cmd_npm_eval(args: argparse.Namespace) -> None:
    from memlm.npm import tasks
    from memlm.npm.phrase_index import PhraseIndex
    from memlm.train_lm import load_corpora

    if args.max_queries is not None and args.max_queries < 1:
        raise MemlmError(f"--max-queries must be >= 1, got {args.max_queries}")
    pi, model, tok, label = _eval_model(args)
    npm_opts = {"single": args.single, "k": args.k, "l_max": args.l_max, "bm25_passages": args.bm25}
    if args.task == "bbc":
        docs = load_corpora(args.corpus or "bbc", args.split)
        classify = (tasks.mlm_classifier(model, tok) if args.mlm
                    else tasks.npm_classifier(model, tok, pi, tau=args.tau, **npm_opts))  # fmt: skip
        res = tasks.bbc_classification(classify, tok, docs, max_queries=args.max_queries,
                                       limit_tokens=tasks.encoder_limit(model, tok),
                                       keep_predictions=args.predictions, seed=args.seed)  # fmt: skip
    elif args.task == "cloze":
        ref = PhraseIndex.open(args.reference_index) if args.reference_index else pi
        ref_docs = tasks.index_documents(ref, tok)
        docs = load_corpora(args.corpus or ref.manifest["corpus"]["corpus"], args.split)
        probes = tasks.cloze_probes(docs, ref_docs, tok, n=args.max_queries or 500, seed=args.seed,
                                    per_length=args.per_length)  # fmt: skip
        if not probes:
            raise MemlmError("no cloze probe found: no held-out entity occurs in the reference corpus")
        predict = tasks.mlm_predictor(model, tok) if args.mlm else tasks.npm_predictor(model, tok, pi, **npm_opts)
        res = tasks.evaluate_cloze(probes, predict, tok, keep_predictions=args.predictions)
    else:
        ref_docs = tasks.index_documents(pi, tok)
        probes = tasks.update_probes(ref_docs, tok, n=args.max_queries or 50, seed=args.seed)
        work = Path(args.work or f"{args.index}.update")
        if args.mlm:
            res = tasks.corpus_update_probe(
                None,
                tok,
                probes,
                ref_docs,
                work,
                distractors=args.distractors,
                seed=args.seed,
                predict=lambda _: tasks.mlm_predictor(model, tok),
            )
        else:
            res = tasks.corpus_update_probe(model, tok, probes, ref_docs, work, distractors=args.distractors,
                                            seed=args.seed,
                                            predict=lambda p: tasks.npm_predictor(model, tok, p, **npm_opts),
                                            max_length=pi.manifest.get("block_tokens", 510) + 2)  # fmt: skip
        if not args.predictions:
            for part in ("original", "edited"):
                res[part].pop("predictions", None)
    res = {"task": args.task, "model": label, "index": str(args.index), "index_tokens": len(pi),
           "options": {"k": args.k, "l_max": args.l_max, "single": args.single, "bm25": args.bm25,
                       "tau": args.tau, "seed": args.seed, "max_queries": args.max_queries}, **res}  # fmt: skip
    _print_eval(res)
    _write_json(args.json, res)


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


def _print_trime_rows(rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]], tokens: str) -> None:
    print(f"{'memory':10s} {'M':>3s} {'tau_local':>9s} {'tau':>6s} {'lambda':>6s} {'ppl':>10s}  ({tokens})")
    for name, p, res in rows:
        if res is None:
            continue
        if p is None:
            print(f"{name:10s} {'-':>3s} {'-':>9s} {'-':>6s} {'-':>6s} {res['base_ppl']:10.4f}")
            continue
        ext = name == "external"
        m = "-" if p["segments"] is None else str(p["segments"])
        tau = f"{p['temperature']:.3g}" if ext else "-"
        lam = f"{p['lambda']:.3g}" if ext else "-"
        print(f"{name:10s} {m:>3s} {p['local_temperature']:9.3g} {tau:>6s} {lam:>6s} {res['ppl']:10.4f}")


def cmd_trime_eval(args: argparse.Namespace) -> None:
    from memlm.trime.inference import run_trime_eval

    model = args.model
    if model is None and args.datastore:
        from memlm.datastore import Datastore

        model = Datastore.open(args.datastore).model_name
    model = model or DEFAULT_MODEL
    ts, res = run_trime_eval(
        model,
        args.corpus,
        args.split,
        args.seq_len,
        max_segments=args.max_segments,
        local_temperatures=_floats(args.local_temperatures),
        datastore=args.datastore,
        k=args.k,
        search=args.search,
        nprobe=args.nprobe,
        drop_self_matches=args.drop_self_matches,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        dump=args.dump,
    )
    if args.dump:
        print(f"wrote {args.dump}", file=sys.stderr)
    rows = [
        ("none", None, res),
        *((name, res[name], res[name]) for name in ("local", "long", "external") if name in res),
    ]
    _print_trime_rows(rows, f"{res['tokens']} tokens, {args.split}")
    out = {"model": model, "corpus": args.corpus, "split": args.split, "seq_len": args.seq_len, **res,
           "meta": {k: v for k, v in ts.meta.items() if k != "source"}, "source": ts.meta.get("source")}  # fmt: skip
    _write_json(args.json, out)


def cmd_trime_tune(args: argparse.Namespace) -> None:
    from memlm.trime.inference import (
        DEFAULT_SEGMENTS,
        DEFAULT_TRIME_LAMBDAS,
        DEFAULT_TRIME_TEMPERATURES,
        TrimeScores,
        tune_trime_memories,
    )

    valid = TrimeScores.load(args.valid)
    test = TrimeScores.load(args.test) if args.test else None
    res = tune_trime_memories(
        valid,
        test,
        segments=tuple(int(x) for x in _floats(args.segments)) if args.segments else DEFAULT_SEGMENTS,
        temperatures=_floats(args.ext_temperatures) if args.ext_temperatures else DEFAULT_TRIME_TEMPERATURES,
        lambdas=_floats(args.ext_lambdas) if args.ext_lambdas else DEFAULT_TRIME_LAMBDAS,
        knn_temperatures=_floats(args.knn_temperatures) if args.knn_temperatures else (None,),
        local_temperatures=_floats(args.local_temperatures) if args.local_temperatures else None,
    )
    kinds = [k for k in ("local", "long", "external") if k in res]
    print("best on valid:")
    _print_trime_rows(
        [("none", None, res["valid"]), *((k, res[k]["best"], res[k]["best"]) for k in kinds)],
        f"{res['valid']['tokens']} tokens, valid",
    )
    if test is not None:
        print("applied to test:")
        _print_trime_rows(
            [("none", None, res["test"]), *((k, res[k]["best"], res[k]["test"]) for k in kinds)],
            f"{res['test']['tokens']} tokens, test",
        )
    _write_json(args.json, res)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MemlmError(f"expected comma-separated numbers, got {text!r}") from None


def cmd_analyze(args: argparse.Namespace) -> None:
    from memlm.analysis import FIG5_TEMPERATURES, AnalysisSpec, run_analysis

    datastores = {role: d for role, d in (("att", args.datastore_att), ("ffn", args.datastore_ffn)) if d}
    spec = AnalysisSpec(
        model=args.model,
        datastores=datastores,
        valid=args.valid_corpus,
        test=args.test_corpus,
        max_tokens=args.max_tokens,
        window=args.window,
        min_context=args.min_context,
        batch_size=args.batch_size,
        dtype=args.dtype,
        k=args.k,
        nprobe=args.nprobe,
        factory=args.factory,
        fractions=_floats(args.fractions),
        temperatures=_floats(args.fig5_temperatures) if args.fig5_temperatures else FIG5_TEMPERATURES,
        learned_n=tuple(int(n) for n in _floats(args.learned_n)),
        learned_steps=args.learned_steps,
        learned_batch=args.learned_batch,
        learned_lr=args.learned_lr,
        seed=args.seed,
        skip=tuple(s.strip() for s in args.skip.split(",") if s.strip()),
    )
    run_analysis(spec, args.out, log=lambda m: print(m, file=sys.stderr))
    print((Path(args.out) / "tables.md").read_text())


def cmd_demo(args: argparse.Namespace) -> None:
    from memlm.demo import run_demo

    run_demo(out=Path(args.out) if args.out else None, quick=args.quick)


# ---------------------------------------------------------------------------------------------------- parser


def _add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--model",
        default=None if not required else DEFAULT_MODEL,
        help=f"named model (memlm models), HF id or local folder (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype for the forward pass. Default auto = bfloat16 on GPUs and on CPUs with native bf16 "
        "(AVX512-BF16/AMX: 1.4x float32's tokens/s for SmolLM2-135M eval on 2 cores), float32 elsewhere; the output "
        "head and log-softmax always run in float32, so bf16 perplexity stays within 0.2%% of float32 (0.03%% and "
        "0.10%% measured, docs/BENCHMARKS.md)",
    )


def _add_corpus(p: argparse.ArgumentParser, split: str) -> None:
    p.add_argument(
        "--corpus", required=True, help="named corpus (memlm corpora), .txt/.jsonl file or folder; a,b for several"
    )
    p.add_argument(
        "--split",
        default=split,
        choices=["train", "valid", "test", "all"],
        help=f"split of a named corpus: train, valid, test, all (default {split})",
    )
    p.add_argument(
        "--max-tokens", type=V.positive_int, default=None, help="use only the leading documents up to this many tokens"
    )


def _add_ray(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--ray", default=None, metavar="ADDRESS", help=f"{what}: 'local' starts a local Ray cluster, else its address"
    )


def _add_knn_weights(p: argparse.ArgumentParser) -> None:
    """``--lambda`` / ``--temperature`` (Eq. 2-3); unset, they come from the datastore (memlm.calibration)."""
    p.add_argument(
        "--lambda",
        dest="lam",
        type=V.probability,
        default=None,
        help="interpolation weight λ of the kNN term (default: the datastore's calibrated λ, tuned on its build's "
        "held-out slice; 0.25 if it has none)",
    )
    p.add_argument(
        "--temperature",
        type=V.positive_float,
        default=None,
        help="softmax temperature τ on the neighbours' scores (default: the datastore's calibrated τ; 1 if none)",
    )


def _add_windows(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=V.positive_int, default=1024, help="tokens per forward window (default 1024)")
    p.add_argument(
        "--min-context",
        type=V.min_context,
        default=None,
        help="every scored token has at least this many tokens of context, >= 1 (default 512, as the paper)",
    )
    p.add_argument(
        "--stride",
        type=V.positive_int,
        default=None,
        help="instead of --min-context: windows advance by this many tokens (window - min_context); "
        "--stride equal to --window gives non-overlapping blocks (Hugging Face's perplexity guide, run_clm.py)",
    )
    p.add_argument(
        "--block-start",
        default="skip",
        choices=["skip", "bos"],
        help="with --stride = --window: skip the first token of every block (default, as the guide) or score it "
        "from a BOS (or EOS) token put before each block of window - 1 tokens",
    )
    p.add_argument("--batch-size", type=V.positive_int, default=4)


def _window_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """window, min_context (default 512 unless --stride is given), stride and block_start for the windowing."""
    from memlm.windows import resolve_stride

    if args.min_context is not None and args.stride is not None:
        resolve_stride(args.window, args.min_context, args.stride)  # refuses a disagreement
    min_context = args.min_context if args.min_context is not None or args.stride is not None else 512
    return {"window": args.window, "min_context": min_context, "stride": args.stride, "block_start": args.block_start}


def _add_npm(sub) -> None:
    npm = sub.add_parser("npm", help="NPM (Min et al. 2023): phrase index, masked-phrase prediction, classification")
    nsub = npm.add_subparsers(dest="sub", required=True)
    ni = nsub.add_parser("index", help="encode every token of a corpus into a phrase index (rerun to resume)")
    ni.add_argument("--encoder", default="minilm-l6", help="named encoder, HF id or folder (default minilm-l6)")
    _add_corpus(ni, "train")
    ni.add_argument("--out", type=V.output_dir, required=True, help="phrase-index folder")
    ni.add_argument("--overwrite", action="store_true", help="replace a phrase index built with other settings")
    ni.add_argument("--factory", default=None, help="FAISS factory string (default Flat for small corpora)")
    ni.add_argument(
        "--max-length", type=V.positive_int, default=None, help="encoder input length (default: the encoder's)"
    )
    ni.add_argument("--batch-size", type=V.positive_int, default=16)
    ni.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ni.set_defaults(func=cmd_npm_index)

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
        p.add_argument("query", nargs="+", help="text with exactly one [MASK]")

    npr = nsub.add_parser("predict", help="fill the [MASK] of a query with ranked corpus phrases")
    common(npr)
    npr.add_argument("--top", type=V.positive_int, default=10, help="phrases to print (default 10)")
    npr.add_argument("--combine", default="a1", choices=["a1", "sum"], help="span score: App. A.1 (a1) or §3.1 sum")
    npr.set_defaults(func=cmd_npm_predict)
    nc = nsub.add_parser("classify", help="closed-set label probabilities (fuzzy verbalizers, App. A.4)")
    common(nc)
    nc.add_argument(
        "--labels", required=True, help="label=verbalizer,verbalizer;label=... e.g. 'pos=great,good;neg=bad,awful'"
    )
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
    ne.add_argument(
        "--max-queries",
        type=V.positive_int,
        default=None,
        help="bbc: N test articles, a seeded sample (default all); cloze: N probes (500); update: N probes (50)",
    )
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


def _add_trime(sub) -> None:
    te = sub.add_parser("trime-eval", help="TRIME perplexity with local, long-term and external memory (+ dump)")
    _add_model(te)
    _add_corpus(te, "test")
    te.add_argument("--seq-len", type=V.positive_int, required=True, help="tokens per segment (one forward pass each)")
    te.add_argument(
        "--max-segments", type=V.nonneg_int, default=8, help="previous segments kept for the long-term memory"
    )
    te.add_argument("--local-temperatures", default="1", help="τ_local values kept in the dump, comma-separated")
    te.add_argument(
        "--datastore",
        type=V.existing_dir,
        default=None,
        help="external memory: a datastore with ffn_in keys of this model",
    )
    te.add_argument("--k", type=V.neighbours, default=1024, help="entries retrieved per token from the datastore")
    te.add_argument("--search", default="index", choices=["index", "exact"])
    te.add_argument("--nprobe", type=V.positive_int, default=32)
    te.add_argument("--drop-self-matches", action="store_true", help="ignore retrieved entries that are the token")
    te.add_argument("--batch-size", type=V.positive_int, default=8)
    te.add_argument(
        "--dump", type=V.output_file, default=None, help="write per-token scores (.npz) for memlm trime-tune"
    )
    te.add_argument("--json", type=V.output_file, default=None, help="write the results as JSON")
    te.set_defaults(func=cmd_trime_eval)
    tt = sub.add_parser("trime-tune", help="choose M, τ_local, τ, λ on a valid dump; apply to a test dump")
    tt.add_argument(
        "--valid", type=V.existing_file, required=True, help="dump from memlm trime-eval --split valid --dump"
    )
    tt.add_argument("--test", type=V.existing_file, default=None, help="dump from memlm trime-eval --split test --dump")
    tt.add_argument("--segments", default=None, help="M values, comma-separated (default 0,1,2,4,8)")
    tt.add_argument(
        "--temperatures", dest="ext_temperatures", default=None, help="τ of the external memory (default 0.25..8)"
    )
    tt.add_argument("--lambdas", dest="ext_lambdas", default=None, help="λ values (default 0,0.05,...,0.6)")
    tt.add_argument("--knn-temperatures", default=None, help="τ_kNN values (default: τ)")
    tt.add_argument("--local-temperatures", default=None, help="τ_local values (default: all in the dump)")
    tt.add_argument("--json", type=V.output_file, default=None)
    tt.set_defaults(func=cmd_trime_tune)


def build_parser() -> argparse.ArgumentParser:
    parser = V.ArgumentParser(prog="memlm", description="Memory-augmented language models on any HF model.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list named offline models").set_defaults(func=cmd_models)
    sub.add_parser("corpora", help="list named offline corpora and their splits").set_defaults(func=cmd_corpora)

    ds = sub.add_parser("datastore", help="build or inspect a kNN-LM datastore").add_subparsers(
        dest="sub", required=True
    )
    b = ds.add_parser("build", help="one forward pass over a corpus -> (key, next token) datastore (+ index)")
    _add_model(b, required=True)
    _add_corpus(b, "train")
    b.add_argument(
        "--out", type=V.output_dir, required=True, help="datastore folder (rerun the same command to resume)"
    )
    b.add_argument(
        "--key",
        default="ffn_in",
        help="key role[@layer]: ffn_in, final, ffn_out, attn_out, attn_in, block_out, ffn_in_raw (FFN input before "
        "its layer norm) (default ffn_in = last layer's FFN input after layer norm)",
    )
    _add_windows(b)
    b.add_argument("--append", action="store_true", help="add this corpus to an existing datastore")
    b.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the datastore (and index) already in --out, or an unfinished build with other settings",
    )
    b.add_argument(
        "--no-index",
        dest="index",
        action="store_false",
        help="do not build the FAISS index afterwards (nor calibrate λ and τ, which needs it)",
    )
    b.add_argument(
        "--holdout",
        type=V.holdout_fraction,
        default=0.02,
        help="share of the corpus's tokens held out of the datastore (deterministic documents, at least 4,096 "
        "tokens) to tune λ and τ on after the build; recorded in the manifest and used by eval, generate and "
        "lm-eval when no --lambda/--temperature is given (default 0.02; 0 = none)",
    )
    b.add_argument(
        "--calibration-k", type=V.neighbours, default=1024, help="neighbours per held-out token (default 1024)"
    )
    b.add_argument("--factory", default=None, help="FAISS factory string (default: chosen from the datastore size)")
    b.add_argument("--metric", default="l2", choices=["l2", "ip"])
    b.add_argument("--device", default="cpu", help="where the forward pass runs: cpu, cuda, cuda:N (default cpu)")
    b.add_argument(
        "--shards",
        type=V.positive_int,
        default=None,
        help="split the corpus by documents into N shards (docs/SCALING.md)",
    )
    _add_ray(b, "build the shards as Ray tasks")
    b.add_argument("--cpus-per-worker", type=V.positive_int, default=1, help="CPUs (torch threads) per Ray build task")
    b.set_defaults(func=cmd_datastore_build)
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
    _add_ray(ib, "fill a sharded datastore's shard indexes as Ray tasks")
    ib.set_defaults(func=cmd_index_build)

    e = sub.add_parser("eval", help="perplexity of the LM and of the kNN-LM on a corpus split")
    _add_model(e)
    _add_corpus(e, "test")
    e.add_argument(
        "--datastore", type=V.existing_dir, default=None, help="datastore folder (its model and key are used)"
    )
    e.add_argument("--key", default=None, help="check that the datastore holds this key role[@layer]")
    e.add_argument("--k", type=V.neighbours, default=1024, help="neighbours per token (default 1024, as the paper)")
    _add_knn_weights(e)
    e.add_argument("--search", default="index", choices=["index", "exact"], help="neighbours from the index or exact")
    e.add_argument(
        "--scores",
        default="index",
        choices=["index", "exact"],
        help="scores as the index returns them or recomputed from the stored fp16 keys",
    )
    e.add_argument("--nprobe", type=V.positive_int, default=32)
    e.add_argument(
        "--drop-self-matches",
        action="store_true",
        help="ignore neighbours that are the evaluated token itself (text also in the datastore)",
    )
    e.add_argument("--cache", action="store_true", help="also compute the continuous cache (Grave et al. 2017)")
    e.add_argument("--cache-lambda", type=V.probability, default=0.1)
    e.add_argument("--cache-temperature", type=V.positive_float, default=1.0)
    _add_windows(e)
    e.add_argument("--dump", type=V.output_file, default=None, help="write per-token scores (.npz) for memlm tune")
    e.add_argument(
        "--json",
        type=V.output_file,
        default=None,
        help="write the results as (strict) JSON; knn_only_ppl is null when some target is never retrieved (infinite)",
    )
    _add_ray(e, "search a sharded datastore with one Ray actor per shard (default: threads in this process)")
    e.add_argument(
        "--mmap-index",
        action="store_true",
        help="memory-map the index instead of reading it into RAM (larger-than-RAM datastores; sharded: always)",
    )
    e.set_defaults(func=cmd_eval)

    t = sub.add_parser("tune", help="grid-search λ and temperature on a validation dump; apply to a test dump")
    t.add_argument("--valid", type=V.existing_file, required=True, help="dump from memlm eval --split valid --dump")
    t.add_argument("--test", type=V.existing_file, default=None, help="dump from memlm eval --split test --dump")
    t.add_argument("--lambdas", type=V.probability, nargs="+", default=None)
    t.add_argument("--temperatures", type=V.positive_float, nargs="+", default=None)
    t.add_argument("--cache-lambdas", type=V.probability, nargs="+", default=[0.0])
    t.add_argument("--cache-temperatures", type=V.positive_float, nargs="+", default=[1.0])
    t.add_argument("--k", type=V.neighbours, default=None, help="use only the k best of the dumped neighbours")
    t.add_argument("--json", type=V.output_file, default=None)
    t.set_defaults(func=cmd_tune)

    g = sub.add_parser("generate", help="sample from the kNN-LM, streaming tokens as they come")
    _add_model(g)
    g.add_argument("--datastore", type=V.existing_dir, required=True)
    g.add_argument("--prompt", type=V.nonempty_text, required=True)
    g.add_argument("--max-new-tokens", type=V.positive_int, default=40)
    g.add_argument("--k", type=V.neighbours, default=64)
    _add_knn_weights(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--greedy", action="store_true", help="pick the most likely token instead of sampling")
    g.add_argument(
        "--show-neighbours",
        type=V.nonneg_int,
        default=0,
        metavar="N",
        help="print under each generated token the N nearest datastore entries with their source text",
    )
    _add_ray(g, "search a sharded datastore with one Ray actor per shard")
    g.set_defaults(func=cmd_generate)

    le = sub.add_parser(
        "lm-eval",
        help="EleutherAI lm-evaluation-harness tasks on a model + memory (memlm_wikitext2, memlm_imdb, ...)",
    )
    _add_model(le)
    le.add_argument("--tasks", required=True, help="comma-separated: memlm_wikitext2, memlm_imdb, memlm_bbc_topic")
    le.add_argument("--datastore", default=None, help="kNN-LM datastore folder (none: the bare LM, or cache only)")
    _add_knn_weights(le)
    le.add_argument("--k", type=V.neighbours, default=1024, help="neighbours per token")
    le.add_argument("--nprobe", type=V.positive_int, default=32)
    le.add_argument("--cache", action="store_true", help="add the continuous cache (Grave et al. 2017)")
    le.add_argument("--cache-lambda", type=V.probability, default=0.1)
    le.add_argument("--cache-temperature", type=V.positive_float, default=1.0)
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
    le.add_argument("--limit", type=float, default=None, help="first N documents per task (or a fraction)")
    le.add_argument("--samples", default=None, help="document indices per task, JSON: '{\"memlm_wikitext2\": [0, 9]}'")
    le.add_argument("--out", default=None, help="write the results and settings as JSON here")
    le.add_argument(
        "--lm-eval-tasks", action="store_true", help="also offer lm_eval's built-in tasks (they need the dataset hub)"
    )
    le.set_defaults(func=cmd_lm_eval)

    t = sub.add_parser("train", help="train a causal LM from scratch or continue a pretrained one (resumable)")
    t.add_argument(
        "--out",
        type=V.output_dir,
        required=True,
        help="run folder; rerun the same command to resume; model in OUT/final",
    )
    t.add_argument("--corpus", required=True, help="training corpora, comma-separated (split train), e.g. wiki,news")
    t.add_argument("--valid-corpus", default=None, help="validation corpora (split valid; default: --corpus)")
    t.add_argument(
        "--valid-tokens", type=V.nonneg_int, default=200_000, help="validation tokens scored (0: no validation)"
    )
    t.add_argument(
        "--objective",
        default="lm",
        choices=["lm", "npm", "npm-single", "mlm"],
        help="lm: causal LM (--loss picks CE or TRIME); npm / npm-single: NPM on a BERT-like encoder (Min et al. "
        "2023); mlm: the same encoder with a masked-LM head (NPM's parametric baseline)",
    )
    init = t.add_mutually_exclusive_group()
    init.add_argument(
        "--from-scratch",
        metavar="SIZE",
        help="GPT-2-style model: 5m..50m or <layers>x<dim> (6x384); npm: a BERT of that size",
    )
    init.add_argument(
        "--model",
        help="continue training this pretrained model (named, HF id or folder); npm: the encoder (default minilm-l6)",
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        help="from scratch: bpe:<vocab> (trained here; default bpe:8192), gpt2 or folder; npm: the encoder whose "
        "tokenizer to use (default minilm-l6)",
    )
    t.add_argument("--n-positions", type=V.positive_int, default=1024, help="from scratch: maximum positions")
    t.add_argument("--dropout", type=V.probability, default=0.1, help="from scratch: dropout")
    t.add_argument("--steps", type=V.positive_int, default=1000, help="optimizer updates")
    t.add_argument("--batch-size", type=V.positive_int, default=8, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=V.positive_int, default=1, help="micro-batches per update")
    t.add_argument("--seq-len", type=V.positive_int, default=512)
    t.add_argument("--lr", type=V.positive_float, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--weight-decay", type=V.nonneg_float, default=0.1)
    t.add_argument("--warmup", type=V.nonneg_float, default=0.05, help="warm-up updates, or a fraction of --steps")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    t.add_argument(
        "--eval-every", type=V.nonneg_int, default=200, help="validation every N updates (0: only at the end)"
    )
    t.add_argument(
        "--save-every", type=V.nonneg_int, default=200, help="checkpoint every N updates (0: only at the end)"
    )
    t.add_argument(
        "--loss",
        default="ce",
        choices=["ce", "trime", "trime-long", "trime-ext"],
        help="ce (plain LM); TRIME with local memory, + long-term (consecutive segments), + external (BM25 batches)",
    )
    t.add_argument(
        "--ce-warmup", type=V.probability, default=0.05, help="TRIME: plain CE for this fraction of updates first"
    )
    t.add_argument(
        "--segments-per-doc", type=V.positive_int, default=None, help="trime-long: consecutive segments per batch"
    )
    t.add_argument(
        "--drop-local-p", type=V.probability, default=0.9, help="trime-ext: drop the local memory with prob. p"
    )
    t.add_argument("--packing", default="bm25", choices=["bm25", "random"], help="trime-ext: batch packing")
    t.add_argument(
        "--mask-budget", type=V.probability, default=None, help="npm, mlm: fraction of tokens masked (default 0.15)"
    )
    t.add_argument("--max-span", type=V.positive_int, default=None, help="npm: longest masked span (default 10)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", help="auto (a CUDA GPU when there is one, else CPU), cpu, cuda, cuda:N")
    t.add_argument("--stop-after", type=V.positive_int, default=None, help="stop (resumably) after this many updates")
    t.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in --out")
    t.set_defaults(func=cmd_train, train_parser=t)

    a = sub.add_parser("analyze", help="Xu et al. 2023 ablations: h_ds, similarity, learned W_ds, FAISS vs exact, τ")
    _add_model(a, required=True)
    a.set_defaults(dtype="bfloat16")
    a.add_argument("--datastore-att", help="datastore with ffn_in keys (Xu's 'att')")
    a.add_argument("--datastore-ffn", help="datastore with final keys (Xu's 'ffn')")
    a.add_argument("--valid-corpus", default="wiki", help="held-out corpora (split valid) for tuning λ and τ")
    a.add_argument("--test-corpus", default="wiki", help="held-out corpora (split test) for the reported numbers")
    a.add_argument(
        "--max-tokens", type=V.positive_int, default=None, help="per split: leading documents up to this many tokens"
    )
    a.add_argument("--window", type=V.positive_int, default=512)
    a.add_argument("--min-context", type=V.min_context, default=128)
    a.add_argument("--batch-size", type=V.positive_int, default=4)
    a.add_argument("--k", type=V.neighbours, default=1024)
    a.add_argument("--nprobe", type=V.positive_int, default=32)
    a.add_argument("--factory", default=None, help="approximate FAISS index (default IVF<nlist>,PQ<dim/16>)")
    a.add_argument("--fractions", default="0.05,0.25,0.5,1", help="datastore ratios for Fig. 2/4 and Table 3")
    a.add_argument("--fig5-temperatures", default=None, help="τ values of Fig. 5 (default 0.1,...,3.0,3.5,4,5,6,8,10)")
    a.add_argument("--learned-n", default="1,2,3,6", help="embeddings per word of the learned W_ds")
    a.add_argument("--learned-steps", type=V.positive_int, default=1000, help="training updates of each learned W_ds")
    a.add_argument("--learned-batch", type=V.positive_int, default=512)
    a.add_argument("--learned-lr", type=V.positive_float, default=1e-3)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--skip", default="", help="comma-separated parts to skip: table1, approx, temperature, learned")
    a.add_argument("--out", type=V.output_dir, required=True, help="output folder (rerun to resume)")
    a.set_defaults(func=cmd_analyze)

    _add_npm(sub)
    _add_trime(sub)

    d = sub.add_parser("demo", help="SmolLM2-135M + wiki and news datastores on the offline defaults")
    d.add_argument("--out", type=V.output_dir, default=None, help="output folder (default $MEMLM_HOME/demo)")
    d.add_argument("--quick", action="store_true", help="a much smaller run (tests use it)")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.objective == "lm" and not (args.from_scratch or args.model):
        args.train_parser.error("one of the arguments --from-scratch --model is required")  # as before --objective
    if getattr(args, "lambdas", False) is None:
        from memlm.evaluate import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES

        args.lambdas = list(DEFAULT_LAMBDAS)
        args.temperatures = args.temperatures or list(DEFAULT_TEMPERATURES)
    elif getattr(args, "temperatures", False) is None:
        from memlm.evaluate import DEFAULT_TEMPERATURES

        args.temperatures = list(DEFAULT_TEMPERATURES)
    if getattr(args, "dtype", None) == "auto":
        from memlm.resources import default_dtype

        args.dtype = default_dtype()  # resolved once, so result files and caches record the dtype actually used
    try:
        V.preflight(args)  # cheap cross-argument checks before any model, corpus or forward pass
        args.func(args)
    except MemlmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    return 0
