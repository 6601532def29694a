"""Generation from the kNN-LM: beam search and batched left-padded prompts get, at every step and for every row, the
interpolated distribution computed directly on that row's own tokens; streaming; neighbours traced to their text."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from conftest import Doc, make_toy_docs
from test_datastore import build
from test_reliability import memlm

from memlm.core.distribution import knn_distribution, mix
from memlm.knnlm.generate import MixtureLogitsProcessor, NeighbourStreamer, SourceLookup, generate_text, left_pad
from memlm.mixing.datastore import DatastoreComponent
from memlm.models.keys import KeyCapture
from memlm.retrieval import as_memory
from memlm.storage.index import build_index


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_lm):
    store = build(tmp_path_factory.mktemp("gen-ds"), tiny_lm, make_toy_docs(30, seed=4), window=48, min_context=16)
    build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
    return store


class Recorder(MixtureLogitsProcessor):
    """Keeps every (input_ids, returned scores) pair the generation loop saw."""

    calls: list

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        self.calls.append((input_ids.clone(), out.clone()))
        return out


def _direct(model, ds, seq: list[int], k: int, lam: float, tau: float) -> torch.Tensor:
    """Eq. 3 for one unpadded sequence: LM log-softmax at its last position mixed with p_kNN (exact search)."""
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        q = cap.keys_by_spec[ds.key_spec][0, -1].double().numpy()
    d = -((np.asarray(ds.keys, dtype=np.float64) - q) ** 2).sum(1)
    top = np.argsort(-d, kind="stable")[:k]
    knn = knn_distribution(
        torch.from_numpy(d[top]).float()[None],
        torch.from_numpy(np.asarray(ds.values)[top]).long()[None],
        len(logits),
        tau,
    )[0]
    return mix([torch.log_softmax(logits, -1), knn], weights=[1 - lam, lam])


@pytest.mark.parametrize("num_beams,do_sample", [(1, False), (3, False), (2, True)])
def test_batched_left_padded_and_beam_search_match_direct(tiny_lm, ds, num_beams, do_sample):
    model, tok = tiny_lm
    prompts = ["the cat", "a dog ran in the park and the", "over"]  # different lengths: left padding
    token_prompts = [tok.encode(p) for p in prompts]
    pad = [max(map(len, token_prompts)) - len(p) for p in token_prompts]
    k, lam, tau = 8, 0.5, 2.0
    rec = Recorder(model, f"knn:{ds.path}?k={k}&temperature={tau}", f"knn={lam}")
    rec.calls = []
    torch.manual_seed(0)
    texts = generate_text(
        model, tok, prompts, max_new_tokens=4, num_beams=num_beams, do_sample=do_sample, processor=rec
    )
    assert len(texts) == 3 and len(rec.calls) == 4
    for input_ids, scores in rec.calls:
        assert input_ids.shape[0] == 3 * num_beams
        for row in range(input_ids.shape[0]):
            b = row // num_beams
            seq = input_ids[row, pad[b] :].tolist()
            assert seq[: len(token_prompts[b])] == token_prompts[b]
            expected = _direct(model, ds, seq, k, lam, tau)
            torch.testing.assert_close(scores[row], expected, rtol=1e-4, atol=1e-4)


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_lm, ds):
    model, tok = tiny_lm
    prompts = ["the cat", "a dog ran in the park and the", "over"]
    memory = f"knn:{ds.path}?k=8"
    together = generate_text(model, tok, prompts, memory, "knn=0.5", max_new_tokens=5)
    alone = [generate_text(model, tok, [p], memory, "knn=0.5", max_new_tokens=5)[0] for p in prompts]
    assert together == alone


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_source_lookup_finds_each_entry_in_its_document(tmp_path, tiny_lm):
    model, tok = tiny_lm
    docs = make_toy_docs(8, seed=11)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    store = build(
        tmp_path,
        tiny_lm,
        [Doc(d.id, d.text) for d in docs],
        source={"corpus": str(path), "split": None, "documents": 8},
    )
    lookup = SourceLookup(store, tok, context_tokens=4)
    by_id = {d.id: tok.encode(d.text) + [tok.eos_token_id] for d in docs}
    for entry in range(len(store)):
        nb = lookup.neighbour(entry, 0.0)
        toks = by_id[nb.doc_id]
        off = int(store.offset[entry])
        assert toks[off] == int(store.values[entry])  # the entry's value is the token at its offset
        if off < len(toks) - 1:
            assert nb.value == tok.decode([toks[off]])
            assert nb.before == tok.decode(toks[max(0, off - 4) : off])


def test_streamer_prints_tokens_with_their_neighbours(tmp_path, tiny_lm):
    model, tok = tiny_lm
    text = "alpha beta gamma delta epsilon zeta eta theta"
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"id": "greek", "text": text}) + "\n")
    store = build(tmp_path, tiny_lm, [Doc("greek", text)], window=64, min_context=1, source={"corpus": str(path)})
    build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
    knn = MixtureLogitsProcessor(model, [DatastoreComponent(as_memory(store), 2, record=True)], "knn=1")
    out = io.StringIO()
    streamer = NeighbourStreamer(tok, knn, SourceLookup(store, tok), n_neighbours=1, out=out)
    got = generate_text(model, tok, ["alpha beta gamma"], max_new_tokens=3, processor=knn, streamer=streamer)
    assert got[0].startswith(" delta e")
    lines = out.getvalue().splitlines()
    # one line per token, then its nearest entry: the same token in context, from document "greek"
    assert lines[0] == repr(" delta") and lines[1].strip().startswith("[greek] ...alpha beta gamma[[ delta]]")
    assert len(knn.components[0].history) == 3


def test_cli_generate_streams_and_shows_neighbours(tmp_path, tiny_lm_dir):
    corpus = tmp_path / "greek.jsonl"
    corpus.write_text(json.dumps({"id": "greek", "text": "alpha beta gamma delta epsilon zeta eta theta"}) + "\n")
    ds = tmp_path / "ds"
    r = memlm(
        "datastore",
        "build",
        "--model",
        str(tiny_lm_dir),
        "--corpus",
        str(corpus),
        "--out",
        str(ds),
        "--window",
        "64",
        "--min-context",
        "8",
    )
    assert r.returncode == 0, r.stderr
    common = ["generate", "--prompt", "alpha beta gamma", "--greedy", "--lambda", "1"]
    r = memlm(*common, "--memory", f"{ds}?k=1", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "alpha beta gamma delta e"  # λ = 1, k = 1 replays the datastore: " delta", " e"
    r = memlm(*common, "--memory", f"knn:{ds}?k=2", "--max-new-tokens", "1", "--show-neighbours", "2")
    assert r.returncode == 0, r.stderr
    assert "' delta'" in r.stdout and "[greek] ...alpha beta gamma[[ delta]] epsilon" in r.stdout


def test_every_generation_path_searches_the_same_k_and_has_one_cache_default(tiny_lm, ds):
    """generate_text, MixtureLogitsProcessor, memlm.wrap, lm-eval's generate_until and the CLI's eval all default to
    core.config's DEFAULT_K neighbours (the k every calibration fits at) and the cache's weight to
    DEFAULT_CACHE_LAMBDA: a path with its own default fails here."""
    import argparse

    from memlm.cli import build_parser
    from memlm.core.config import DEFAULT_CACHE_LAMBDA, DEFAULT_K, RetrievalConfig
    from memlm.knnlm.default_mixture import calibrated_weights
    from memlm.knnlm.memories import open_memories
    from memlm.knnlm.wrap import wrap

    model, tok = tiny_lm
    inner, seen = as_memory(ds), []

    class Spy:
        key_spec = ds.key_spec

        def search(self, queries, k):
            seen.append(k)
            return inner.search(queries, k)

    generate_text(model, tok, ["the cat"], [Spy()], "knn=0.5", max_new_tokens=2)
    assert seen == [DEFAULT_K, DEFAULT_K] and DEFAULT_K == 1024
    assert MixtureLogitsProcessor(model, [ds], "knn=0.5").components[0].k == DEFAULT_K
    assert wrap(model, str(ds.path), "knn=0.5").mixture.components[0].k == DEFAULT_K
    assert not {"cache", "cache_lambda", "lam"} & set(RetrievalConfig().to_dict())  # weights are not settings
    assert calibrated_weights(open_memories("cache"))["cache"] == DEFAULT_CACHE_LAMBDA
    pytest.importorskip("lm_eval")
    from memlm.lmeval.model import MemlmLM

    lm = MemlmLM(model=model, tokenizer=tok, memories=f"{ds.path};cache", window=64, min_context=32)
    assert [d.k for d in lm.dense] == [DEFAULT_K] and lm.cache.k == 256
    assert [c.k for c in lm._generation_processor().components] == [DEFAULT_K]
    commands = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
    assert commands["eval"].get_default("k") == DEFAULT_K
    assert commands["eval"].get_default("cache_lambda") == DEFAULT_CACHE_LAMBDA


def test_fixed_weights_as_a_string_and_as_a_mixture():
    """``knn=0.25;ngram=0.5/0.1`` is the fixed-weight rule's weights by component name; ``fixed_mixture`` names the
    components of a memories list as every consumer does (lm, knn, knn2, ngram); a malformed string is one error."""
    from types import SimpleNamespace

    from memlm.core.mixture import rule_mixture
    from memlm.errors import MemlmError
    from memlm.mixing.weights import fixed_mixture, is_weights, parse_weights, weights_text

    weights = parse_weights("knn=0.25; knn2=0.1;ngram=0.5/0.1")
    assert weights == {"knn": 0.25, "knn2": 0.1, "ngram": (0.5, 0.1)} and weights_text(weights) == (
        "knn=0.25;knn2=0.1;ngram=0.5/0.1"
    )
    memories = [SimpleNamespace(kind=k) for k in ("knn", "ngram", "knn")]
    got = fixed_mixture(memories, weights).to_dict()
    assert got == rule_mixture(("lm", "knn", "ngram", "knn2"), weights).to_dict()
    assert is_weights("knn=0.2") and not is_weights("fit.json")
    for bad in ("knn", "knn=lots", "=0.2", "ngram=0.1/0.2/0.3"):
        with pytest.raises(MemlmError, match="name=λ or name=λ_sparse/λ_dense"):
            parse_weights(bad)
