"""The extension points of docs/ARCHITECTURE.md, as a user would use them: a new memory, a new searcher and a new
retrieval method (an efficiency strategy with its own setting), each defined here in a few lines, run through memlm
eval's scorer (`score_tokens`) and, for the memory and the searcher, as a component of the mixture
(`DatastoreComponent`) in generation (`MixtureLogitsProcessor`, `generate_text`), `memlm.wrap` and the lm-eval adapter
(`MemlmLM`), with no edit to memlm. Each result is checked against the same
quantity recomputed here with NumPy (Khandelwal et al. 2020, Eq. 2-3: p = (1-λ) p_LM + λ softmax(-d/τ) summed per
value). A new training objective has its worked example in tests/test_train_driver.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import make_toy_docs
from test_datastore import build

from memlm.core.config import RetrievalConfig
from memlm.core.memory import Retrieved
from memlm.knnlm.evaluate import EFFICIENCY_STRATEGIES, lm_scores, perplexities
from memlm.knnlm.generate import MixtureLogitsProcessor, generate_text
from memlm.knnlm.scoring import score_tokens
from memlm.mixing.datastore import DatastoreComponent
from memlm.models.keys import KeyCapture, KeySpec, num_layers
from memlm.retrieval import DatastoreMemory

W, C, K, LAM, TAU = 32, 12, 6, 0.5, 2.0
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the bird sang over the old river"]


# ------------------------------------------------------------------------------------ a new memory, in ~25 lines


class SentenceMemory:
    """A toy memory: the hidden states of a few sentences (next token as value), in RAM, searched by brute force."""

    def __init__(self, model, tokenizer, sentences):
        self.key_spec = KeySpec("ffn_in", -1).normalized(num_layers(model))
        keys, values = [], []
        with torch.no_grad(), KeyCapture(model, [self.key_spec]) as cap:
            for s in sentences:
                ids = tokenizer(s, return_tensors="pt")["input_ids"]
                model(input_ids=ids)
                keys.append(cap.keys_by_spec[self.key_spec][0, :-1].float().numpy())
                values.append(ids[0, 1:].numpy())
        self.keys, self.values = np.concatenate(keys), np.concatenate(values)

    def search(self, queries, k):
        d = -((np.asarray(queries, np.float32)[:, None, :] - self.keys[None]) ** 2).sum(-1)  # -squared L2
        top = np.argsort(-d, axis=1, kind="stable")[:, :k]
        return Retrieved(np.take_along_axis(d, top, 1).astype(np.float32), self.values[top], top)

    def describe(self):
        return {"memory": "sentences", "entries": len(self.values)}


# ---------------------------------------------------------------------------------- a new searcher, in ~10 lines


class NumpySearcher:
    """A toy searcher: exact -squared L2 over a datastore's keys with NumPy (where a FAISS index would be)."""

    metric = "l2"

    def __init__(self, keys):
        self.keys = np.asarray(keys, np.float32)

    def search(self, queries, k):
        d = -((np.asarray(queries, np.float32)[:, None, :] - self.keys[None]) ** 2).sum(-1)
        ids = np.argsort(-d, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(d, ids, 1).astype(np.float32), ids.astype(np.int64)

    def describe(self):
        return {"search": "numpy"}


# ---------------------------------------------------------------- a new retrieval method, in ~20 lines


@dataclass(frozen=True)
class UnsureConfig(RetrievalConfig):
    """RetrievalConfig plus the new method's one setting; ``efficiency`` names the strategy it chooses."""

    min_entropy: float | None = None

    @property
    def efficiency(self) -> str:
        return "search-when-unsure" if self.min_entropy is not None else super().efficiency


def search_when_unsure(ts, queries, memory, config, provenance, progress):
    """A toy adaptive retrieval: search (and interpolate with λ = LAM) only where the LM's entropy exceeds
    ``min_entropy``; elsewhere λ_t = 0 and nothing is searched (the datastore's ``searched`` and ``lambda``
    columns)."""
    searched = ts.lm_entropy > config.min_entropy
    scores = np.full((len(queries), config.k), -np.inf, np.float32)
    ids = np.full((len(queries), config.k), -1, np.int64)
    scores[searched], ids[searched] = memory.search_ids(queries[searched], config.k)
    return scores, ids, {"searched": searched, "lambda": np.where(searched, LAM, 0.0).astype(np.float32)}


# ----------------------------------------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def memory(tiny_lm):
    return SentenceMemory(*tiny_lm, SENTENCES)


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_lm):
    return build(tmp_path_factory.mktemp("ext-ds"), tiny_lm, make_toy_docs(12, seed=5), window=W, min_context=C)


