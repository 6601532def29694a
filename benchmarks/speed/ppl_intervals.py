"""How far a compute path's perplexity is from float32's, with a paired bootstrap interval over documents.

The issue bounds a fast path's perplexity difference from float32 at 0.2% on WikiText-2 test (window 1024). The timing
rows (``default_vs_old.py``, ``int8_w8a8.py``) score a 19,711-token slice: 4 documents, too few for an interval over
documents. This script scores **all of WikiText-2 test** (62 articles, 303,289 tokens; windows 1024 / 512, batch 4,
``memlm eval``'s ``lm_scores``) once per path, each in its own process (a CPU proxy is set through the environment
before torch loads), keeps every token's log-probability, and reports each path's perplexity and each pair's relative
change ``ppl_B / ppl_A - 1`` with its 95% paired percentile interval over documents (``memlm.core.bootstrap``: 1,000
resamples, seed 0). Nothing is timed, so the machine need not be idle; each path's scores are kept in ``--work`` and a
rerun skips the paths already scored (resumable).

Paths: ``NAME`` is ``float32`` or ``int8`` (``--quantize int8`` on float32) or ``int8-reduced-range`` (its 7-bit
FBGEMM layer, :class:`memlm.models.int8.ReducedRangeInt8Linear`, on any CPU) or ``bfloat16``, optionally ``@avx2``
(torch, oneDNN and MKL held to AVX2: a CPU without AVX-512, VNNI or bf16) or ``@avxvnni`` (held to AVX2 with AVX-VNNI:
Intel's 12th-14th generation Core). The env lines are ``int8_exactness.py``'s.

    python benchmarks/speed/ppl_intervals.py --work data/ppl-intervals \\
      --out docs/results/speed/ppl_intervals_int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROXIES: dict[str, dict[str, str]] = {
    "": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avxvnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX2_E1"},
}
#: (reference, system) pairs reported when both paths were scored: the fast path against float32 on the same CPU kind
PAIRS = (
    ("float32", "int8"),
    ("float32", "int8-reduced-range"),
    ("float32", "bfloat16"),
    ("float32@avx2", "int8@avxvnni"),
    ("float32", "float32@avx2"),
)


def split_path(name: str) -> tuple[str, str]:
    """``"int8@avxvnni"`` -> ``("int8", "avxvnni")``; refuses an unknown path or proxy."""
    path, _, proxy = name.partition("@")
    if path not in ("float32", "int8", "int8-reduced-range", "bfloat16") or proxy not in PROXIES:
        raise SystemExit(f"unknown path {name!r}: float32, int8, int8-reduced-range or bfloat16, optionally @avx2 "
                         "or @avxvnni")  # fmt: skip
    return path, proxy


def child(args: argparse.Namespace) -> None:
    """Score the corpus' test split on one path; save targets, log-probabilities and documents to ``--scores``."""
    import numpy as np
    import torch

    from memlm.core.distribution import perplexity
    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents
    from memlm.knnlm.evaluate import lm_scores
    from memlm.models.compute import ComputePath, apply_compute_path
    from memlm.models.resources import load_causal_lm

    path, _ = split_path(args.path)
    dtype = "bfloat16" if path == "bfloat16" else "float32"
    model, tok = load_causal_lm(args.model, dtype=dtype)
    if path == "int8":
        apply_compute_path(model, ComputePath("float32", quantize="int8"), tokenizer=tok)
    if path == "int8-reduced-range":  # the 7-bit FBGEMM layer whatever this CPU's rule chooses
        from memlm.models.int8 import ReducedRangeInt8Linear, quantize_int8

        quantize_int8(model, tok, layer=ReducedRangeInt8Linear)
    docs = load_documents(args.corpus, "test")
    if args.tokens:
        docs = limit_documents(docs, tok, args.tokens)
    t0 = time.perf_counter()
    ts, _, _ = lm_scores(model, tok, docs, [], 1024, 512, 4, True)
    tmp = Path(str(args.scores) + ".tmp.npz")
    np.savez(tmp, targets=ts.targets, lm_logprob=ts.lm_logprob, doc_index=ts.doc_index)
    os.replace(tmp, args.scores)
    print(json.dumps({"path": args.path, "tokens": len(ts), "seconds": time.perf_counter() - t0,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "ppl": perplexity(ts.lm_logprob)}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--work", required=True, help="folder for each path's scores (a rerun reuses them)")
    p.add_argument("--paths", default="float32,int8,float32@avx2,int8@avxvnni")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="wikitext2", help="named corpus whose test split is scored")
    p.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="score only the first documents up to this many tokens "
        "(default 0: the whole test split; a small value is a smoke test)",
    )
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--scores", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        sys.exit("--out is required")
    import numpy as np

    from memlm.core.bootstrap import evidence

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine(),
                              "corpus": args.corpus, "model": args.model, "window": 1024, "min_context": 512,
                              "paths": {}}  # fmt: skip
    for name in names:
        _, proxy = split_path(name)
        scores, info = (work / f"{args.corpus}-{args.tokens or 'all'}-{name}.{ext}" for ext in ("npz", "json"))
        if not scores.exists():
            env = {**os.environ, **PROXIES[proxy], "PYTHONPATH": str(REPO / "src")}
            argv = ["--work", str(work), "--path", name, "--scores", str(scores), "--model", args.model,
                    "--corpus", args.corpus, "--tokens", str(args.tokens)]  # fmt: skip
            print(f"scoring {name} ...", flush=True)
            info.write_text(json.dumps(protocol.run_child(__file__, argv, env, show_stderr=True)) + "\n")
        result["paths"][name] = {"environment": PROXIES[proxy], **json.loads(info.read_text())}
        print(name, result["paths"][name], flush=True)
    loaded = {n: np.load(work / f"{args.corpus}-{args.tokens or 'all'}-{n}.npz") for n in names}
    first = loaded[names[0]]
    for n, z in loaded.items():
        if not (np.array_equal(z["targets"], first["targets"]) and np.array_equal(z["doc_index"], first["doc_index"])):
            sys.exit(f"{n} scored other tokens than {names[0]}: delete {work} and rerun")
    pairs = [(a, b) for a, b in PAIRS if a in loaded and b in loaded]
    logprobs = {n: z["lm_logprob"] for n, z in loaded.items()}
    result.update(evidence(logprobs, first["doc_index"], pairs, resamples=args.resamples))
    protocol.save_result(args.out, result)
    for key, row in result["differences"].items():
        interval = f"[{row['low']:+.4%}, {row['high']:+.4%}]" if row["low"] is not None else "(no interval)"
        print(f"{key}: {row['relative_change']:+.4%} {interval}", flush=True)


if __name__ == "__main__":
    main()
