"""The 7-bit FBGEMM int8 path against float32 on all of WikiText-2 test: perplexity per token with the paired bootstrap
interval of its relative change, and forward tokens/s end to end, on a CPU without VNNI.

``--quantize int8`` is refused on x86 CPUs without VNNI or AMX-INT8 (``torch._int_mm`` saturates or runs ~24x slower
than float32 there). :class:`memlm.models.int8.ReducedRangeInt8Linear` computes its integer products with FBGEMM's
dynamic linear at ``reduce_range`` (7-bit activations: pair sums of at most 127 · 127 · 2 fit in int16), with memlm's
SmoothQuant smoothing, per-token scales and float32 outlier channels. This script decides whether ``--quantize int8``
may use it on such a CPU (:func:`memlm.models.int8.reduced_range_adopted`: the perplexity change's paired 95%
interval within ±0.2% and faster than float32 end to end).

Protocol: ``memlm eval``'s default (``docs/concepts/evaluation-protocol.md``): SmolLM2-135M, the raw WikiText-2 test
split as one stream with EOS after each of its 62 articles, windows of 1,024 tokens advancing by 512, batches of 4,
the head and log-softmax in float32 (``memlm.models.forward.forward_windows``, as ``memlm.knnlm.evaluate.lm_scores``
runs it). Both models are loaded in one process; the windows' batches are split into chunks of ``--chunk`` batches,
and each chunk is scored by float32, then by int8 (A/B/A/B...), ``uptime``'s load average read before each; each
chunk's scores and timing are saved in ``--work``, so a rerun resumes at the first chunk not scored. Perplexity: the
token perplexity of each path over the scored chunks and the relative change with its paired percentile interval
over documents (``memlm.core.bootstrap.evidence``: 1,000 resamples, seed 0). Speed: scored tokens per second of
each path over all chunks (the ratio of their summed times), and the median and range of the chunks' paired ratios;
a forward pass of 1,024 positions scores 512 of them (2,048 forward tokens per 1,024 scored). Timings taken beside
other jobs on a 2-core CPU are ratios of adjacent runs, not absolute speeds: the record keeps every load average.

    python benchmarks/speed/int8_reduced_range_wikitext2.py --work data/int8-reduced-range \\
      --out docs/results/speed/int8_reduced_range_wikitext2_avx2.json

``--max-chunks N`` stops after N chunks (a later run resumes); ``--report-only`` writes the JSON from the chunks
scored so far (then ``complete`` is false unless all were).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
import protocol  # noqa: E402
import torch  # noqa: E402

from memlm.core.bootstrap import evidence  # noqa: E402
from memlm.core.distribution import perplexity  # noqa: E402
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import batched, sliding_windows, tokenize_documents  # noqa: E402
from memlm.models import int8 as int8_lib  # noqa: E402
from memlm.models.forward import forward_windows  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402

PATHS = ("float32", "int8-reduced-range")
WINDOW, STRIDE, BATCH = 1024, 512, 4


def score_chunk(model: torch.nn.Module, batches: list, pad_id: int) -> dict[str, Any]:
    """One chunk of window batches through ``model``: each scored token's target, log-probability and document."""
    targets, logprobs, docs = [], [], []
    forward_tokens = sum(len(w.input_ids) for b in batches for w in b)
    load = os.getloadavg()
    t0 = time.perf_counter()
    for outputs in forward_windows(model, batches, (), True, pad_id=pad_id):
        for o in outputs:
            targets.append(o.targets)
            logprobs.append(o.lm_logprob)
            docs.append(o.window.doc_index[o.window.score_from : len(o.window.input_ids)])
    seconds = time.perf_counter() - t0
    t = np.concatenate(targets).astype(np.int64)
    return {"targets": t, "lm_logprob": np.concatenate(logprobs).astype(np.float32),
            "doc_index": np.concatenate(docs).astype(np.int32),
            "timing": {"seconds": seconds, "scored_tokens": len(t), "forward_tokens": forward_tokens,
                       "load_avg_before": list(load)}}  # fmt: skip


