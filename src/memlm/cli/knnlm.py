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
from memlm.knnlm.calibration import knn_parameters

# memlm.knnlm.evaluate, .generate, .keys and .sharded import torch or faiss: imported in the commands (see common.py)


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.knnlm.evaluate import perplexities, value_counts
    from memlm.knnlm.memories import memory_spec
    from memlm.knnlm.scoring import score_tokens
    from memlm.leakage import Evaluated, check_leakage
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
    leakage = check_leakage(evaluated, ds, ngram, tok, args.allow_overlap)
    for store in stores[1:]:  # each further datastore checked as the first
        more = check_leakage(evaluated, store, None, tok, args.allow_overlap)
        for key in ("overlap", "notes", "memories"):
            leakage[key] = leakage[key] + more[key]
    setting = {k: getattr(args, k) for k in ("k", "search", "scores", "nprobe", "index")}  # noticed if uncalibrated
    weights = [knn_parameters(store, args.lam, args.temperature, setting=setting) for store in stores]
    cache = args.cache is not None
    total = sum(w[0] for w in weights) + (args.cache_lambda if cache else 0.0)
    if len(stores) > 1 and total >= 1.0:
        given = ", ".join(f"{w[0]:g}" for w in weights)
        raise MemlmError(f"the datastores' λ's ({given}) and the cache's sum to {total:g}: the LM would keep no "
                         "weight; give a smaller --lambda (each datastore's)")  # fmt: skip
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
    lam, temperature, origin = 0.0, args.temperature or 1.0, None
    if ds is not None:
        lam, temperature, origin = weights[0]
        if cache and args.lam is None and lam + args.cache_lambda > 1:
            lam = 1.0 - args.cache_lambda  # the calibrated λ was tuned without the cache: leave the cache its weight
            print(f"λ lowered to {lam:g} so that λ + --cache-lambda <= 1", file=sys.stderr)
    res = perplexities(
        ts,
        lam=lam,
        temperature=temperature,
        cache_lambda=args.cache_lambda if cache else 0.0,
        cache_temperature=args.cache_temperature,
        target_counts=value_counts(ds, ts.targets) if ds is not None else None,
        datastores=[(w[0], w[1]) for w in weights[1:]],
    )
    first = ts.meta["components"].get("knn", {})  # the first datastore's description
    res.update(
        model=model_name,
        memories=memory_spec(list(ts.components.values())),
        corpus=args.corpus,
        split=args.split,
        **({"parameters_from": origin} if origin else {}),
        **({"datastores": each} if (each := _each_datastore(ts, weights)) else {}),
        **{k: v for k, v in ts.meta.items() if k.startswith("seconds")},
        **{k: v for k, v in first.items() if k in ("datastore", "key", "search", "scores")},
        retrieval={  # the values this result used (score_tokens records the search; λ, τ are chosen here)
            **ts.meta["retrieval"],
            **({"lam": res.get("lambda", lam), "temperature": temperature} if ds is not None else {}),
            "cache_lambda": res.get("cache_lambda", args.cache_lambda if cache else 0.0),
            "cache_temperature": args.cache_temperature,
        },
    )
    if ngram is not None:
        res.update(ngram_cli.ngram_result(args, ts, ngram, lam, temperature, base=res))
    mixed = {}
    if args.mixture == "stored":
        mixed = mixture_result(stored_eval_mixture(args, stores, ngram), ts, res, "the memory's build-time calibration")
    elif args.mixture:
        mixed = mixture_result(load_mixture(args.mixture), ts, res, args.mixture)
    elif not weights_given(args) and (stores or ngram is not None):
        from memlm.knnlm.default_mixture import default_mixture

        chosen = default_mixture(model, tok, stores, ngram, config, cache=cache, batch_size=args.batch_size)
        chosen.announce()
        if chosen.fit is not None:
            mixed = mixture_result(chosen.fit, ts, res, chosen.origin)
    res.update({k: v for k, v in mixed.items() if k != "mixture"})
    _print_result(res)
    res["leakage"] = leakage
    if mixed:
        res["mixture"] = mixed["mixture"]  # the fit applied, recorded (not printed)
    write_json(args.json, res)


