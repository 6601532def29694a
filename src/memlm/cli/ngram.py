"""``memlm ngram build|info``: ∞-gram indexes (memlm.ngram); the ``--ngram`` options of ``memlm eval`` and ``tune``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memlm.cli import common
from memlm.cli import validate as V
from memlm.cli.common import add_corpus, add_model, load_documents
from memlm.cli.report import print_result
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
    from memlm.knnlm.calibration import has_stored_mixture, report_mixture, stored_mixture
    from memlm.ngram.index import build_ngram_index

    model, tok = common._load_model(args.model, args.dtype)
    docs, source = load_documents(args.corpus, args.split, tok, args.max_tokens)
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
        cal = m.get("calibration")
        if (
            cal is not None
            and cal.get("holdout_ids") == source["holdout"].get("ids_sha256")
            and has_stored_mixture(index)  # an index calibrated before the fit existed (or a corrupt one): again
        ):
            print(
                f"calibration already recorded: λ_sparse={cal['lambda_sparse']:g}, λ_dense={cal['lambda_dense']:g}",
                file=sys.stderr,
            )
            return
        from memlm.ngram.calibration import calibrate_ngram
        from memlm.ngram.memory import NgramMemory

        hold = source["holdout"]
        print(f"calibrating λ_sparse, λ_dense and the mixture on {hold['tokens']:,} held-out tokens "
              f"({hold['documents']:,} document{'s' if hold['documents'] != 1 else ''})", file=sys.stderr)  # fmt: skip
        cal = calibrate_ngram(
            model, tok, NgramMemory(index), held_out, window=args.window, stride=args.stride, batch_size=args.batch_size
        )
        cal["holdout_ids"] = hold.get("ids_sha256")
        index.record_calibration(cal)
        print(
            f"calibrated: λ_sparse={cal['lambda_sparse']:g}, λ_dense={cal['lambda_dense']:g} (held-out ppl "
            f"{cal['base_ppl']:.3f} -> {cal['ngram_ppl']:.3f}); recorded in {index.path}",
            file=sys.stderr,
        )
        report_mixture(stored_mixture(index), f"the slice is capped by the corpus: tune on your own valid text "
                       f"with `memlm eval --ngram {index.path} --dump` + `memlm tune --mixture gate`")  # fmt: skip


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


# ------------------------------------------------------------------------------------ memlm eval / tune --ngram


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """``--ngram DIR`` (more than once for several indexes) and its weights for ``memlm eval``, ``generate`` and
    ``lm-eval``."""
    g = p.add_argument_group("∞-gram (docs/NGRAM.md)")
    g.add_argument(
        "--ngram",
        type=V.existing_dir,
        default=None,
        metavar="DIR",
        action="append",
        help="an ∞-gram index (memlm ngram build) to interpolate, alone or with --datastore; give it again for "
        "several indexes, each with its own weights",
    )
    g.add_argument(
        "--ngram-lambda-sparse",
        type=V.probability,
        nargs="+",
        default=None,
        metavar="λ",
        help="weight of P∞ where it is sparse: one value, or one per --ngram in order (default: each index's "
        "calibration, else 0.1)",
    )
    g.add_argument(
        "--ngram-lambda-dense",
        type=V.probability,
        nargs="+",
        default=None,
        metavar="λ",
        help="weight of P∞ elsewhere: one value, or one per --ngram (default: each index's calibration, else 0.03)",
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


def given_lambdas(args: argparse.Namespace, n: int) -> list[tuple[float | None, float | None]]:
    """Each of the ``n`` ``--ngram`` indexes' ``(λ_sparse, λ_dense)`` as given on the command line (None: not given,
    the index's calibration then): one value for every index, or one per index in the order of ``--ngram``."""
    from memlm.ngram.mixture import per_index_lambdas

    names = ("--ngram-lambda-sparse", "--ngram-lambda-dense")
    return per_index_lambdas(args.ngram_lambda_sparse, args.ngram_lambda_dense, n, names)


_NOT_NGRAM = {"tokens", "base_ppl", "knn_ppl", "lambda", "temperature"}  # what eval reports apart