def _brute_knn_logprob(keys, values, query, target, k, tau):
    """log p_kNN(target) for one query: top-k by -squared L2, softmax(-d/τ), mass of entries with the target value."""
    d = -((keys.astype(np.float64) - query.astype(np.float64)) ** 2).sum(1)
    top = np.argsort(-d, kind="stable")[:k]
    w = np.exp((d[top] - d[top].max()) / tau)
    mass = w[values[top] == target].sum() / w.sum()
    return -math.inf if mass == 0 else math.log(mass)


def _brute_ppl(model, tok, docs, keys, values, spec):
    ts, queries, _ = lm_scores(model, tok, docs, [spec], W, C, progress=False)
    q = queries[spec]
    knn = np.array([_brute_knn_logprob(keys, values, q[i], ts.targets[i], K, TAU) for i in range(len(q))])
    lm = ts.lm_logprob.astype(np.float64)
    return math.exp(-np.mean(np.log((1 - LAM) * np.exp(lm) + LAM * np.exp(knn))))


def test_new_memory_through_score_tokens(tiny_lm, memory):
    model, tok = tiny_lm
    docs = make_toy_docs(3, seed=8)
    ts = score_tokens(model, tok, docs, memory, k=K, window=W, min_context=C, progress=False)
    assert ts.meta["components"]["knn"]["memory"] == "sentences" and ts.columns["knn"]["scores"].shape == (
        len(ts.targets),
        K,
    )
    got = perplexities(ts, lam=LAM, temperature=TAU)["knn_ppl"]
    ref = _brute_ppl(model, tok, docs, memory.keys, memory.values, memory.key_spec)
    assert got == pytest.approx(ref, rel=1e-4)
    with pytest.raises(Exception, match="need a datastore"):
        score_tokens(model, tok, docs, memory, k=K, window=W, min_context=C, progress=False, pointer_min=2)


def test_new_searcher_through_score_tokens(tiny_lm, ds):
    model, tok = tiny_lm
    docs = make_toy_docs(3, seed=8)
    toy = DatastoreMemory(ds, searcher=NumpySearcher(ds.keys))
    ts = score_tokens(model, tok, docs, toy, k=K, window=W, min_context=C, progress=False)
    described = ts.meta["components"]["knn"]
    assert described["searcher"] == {"search": "numpy"} and described["datastore"] == str(ds.path)
    got = perplexities(ts, lam=LAM, temperature=TAU)["knn_ppl"]
    ref = _brute_ppl(model, tok, docs, np.asarray(ds.keys, np.float32), np.asarray(ds.values), ds.key_spec)
    assert got == pytest.approx(ref, rel=1e-4)
    # a memory over a datastore keeps every option: RetoMaton's pointers reuse the toy searcher's results
    reuse = score_tokens(model, tok, docs, toy, k=K, window=W, min_context=C, progress=False, pointer_min=2)
    assert 0 < reuse.columns["knn"]["searched"].mean() < 1


def _one_step(model, tok, mem, prompt):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad(), MixtureLogitsProcessor(model, [DatastoreComponent(mem, K, TAU)], f"knn={LAM}") as proc:
        logits = model(input_ids=ids).logits[:, -1]
        mixed = proc(ids, logits)[0].double()
        return ids, logits[0].double(), mixed


@pytest.mark.parametrize("which", ["memory", "searcher"])
def test_new_memory_and_searcher_through_generation(tiny_lm, memory, ds, which):
    model, tok = tiny_lm
    mem = memory if which == "memory" else DatastoreMemory(ds, searcher=NumpySearcher(ds.keys))
    keys = memory.keys if which == "memory" else np.asarray(ds.keys, np.float32)
    values = memory.values if which == "memory" else np.asarray(ds.values)
    ids, logits, mixed = _one_step(model, tok, mem, "the cat sat on the")
    with torch.no_grad(), KeyCapture(model, [mem.key_spec]) as cap:
        model(input_ids=ids)
        query = cap.keys_by_spec[mem.key_spec][0, -1].float().numpy()
    p_lm = torch.softmax(logits, -1).numpy()
    for w in (int(p_lm.argmax()), int(values[0]), 5):
        p_knn = math.exp(_brute_knn_logprob(keys, values, query, w, K, TAU))
        assert mixed[w].item() == pytest.approx(math.log((1 - LAM) * p_lm[w] + LAM * p_knn), rel=1e-4, abs=1e-5)
    text = generate_text(model, tok, ["the cat sat on the"], [DatastoreComponent(mem, K, TAU)], f"knn={LAM}",
                         max_new_tokens=4)  # fmt: skip
    assert len(text) == 1 and isinstance(text[0], str)