def weights_given(args: argparse.Namespace) -> bool:
    """Whether the command line sets a weight (--lambda, --temperature, --ngram-lambda-sparse / -dense): then the
    fixed-weight rule of those values, and no default mixture."""
    names = ("lam", "temperature", "ngram_lambda_sparse", "ngram_lambda_dense")
    return any(getattr(args, n, None) is not None for n in names)


def _each_datastore(ts, weights: list[tuple[float, float, str]]) -> list[dict[str, Any]]:
    """With several datastores: each one's description and the λ, τ it was mixed with (and where they came from)."""
    if len(weights) < 2:
        return []
    described = [ts.meta["components"][name] for name in ts.names("knn")]
    return [{**d, "lambda": w[0], "temperature": w[1], "parameters_from": w[2]}
            for d, w in zip(described, weights, strict=True)]  # fmt: skip


def stored_eval_mixture(args: argparse.Namespace, stores: list, ngram):
    """``memlm eval --mixture stored``: the guarded mixture fitted when the one memory given was built or calibrated
    (memlm.knnlm.calibration.stored_mixture), or one MemlmError saying why there is none and what to do."""
    from memlm.knnlm.calibration import stored_mixture

    memories = [*stores, *([] if ngram is None else getattr(ngram, "memories", [ngram]))]  # one (checked before)
    fit = stored_mixture(memories[0])
    if fit is None:
        where = getattr(memories[0], "path", None) or getattr(getattr(memories[0], "index", None), "path", "it")
        raise MemlmError(f"{where} records no fitted mixture (built with --holdout 0 / --no-calibrate, or by an older "
                         "memlm): calibrate it (memlm datastore calibrate, or rebuild the ∞-gram index with a "
                         "holdout), or fit one with memlm tune --mixture gate")  # fmt: skip
    return fit


def load_mixture(path: str):
    """The fitted mixture of ``memlm eval --mixture FILE`` (a tune --mixture gate result, or its record)."""
    import json

    from memlm.mixing.dump import DumpMixture

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (OSError, ValueError) as error:
        raise MemlmError(f"--mixture {path}: not a readable JSON file ({error})") from error
    return DumpMixture.from_dict(data, f"--mixture {path}")


def mixture_result(dm, ts, res: dict[str, Any], path: str) -> dict[str, Any]:
    """``memlm eval --mixture``: ``mixture_ppl`` of the stored fit on this eval's tokens, its interval and its paired
    differences against the base LM and each fixed-weight row of ``res`` (re-mixed by the rule it recorded under
    ``mixtures``, at its τ and k), merged into ``res``'s evidence (memlm.mixing.report)."""
    import torch

    from memlm.core.mixture import Mixture
    from memlm.mixing.report import report

    rules = {key: Mixture.from_dict(record) for key, record in (res.get("mixtures") or {}).items()}
    rows = {"base_ppl": torch.from_numpy(ts.lm_logprob), **rules,
            "mixture_ppl": dm.logprob(ts, "this eval (its --memory)")}  # fmt: skip
    taus = res.get("temperatures") or res.get("temperature") or 1.0  # several datastores: one τ each
    own = report(ts, rows, [(key, "mixture_ppl") for key in rows if key != "mixture_ppl"], temperature=taus,
                 k=res.get("k"), cache_temperature=res.get("cache_temperature") or 1.0)  # fmt: skip
    return {
        "mixture_ppl": own["mixture_ppl"],
        "mixture_form": dm.fit.form,
        "mixture": {"from": path, **dm.to_dict()},
        "intervals": {**res.get("intervals", {}), "mixture_ppl": own["intervals"]["mixture_ppl"]},
        "differences": {**res.get("differences", {}), **own["differences"]},
    }


def _print_result(res: dict[str, Any]) -> None:
    """A perplexity result with its intervals, paired differences and frequency buckets (memlm.cli.report)."""
    print_result(res)


def cmd_tune(args: argparse.Namespace) -> None:
    from memlm.knnlm.table import TokenTable
    from memlm.leakage import check_dumps

    valid = TokenTable.load(args.valid)
    test = TokenTable.load(args.test) if args.test else None
    leakage = check_dumps(valid, test, allow_overlap=args.allow_overlap)  # every path: the same memories, no leak
    if "ngram" in valid.columns:
        out = ngram_cli.tune_with_ngram(args, valid, test, leakage)
    else:
        out = _tune_rule(args, valid, test, leakage)
    if args.mixture == "gate" and valid.lm_entropy is None:
        print("note: this dump has no LM entropy / max log-prob (written by an older memlm): the fixed-weight rule "
              "only; rerun memlm eval --dump for the learned mixture", file=sys.stderr)  # fmt: skip
    elif args.mixture == "gate":
        out.update(tune_mixture(args, valid, test, out["valid"]["best"]))
    write_json(args.json, out)


