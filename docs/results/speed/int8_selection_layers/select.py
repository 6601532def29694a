import sys
import time

import numpy as np
import torch

import memlm.models.int8 as I
from memlm.data.corpora import load_documents
from memlm.data.windows import limit_documents
from memlm.knnlm.evaluate import lm_scores
from memlm.models.compute import ComputePath, apply_compute_path
from memlm.models.keys import KeySpec
from memlm.models.resources import load_causal_lm

torch.set_num_threads(2)
spec = KeySpec("ffn_in", -1)
ids = torch.randint(0, 49152, (4, 1024), generator=torch.Generator().manual_seed(0))
orig = I.input_absmax


def run(split_sizes, alpha):
    def ia(*a, **k):
        am, groups = orig(*a, **k)
        out = []
        for g in groups:
            out += [[i] for i in g] if len(g) in split_sizes else [g]
        return am, out

    I.input_absmax = ia
    I.ALPHA = alpha
    model, tok = load_causal_lm("smollm2-135m", dtype="float32")
    if alpha is not None:
        I.quantize_int8.__defaults__ = (None, alpha, I.CALIBRATION_TOKENS)
        apply_compute_path(model, ComputePath("float32", quantize="int8"), tokenizer=tok)
    docs = limit_documents(load_documents("wikitext2", sys.argv[1]), tok, int(sys.argv[2]))
    ts, qk, _ = lm_scores(model, tok, docs, [spec], 1024, 512, 4, False)
    with torch.inference_mode():
        model.model(input_ids=ids[:, :256], use_cache=False)
        t = time.perf_counter()
        for _ in range(2):
            model.model(input_ids=ids, use_cache=False)
    body = 2 * 4096 / (time.perf_counter() - t)
    return qk[spec].astype(np.float32), np.exp(-ts.lm_logprob.astype(np.float64).mean()), body


ref = run((), None)
print("fp32", ref[1], ref[2], flush=True)
for split, alpha in [((2, 3), 0.5), ((3,), 0.5), ((), 0.5)]:
    k, p, b = run(split, alpha)
    e = np.linalg.norm(k - ref[0], axis=1) / np.linalg.norm(ref[0], axis=1)
    print(
        f"split {split} alpha {alpha}: ppl {p / ref[1] - 1:+.4%} key p99 {np.percentile(e, 99):.3g} "
        f"body {b:.0f} tok/s ({b / ref[2]:.2f}x)",
        flush=True,
    )
