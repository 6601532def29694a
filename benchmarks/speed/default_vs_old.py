"""Today's default path against the original default (commit 538db93), in one run.

Each row is ``memlm eval``'s scoring (``lm_scores``: windows 1024 / 512, batch 4, the ``ffn_in@-1`` key kept) and
``datastore build``'s key pass (``write_datastore``) on the same text (``--corpus``: its test split scored, its train
split keyed; default ``wiki``, the Wikipedia lead sections), timed in its own process with the
code of one commit on ``PYTHONPATH`` and ``--dtype auto`` as that commit resolves it. The old code is ``git archive``d
from ``--old-commit`` (default: the commit before the first change, where ``auto`` picked bfloat16 on any
AVX512-BF16 CPU). Rows alternate old / new ``--repeats`` times, each started on an idle machine
(``protocol.wait_for_idle``), so a drift of the machine shows up in both. The child uses only APIs both commits have
(``load_causal_lm``, ``lm_scores``, ``write_datastore``, ``load_documents``, ``limit_documents``,
``core.distribution.perplexity``).

    python benchmarks/speed/default_vs_old.py --out docs/results/speed/default_vs_old.json
    python benchmarks/speed/default_vs_old.py --corpus wikitext2 --new-quantize int8 --out ...   # the int8 path
    python benchmarks/speed/default_vs_old.py --corpus wikitext2 --new-dtype float32 --new-quantize int8 --out ...
      # the int8 path on an AMX CPU (the new auto there is bfloat16)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OLD_COMMIT = "6fa906e^"  # the parent of 'models.compute: compute paths ...', the first code change


def allocator() -> dict[str, Any]:
    """What memlm did to the C allocator in this process (the old code had no such module)."""
    try:
        from memlm.models.allocator import allocator_state
    except ImportError:
        return {"tuned": False, "reason": "this commit has no memlm.models.allocator"}
    return allocator_state()


def time_eval_and_build(model, tok, docs, build_docs) -> tuple[dict[str, Any], Any]:
    """``memlm eval``'s scoring of ``docs`` (``lm_scores``: windows 1024 / 512, batch 4, the ``ffn_in@-1`` key kept)
    after a small warm-up, then ``datastore build``'s key pass over ``build_docs``: the timing fields of a row and the
    scored positions' keys. Uses only APIs that every commit since the original default has (the old code's child
    runs it)."""

    from memlm.core.distribution import perplexity
    from memlm.knnlm.evaluate import lm_scores
    from memlm.knnlm.write import write_datastore
    from memlm.models.keys import KeySpec

    spec = KeySpec("ffn_in", -1)
    lm_scores(model, tok, docs[:1], [spec], 128, 64, 1, False)  # warm-up
    t0 = time.perf_counter()
    ts, queries, _ = lm_scores(model, tok, docs, [spec], 1024, 512, 4, False)
    eval_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ds = write_datastore(model, tok, build_docs, Path(tmp) / "ds", window=1024, min_context=512, batch_size=4,
                             progress=False, overwrite=True)  # fmt: skip
        build_s = time.perf_counter() - t0
    timing = {
        "tokens": len(ts),
        "eval_s": eval_s,
        "eval_tok_per_s": len(ts) / eval_s,
        "ppl": perplexity(ts.lm_logprob),
        "build_entries": len(ds),
        "build_s": build_s,
        "build_entries_per_s": len(ds) / build_s,
    }
    return timing, queries[spec]


def child(args: argparse.Namespace) -> None:
    """One row: load, warm up, time the scoring and the key pass; print one JSON line."""
    import numpy as np

    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents
    from memlm.models.resources import default_dtype, load_causal_lm

    dtype = default_dtype()
    t0 = time.perf_counter()
    model, tok = load_causal_lm(args.model, dtype=dtype)
    quantize = os.environ.get("MEMLM_BENCH_QUANTIZE", "none")
    if quantize != "none":  # only the new code's side (--new-quantize)
        from memlm.models.compute import ComputePath, apply_compute_path

        apply_compute_path(model, ComputePath(dtype, quantize=quantize), tokenizer=tok)
    load_s = time.perf_counter() - t0
    docs = limit_documents(load_documents(args.corpus, "test"), tok, args.tokens)
    build_docs = limit_documents(load_documents(args.corpus, "train"), tok, args.build_tokens)
    timing, keys = time_eval_and_build(model, tok, docs, build_docs)
    np.save(args.keys_out, keys[:2000].astype(np.float32))
    print(
        json.dumps(
            {
                "dtype": dtype,
                "quantize": quantize,
                "corpus": args.corpus,
                "load_s": load_s,
                **timing,
                "peak_rss_mib": protocol.peak_rss_mib(),
                "allocator": allocator(),
            }
        )
    )


def export_src(commit: str, where: Path) -> Path:
    """The ``src/`` tree of ``commit`` under ``where`` (git archive: no worktree left behind)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], check=True, capture_output=True).stdout
    tar = where / "src.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(where, filter="data")
    return where / "src"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--corpus",
        default="wiki",
        help="named corpus: its test split is scored, its train split keyed (default wiki, the Wikipedia lead "
        "sections the AVX-512 rows used; wikitext2 for WikiText-2)",
    )
    p.add_argument("--tokens", type=int, default=20_000, help="scored test tokens")
    p.add_argument("--build-tokens", type=int, default=8_000, help="train tokens for the key pass")
    p.add_argument(
        "--new-quantize",
        default="none",
        help="put the new code's side on --quantize QUANTIZE (e.g. int8) after loading in its default dtype",
    )
    p.add_argument("--old-commit", default=OLD_COMMIT)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--dtype",
        default=None,
        help="pin both sides' --dtype auto through MEMLM_DEFAULT_DTYPE (both commits read it), e.g. float32 for a "
        "CPU without native bf16 where both defaults are float32 (the AVX2 proxy); default: each commit's own auto",
    )
    p.add_argument(
        "--new-dtype",
        default=None,
        help="pin only the new code's side (e.g. float32 with --new-quantize int8 on an AMX CPU, where the new auto is "
        "bfloat16 and int8 needs float32); the old side keeps --dtype or its own auto",
    )
    p.add_argument("--wait-idle", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keys-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        sys.exit("--out is required")
    old_sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.old_commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    new_sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": protocol.machine(),
        "old_commit": old_sha,
        "new_commit": new_sha,
        "rows": [],
    }
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"old": export_src(old_sha, Path(tmp)), "new": REPO / "src"}
        for rep in range(args.repeats):
            for which in ("old", "new"):
                idle = protocol.wait_for_idle(protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=args.wait_idle)
                keys = Path(tmp) / f"keys-{which}.npy"
                argv = [
                    "--model",
                    args.model,
                    "--tokens",
                    str(args.tokens),
                    "--build-tokens",
                    str(args.build_tokens),
                    "--corpus",
                    args.corpus,
                    "--keys-out",
                    str(keys),
                ]
                env = {**os.environ, "PYTHONPATH": str(srcs[which])}
                env.pop("MEMLM_DEFAULT_DTYPE", None)
                env["MEMLM_BENCH_QUANTIZE"] = args.new_quantize if which == "new" else "none"
                if args.dtype:
                    env["MEMLM_DEFAULT_DTYPE"] = args.dtype
                if args.new_dtype and which == "new":
                    env["MEMLM_DEFAULT_DTYPE"] = args.new_dtype
                row = {"code": which, "repeat": rep, "idle_before": idle, **protocol.run_child(__file__, argv, env)}
                row["load_after"] = protocol.load_average()
                result["rows"].append(row)
                print(
                    f"{which} #{rep}: {row['dtype']} eval {row['eval_tok_per_s']:.1f} tok/s (ppl "
                    f"{row['ppl']:.6f}), build {row['build_entries_per_s']:.1f} entries/s, load before "
                    f"{idle['load_avg_before']}",
                    flush=True,
                )
                protocol.save_result(args.out, result)
        a, b = np.load(Path(tmp) / "keys-old.npy"), np.load(Path(tmp) / "keys-new.npy")
        err = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-12)
    rows = result["rows"]

    def med(code: str, field: str) -> float:
        return statistics.median(r[field] for r in rows if r["code"] == code)

    result["summary"] = {
        "eval_ratio": med("new", "eval_tok_per_s") / med("old", "eval_tok_per_s"),
        "build_ratio": med("new", "build_entries_per_s") / med("old", "build_entries_per_s"),
        # new / old - 1 (positive: the new path's perplexity is higher). Older files have
        # "ppl_relative_difference" = old / new - 1 instead, the opposite sign.
        "ppl_change_new_vs_old": med("new", "ppl") / med("old", "ppl") - 1,
        "key_error_old_vs_new_p99": float(np.percentile(err, 99)),
        "key_error_old_vs_new_mean": float(err.mean()),
    }
    print(json.dumps(result["summary"], indent=1))
    protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