def ngram_result(
    args: argparse.Namespace, ts, memory, lam: float | None, temperature: float, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ∞-gram part of ``memlm eval``'s result (with the kNN term when the dump has one). With ``base`` (the
    result of :func:`memlm.knnlm.evaluate.perplexities` it joins), its ``intervals``, ``differences``,
    ``frequency_buckets`` and ``mixtures`` are returned merged with the ∞-gram's (the ∞-gram's buckets count each
    target among the index's tokens). Weights calibrated apart that sum past 1 are scaled by the rule
    (:func:`memlm.core.mixture.rule_mixture`); ``knn_ngram_weights`` records the weights it used."""
    from memlm.core.mixture import Mixture
    from memlm.knnlm.dump_mixture import rule_weights
    from memlm.ngram.memory import NgramMemories
    from memlm.ngram.mixture import ngram_logprobs, ngram_parameters, ngram_report

    if isinstance(memory, NgramMemories):
        return multi_ngram_result(args, ts, memory, lam, temperature, base)
    ls, ld, origin = ngram_parameters(memory.index, *given_lambdas(args, 1)[0])
    has_knn = ts.knn_scores is not None and lam is not None
    rep = ngram_report(ts, ls, ld, lam=lam if has_knn else None, temperature=temperature)
    rows, _ = ngram_logprobs(ts, (ls, ld), lam if has_knn else None, temperature)
    rows.pop("knn_ppl", None)  # eval's own row (base)
    if has_knn:
        used = rule_weights(Mixture.from_dict(rep["mixtures"]["knn_ngram_ppl"]))
        rep["knn_ngram_weights"] = {
            "lambda": used["knn"],
            "lambda_sparse": used["ngram"][0],
            "lambda_dense": used["ngram"][1],
            "note": "tune all four jointly on a valid dump with memlm tune",
        }
        scaled = lam + max(ls, ld) > 1.0  # the rule scaled the ∞-gram's weights: another ∞-gram row than ngram_ppl
        refs = ("base_ppl", "knn_ppl") + (() if scaled else ("ngram_ppl",))
        rep["differences"] = {k: v for k, v in rep["differences"].items()
                              if v["system"] != "knn_ngram_ppl" or v["reference"] in refs}  # fmt: skip
        rep["mixtures"].pop("knn_ppl")  # eval's own row (base)
    buckets = _bucket_tables(ts, rows, memory)
    own = {k: v for k, v in rep.items() if k not in _NOT_NGRAM}
    return {**own, **_merged(base, own, buckets), "ngram_parameters_from": origin, **memory.describe()}


def _bucket_tables(ts, rows: dict[str, Any], memory) -> dict[str, Any]:
    """Each ∞-gram mixture's change against the LM by frequency of the target among the index's tokens."""
    from memlm.knnlm.evaluate import bucket_table

    counts = memory.token_counts(ts.targets)
    where = f"∞-gram index {memory.index.path} ({len(memory.index):,} tokens)"
    return {k: bucket_table(ts, v, counts, where) for k, v in rows.items() if k != "base_ppl" and k != "knn_ppl"}


def _merged(base: dict[str, Any] | None, own: dict[str, Any], buckets: dict[str, Any]) -> dict[str, Any]:
    """``intervals``, ``differences``, ``frequency_buckets`` and ``mixtures`` (each fixed-weight row's rule) of
    eval's result with the ∞-gram's added (the result's own rows kept where both have one: base and kNN-LM come
    from the same dump)."""
    base = base or {}
    return {
        "intervals": {**own.get("intervals", {}), **base.get("intervals", {})},
        "differences": {**own.get("differences", {}), **base.get("differences", {})},
        "frequency_buckets": {**base.get("frequency_buckets", {}), **buckets},
        "mixtures": {**base.get("mixtures", {}), **own.get("mixtures", {})},
    }


def multi_ngram_result(
    args: argparse.Namespace, ts, memories, lam: float | None, temperature: float, base: dict[str, Any] | None = None
) -> dict:
    """``memlm eval`` with several ``--ngram``: each index alone beside the LM (its own λ's: the flags, else its
    calibration, as for one index), and all of them together, each with its own λ's, mixed by the rule
    (:func:`memlm.core.mixture.rule_mixture`, which scales weights that sum past 1 to leave the LM a weight > 0);
    with a datastore, with the kNN term too. ``multi_ngram_weights`` records the weights the rule used. The weights
    are set apart here: ``--dump`` and ``memlm tune`` tune them jointly. Intervals of the combined rows (each
    index's own rows have theirs under ``ngrams``) merged with ``base``'s as :func:`ngram_result` does."""
    from memlm.core.bootstrap import evidence
    from memlm.core.distribution import perplexity
    from memlm.core.mixture import Mixture
    from memlm.knnlm.dump_mixture import rule_rows, rule_weights
    from memlm.knnlm.mixture_inputs import ngram_component
    from memlm.ngram.mixture import ngram_parameters, ngram_report, reference_view

    refs, weights = [], {}
    given = given_lambdas(args, len(memories.memories))
    for r, memory in enumerate(memories.memories):
        ls, ld, origin = ngram_parameters(memory.index, *given[r])
        rep = ngram_report(reference_view(ts, r), ls, ld)
        refs.append({**memory.describe(), **{k: v for k, v in rep.items() if k not in _NOT_NGRAM},
                     "ngram_parameters_from": origin})  # fmt: skip
        weights[ngram_component(r)] = (ls, ld)
    specs = {"multi_ngram_ppl": weights}
    has_knn = ts.knn_scores is not None and lam is not None
    if has_knn:
        specs["knn_multi_ngram_ppl"] = {"knn": lam, **weights}
    if base is not None and "knn_ppl" in (base.get("intervals") or {}) and ts.knn_lambda is None:
        specs["knn_ppl"] = {"knn": base["lambda"]}  # the kNN-LM's row, for its difference
    mixed, mixtures = rule_rows(ts, specs, temperature)
    used = {key: rule_weights(Mixture.from_dict(m)) for key, m in mixtures.items()}
    names = list(weights)
    out: dict[str, Any] = {
        "ngrams": refs,
        "multi_ngram_ppl": perplexity(mixed["multi_ngram_ppl"]),
        "multi_ngram_weights": [used["multi_ngram_ppl"][c] for c in names],
        "multi_ngram_note": "each index's own (λ_sparse, λ_dense), scaled to sum <= 1; tune them jointly with "
        "memlm eval --dump on valid text and memlm tune",
    }
    if has_knn:
        out["knn_multi_ngram_ppl"] = perplexity(mixed["knn_multi_ngram_ppl"])
        out["knn_multi_ngram_weights"] = {"lambda": lam, "temperature": temperature,
                                          "weights": [used["knn_multi_ngram_ppl"][c] for c in names]}  # fmt: skip
    mixtures.pop("knn_ppl", None)  # eval's own row (base)
    own = {**evidence({"base_ppl": ts.lm_logprob, **mixed}, ts.doc_index), "mixtures": mixtures}
    return {**out, **_merged(base, own, {})}


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ngram-lambdas",
        type=V.probability,
        nargs="+",
        default=None,
        help="λ_sparse / λ_dense candidates for a dump with ∞-gram scores (default: a grid fine below 0.1)",
    )


def _grids(args: argparse.Namespace) -> dict[str, Any]:
    """``memlm tune``'s grids for the ∞-gram tuners: its weights', and λ, τ (and k) of a kNN term."""
    from memlm.ngram.mixture import NGRAM_LAMBDAS

    lambdas = args.ngram_lambdas or NGRAM_LAMBDAS
    return {"lambdas": lambdas, "knn_lambdas": args.lambdas, "temperatures": args.temperatures, "k": args.k}


def tune_with_ngram(
    args: argparse.Namespace, valid, test=None, leakage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``memlm tune`` on a dump with ∞-gram scores: λ_sparse, λ_dense (and λ, τ of its kNN term) tuned jointly.
    ``test``: the ``--test`` dump, checked by the caller against ``valid`` (memlm.leakage.check_dumps: the same
    model and memories), whose record ``leakage`` goes into the result. Returns the result (the caller writes it)."""
    from memlm.ngram.mixture import ngram_report, tune_ngram

    if valid.ngram_extra_logprob is not None:
        return tune_with_ngrams(args, valid, test, leakage)
    result = tune_ngram(valid, **_grids(args))
    best = result["best"]
    has_knn = valid.knn_scores is not None
    print(
        f"best on valid: lambda_sparse={best['lambda_sparse']} lambda_dense={best['lambda_dense']}"
        + (f" lambda={best['lambda']} temperature={best['temperature']}" if has_knn else "")
        + f" ppl={best['ppl']:.4f}"
    )

    weights = {**({"knn": best["lambda"]} if has_knn else {}), "ngram": (best["lambda_sparse"], best["lambda_dense"])}
    best.update(_tune_cache(args, valid, weights, best))
    if has_knn and valid.knn_extra_scores is not None:  # several datastores: the others beside this rule
        from memlm.knnlm.evaluate import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES

        grid = (args.lambdas or DEFAULT_LAMBDAS, args.temperatures or DEFAULT_TEMPERATURES)
        rule = {**weights, **({"cache": best["cache_lambda"]} if best.get("cache_lambda") else {})}
        best["datastores"] = further_datastores(valid, rule, best, grid, args.k)

    def report(ts) -> dict[str, Any]:
        lam = best["lambda"] if has_knn else None
        rep = ngram_report(ts, best["lambda_sparse"], best["lambda_dense"], lam=lam,
                           temperature=best["temperature"], k=args.k)  # fmt: skip
        return _with_cache_row(ts, rep, weights, best, args.k)

    out: dict[str, Any] = {"valid": {"best": best, "grid_points": len(result["grid"]), "report": report(valid)}}
    if test is not None:
        res = report(test)
        out["test"] = res
        print_result(res)
    out["grid"] = result["grid"]
    out["leakage"] = leakage
    return out


def tune_with_ngrams(
    args: argparse.Namespace, valid, test=None, leakage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``memlm tune`` on a dump with several ∞-gram indexes (``memlm eval --ngram A --ngram B --dump``): each index's
    (λ_sparse, λ_dense) tuned jointly (:func:`~memlm.ngram.mixture.tune_ngrams`, coordinate descent of
    :func:`~memlm.ngram.mixture.tune_multi_ngram`), with λ, τ of the kNN term when the dump has neighbours."""
    from memlm.knnlm.mixture_inputs import ngram_component
    from memlm.ngram.mixture import multi_ngram_report, tune_ngrams

    result = tune_ngrams(valid, **_grids(args))
    has_knn = valid.knn_scores is not None
    lam = result["lambda"] if has_knn else None
    weights = result["weights"]
    pairs = "; ".join(f"({a:g}, {b:g})" for a, b in weights)
    print(
        f"best on valid: (lambda_sparse, lambda_dense) per ∞-gram index {pairs}"
        + (f" lambda={result['lambda']} temperature={result['temperature']}" if has_knn else "")
        + f" ppl={result['ppl']:.4f}"
    )
    described = valid.meta.get("ngrams") or [{} for _ in weights]
    best = {
        "ngrams": [{**d, "lambda_sparse": w[0], "lambda_dense": w[1]} for d, w in zip(described, weights, strict=True)],
        "weights": weights,
        **({"lambda": result["lambda"], "temperature": result["temperature"]} if has_knn else {}),
        "ppl": result["ppl"],
    }
    rule = {**({"knn": lam} if has_knn else {}), **{ngram_component(r): tuple(w) for r, w in enumerate(weights)}}
    best.update(_tune_cache(args, valid, rule, best))

    def report(ts) -> dict[str, Any]:
        return _with_cache_row(ts, multi_ngram_report(ts, weights, lam, result["temperature"], args.k), rule, best,
                               args.k)  # fmt: skip

    out: dict[str, Any] = {
        "valid": {"best": best, "alone": result["alone"], "starts": result["starts"], "report": report(valid)}
    }
    if test is not None:
        res = report(test)
        out["test"] = res
        print_result(res)
    out["leakage"] = leakage
    return out


def _tune_cache(args: argparse.Namespace, valid, weights: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """``--cache-lambdas`` on a dump with the cache: λc and τc tuned beside the ∞-gram rule found on ``valid`` (its
    ``weights`` fixed; memlm.knnlm.dump_mixture.tune_beside): ``{"cache_lambda", "cache_temperature",
    "cache_ppl"}``, or {} when not asked (or the dump has no cache)."""
    from memlm.knnlm.dump_mixture import tune_beside

    if not any(args.cache_lambdas) or valid.cache_scores is None:
        return {}
    grid = (args.cache_lambdas, args.cache_temperatures)
    b = tune_beside(valid, weights, "cache", grid, best.get("temperature") or 1.0, args.k)["best"]
    print(f"the cache beside them on valid: cache_lambda={b['lambda']} cache_temperature={b['temperature']} "
          f"ppl={b['ppl']:.4f}")  # fmt: skip
    return {"cache_lambda": b["lambda"], "cache_temperature": b["temperature"], "cache_ppl": b["ppl"]}


def further_datastores(valid, weights: dict[str, Any], best: dict[str, Any], grid: tuple, k) -> list[dict[str, Any]]:
    """memlm tune on a dump of several datastores: each further one's λ_j, τ_j beside the rule ``weights`` tuned
    so far (memlm.knnlm.dump_mixture.tune_datastores_beside, ``grid`` = tune's λ and τ candidates), printed."""
    from memlm.knnlm.dump_mixture import tune_datastores_beside

    found = tune_datastores_beside(valid, weights, grid, best.get("temperature") or 1.0, k,
                                   best.get("cache_temperature") or 1.0)  # fmt: skip
    for d in found:
        print(f"{d['component']} beside them on valid: lambda={d['lambda']} temperature={d['temperature']} "
              f"ppl={d['ppl']:.4f}")  # fmt: skip
    return found


def _with_cache_row(ts, rep: dict[str, Any], weights: dict[str, Any], best: dict[str, Any], k) -> dict[str, Any]:
    """``rep`` (an ∞-gram report of ``ts``) with ``cache_rule_ppl``, the tuned rule plus the cache at ``best``'s λc,
    τc, its interval, its differences against the base LM and the rule without the cache, and its mixture."""
    from memlm.core.bootstrap import evidence
    from memlm.core.distribution import perplexity
    from memlm.knnlm.dump_mixture import rule_rows

    if not best.get("cache_lambda"):
        return rep
    ref = "knn_ngram_ppl" if "knn" in weights else "ngram_ppl"
    rows, mixtures = rule_rows(ts, {ref: weights, "cache_rule_ppl": {**weights, "cache": best["cache_lambda"]}},
                               best.get("temperature") or 1.0, k, best["cache_temperature"])  # fmt: skip
    ev = evidence({"base_ppl": ts.lm_logprob, **rows}, ts.doc_index, pairs=[("base_ppl", "cache_rule_ppl"),
                                                                          (ref, "cache_rule_ppl")])  # fmt: skip
    rep.update(cache_rule_ppl=perplexity(rows["cache_rule_ppl"]), cache_lambda=best["cache_lambda"],
               cache_temperature=best["cache_temperature"])  # fmt: skip
    rep["intervals"]["cache_rule_ppl"] = ev["intervals"]["cache_rule_ppl"]
    rep["differences"].update(ev["differences"])
    rep["mixtures"]["cache_rule_ppl"] = mixtures["cache_rule_ppl"]
    return rep


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """``--ngram DIR`` (and its weights, ``--show-sources``) for ``memlm generate``."""
    add_eval_args(p)
    p.add_argument(
        "--show-sources",
        type=V.nonneg_int,
        default=0,
        metavar="N",
        help="with --ngram: after the text, each generated token's longest matching suffix and N documents "
        "of the index that hold it (document index, id, offset)",
    )


def note_approximate(step) -> None:
    """A line on stderr when generation's P∞ was not exact over the vocabulary at some step."""
    from memlm.ngram.generate import approximation_note

    if (note := approximation_note(step)) is not None:
        print(note, file=sys.stderr)


def ngram_memories(args: argparse.Namespace, tok) -> tuple[list, tuple[list, list]]:
    """The ``--ngram`` indexes of ``memlm generate`` (checked against the tokenizer), in order, and their
    ``([λ_sparse], [λ_dense])`` as given (None: each index's calibration; mixed by the fixed-weight rule, which
    shares weights set apart beside the kNN terms as ``memlm eval`` does: :func:`memlm.core.mixture.rule_mixture`)."""
    memory = open_ngram(args, tok)
    memories = [] if memory is None else list(getattr(memory, "memories", [memory]))  # NgramMemories: several
    given = given_lambdas(args, len(memories)) if memories else []
    return memories, ([g[0] for g in given], [g[1] for g in given])


def print_sources(args: argparse.Namespace, memories, tok, prompt: list[int], text: str) -> None:
    """``--show-sources N``: under the generated text, each token's longest matched suffix and up to N documents;
    with several indexes, one line per index (``[i:folder]``, in the order of ``--ngram``)."""
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
    b = nsub.add_parser("build", help="index a corpus with the model's tokenizer (suffix array) and calibrate λ's")
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
        help="share of the corpus's tokens held out to calibrate λ_sparse / λ_dense (0: none)",
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
