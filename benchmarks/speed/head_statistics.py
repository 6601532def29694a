"""The LM terms of a scoring pass alone: the output projection and the log-softmax statistics.

On the real model's head and its real final hidden states (bf16 body: the `final` key of the first windows of
WikiText-2 test, the scored rows of one batch of 4 windows 1024 / 512), times, in one process after an idle wait:

* the head as it was: the model's own bf16 head, then the float32 product on a fresh tensor (a forward hook);
* :class:`memlm.models.forward.fp32_head` now, as a float32 product and as bf16 products with float32 sums (the latter
  only where :func:`memlm.models.compute.bf16_products_available` says so, or with ``--force-bf16-products``);
* the statistics (log p(target), max, entropy) on the whole tensor as before, and by row blocks
  (:func:`memlm.models.forward.logprob_statistics`, its two row-block buffers made by each call), checking that both
  give the same bits.

Each variant: ``--repeats`` calls after one warm-up, the least and the median seconds. The logits' error against a
float64 product is recorded for each head.

    python benchmarks/speed/head_statistics.py --out docs/results/speed/head_statistics.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402


def _time(fn, repeats: int) -> dict[str, float]:
    fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "repeats": repeats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--force-bf16-products", action="store_true")
    p.add_argument("--wait-idle", type=float, default=300)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from memlm.data.corpora import load_documents
    from memlm.data.windows import TokenChunk, sliding_windows
    from memlm.models.compute import bf16_products_available
    from memlm.models.forward import fp32_head, lm_entropy, logprob_statistics
    from memlm.models.keys import KeyCapture, KeySpec
    from memlm.models.resources import load_causal_lm

    torch.set_num_threads(2)
    model, tok = load_causal_lm(args.model, dtype="bfloat16")
    text = "\n".join(d.text for d in load_documents("wikitext2", "test")[:4])
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    windows = list(sliding_windows([TokenChunk(ids, 0, 0)], 1024, 512))[1 : 1 + args.windows]  # score 512 each
    spec = KeySpec("final", -1)
    hs, targets = [], []
    with torch.inference_mode(), KeyCapture(model, [spec]) as cap:
        for w in windows:
            model(input_ids=torch.from_numpy(w.input_ids)[None], use_cache=False)  # the head's input: every position
            hs.append(cap.keys_by_spec[spec][0, w.score_from - 1 : len(w.input_ids) - 1].clone())
            targets.append(torch.from_numpy(w.targets))
    h, target = torch.cat(hs), torch.cat(targets)  # [n, d] bf16, [n]
    head = model.get_output_embeddings()
    exact = h.double() @ head.weight.detach().double().T
    result: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": protocol.machine()}
    result.update(rows=int(h.shape[0]), vocab=int(exact.shape[1]), head={}, statistics={})
    result["idle_before"] = protocol.idle_check(False, wait=args.wait_idle)
    result["load_avg_before"] = protocol.load_average()

    with torch.inference_mode():
        w32 = head.weight.detach().float()

        def old_head() -> torch.Tensor:  # the earlier hook: the bf16 head ran, then its output was replaced
            head(h)
            return torch.nn.functional.linear(h.float(), w32)

        variants = {"old: bf16 head, then float32 on a fresh tensor": old_head}
        hooks = {"float32": fp32_head(model, reuse_output=True, bf16_products=False)}
        if bf16_products_available(torch.device("cpu")) or args.force_bf16_products:
            hooks["bf16-products"] = fp32_head(model, reuse_output=True, bf16_products=True)
        for name, fn in variants.items():
            z = fn()
            result["head"][name] = {**_time(fn, args.repeats), "max_abs_error": float((z.double() - exact).abs().max())}
        for name, hook in hooks.items():
            with hook:
                z = head(h)
                err = float((z.double() - exact).abs().max())
                result["head"][f"now: {name}"] = {**_time(lambda: head(h), args.repeats), "max_abs_error": err}
        logits = torch.nn.functional.linear(h.float(), w32)

        def whole() -> tuple:
            logp = torch.log_softmax(logits, -1)
            return (logp.gather(-1, target[:, None]).squeeze(-1).numpy(), logp.amax(-1).numpy(),
                    lm_entropy(logp).numpy())  # fmt: skip

        result["statistics"]["old: whole tensor"] = _time(whole, args.repeats)
        result["statistics"]["now: row blocks"] = _time(lambda: logprob_statistics(logits, target), args.repeats)
        same = all(np.array_equal(a, b) for a, b in zip(whole(), logprob_statistics(logits, target), strict=True))
        result["statistics"]["same_bits"] = bool(same)
    result["load_avg_after"] = protocol.load_average()
    for part in ("head", "statistics"):
        for name, row in result[part].items():
            if isinstance(row, dict):
                print(f"{part:10s} {name:50s} min {row['min_s']:.3f} s  median {row['median_s']:.3f} s", flush=True)
    print("same bits:", result["statistics"]["same_bits"])
    protocol.save_result(args.out, result)


if __name__ == "__main__":
    main()
