"""One generation step's datastore cost at k = 64 and k = 1024, beside the LM's own step (memlm.core.config.DEFAULT_K).

A generation step searches each datastore for the newest position's key and turns the k neighbours into p_kNN over the
vocabulary (Khandelwal et al. 2020, Eq. 2) with its features (:class:`memlm.mixing.datastore.DatastoreComponent`). This
times that step on random keys in an IVF-Flat index (``--entries``, d 576 and a 49,152-token vocabulary as SmolLM2-135M,
nprobe 32), and one new token of a randomly initialised model of SmolLM2-135M's shape with ``--context`` tokens of KV
cache; medians over ``--repeats`` steps, on one thread. Timing protocol: ``benchmarks/protocol.py`` (idle check
first, or ``--force`` to record ``idle: false``; the machine and the load averages recorded).

    PYTHONPATH=src python benchmarks/speed/generation_k.py --json docs/results/speed/generation_k.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402

from memlm.core.memory import Retrieved  # noqa: E402
from memlm.mixing.component import Batch  # noqa: E402
from memlm.mixing.datastore import DatastoreComponent  # noqa: E402

VOCAB, DIM = 49152, 576


class _IvfMemory:
    """Random keys and values behind an IVF-Flat index (nprobe 32): the memory a generation step searches."""

    key_spec = "key"

    def __init__(self, n: int, rng: np.random.Generator) -> None:
        keys = rng.standard_normal((n, DIM)).astype(np.float32)
        self.values = rng.integers(0, VOCAB, n)
        nlist = int(4 * np.sqrt(n))
        self.index = faiss.IndexIVFFlat(faiss.IndexFlatL2(DIM), DIM, nlist)
        self.index.train(keys[: min(n, 40 * nlist)])
        self.index.add(keys)
        self.index.nprobe = 32

    def search(self, queries: np.ndarray, k: int) -> Retrieved:
        d, i = self.index.search(queries, k)
        return Retrieved(-d, np.where(i >= 0, self.values[np.maximum(i, 0)], -1), i)


def _median_ms(fn, repeats: int, warmup: int) -> float:
    times = []
    for _ in range(warmup + repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times[warmup:]) * 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, nargs="+", default=[20_000, 200_000])
    p.add_argument("--ks", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=35)
    p.add_argument("--json", default=None)
    protocol.add_idle_args(p)
    args = p.parse_args()
    idle = protocol.idle_check(args.force, args.wait)
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    result: dict = {"command": " ".join(["python", *sys.argv]), "vocab": VOCAB, "dim": DIM, "nprobe": 32,
                    "threads": 1, "idle": idle, "machine": protocol.machine(), "step_ms": {}}  # fmt: skip
    for n in args.entries:
        memory = _IvfMemory(n, rng)
        for k in args.ks:
            step = DatastoreComponent(memory, k, 1.0)

            def one(step=step) -> None:
                q = rng.standard_normal((1, DIM)).astype(np.float32)
                step.step(Batch({"key": q}, vocab=VOCAB))

            result["step_ms"][f"entries={n} k={k}"] = ms = _median_ms(one, args.repeats, 5)
            print(f"datastore step, {n:,} entries, k={k}: {ms:.2f} ms", flush=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        past = model(torch.randint(0, VOCAB, (1, args.context)), use_cache=True).past_key_values

        def lm_step() -> None:
            model(torch.randint(0, VOCAB, (1, 1)), past_key_values=past, use_cache=True)

        result["lm_step_ms"] = ms = _median_ms(lm_step, max(5, args.repeats // 3), 3)
    print(f"LM step (SmolLM2-135M's shape, {args.context} tokens of KV cache): {ms:.2f} ms", flush=True)
    result["load_avg_after"] = protocol.load_average()
    protocol.save_result(args.json, result)


if __name__ == "__main__":
    main()