def load_models(calibration: str) -> tuple[dict[str, torch.nn.Module], Any, dict[str, Any]]:
    """float32 SmolLM2-135M and a copy whose decoder linears are :class:`ReducedRangeInt8Linear` (calibrated as
    ``--quantize int8`` calibrates: 2,048 tokens of the ``wiki`` train split)."""
    fp32, tok = load_causal_lm("smollm2-135m", dtype="float32")
    rr, _ = load_causal_lm("smollm2-135m", dtype="float32")
    texts = None if calibration == "wiki" else [calibration]
    info = int8_lib.quantize_int8(rr, tok, texts, layer=int8_lib.ReducedRangeInt8Linear)
    return {"float32": fp32.eval(), "int8-reduced-range": rr.eval()}, tok, info


def run_chunks(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Score every chunk not yet in ``work``, float32 then int8 per chunk; returns the int8 layer's record."""
    models, tok, info = load_models("wiki")
    (work / "int8.json").write_text(json.dumps(info) + "\n")
    docs = load_documents("wikitext2", "test")
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    windows = list(sliding_windows(tokenize_documents(docs, tok), WINDOW, stride=STRIDE, bos_id=bos))
    batches = list(batched(windows, BATCH))
    chunks = [batches[i : i + args.chunk] for i in range(0, len(batches), args.chunk)]
    (work / "plan.json").write_text(json.dumps({"chunks": len(chunks), "batches": len(batches),
                                                "windows": len(windows), "chunk": args.chunk}))  # fmt: skip
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.inference_mode():  # warm-up (untimed): one batch each
        for m in models.values():
            for _ in forward_windows(m, [batches[0][:1]], (), True, pad_id=pad):
                pass
    done = 0
    for k, chunk in enumerate(chunks):
        if all((work / f"chunk{k:04d}-{p}.npz").exists() for p in PATHS):
            continue
        if args.max_chunks and done >= args.max_chunks:
            break
        for p in PATHS:
            with torch.inference_mode():
                r = score_chunk(models[p], chunk, pad)
            np.savez(work / f"tmp-{p}.npz", targets=r["targets"], lm_logprob=r["lm_logprob"], doc_index=r["doc_index"])
            (work / f"chunk{k:04d}-{p}.json").write_text(json.dumps(r["timing"]) + "\n")
            os.replace(work / f"tmp-{p}.npz", work / f"chunk{k:04d}-{p}.npz")
            t = r["timing"]
            print(f"chunk {k + 1}/{len(chunks)} {p}: {t['scored_tokens']} tokens in {t['seconds']:.1f} s "
                  f"({t['scored_tokens'] / t['seconds']:.0f}/s), load {t['load_avg_before']}", flush=True)  # fmt: skip
        done += 1
    return info


def report(work: Path, resamples: int) -> dict[str, Any]:
    """Perplexities, the paired interval and the speed over the chunks both paths scored."""
    plan = json.loads((work / "plan.json").read_text())
    ks = [k for k in range(plan["chunks"]) if all((work / f"chunk{k:04d}-{p}.npz").exists() for p in PATHS)]
    scores = {p: [np.load(work / f"chunk{k:04d}-{p}.npz") for k in ks] for p in PATHS}
    timing = {p: [json.loads((work / f"chunk{k:04d}-{p}.json").read_text()) for k in ks] for p in PATHS}
    cat = {p: {f: np.concatenate([z[f] for z in scores[p]]) for f in ("targets", "lm_logprob", "doc_index")}
           for p in PATHS}  # fmt: skip
    a, b = PATHS
    if not (np.array_equal(cat[a]["targets"], cat[b]["targets"]) and np.array_equal(cat[a]["doc_index"],
                                                                                    cat[b]["doc_index"])):  # fmt: skip
        raise SystemExit("the two paths scored other tokens: delete the work folder and rerun")
    ev = evidence({p: cat[p]["lm_logprob"] for p in PATHS}, cat[a]["doc_index"], [(a, b)], resamples=resamples)
    diff = next(iter(ev["differences"].values()))
    secs = {p: sum(t["seconds"] for t in timing[p]) for p in PATHS}
    scored = sum(t["scored_tokens"] for t in timing[a])
    pair_ratios = [ta["seconds"] / tb["seconds"] for ta, tb in zip(timing[a], timing[b], strict=True)]
    speed = {
        "scored_tokens_per_path": scored,
        "forward_tokens_per_path": sum(t["forward_tokens"] for t in timing[a]),
        "tokens_per_s": {p: scored / secs[p] for p in PATHS},
        "seconds": secs,
        "speed_vs_float32": secs[a] / secs[b],
        "pair_ratio_median": statistics.median(pair_ratios),
        "pair_ratio_min": min(pair_ratios),
        "pair_ratio_max": max(pair_ratios),
        "pairs_faster": sum(r > 1 for r in pair_ratios),
        "pairs": len(pair_ratios),
        "load_avg_before_min": min(t["load_avg_before"][0] for p in PATHS for t in timing[p]),
        "load_avg_before_max": max(t["load_avg_before"][0] for p in PATHS for t in timing[p]),
        "chunks": {p: timing[p] for p in PATHS},
    }
    complete = len(ks) == plan["chunks"]
    measured = {"ppl_change": diff["relative_change"], "ppl_change_low": diff["low"], "ppl_change_high": diff["high"],
                "speed_vs_float32": speed["speed_vs_float32"], "complete": complete,
                "tokens": int(len(cat[a]["targets"]))}  # fmt: skip
    return {
        "complete": complete,
        "chunks_scored": len(ks),
        "chunks_total": plan["chunks"],
        "documents": int(len(np.unique(cat[a]["doc_index"]))),
        "tokens": int(len(cat[a]["targets"])),
        "ppl": {p: perplexity(cat[p]["lm_logprob"]) for p in PATHS},
        **ev,
        "speed": speed,
        "rule": {
            "bound": int8_lib.PPL_BOUND,
            "measured": measured,
            "adopted": int8_lib.reduced_range_adopted(measured),
        },  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="folder of each chunk's scores and timing (a rerun resumes)")
    ap.add_argument("--out", help="JSON file of the results")
    ap.add_argument("--chunk", type=int, default=4, help="window batches per chunk (4 windows of 1,024 a batch)")
    ap.add_argument("--max-chunks", type=int, default=0, help="stop after this many new chunks (0: all)")
    ap.add_argument("--report-only", action="store_true", help="write the JSON from the chunks scored so far")
    ap.add_argument("--resamples", type=int, default=1000)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    info = json.loads((work / "int8.json").read_text()) if args.report_only else run_chunks(args, work)
    if args.out:
        result = {"what": __doc__.split("\n\n")[0], "command": " ".join(["python", *sys.argv]),
                  "machine": protocol.machine(), "lscpu_flags": protocol.lscpu_flags(),
                  "int8_products_exact": int8_lib.int8_products_exact(),
                  "int8_products_native": int8_lib.int8_products_native(), "corpus": "wikitext2 test",
                  "model": "smollm2-135m", "window": WINDOW, "stride": STRIDE, "batch": BATCH,
                  "int8": info, **report(work, args.resamples)}  # fmt: skip
        protocol.save_result(args.out, result)
        r = result["rule"]["measured"]
        print(
            f"ppl {result['ppl']}; change {r['ppl_change']:+.4%} [{r['ppl_change_low']:+.4%}, "
            f"{r['ppl_change_high']:+.4%}]; speed {r['speed_vs_float32']:.3f}x; adopted {result['rule']['adopted']}"
        )


if __name__ == "__main__":
    main()
