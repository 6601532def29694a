"""``memlm eval``, ``memlm tune`` and ``memlm generate``: the kNN-LM (memlm.knnlm.evaluate, memlm.knnlm.generate) with a
datastore's calibrated (or given) λ and τ."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from memlm.cli import common
from memlm.cli import ngram as ngram_cli
from memlm.cli import validate as V
from memlm.cli.common import (
    DEFAULT_MODEL,
    add_corpus,
    add_knn_weights,
    add_model,
    add_ray,
    add_windows,
    window_kwargs,
    write_json,
)
from memlm.cli.memories import add_memory_args
from memlm.cli.report import print_result
from memlm.core.config import DEFAULT_CACHE_LAMBDA, DEFAULT_K, RetrievalConfig
from memlm.data.corpora import load_corpus_source
from memlm.errors import MemlmError
from memlm.knnlm.calibration import datastore_weights, stored_mixture

# memlm.knnlm.evaluate, .generate, .keys and .sharded import torch or faiss: imported in the commands (see common.py)


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.knnlm.evaluate import eval_result
    from memlm.knnlm.memories import memory_spec
    from memlm.knnlm.scoring import score_tokens
    from memlm.leakage import Evaluated, check_leakage
    from memlm.mixing.dump import DumpMixture
    from memlm.mixing.report import mixture_beside
    from memlm.models.keys import KeySpec
    from memlm.storage.sharded import open_datastore

    stores = [open_datastore(p, ray=args.ray, mmap_index=args.mmap_index) for p in args.datastore or []]
    ds = stores[0] if stores else None
    model_name = args.model or (ds.model_name if ds else None) or DEFAULT_MODEL
    model, tok = common._load_model(model_name, args.dtype, args)
    model = common.place_model(model, args.device)
    for store in stores:
        store.check_compatible(model, tok, KeySpec.parse(args.key) if args.key else None)
    ngram = ngram_cli.open_ngram(args, tok)
    V.check_against_model(args, model)
    docs, source = load_corpus_source(args.corpus, args.split, tok, args.max_tokens)
    evaluated = Evaluated(docs, args.corpus, args.split, source["fingerprint"])
    leakage = check_leakage(evaluated, stores, ngram, tok, args.allow_overlap)
    setting = {k: getattr(args, k) for k in ("k", "search", "scores", "nprobe", "index")}  # noticed if uncalibrated
    cache = args.cache is not None
    weights = datastore_weights(stores, args.lam, args.temperature, args.cache_lambda if cache else 0.0, setting)
    config = RetrievalConfig.with_options(  # built once here, passed down (recorded in the result's retrieval)
        k=args.k,
        **window_kwargs(args),
        search=args.search,
        scores=args.scores,
        nprobe=args.nprobe,
        drop_self_matches=args.drop_self_matches,
        adaptive=args.adaptive,
        adaptive_fraction=args.adaptive_fraction,
        pointer_min=args.pointer_min,
        pointer_rule=args.pointer_rule or "retomaton",
        pipeline=args.pipeline,
        index_path=args.index,
    )
    meta = {"model": model_name, "source": source, "leakage": leakage}  # memlm tune compares these
    if ds is not None:
        meta["datastore_build_id"] = ds.manifest.get("build_id")
    ts = score_tokens(model, tok, docs, _eval_components(args, stores, ngram), config, batch_size=args.batch_size,
                      meta=meta)  # fmt: skip
    for name, (_, tau, _) in zip(ts.names("knn"), weights, strict=True):  # each datastore read at its τ by default
        ts.components[name].temperature = ts.meta["components"][name]["temperature"] = float(tau)
    if args.dump:
        ts.save(args.dump)
        print(f"wrote {args.dump}", file=sys.stderr)
    about = {"model": model_name, "memories": memory_spec(list(ts.components.values())), "corpus": args.corpus,
             "split": args.split}  # fmt: skip
    res = eval_result(ts, weights, (args.cache_lambda if cache else 0.0, args.cache_temperature), ds,
                      args.temperature, about)  # fmt: skip
    lam, temperature = weights[0][:2] if ds is not None else (0.0, args.temperature or 1.0)
    if ngram is not None:
        from memlm.ngram.results import ngram_result

        res.update(ngram_result(ts, ngram, lam, temperature, ngram_cli.ngram_weights(args, ngram), base=res))
    mixed = {}
    if args.mixture == "stored":
        memory = [*stores, *([] if ngram is None else getattr(ngram, "memories", [ngram]))][0]  # one (checked)
        mixed = mixture_beside(stored_mixture(memory, required=True), ts, res, "the memory's build-time calibration")
    elif args.mixture:
        mixed = mixture_beside(DumpMixture.load(args.mixture), ts, res, args.mixture)
    elif not weights_given(args) and (stores or ngram is not None):
        from memlm.knnlm.default_mixture import default_mixture

        chosen = default_mixture(model, tok, stores, ngram, config, cache=cache, batch_size=args.batch_size)
        chosen.announce()
        if chosen.fit is not None:
            mixed = mixture_beside(chosen.fit, ts, res, chosen.origin)
    res.update({k: v for k, v in mixed.items() if k != "mixture"})
    print_result(res)
    res["leakage"] = leakage
    if mixed:
        res["mixture"] = mixed["mixture"]  # the fit applied, recorded (not printed)
    write_json(args.json, res)


def weights_given(args: argparse.Namespace) -> bool:
    """Whether the command line sets a weight (--lambda, --temperature, --ngram-lambda-sparse / -dense): then the
    fixed-weight rule of those values, and no default mixture."""
    names = ("lam", "temperature", "ngram_lambda_sparse", "ngram_lambda_dense")
    return any(getattr(args, n, None) is not None for n in names)


def cmd_tune(args: argparse.Namespace) -> None:
    """``memlm tune``: the one fitter on a valid table (:func:`memlm.mixing.report.fit_table`, ``--mixture`` its
    form, τ chosen by likelihood among ``--temperatures``), reported on valid and on ``--test``
    (:func:`memlm.mixing.report.fit_report`)."""
    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.knnlm.table import TokenTable
    from memlm.leakage import check_dumps
    from memlm.mixing.report import fit_report, fit_summary, fit_table

    valid = TokenTable.load(args.valid)
    test = TokenTable.load(args.test) if args.test else None
    leakage = check_dumps(valid, test, allow_overlap=args.allow_overlap)  # the same memories, no leak
    dm = fit_table(valid, args.mixture, args.temperatures or DEFAULT_TEMPERATURES, args.k, args.cache_temperatures)
    out: dict[str, Any] = {"best": fit_summary(dm), "mixture": dm.to_dict(), "valid": fit_report(dm, valid)}
    print("fitted on valid: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in out["best"].items()))  # fmt: skip
    for warning in dm.fit.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if test is not None:
        out["test"] = fit_report(dm, test)
        print("on test:")
        print_result(out["test"])
    out["leakage"] = leakage
    write_json(args.json, out)


def cmd_generate(args: argparse.Namespace) -> None:
    """``memlm generate``: the LM and every --memory mixed at each step by one mixture (--mixture, the fixed weights
    of --lambda / --ngram-lambda-*, else the memories' stored fits), streamed; neighbours and ∞-gram sources on
    request."""
    import torch

    from memlm.cli.memories import checked_mixture, cli_mixture, memory_spec_of
    from memlm.knnlm.generate import MixtureLogitsProcessor, NeighbourStreamer, SourceLookup, generate_text
    from memlm.knnlm.memories import open_memories

    if not memory_spec_of(args):
        raise MemlmError("memlm generate needs --memory: a datastore or ∞-gram index folder, or a spec "
                         "(knn:DS;ngram:IDX; --memory may be given more than once)")  # fmt: skip
    mixture = checked_mixture(args)
    components = open_memories(memory_spec_of(args))
    datastores = [c.datastore for c in components if c.kind == "knn" and c.datastore is not None]
    ngrams = [c.memory for c in components if c.kind == "ngram"]
    model, tok = common._load_model(args.model or next((ds.model_name for ds in datastores), None) or DEFAULT_MODEL,
                                    args.dtype)  # fmt: skip
    for c in components:
        c.check_compatible(model, tok)
        c.record = args.show_neighbours > 0
    for i, ds in enumerate(datastores or [None]):
        common.check_prompt_leakage(args, ds, ngrams if i == 0 else None, tok)
    torch.manual_seed(args.seed)
    proc = MixtureLogitsProcessor(model, components, cli_mixture(args, components, mixture), tokenizer=tok)
    lookup = SourceLookup(datastores[0], tok) if args.show_neighbours > 0 and datastores else None
    streamer = NeighbourStreamer(tok, proc, lookup, n_neighbours=args.show_neighbours)
    print(args.prompt, end="" if lookup is None else "\n", flush=True)
    text = generate_text(
        model,
        tok,
        [args.prompt],
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy,
        streamer=streamer,
        processor=proc,
    )[0]
    if ngrams:
        prompt = list(tok(args.prompt, add_special_tokens=False)["input_ids"])
        ngram_cli.print_sources(args, ngrams, tok, prompt, text)
        ngram_cli.note_approximate(proc)


def cmd_gate_train(args: argparse.Namespace) -> None:
    import numpy as np

    from memlm.knnlm.adaptive import gate_features, train_gate
    from memlm.knnlm.table import TokenTable

    ts = TokenTable.load(args.dump)
    if "knn" not in ts.columns or ts.lm_entropy is None or ts.position is None:
        raise MemlmError(f"{args.dump} lacks datastore neighbours or the LM's entropy: rerun memlm eval --datastore DS "
                         "--dump with this memlm")  # fmt: skip
    knn = ts.logprob("knn", temperature=args.temperature)
    gate = train_gate(gate_features(ts.lm_entropy, ts.lm_max_logprob, ts.position), ts.lm_logprob, knn.numpy(),
                      steps=args.steps, seed=args.seed)  # fmt: skip
    gate.save(args.out)
    lam = gate.lambdas(gate_features(ts.lm_entropy, ts.lm_max_logprob, ts.position))
    print(f"wrote {args.out}: λ on the dump's {len(ts):,} tokens mean {float(np.mean(lam)):.3f}, "
          f"median {float(np.median(lam)):.3f}")  # fmt: skip


def _memory_specs(args: argparse.Namespace) -> None:
    """``--memory`` read (memlm.knnlm.memories.parse_spec, nothing opened): ``args.memories`` the ``(kind, path,
    options)`` of each memory in order, and by kind ``args.datastore``, ``args.ngram`` (paths) and ``args.cache``
    (the cache's options, or None)."""
    from memlm.knnlm.memories import parse_spec

    items = [item for spec in args.memory or [] for item in parse_spec(spec)]
    args.memories, args.cache = items, None
    args.datastore = [path for kind, path, _ in items if kind == "knn"]
    args.ngram = [path for kind, path, _ in items if kind == "ngram"]
    for kind, path, options in items:
        if kind not in ("knn", "ngram", "cache"):
            raise MemlmError(f"memlm eval reads datastores, ∞-gram indexes and the cache; --memory {kind}:{path} is "
                             "another kind: score it with memlm.score_tokens")  # fmt: skip
        if kind == "cache":
            if args.cache is not None:
                raise MemlmError("--memory names the cache twice: give it once")
            unknown = set(options) - {"k", "max_len", "metric"}
            if unknown:
                raise MemlmError(f"the cache takes k, max_len and metric (its λc and τ: --cache-lambda, "
                                 f"--cache-temperature), not {', '.join(sorted(unknown))}")  # fmt: skip
            args.cache = options
        elif options:
            flags = "--k, --search, --scores, --nprobe, --lambda, --temperature" if kind == "knn" else (
                "--ngram-max-n, --ngram-lambda-sparse, --ngram-lambda-dense")  # fmt: skip
            raise MemlmError(f"memlm eval sets a {kind} memory's options with its flags ({flags}), not in --memory "
                             f"{path}?{'&'.join(options)}")  # fmt: skip
        elif not Path(path).is_dir():
            raise MemlmError(f"--memory: folder {path!r} does not exist")


def _cache_component(options: dict[str, str]):
    """The continuous cache of ``--memory cache?k=..&max_len=..&metric=..`` (its defaults otherwise)."""
    from memlm.knnlm.cache import CacheComponent

    try:
        return CacheComponent(int(options.get("k", 256)), int(options.get("max_len", 2048)),
                              options.get("metric", "ip"))  # fmt: skip
    except ValueError as error:
        raise MemlmError(f"--memory cache?...: k and max_len are whole numbers ({error})") from None


def _eval_components(args: argparse.Namespace, stores: list, ngram) -> list:
    """The memories of ``memlm eval`` in the order ``--memory`` gave them: the open datastores, the ∞-gram memories,
    the cache."""
    found = {"knn": iter(stores), "ngram": iter(getattr(ngram, "memories", [ngram] if ngram is not None else []))}
    return [_cache_component(options) if kind == "cache" else next(found[kind]) for kind, _, options in args.memories]


def check_eval(args: argparse.Namespace) -> None:
    _memory_specs(args)
    V.check_windows(args)
    if args.key:
        from memlm.models.keys import KeySpec

        KeySpec.parse(args.key)
    paths = args.datastore or []
    for path in paths:
        V.check_datastore_k(path, args.k)
    if len({str(Path(p).resolve()) for p in paths}) < len(paths):
        raise MemlmError(f"--memory names the same datastore twice ({', '.join(paths)}): give each once")
    several = [f for f, on in (("--adaptive", args.adaptive), ("--pointer-min", args.pointer_min),
                               ("--index", args.index)) if on]  # fmt: skip
    if len(paths) > 1 and several:
        raise MemlmError(f"{several[0]} applies to one datastore; give one datastore (--memory) with it, or leave "
                         "it out to mix several")  # fmt: skip
    fast = [f for f, on in (("--adaptive", args.adaptive), ("--pointer-min", args.pointer_min)) if on]
    if args.pipeline and fast:
        raise MemlmError(f"--pipeline searches each batch as it comes, {fast[0]} needs every query first: use one")
    if getattr(args, "pointer_rule", None) and not args.pointer_min:
        raise MemlmError("--pointer-rule chooses what pointer reuse does where it searches: give --pointer-min N too")
    if args.adaptive_fraction is not None and args.adaptive is None:
        raise MemlmError("--adaptive-fraction needs --adaptive GATE (a gate from memlm gate train)")
    if (args.adaptive or args.pointer_min or args.pipeline or args.index) and not args.datastore:
        raise MemlmError("--adaptive, --pointer-min, --pipeline and --index need a datastore (--memory DIR) to search")
    if args.index:
        _index_of_datastore(args.index, paths[0])
    if args.mixture:
        _mixture_of_memories(args)


def _mixture_of_memories(args: argparse.Namespace) -> None:
    """``--mixture``: a fit whose components are this eval's memories, before the model loads (the features are
    checked again on the scored tokens)."""
    from memlm.mixing.component import component_name

    if args.mixture == "stored":
        if len(args.datastore or []) + len(args.ngram or []) != 1 or args.cache is not None:
            raise MemlmError("--mixture stored applies one memory's build-time fit (LM + that memory): give exactly "
                             "one datastore or one ∞-gram index (--memory), without the cache; for several memories "
                             "fit them together with memlm tune and pass its --json file")  # fmt: skip
        return
    from memlm.mixing.dump import DumpMixture

    dm = DumpMixture.load(args.mixture)
    counts: dict[str, int] = {}
    given = ["lm"]
    for kind, _, _ in args.memories:
        given.append(component_name(kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    if sorted(dm.mixture.components) != sorted(given):
        raise MemlmError(
            f"--mixture {args.mixture} mixes {', '.join(dm.mixture.components)}, this eval gives "
            f"{', '.join(given)}: give the same memories (--memory) as the valid dump it was fitted on, or fit again "
            "with memlm tune"
        )


def _index_of_datastore(index: str, datastore: str) -> None:
    """``--index`` must have been built from ``--datastore``'s keys (its sidecar records the datastore's identity):
    an index from another datastore returns ids of other entries (a wrong perplexity, or an IndexError when it has
    more entries). Cheap: the sidecar and the manifest, not the FAISS file."""
    from memlm.storage.sharded import is_sharded, open_datastore

    if is_sharded(datastore):  # a sharded index description: its searcher checks each shard's index
        return
    problem = open_datastore(datastore).index_problem(index)
    if problem is not None:
        raise MemlmError(
            f"--index: {problem}; give an index built from it (`memlm index build {datastore} --out FILE`)"
        )


def add_parsers(sub) -> None:
    e = sub.add_parser("eval", help="perplexity of the LM and of the kNN-LM on a corpus split")
    add_model(e)
    common.add_compute_path(e)
    add_corpus(e, "test")
    e.add_argument(
        "--memory",
        default=None,
        action="append",
        metavar="SPEC",
        help="a memory to mix, in order (memlm.knnlm.memories): a datastore folder (its model and key are used; "
        "several: each its calibrated λ, τ or --lambda / --temperature, mixed by one rule, row multi_knn_ppl), an "
        "∞-gram index folder (each its own weights), or cache (the continuous cache, Grave et al. 2017; "
        "cache?k=256&max_len=2048&metric=ip); kind:PATH spells the kind out (knn:DIR, ngram:DIR); give it again "
        "for more, or join specs with ';'",
    )
    e.add_argument("--key", default=None, help="check that the datastore holds this key role[@layer]")
    e.add_argument(
        "--k", type=V.neighbours, default=DEFAULT_K, help=f"neighbours per token (default {DEFAULT_K}, as the paper)"
    )
    add_knn_weights(e)
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
    e.add_argument("--cache-lambda", type=V.probability, default=DEFAULT_CACHE_LAMBDA, help="the cache's λc")
    e.add_argument("--cache-temperature", type=V.positive_float, default=1.0)
    add_windows(e)
    common.add_allow_overlap(e)
    common.add_device(e)
    e.add_argument("--dump", type=V.output_file, default=None, help="write per-token scores (.npz) for memlm tune")
    e.add_argument(
        "--json",
        type=V.output_file,
        default=None,
        help="write the results as (strict) JSON; knn_only_ppl is null when some target is never retrieved (infinite)",
    )
    add_ray(e, "search a sharded datastore with one Ray actor per shard (default: threads in this process)")
    e.add_argument(
        "--mmap-index",
        action="store_true",
        help="memory-map the index instead of reading it into RAM (larger-than-RAM datastores; sharded: always)",
    )
    e.add_argument(
        "--index",
        type=V.existing_file,
        default=None,
        help="search this index of the datastore instead of its index.faiss (e.g. a compressed OPQ/PCA one)",
    )
    fast = e.add_argument_group("efficient kNN-LM (docs/results/efficient-knnlm.md)")
    fast.add_argument(
        "--adaptive",
        type=V.existing_file,
        default=None,
        metavar="GATE",
        help="adaptive retrieval (He et al. 2021): a gate from `memlm gate train` gives each token its λ",
    )
    fast.add_argument(
        "--adaptive-fraction",
        type=V.probability,
        default=None,
        metavar="F",
        help="with --adaptive: search only the share F of tokens the gate ranks highest (λ = 0 elsewhere)",
    )
    fast.add_argument(
        "--pointer-min",
        type=V.nonneg_int,
        default=0,
        metavar="N",
        help="pointer reuse (RetoMaton, Alon et al. 2022): skip the search where >= N of the previous token's "
        "neighbours continue with the observed token (0 = off); every row is then scored exactly from the keys",
    )
    fast.add_argument(
        "--pointer-rule",
        choices=["retomaton", "replace"],
        default=None,
        help="with --pointer-min, what a token that searches scores with: 'retomaton' (the paper's code: the k "
        "search results and the surviving pointers), 'replace' (the search results only) (default retomaton)",
    )
    fast.add_argument(
        "--pipeline",
        action="store_true",
        help="search each forward batch in a background thread while the model computes the next",
    )
    e.add_argument(
        "--mixture",
        type=lambda value: value if value == "stored" else V.existing_file(value),
        default=None,
        metavar="FIT.json|stored",
        help="also score the learned mixture fitted by memlm tune --json FIT.json (the same "
        "--memory in the same order) and report mixture_ppl beside the fixed-weight rows; stored: the "
        "one memory's own fit, made when it was built or calibrated. Without --mixture and without --lambda, "
        "--temperature or --ngram-lambda-*: the memories' stored fits (one: its own; several: combined and checked "
        "on their calibration slices), said in one line",
    )
    ngram_cli.add_eval_args(e, selection=False)
    e.set_defaults(func=cmd_eval, check=check_eval)  # looked up when the parser is built (tests replace it first)

    t = sub.add_parser("tune", help="fit the mixture of the LM and the memories on a valid dump; apply to a test dump")
    t.add_argument("--valid", type=V.existing_file, required=True, help="dump from memlm eval --split valid --dump")
    t.add_argument("--test", type=V.existing_file, default=None, help="dump from memlm eval --split test --dump")
    t.add_argument(
        "--temperatures",
        type=V.positive_float,
        nargs="+",
        default=None,
        help="the datastores' τ candidates: the fit at each, the most likely on valid kept (default 0.1 ... 1000)",
    )
    t.add_argument("--cache-temperatures", type=V.positive_float, nargs="+", default=[1.0], help="the cache's τc")
    t.add_argument("--k", type=V.neighbours, default=None, help="use only the k best of the dumped neighbours")
    t.add_argument("--json", type=V.output_file, default=None, help="the fit and its reports, for memlm eval --mixture")
    t.add_argument(
        "--mixture",
        choices=["rule", "constant", "gate", "guarded"],
        default="rule",
        help="the form fitted by maximum likelihood (no grid over the weights): rule (default; the papers' fixed "
        "weights, one per memory, an ∞-gram's λ_sparse / λ_dense, by EM), constant (one weight per memory), gate "
        "(per-token weights from a small gate), guarded (the LM alone, constant weights or the gate, whichever the "
        "part of valid kept apart prefers; docs/results/mixture.md)",
    )
    common.add_allow_overlap(t)
    t.set_defaults(func=cmd_tune)

    g = sub.add_parser("generate", help="sample from the LM mixed with its memories, streaming tokens as they come")
    add_model(g)
    g.add_argument("--prompt", type=V.nonempty_text, required=True)
    g.add_argument("--max-new-tokens", type=V.positive_int, default=40)
    add_memory_args(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--greedy", action="store_true", help="pick the most likely token instead of sampling")
    g.add_argument(
        "--show-neighbours",
        type=V.nonneg_int,
        default=0,
        metavar="N",
        help="print under each generated token the N nearest datastore entries with their source text",
    )
    g.add_argument(
        "--show-sources",
        type=V.nonneg_int,
        default=0,
        metavar="N",
        help="with an ∞-gram memory: after the text, each generated token's longest matching suffix and N documents "
        "of the index that hold it (document index, id, offset)",
    )
    common.add_allow_overlap(g)
    g.set_defaults(func=cmd_generate)

    gate = sub.add_parser("gate", help="adaptive retrieval (He et al. 2021): train the gate that predicts λ per token")
    gsub = gate.add_subparsers(dest="gate_cmd", required=True)
    gt = gsub.add_parser("train", help="train a gate on a valid dump from memlm eval --datastore DS --dump")
    gt.add_argument(
        "--dump", type=V.existing_file, required=True, help="held-out dump (memlm eval --split valid --dump)"
    )
    gt.add_argument("--out", type=V.output_file, required=True, help="gate file (.npz) for memlm eval --adaptive")
    gt.add_argument("--temperature", type=V.positive_float, default=1.0, help="τ of the kNN term it is trained with")
    gt.add_argument("--steps", type=V.positive_int, default=300)
    gt.add_argument("--seed", type=int, default=0)
    gt.set_defaults(func=cmd_gate_train)
