"""memlm's speed against the machine's peak, in one bounded run (docs/results/performance.md).

    python benchmarks/speed/run.py --tokens 20000 --out docs/results/speed/<machine>.json

Steps, each timed with the protocol of ``benchmarks/protocol.py`` (idle check first; load average before and
after each step):

1. peak: matrix products at SmolLM2-135M's shapes in float32, bfloat16 and int8 (``peak.py``), GFLOP/s;
2. input: tokenization and windowing of the evaluation text (seconds, tokens/s);
3. candidates: ``memlm eval``'s forward pass without a datastore (LM log-probabilities + the ``ffn_in`` queries) on
   the same ``--tokens`` of the ``wiki`` corpus' test split (Wikipedia lead sections) for each compute path of
   ``--paths`` (float32 first: the reference): tokens/s, its ratio to today's default (``--dtype auto`` on this
   machine), achieved GFLOP/s and its share of the
   peak of its dtype, perplexity difference and relative key error against float32;
4. profile: the same forward pass by component (``components.py``) for float32 and the default path, eval-style
   (log-probabilities + keys) and build-style (keys only), on the first ``--profile-windows`` windows;
5. build: ``datastore build`` of ``--build-tokens`` of ``wiki`` train on each of ``--build-paths``: entries/s;
6. kNN eval: ``memlm eval`` with the default path's datastore (or ``--datastore``) on ``--knn-tokens``, without and
   with ``--pipeline``: tokens/s, forward and search seconds;
7. FAISS sweep: the kNN eval's queries searched at each of ``--faiss-batches`` x ``--faiss-threads``: queries/s.

Time on 2 idle cores with the defaults: about 12 minutes, two thirds of it step 3 (4 paths x 20,000 tokens at window
1024 / min-context 512, ~40,000 forward positions each); ``--tokens`` scales step 3, ``--paths`` adds or drops rows
(``bfloat16+inductor`` adds torch.compile, its compile time in ``warmup_s``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # speed/, benchmarks/
import components  # noqa: E402
import numpy as np  # noqa: E402
import peak as peak_lib  # noqa: E402
import protocol  # noqa: E402
import torch  # noqa: E402

from memlm.core.distribution import perplexity  # noqa: E402
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import batched, limit_documents, resolve_stride, sliding_windows, tokenize_documents  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.evaluate import lm_scores  # noqa: E402
from memlm.knnlm.scoring import score_tokens  # noqa: E402
from memlm.knnlm.write import write_datastore  # noqa: E402
from memlm.models.allocator import allocator_state  # noqa: E402
from memlm.models.compute import (  # noqa: E402
    ATTENTIONS,
    COMPILES,
    QUANTIZATIONS,
    ComputePath,
    apply_compute_path,
    relative_key_error,  # noqa: E402
)
from memlm.models.keys import KeySpec  # noqa: E402
from memlm.models.resources import default_dtype, load_causal_lm  # noqa: E402
from memlm.storage import index as index_lib  # noqa: E402
from memlm.storage.datastore import Datastore  # noqa: E402

SPEC = KeySpec("ffn_in", -1)
README_DATASTORE = Path("ds/wiki")  # README: memlm datastore build ... --corpus wiki --out ds/wiki --max-tokens 200000


def parse_path(text: str) -> ComputePath:
    """``"bfloat16+eager"``, ``"float32+int8-dynamic"``, ``"auto+inductor"``: a dtype, then parts in any order."""
    dtype, *parts = text.split("+")
    fields: dict[str, str] = {"dtype": default_dtype() if dtype == "auto" else dtype}
    for part in parts:
        name = next(
            (
                n
                for n, allowed in (("attention", ATTENTIONS), ("compile", COMPILES), ("quantize", QUANTIZATIONS))
                if part in allowed
            ),
            None,
        )
        if name is None:
            sys.exit(f"unknown part {part!r} of compute path {text!r}")
        fields[name] = part
    return ComputePath(**fields)


def load(args: argparse.Namespace, path: ComputePath):
    model, tok = load_causal_lm(args.model, dtype=path.dtype)
    return apply_compute_path(model, path), tok


def window_lengths(docs, tok, window: int, min_context: int) -> list[int]:
    stride, _ = resolve_stride(window, min_context, None)
    return [len(w.input_ids) for w in sliding_windows(tokenize_documents(docs, tok), window, stride=stride)]


def step_input(args, docs, tok) -> dict[str, Any]:
    t0 = time.perf_counter()
    chunks = list(tokenize_documents(docs, tok))
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    windows = list(sliding_windows(chunks, args.window, args.min_context))
    t_win = time.perf_counter() - t0
    n = sum(w.n_targets for w in windows)
    return {
        "tokens": n,
        "windows": len(windows),
        "tokenization_s": t_tok,
        "windowing_s": t_win,
        "tokenization_tok_per_s": n / t_tok if t_tok else None,
        "windowing_tok_per_s": n / t_win if t_win else None,
    }


def step_candidate(args, path: ComputePath, docs, peak: dict, ref: dict | None) -> tuple[dict[str, Any], dict]:
    model, tok = load(args, path)
    t0 = time.perf_counter()
    lm_scores(model, tok, docs[:1], [SPEC], min(args.window, 128), min(args.min_context, 64), 1, False)  # warm-up
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    ts, queries, _ = lm_scores(model, tok, docs, [SPEC], args.window, args.min_context, args.batch_size, False)
    seconds = time.perf_counter() - t0
    lp = ts.lm_logprob.astype(np.float64)
    lengths = window_lengths(docs, tok, args.window, args.min_context)
    flops = components.count_flops(model, lengths, components.head_positions_scored(model, lengths, len(ts)))
    dtype_peak = peak["peak_gflops"]["int8" if path.quantize == "int8-dynamic" else path.dtype]
    row: dict[str, Any] = {
        "path": path.label(),
        "tokens": len(ts),
        "forward_positions": sum(lengths),
        "warmup_s": warm,
        "forward_s": seconds,
        "tokens_per_s": len(ts) / seconds,
        "ppl": perplexity(lp),
        **components.achieved(flops, seconds, dtype_peak),
    }
    if path.compile != "none":  # how many graphs dynamo made (one per block kind when layers share them)
        from torch._dynamo.utils import counters

        row["dynamo_counters"] = {
            k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")
        }
    if ref is not None:
        e = relative_key_error(queries[SPEC], ref["keys"])
        row.update(
            relative_ppl_difference=row["ppl"] / ref["ppl"] - 1,
            key_error_mean=float(e.mean()),
            key_error_p99=float(np.percentile(e, 99)),
            key_error_max=float(e.max()),
        )
    return row, {"keys": queries[SPEC], "ppl": row["ppl"]}


def step_profile(args, path: ComputePath, docs, peak: dict) -> dict[str, Any]:
    model, tok = load(args, path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    stride, _ = resolve_stride(args.window, args.min_context, None)
    windows = list(sliding_windows(tokenize_documents(docs, tok), args.window, stride=stride))[: args.profile_windows]
    batches = list(batched(iter(windows), args.batch_size))
    components.profile_forward(model, batches[:1], [SPEC], True, pad)  # warm-up
    out = {}
    for style, with_lp in (("eval", True), ("build", False)):
        prof = components.profile_forward(model, batches, [SPEC], with_lp, pad)
        dtype_peak = peak["peak_gflops"]["int8" if path.quantize == "int8-dynamic" else path.dtype]
        prof.update(components.achieved(prof["flops"], prof["seconds_total"], dtype_peak))
        prof["tokens_per_s"] = prof["scored_tokens"] / prof["seconds_total"]
        out[style] = prof
        print(
            f"  profile {path.label()} {style}: {prof['tokens_per_s']:.0f} tok/s, "
            f"{prof['gflops_per_s']:.1f} GFLOP/s; "
            + ", ".join(f"{k} {v:.0%}" for k, v in prof["share"].items() if v >= 0.02),
            flush=True,
        )
    return out


def step_build(args, path: ComputePath, docs, where: Path) -> tuple[dict[str, Any], Path]:
    model, tok = load(args, path)
    out = where / f"ds-{path.label()}"
    t0 = time.perf_counter()
    windows = {"window": args.window, "min_context": args.min_context, "batch_size": args.batch_size}
    ds = write_datastore(model, tok, docs, out, progress=False, overwrite=True, **windows)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not ds.index_path.exists():
        index_lib.build_index(ds.keys, ds.index_path, progress=False)
    return {
        "path": path.label(),
        "entries": len(ds),
        "build_s": seconds,
        "entries_per_s": len(ds) / seconds,
        "index_s": time.perf_counter() - t0,
        "index": index_lib.read_index_meta(ds.index_path)["factory"],
    }, out


def step_knn(args, path: ComputePath, docs, ds_path: Path) -> dict[str, Any]:
    model, tok = load(args, path)
    ds = Datastore.open(ds_path)
    rows = {}
    for name, pipeline in (("sequential", False), ("pipeline", True)):
        t0 = time.perf_counter()
        ts = score_tokens(
            model,
            tok,
            docs,
            ds,
            batch_size=args.batch_size,
            progress=False,
            k=args.k,
            window=args.window,
            min_context=args.min_context,
            pipeline=pipeline,
        )
        seconds = time.perf_counter() - t0
        rows[name] = {
            "tokens": len(ts),
            "seconds": seconds,
            "tokens_per_s": len(ts) / seconds,
            "forward_s": ts.meta["seconds_forward"],
            "search_s_after_forward": ts.meta["seconds_search"],
        }
        print(
            f"  kNN eval {name}: {len(ts) / seconds:.0f} tok/s (forward {ts.meta['seconds_forward']:.1f} s, "
            f"search after it {ts.meta['seconds_search']:.1f} s)",
            flush=True,
        )
    rows["pipeline_speedup"] = rows["pipeline"]["tokens_per_s"] / rows["sequential"]["tokens_per_s"]
    return {
        "datastore": str(ds_path),
        "entries": len(ds),
        "path": path.label(),
        "k": args.k,
        "index": index_lib.read_index_meta(ds.index_path)["factory"],
        **rows,
    }


def step_faiss(args, ds_path: Path, queries: np.ndarray) -> dict[str, Any]:
    import faiss

    index = index_lib.load_index(Datastore.open(ds_path).index_path)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    before = faiss.omp_get_max_threads()
    rows = []
    try:
        for threads in args.faiss_threads:
            faiss.omp_set_num_threads(threads)
            for bs in args.faiss_batches:
                index.search(q[:bs], args.k)  # warm-up
                t0 = time.perf_counter()
                for i in range(0, len(q), bs):
                    index.search(q[i : i + bs], args.k)
                s = time.perf_counter() - t0
                rows.append({"threads": threads, "batch": bs, "queries": len(q), "seconds": s, "qps": len(q) / s})
                print(f"  FAISS threads {threads} batch {bs}: {len(q) / s:.0f} queries/s", flush=True)
    finally:
        faiss.omp_set_num_threads(before)
    return {
        "index": index_lib.read_index_meta(Datastore.open(ds_path).index_path)["factory"],
        "k": args.k,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file of the results")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=20_000, help="wiki test tokens per candidate (step 3)")
    p.add_argument(
        "--paths",
        default="float32,bfloat16,float32+eager,float32+int8-dynamic",
        help="compute paths to compare (step 3), float32 first; auto = --dtype auto's dtype. Add e.g. "
        "bfloat16+inductor for torch.compile (its compile time is in warmup_s)",
    )
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--min-context", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--profile-windows", type=int, default=4)
    p.add_argument("--build-tokens", type=int, default=8_000)
    p.add_argument("--build-paths", default="float32,auto")
    p.add_argument(
        "--datastore",
        default=None,
        help=f"datastore for steps 6-7 (default: the README's {README_DATASTORE} when it exists and fits the model, "
        "else the one step 5 built on the default path)",
    )
    p.add_argument("--knn-tokens", type=int, default=3_000)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--faiss-batches", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--faiss-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", default="peak,input,candidates,profile,build,knn,faiss")
    p.add_argument("--work", default=None, help="folder for the datastores (default: a temporary one)")
    p.add_argument("--wait-idle", type=float, default=300, help="seconds to wait for an idle machine (default 300)")
    p.add_argument("--force", action="store_true", help="run on a busy machine; results are marked not idle")
    args = p.parse_args()
    steps = set(args.steps.split(","))
    t_start = time.perf_counter()
    idle = protocol.idle_check(args.force, args.wait_idle)
    default = parse_path("auto")
    paths = [parse_path(x) for x in args.paths.split(",")]
    paths = [x for i, x in enumerate(paths) if x not in paths[:i]]
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": protocol.machine(),
        "idle_before": idle,
        "default_path": default.label(),
        "settings": vars(args),
    }
    fwd_per_s = 300.0  # float32 forward positions/s on 2 idle cores, for the plan only
    print(
        f"plan: {len(paths)} candidates x {args.tokens} tokens (~{2 * args.tokens * len(paths) / fwd_per_s / 60:.0f}"
        f" min at float32 speed), builds {args.build_paths} x {args.build_tokens}, kNN eval 2 x {args.knn_tokens}",
        flush=True,
    )

    def save() -> None:
        result["total_s"] = time.perf_counter() - t_start
        result["allocator"] = allocator_state()
        atomic_write_json(args.out, result)

    peak = {"peak_gflops": {"float32": None, "bfloat16": None, "int8": None}}
    if "peak" in steps:
        peak = result["peak"] = protocol.timed("peak", peak_lib.measure_peak)
        peak["onednn"] = peak_lib.onednn_check()
        print(f"  oneDNN kernels: {peak['onednn']}", flush=True)
        save()
    _, tok = load_causal_lm(args.model, dtype="float32")
    eval_docs = limit_documents(load_documents("wiki", "test"), tok, args.tokens)
    if "input" in steps:
        result["input"] = protocol.timed("input", lambda: step_input(args, eval_docs, tok))
    ref, keys_default = None, None
    if "candidates" in steps:
        rows = []
        for path in paths:
            row, got = step_candidate(args, path, eval_docs, peak, ref)
            row.update(load_avg_after=protocol.load_average())
            ref = ref or got
            keys_default = got["keys"] if path == default else keys_default
            rows.append(row)
            print(
                f"[candidate {row['path']}] {row['tokens_per_s']:.1f} tok/s, {row['gflops_per_s']:.1f} GFLOP/s"
                + (f" ({row['share_of_peak']:.0%} of peak)" if row.get("share_of_peak") else "")
                + (
                    f", ppl {row.get('relative_ppl_difference', 0):+.3%}, key error p99 "
                    f"{row.get('key_error_p99', 0):.2e}"
                    if "key_error_p99" in row
                    else ""
                ),
                flush=True,
            )
            result["candidates"] = rows
            save()
        base = next((r for r in rows if r["path"] == default.label()), None)
        for r in rows:
            r["ratio_to_default"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    if "profile" in steps:
        result["profile"] = {
            x.label(): protocol.timed(f"profile {x.label()}", lambda x=x: step_profile(args, x, eval_docs, peak))
            for x in dict.fromkeys([parse_path("float32"), default])
        }
        save()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        ds_path = Path(args.datastore) if args.datastore else None
        if "build" in steps:
            train = limit_documents(load_documents("wiki", "train"), tok, args.build_tokens)
            builds = []
            for x in dict.fromkeys(parse_path(b) for b in args.build_paths.split(",")):
                rec, where = step_build(args, x, train, Path(tmp))
                rec["load_avg_after"] = protocol.load_average()
                print(f"[build {rec['path']}] {rec['entries_per_s']:.1f} entries/s ({rec['entries']} entries)")
                builds.append(rec)
                ds_path = where if x == default and not args.datastore else ds_path
            result["build"] = builds
            save()
        if not args.datastore and (README_DATASTORE / "manifest.json").exists():
            try:  # the README's datastore, when this model and path may query it
                m, t = load(args, default)
                Datastore.open(README_DATASTORE).check_compatible(m, t)
                ds_path = README_DATASTORE
            except MemlmError as e:
                result["readme_datastore_not_used"] = str(e)
        if ds_path is not None and "knn" in steps:
            knn_docs = limit_documents(load_documents("wiki", "valid"), tok, args.knn_tokens)
            result["knn_eval"] = protocol.timed("kNN eval", lambda: step_knn(args, default, knn_docs, ds_path))
            save()
        if ds_path is not None and "faiss" in steps:
            if keys_default is None:
                m, _ = load(args, default)
                _, q, _ = lm_scores(m, tok, eval_docs, [SPEC], args.window, args.min_context, args.batch_size, False)
                keys_default = q[SPEC]
            queries = keys_default[: max(args.faiss_batches) * 4]
            result["faiss_sweep"] = protocol.timed("FAISS sweep", lambda: step_faiss(args, ds_path, queries))
    result["load_avg_at_end"] = protocol.load_average()
    save()
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