@pytest.mark.parametrize("which", ["memory", "searcher"])
def test_new_memory_and_searcher_through_lm_eval(tiny_lm, memory, ds, which):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from memlm.lmeval.model import MemlmLM

    model, tok = tiny_lm
    mem = memory if which == "memory" else DatastoreMemory(ds, searcher=NumpySearcher(ds.keys))
    keys = memory.keys if which == "memory" else np.asarray(ds.keys, np.float32)
    values = memory.values if which == "memory" else np.asarray(ds.values)
    lm = MemlmLM(model=model, tokenizer=tok, memories=[DatastoreComponent(mem, K, TAU)], mixture=f"knn={LAM}")
    ctx, cont = "a dog ran", " in the park"
    ((logp, _),) = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)])
    seq, n_ctx = tok.encode(ctx + cont), len(tok.encode(ctx))
    with torch.no_grad(), KeyCapture(model, [mem.key_spec]) as cap:
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
        q = cap.keys_by_spec[mem.key_spec][0].float().numpy()
    ref = 0.0
    for pos in range(n_ctx - 1, len(seq) - 1):
        p_lm = torch.softmax(logits[pos], -1)[seq[pos + 1]].item()
        knn = _brute_knn_logprob(keys, values, q[pos], seq[pos + 1], K, TAU)
        ref += math.log((1 - LAM) * p_lm + LAM * math.exp(knn))
    assert logp == pytest.approx(ref, rel=1e-4)


def test_new_memory_through_wrap(tiny_lm, memory):
    import memlm

    model, tok = tiny_lm
    knn = memlm.wrap(model, [DatastoreComponent(memory, K, TAU)], f"knn={LAM}")
    ids = tok("the bird sang over the", return_tensors="pt")["input_ids"]
    last = knn(input_ids=ids).logits[0, -1].double()
    _, _, mixed = _one_step(model, tok, memory, "the bird sang over the")
    torch.testing.assert_close(last, mixed, rtol=1e-5, atol=1e-5)


def test_new_retrieval_method_through_score_tokens(tiny_lm, ds, monkeypatch):
    """A new method is a config subclass and one EFFICIENCY_STRATEGIES entry: score_tokens runs it, and its
    perplexity equals Σ log((1 - λ_t) p_LM + λ_t p_kNN) with λ_t = LAM where the LM is unsure, computed here."""
    monkeypatch.setitem(EFFICIENCY_STRATEGIES, "search-when-unsure", search_when_unsure)
    model, tok = tiny_lm
    docs = make_toy_docs(3, seed=8)
    ts_all, queries, _ = lm_scores(model, tok, docs, [ds.key_spec], W, C, progress=False)
    threshold = float(np.median(ts_all.lm_entropy))
    config = UnsureConfig(k=K, window=W, min_context=C, min_entropy=threshold)
    toy = DatastoreMemory(ds, searcher=NumpySearcher(ds.keys))  # the toy searcher above: no FAISS index needed
    ts = score_tokens(model, tok, docs, toy, config, progress=False)
    assert ts.meta["retrieval"]["min_entropy"] == threshold and 0 < ts.columns["knn"]["searched"].mean() < 1
    got = perplexities(ts, lam=LAM, temperature=TAU)["knn_ppl"]
    keys, values, q = np.asarray(ds.keys, np.float32), np.asarray(ds.values), queries[ds.key_spec]
    total = 0.0
    for i, target in enumerate(ts_all.targets):
        p_lm = math.exp(float(ts_all.lm_logprob[i]))
        lam_t = LAM if ts_all.lm_entropy[i] > threshold else 0.0
        p_knn = math.exp(_brute_knn_logprob(keys, values, q[i], target, K, TAU)) if lam_t else 0.0
        total += math.log((1 - lam_t) * p_lm + lam_t * p_knn)
    assert got == pytest.approx(math.exp(-total / len(ts_all.targets)), rel=1e-4)