def _tune_rule(args: argparse.Namespace, valid, test, leakage: dict[str, Any]) -> dict[str, Any]:
    """The fixed-weight rule: λ, τ (and the cache's λc, τc) grid-searched on ``valid``, applied to ``test``."""
    from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES
    from memlm.knnlm.evaluate import perplexities, tune

    lambdas = args.lambdas if args.lambdas is not None else list(DEFAULT_LAMBDAS)
    temperatures = args.temperatures if args.temperatures is not None else list(DEFAULT_TEMPERATURES)
    result = tune(
        valid,
        lambdas=lambdas,
        temperatures=temperatures,
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
    if len(valid.names("knn")) > 1:
        grid = (lambdas, temperatures)
        from memlm.mixing.dump import tune_datastores_beside

        best["datastores"] = tune_datastores_beside(valid, _rule_weights(best, True), grid, best.get("temperature")
                                                    or 1.0, args.k, best.get("cache_temperature") or 1.0)  # fmt: skip
        ngram_cli.print_datastores(best["datastores"])
    if test is not None:
        res = perplexities(
            test,
            lam=best["lambda"],
            temperature=best["temperature"],
            k=args.k,
            cache_lambda=best["cache_lambda"],
            cache_temperature=best["cache_temperature"],
            datastores=[(d["lambda"], d["temperature"]) for d in best.get("datastores") or []],
        )
        out["test"] = res
        _print_result(res)
    out["grid"] = result["grid"]
    out["leakage"] = leakage
    return out


def _rule_weights(best: dict[str, Any], has_knn: bool) -> dict[str, Any]:
    """The rule's weights by component (memlm.mixing.dump.rule_for) from its best point on valid (any tune
    path: λ, the cache's λc, one (λ_sparse, λ_dense) or a list of them)."""
    from memlm.mixing.component import component_name

    pairs = best.get("weights") or ([[best["lambda_sparse"], best["lambda_dense"]]] if "lambda_sparse" in best else [])
    weights: dict[str, Any] = {"knn": best["lambda"]} if has_knn else {}
    weights.update({component_name("ngram", r): tuple(w) for r, w in enumerate(pairs)})
    if best.get("cache_lambda"):
        weights["cache"] = best["cache_lambda"]
    weights.update({d["component"]: d["lambda"] for d in best.get("datastores") or []})
    return weights


def tune_mixture(args: argparse.Namespace, valid, test, rule_best: dict[str, Any]) -> dict[str, Any]:
    """``memlm tune --mixture gate``: the guarded learned mixture of every memory of ``valid`` (τ searched on the
    fit's kept part, memlm.mixing.dump.fit_dump), applied to ``test`` beside the base LM and the fixed-weight
    rule tuned on the same ``valid`` (``rule_best``), with intervals and paired differences."""
    import torch

    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.mixing.dump import fit_dump, rule_for
    from memlm.mixing.report import report

    temperatures = args.temperatures if args.temperatures is not None else list(DEFAULT_TEMPERATURES)
    dm = fit_dump(valid, temperatures, args.k, args.cache_temperatures)
    fit = dm.fit
    print(
        f"learned mixture on valid: {fit.tokens:,} tokens of {fit.documents:,} documents (fitted on {fit.fit_tokens:,}"
        f", checked on the {fit.kept_tokens:,} kept apart); chosen form {fit.form}"
        + (f", temperature={dm.temperature:g}" if dm.temperature is not None else "")
        + "; held-out log-likelihood per token "
        + ", ".join(f"{f} {v:.4f}" for f, v in fit.heldout_loglik.items())
    )
    for w in fit.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if fit.form == "lm":
        print(f"warning: the learned mixture falls back to the LM alone: on the {fit.kept_tokens:,} valid tokens kept "
              "apart neither constant weights nor the gate beat the LM (fitted on the rest); the fixed-weight rule "
              "tuned on the same valid dump may do worse than the LM on other text", file=sys.stderr)  # fmt: skip
    out: dict[str, Any] = {"mixture": dm.to_dict()}
    if test is None:
        return out
    from memlm.mixing.inputs import dump_components

    if dump_components(test) != dm.mixture.components:
        print(f"note: the --test dump holds {', '.join(dump_components(test))}, the fit mixes "
              f"{', '.join(dm.mixture.components)}: the learned mixture is not applied to it (dump both with the "
              "same memories)", file=sys.stderr)  # fmt: skip
        return out
    weights = _rule_weights(rule_best, "knn" in valid.columns)
    knn_taus = [rule_best.get("temperature") or 1.0] + [d["temperature"] for d in rule_best.get("datastores") or []]
    taus = (knn_taus if len(knn_taus) > 1 else knn_taus[0], rule_best.get("cache_temperature") or 1.0)
    rows = {"base_ppl": torch.from_numpy(test.lm_logprob), "rule_ppl": rule_for(test, weights),
            "mixture_ppl": dm.logprob(test, "the --test dump")}  # fmt: skip
    pairs = (("base_ppl", "rule_ppl"), ("base_ppl", "mixture_ppl"), ("rule_ppl", "mixture_ppl"))
    res = {"form": fit.form, **report(test, rows, pairs, temperature=taus[0], k=args.k, cache_temperature=taus[1])}
    print("on test (rule_ppl: the fixed-weight rule tuned on the same valid dump; mixture_ppl: the learned mixture):")
    _print_result(res)
    return {**out, "mixture_test": res}


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
                             "fit them together with memlm tune --mixture gate and pass its --json file")  # fmt: skip
        return
    dm = load_mixture(args.mixture)
    counts: dict[str, int] = {}
    given = ["lm"]
    for kind, _, _ in args.memories:
        given.append(component_name(kind, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    if sorted(dm.mixture.components) != sorted(given):
        raise MemlmError(
            f"--mixture {args.mixture} mixes {', '.join(dm.mixture.components)}, this eval gives "
            f"{', '.join(given)}: give the same memories (--memory) as the valid dump it was fitted on, or fit again "
            "with memlm tune --mixture gate"
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
        help="also score the learned mixture fitted by memlm tune --mixture gate --json FIT.json (the same "
        "--memory in the same order) and report mixture_ppl beside the fixed-weight rows; stored: the "
        "one memory's own fit, made when it was built or calibrated. Without --mixture and without --lambda, "
        "--temperature or --ngram-lambda-*: the memories' stored fits (one: its own; several: combined and checked "
        "on their calibration slices), said in one line",
    )
    ngram_cli.add_eval_args(e, selection=False)
    e.set_defaults(func=cmd_eval, check=check_eval)  # looked up when the parser is built (tests replace it first)

    t = sub.add_parser("tune", help="grid-search λ and temperature on a validation dump; apply to a test dump")
    t.add_argument("--valid", type=V.existing_file, required=True, help="dump from memlm eval --split valid --dump")
    t.add_argument("--test", type=V.existing_file, default=None, help="dump from memlm eval --split test --dump")
    t.add_argument("--lambdas", type=V.probability, nargs="+", default=None)
    t.add_argument("--temperatures", type=V.positive_float, nargs="+", default=None)
    t.add_argument("--cache-lambdas", type=V.probability, nargs="+", default=[0.0])
    t.add_argument("--cache-temperatures", type=V.positive_float, nargs="+", default=[1.0])
    t.add_argument("--k", type=V.neighbours, default=None, help="use only the k best of the dumped neighbours")
    t.add_argument("--json", type=V.output_file, default=None)
    t.add_argument(
        "--mixture",
        choices=["rule", "gate"],
        default="gate",
        help="gate (default): the guarded learned mixture of every memory of the dump (the LM alone, constant "
        "weights or per-token weights from a small gate, whichever the part of valid kept apart prefers; "
        "docs/results/mixture.md), applied to --test beside the fixed-weight rule; its fit goes into --json for "
        "memlm eval --mixture; rule: the fixed weights grid-searched, alone",
    )
    common.add_allow_overlap(t)
    ngram_cli.add_tune_args(t)
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
