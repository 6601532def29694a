"""lm-eval's ``MemlmLM`` through one ``Mixture``: a stored gate mixes every continuation token as a NumPy
transcription of ``λ(c) = softmax(W (φ(c) - mean) / std + b)``, ``P = Σ_i λ_i(c) P_i`` says (p_LM from the model, p_kNN
from an exact search, Khandelwal et al. 2020 Eq. 2; P∞ from a scan of the reference tokens, Liu et al. 2024; the cache
over the sequence's own earlier states, Grave et al. 2017); memories are one spec string or list (two datastores, two
∞-gram indexes, no special case); a fit made for other memories is refused before anything is scored; one mixture over
the same memories gives the same log p in scoring, a generation step, ``memlm.wrap`` and lm-eval."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("infini_gram")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_toy_docs  # noqa: E402
from test_datastore import build  # noqa: E402
from test_ngram import Brute, _brute_p_inf, _ids  # noqa: E402

from memlm.core.mixture import Mixture, MixtureFit  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.lmeval.model import MemlmLM  # noqa: E402
from memlm.mixing.dump import DumpMixture  # noqa: E402
from memlm.models.keys import KeyCapture, num_layers  # noqa: E402
from memlm.ngram.index import build_ngram_index  # noqa: E402
from memlm.storage.index import build_index  # noqa: E402

K, TAU, CACHE_TAU = 8, 2.0, 1.5
TEXT = "the old river ran over the park while the cat sat on a mat and the dog ran"

# each kind's features as memlm.mixing.inputs documents them
LM_FEATURES = ["lm_entropy", "lm_max_logprob"]
KNN_FEATURES = ["top_score", "logsumexp", "top_value_share", "empty"]
NGRAM_FEATURES = ["log_n", "log_count", "sparse"]


def _corpora():
    return make_toy_docs(60, seed=3) + [make_toy_docs(1, seed=5)[0]], make_toy_docs(25, seed=11)


@pytest.fixture(scope="module")
def memories(tmp_path_factory, tiny_lm):
    """Two datastores of the tiny LM (exact flat-L2 indexes) and two ∞-gram indexes over different toy corpora."""
    _, tok = tiny_lm
    root = tmp_path_factory.mktemp("lmeval-mixture")
    stores = []
    for name, docs in (("ds1", make_toy_docs(40, seed=3)), ("ds2", make_toy_docs(30, seed=8))):
        store = build(root, tiny_lm, docs, name=name, window=48, min_context=16)
        build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
        stores.append(store)
    ngrams = [build_ngram_index(tok, docs, root / f"ng{i}", progress=False) for i, docs in enumerate(_corpora())]
    brutes = [Brute(tok, docs) for docs in _corpora()]
    return stores, ngrams, brutes


def _gate_file(path: Path, components: list[str], seed: int) -> tuple[Path, Mixture]:
    """A stored fit (the record ``memlm tune --mixture gate --json`` writes) whose gate has non-zero weights on every
    feature of its memories, at τ = 2 over k = 8 neighbours and τc = 1.5."""
    names = list(LM_FEATURES)
    for c in components[1:]:
        kind = c.rstrip("0123456789")
        names += [
            f"{c}_{f}" for f in {"knn": KNN_FEATURES, "ngram": NGRAM_FEATURES, "cache": ["top_score", "empty"]}[kind]
        ]
    rng = np.random.default_rng(seed)
    W = rng.normal(0.0, 0.8, (len(components), len(names)))
    W[0] = 0.0
    b = np.concatenate([[0.0], rng.normal(-1.0, 0.5, len(components) - 1)])
    mean, std = rng.normal(0.0, 1.0, len(names)), rng.uniform(0.5, 3.0, len(names))
    mixture = Mixture(tuple(components), tuple(names), W, b, mean, std, "gate")
    fit = MixtureFit(mixture, 5000, 10, 3750, 1250, "documents", {"lm": -3.0, "constant": -2.9, "gate": -2.8},
                     [1.0 / len(components)] * len(components))  # fmt: skip
    has_knn, has_cache = "knn" in components, "cache" in components
    record = DumpMixture(fit, TAU if has_knn else None, K if has_knn else None, CACHE_TAU if has_cache else None)
    atomic_write_json(path, {"mixture": record.to_dict()})
    return path, mixture


def _knn_by_hand(store, query: np.ndarray, vocab: int) -> tuple[np.ndarray, list[float]]:
    """p_kNN(. | c) [V] (Eq. 2: the k nearest by squared L2 distance, softmax of -distance / τ) and its features: the
    top score, log Σ_i exp(s_i / τ), the top value's share, the empty flag."""
    keys, values = np.asarray(store.keys, dtype=np.float64), np.asarray(store.values)
    s = -((keys - query) ** 2).sum(1)
    top = np.argsort(-s, kind="stable")[:K]
    e = np.exp((s[top] - s[top].max()) / TAU)
    p = np.zeros(vocab)
    np.add.at(p, values[top], e / e.sum())
    lse = s[top].max() / TAU + math.log(e.sum())
    return p, [s[top[0]], lse, p[values[top[0]]], 0.0]


def _cache_by_hand(hidden: np.ndarray, seq: list[int], pos: int, vocab: int) -> tuple[np.ndarray, list[float]]:
    """p_cache(. | c) [V] at position ``pos``: softmax over the earlier positions m < pos of h_pos · h_m / τc, on
    their next tokens (Grave et al. 2017); features: the top score and the empty flag."""
    p = np.zeros(vocab)
    if pos == 0:
        return p, [0.0, 1.0]
    s = hidden[:pos] @ hidden[pos]
    e = np.exp((s - s.max()) / CACHE_TAU)
    np.add.at(p, np.asarray(seq[1 : pos + 1]), e / e.sum())
    return p, [s.max(), 0.0]


def _forward(model, seq: list[int], specs) -> tuple[np.ndarray, dict]:
    with torch.no_grad(), KeyCapture(model, specs) as cap:
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
        keys = {s: cap.keys_by_spec[s][0].double().numpy() for s in specs}
    return torch.softmax(logits, -1).numpy(), keys


def _gate_by_hand(model, seq, positions, doc_start, parts, mixture) -> tuple[np.ndarray, np.ndarray]:
    """For each position of ``seq`` in ``positions`` (predicting ``seq[pos + 1]``): ``P(. | c)`` [V] of the gate in
    NumPy and ``log P(target)``. ``parts`` are the memories by component (a datastore, a Brute of an ∞-gram's
    reference, or None for the cache); the ∞-gram's document is ``seq[doc_start:]``."""
    from memlm.knnlm.evaluate import CACHE_KEY

    cache_spec = CACHE_KEY.normalized(num_layers(model))
    specs = list({p.key_spec: 0 for c, p in parts.items() if c.startswith("knn")}) + [cache_spec]
    p_lm, keys = _forward(model, seq, specs)
    vocab = p_lm.shape[1]
    rows, logp = [], []
    for pos in positions:
        probs = {"lm": p_lm[pos]}
        lp = np.log(p_lm[pos])
        feats = {"lm_entropy": -(p_lm[pos] * lp).sum(), "lm_max_logprob": lp.max()}
        for c, part in parts.items():
            if c.startswith("knn"):
                probs[c], f = _knn_by_hand(part, keys[part.key_spec][pos], vocab)
                feats.update(zip([f"{c}_{x}" for x in KNN_FEATURES], f, strict=True))
            elif c.startswith("ngram"):
                context = seq[doc_start : pos + 1]
                probs[c], _ = _brute_p_inf(part, context, vocab)
                _, count, n, sparse = part.infgram(context, seq[pos + 1])
                feats.update({f"{c}_log_n": math.log1p(n), f"{c}_log_count": math.log1p(count), f"{c}_sparse": sparse})
            else:
                probs[c], f = _cache_by_hand(keys[cache_spec], seq, pos, vocab)
                feats.update({"cache_top_score": f[0], "cache_empty": f[1]})
        z = (np.array([feats[f] for f in mixture.feature_names], dtype=np.float64) - mixture.mean) / mixture.std
        a = mixture.W @ z + mixture.b
        lam = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        p = sum(w * probs[c] for w, c in zip(lam, mixture.components, strict=True))
        rows.append(p)
        logp.append(math.log(p[seq[pos + 1]]))
    return np.asarray(rows), np.asarray(logp)


@pytest.mark.parametrize(
    "components",
    [["lm", "knn", "ngram", "cache"], ["lm", "ngram", "ngram2"], ["lm", "knn", "knn2", "ngram", "ngram2", "cache"]],
    ids=["knn-ngram-cache", "two-ngrams", "two-datastores-two-ngrams-cache"],
)
def test_a_stored_gate_mixes_every_token_as_the_formula_says(tiny_lm, memories, tmp_path, components):
    """MemlmLM(memories=[...], mixture=FIT.json): each rolling token's log P and each loglikelihood request's sum and
    greedy flag are those of the gate transcribed in NumPy; the gate's weights vary by token and matter (W = 0 gives
    other numbers). Fails on the old code (no mixture=, no memories=)."""
    model, tok = tiny_lm
    (ds1, ds2), (ng1, ng2), (b1, b2) = memories
    fit, mixture = _gate_file(tmp_path / "fit.json", components, seed=len(components))
    by_name = {"knn": ds1, "knn2": ds2, "ngram": b1, "ngram2": b2, "cache": None}
    parts = {c: by_name[c] for c in components[1:]}
    listed = {"knn": str(ds1.path), "knn2": ds2, "ngram": str(ng1.path), "ngram2": ng2, "cache": "cache"}  # any form
    lm = MemlmLM(model=model, tokenizer=tok, memories=[listed[c] for c in components[1:]], mixture=str(fit), window=64,
                 min_context=32)  # fmt: skip
    assert lm.components == tuple(components)
    settings = lm.memory_settings
    assert settings["mixture"] == mixture.to_dict()
    assert [m["component"] for m in settings["components"]] == components[1:]
    if "knn" in components:
        assert settings["mixture_fit"]["k"] == K and settings["mixture_fit"]["temperature"] == TAU
        assert {(m["k"], m["temperature"]) for m in settings["components"] if m["kind"] == "knn"} == {(K, TAU)}
        assert f"k={K}&temperature={TAU}" in settings["memories"]
    assert not {"datastore", "lambda", "temperature", "ngram", "ngram_lambda_sparse", "cache_lambda"} & set(settings)
    tokens = _ids(tok, TEXT)
    seq = [lm.prefix_token_id, *tokens]  # rolling: every token after the prefix token, the ∞-gram's document the text
    _, want = _gate_by_hand(model, seq, range(len(tokens)), 1, parts, mixture)
    got = lm.rolling_token_logprobs(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    constant = Mixture(mixture.components, mixture.feature_names, 0 * mixture.W, mixture.b, mixture.mean, mixture.std)
    _, flat = _gate_by_hand(model, seq, range(len(tokens)), 1, parts, constant)
    assert np.abs(flat - want).max() > 1e-2  # W matters: a test of the gate, not of its constant part
    ctx, cont = tokens[:6], tokens[6:12]
    seq = ctx + cont
    rows, want = _gate_by_hand(model, seq, range(len(ctx) - 1, len(seq) - 1), 0, parts, mixture)
    ((ll, greedy),) = lm._loglikelihood_tokens([(("a", "b"), ctx, cont)])
    assert ll == pytest.approx(want.sum(), rel=1e-5)
    assert greedy == all(int(r.argmax()) == t for r, t in zip(rows, cont, strict=True))


def test_a_fit_for_other_memories_is_refused_before_scoring(tiny_lm, memories, tmp_path):
    """A fit of (lm, knn, ngram, cache) given other memories, or the same in another order, or with a λ beside it:
    one MemlmError each, from the constructor (nothing is scored)."""
    model, tok = tiny_lm
    (ds1, _), (ng1, ng2), _ = memories
    fit, _ = _gate_file(tmp_path / "fit.json", ["lm", "knn", "ngram", "cache"], seed=0)
    base = {"model": model, "tokenizer": tok, "mixture": str(fit)}
    with pytest.raises(
        MemlmError, match=r"fitted on components lm, knn, ngram, cache; these memories give lm, ngram, ngram2, cache:"
    ):
        MemlmLM(**base, memories=[ng1.path, ng2.path, "cache"])
    with pytest.raises(MemlmError, match="these memories give lm, knn, ngram:"):
        MemlmLM(**base, memories=[ds1.path, ng1.path])  # no cache
    with pytest.raises(MemlmError, match="these memories give lm, knn, knn2, cache:"):
        # refused before the model loads (there is none at that path)
        MemlmLM(model=str(tmp_path / "no-model"), mixture=str(fit), memories=f"{ds1.path};{ds1.path};cache")
    with pytest.raises(MemlmError, match="instead of lam= give mixture=knn=λ"):
        MemlmLM(**base, memories=[ds1.path, ng1.path, "cache"], lam=0.2)
    with pytest.raises(MemlmError, match=r"instead of k= give memories=knn:DIR\?k=N"):
        MemlmLM(**base, memories=[ds1.path, ng1.path, "cache"], k=16)
    (tmp_path / "bad.json").write_text('{"form": "gate"}')
    with pytest.raises(MemlmError, match="holds no fitted mixture"):
        MemlmLM(**{**base, "mixture": str(tmp_path / "bad.json")}, memories=[ds1.path])
    ok = MemlmLM(**base, memories=[ds1.path, ng1.path, "cache"])  # the memories it was made for
    assert ok.components == ("lm", "knn", "ngram", "cache")


def test_a_spec_string_and_a_list_of_components_are_one_rule(tiny_lm, memories):
    """memories as one spec string with weights as a string, or as components with ``fixed_mixture``: the same
    fixed-weight rule, by hand (1 - λ - Σ_r λ_r(c)) p_LM + λ p_kNN + Σ_r λ_r(c) P∞_r, λ_r(c) = λ_sparse,r where
    reference r is sparse, else λ_dense,r (weights that sum past 1 shared as memlm eval shares them)."""
    from memlm.mixing.datastore import DatastoreComponent
    from memlm.mixing.weights import fixed_mixture
    from memlm.ngram.memory import NgramMemory
    from memlm.ngram.step import NgramComponent
    from memlm.retrieval import DatastoreMemory

    model, tok = tiny_lm
    (ds1, _), (ng1, ng2), (b1, b2) = memories
    spec = f"knn:{ds1.path}?k={K}&temperature={TAU};ngram:{ng1.path};{ng2.path}"
    listed = MemlmLM(model=model, tokenizer=tok, memories=spec, mixture="knn=0.5;ngram=0.9/0.1;ngram2=0.6/0.1",
                     window=64, min_context=32)  # fmt: skip
    components = [DatastoreComponent(DatastoreMemory(ds1), K, TAU), NgramComponent(NgramMemory(ng1)),
                  NgramComponent(NgramMemory(ng2))]  # fmt: skip
    weights = fixed_mixture(components, {"knn": 0.5, "ngram": (0.9, 0.1), "ngram2": (0.6, 0.1)})
    objects = MemlmLM(model=model, tokenizer=tok, memories=components, mixture=weights, window=64, min_context=32)
    assert listed.components == ("lm", "knn", "ngram", "ngram2") and listed.mixture.form == "rule"
    tokens = _ids(tok, TEXT)
    got = listed.rolling_token_logprobs(tokens)
    np.testing.assert_array_equal(got, objects.rolling_token_logprobs(tokens))
    assert listed.memory_settings["memories"] == objects.memory_settings["memories"]
    scale = (1 - 0.5) * 0.9 / (0.9 + 0.6)  # λ + Σ_r max_r = 2.0 > 1: the pairs scaled by (1 - λ) W / S
    pairs = [(0.9 * scale, 0.1 * scale), (0.6 * scale, 0.1 * scale)]
    seq = [listed.prefix_token_id, *tokens]
    p_lm, keys = _forward(model, seq, [ds1.key_spec])
    want = []
    for t in range(len(tokens)):
        p_knn, _ = _knn_by_hand(ds1, keys[ds1.key_spec][t], p_lm.shape[1])
        refs = [_brute_p_inf(b, tokens[:t], p_lm.shape[1]) for b in (b1, b2)]
        lam_r = [pr[0] if sparse else pr[1] for (_, sparse), pr in zip(refs, pairs, strict=True)]
        p = (1 - 0.5 - sum(lam_r)) * p_lm[t] + 0.5 * p_knn + sum(w * r[0] for w, r in zip(lam_r, refs, strict=True))
        want.append(math.log(p[tokens[t]]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert listed.memory_settings["mixture"] == objects.memory_settings["mixture"]
    # generation mixes the same shared weights: greedy decoding picks the argmax of the mixture by hand at each step
    from lm_eval.api.instance import Instance
    from test_ngram_multi import _greedy_by_hand

    prompt = "the old river"
    (text,) = listed.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 4}), 0)])
    want = _greedy_by_hand(model, _ids(tok, prompt), 4, [b1, b2], pairs, lam=0.5, ds=ds1, k=K, tau=TAU)
    assert text == tok.decode(want)


def test_two_datastores_each_at_its_own_weight(tiny_lm, memories):
    """Two datastores with weights knn=a;knn2=b: (1 - a - b) p_LM + a p_kNN,1 + b p_kNN,2 by hand; weights that sum
    past 1 are refused; generate_until follows the same mixture's argmax."""
    from lm_eval.api.instance import Instance

    model, tok = tiny_lm
    (ds1, ds2), _, _ = memories
    # lm_eval's --model_args form: memories=knn:DS1?...;knn:DS2?...,mixture=knn=0.3;knn2=0.2
    from lm_eval.utils import simple_parse_args_string

    knn = f"k={K}&temperature={TAU}"
    model_args = f"memories=knn:{ds1.path}?{knn};{ds2.path}?{knn},mixture=knn=0.3;knn2=0.2,window=64"
    args = simple_parse_args_string(model_args)
    lm = MemlmLM(model=model, tokenizer=tok, **args, min_context=32)
    assert lm.components == ("lm", "knn", "knn2")
    assert [c["k"] for c in lm.memory_settings["components"]] == [K, K]
    tokens = _ids(tok, TEXT)
    seq = [lm.prefix_token_id, *tokens]
    p_lm, keys = _forward(model, seq, list({ds1.key_spec: 0, ds2.key_spec: 0}))
    want = []
    for t in range(len(tokens)):
        p1, _ = _knn_by_hand(ds1, keys[ds1.key_spec][t], p_lm.shape[1])
        p2, _ = _knn_by_hand(ds2, keys[ds2.key_spec][t], p_lm.shape[1])
        want.append(math.log((0.5 * p_lm[t] + 0.3 * p1 + 0.2 * p2)[tokens[t]]))
    np.testing.assert_allclose(lm.rolling_token_logprobs(tokens), want, rtol=1e-5)
    with pytest.raises(MemlmError, match="the LM's weight would be <= 0"):
        MemlmLM(model=model, tokenizer=tok, memories=[ds1.path, ds2.path], mixture="knn=0.6;knn2=0.6")
    with pytest.raises(MemlmError, match="weights given for knn3, which are not memories of this mixture"):
        MemlmLM(model=model, tokenizer=tok, memories=[ds1.path, ds2.path], mixture="knn=0.1;knn2=0.1;knn3=0.1")

    # generation mixes both datastores too: each step's greedy token is the argmax of the same mixture by hand
    def greedy(prompt: str, steps: int = 3) -> tuple[list[int], list[int]]:
        seq, picked, without_ds2 = _ids(tok, prompt), [], []
        for _ in range(steps):
            p_lm, keys = _forward(model, seq, list({ds1.key_spec: 0, ds2.key_spec: 0}))
            p1, _ = _knn_by_hand(ds1, keys[ds1.key_spec][-1], p_lm.shape[1])
            p2, _ = _knn_by_hand(ds2, keys[ds2.key_spec][-1], p_lm.shape[1])
            picked.append(int(np.argmax(0.5 * p_lm[-1] + 0.3 * p1 + 0.2 * p2)))
            without_ds2.append(int(np.argmax(0.7 * p_lm[-1] + 0.3 * p1)))
            seq.append(picked[-1])
        return picked, without_ds2

    # a prompt where the second datastore changes what is generated, so that leaving it out is seen
    words = TEXT.split()
    prompts = [" ".join(words[i : i + 3]) for i in range(0, len(words) - 3, 2)]
    prompt, picked = next((p, g) for p in prompts for g, w in [greedy(p)] if g != w)
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 3}), 0)])
    eos = tok.decode([lm.eot_token_id])
    want = tok.decode(picked, skip_special_tokens=True)
    assert text == (want.split(eos)[0] if eos else want)


def test_cli_lm_eval_with_a_fit_records_the_mixture_and_refuses_other_memories(
    tiny_lm, tiny_lm_dir, memories, tmp_path, capsys, monkeypatch
):
    """`memlm lm-eval --mixture FIT.json`: the word perplexity is MemlmLM's with that fit (checked by hand above), the
    result JSON records the mixture (Mixture.to_dict) and how it was fitted; a fit for other memories exits 2 with
    the error and writes nothing."""
    import re

    from lm_eval.api.instance import Instance
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from memlm.cli import main
    from memlm.data.corpora import load_documents

    model, tok = tiny_lm
    (ds1, _), (ng1, _), _ = memories
    fit, mixture = _gate_file(tmp_path / "fit.json", ["lm", "knn", "ngram", "cache"], seed=3)
    out = tmp_path / "r.json"
    base = ["lm-eval", "--model", str(tiny_lm_dir), "--tasks", "memlm_wikitext2", "--window", "256", "--min-context",
            "64", "--samples", '{"memlm_wikitext2": [14]}', "--mixture", str(fit), "--out", str(out)]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main([*base, "--memory", f"{ng1.path};cache"]) == 2
    assert "fitted on components lm, knn, ngram, cache; these memories give lm, ngram, cache" in capsys.readouterr().err
    assert not out.exists()
    assert main([*base, "--memory", str(ds1.path), "--memory", f"ngram:{ng1.path};cache"]) == 0
    record = json.loads(out.read_text())["memlm"]
    assert record["mixture"] == mixture.to_dict() and record["mixture_fit"]["form"] == "gate"
    by_name = {m["component"]: m for m in record["components"]}
    assert by_name["knn"]["k"] == K and by_name["knn"]["temperature"] == TAU
    assert by_name["cache"]["temperature"] == CACHE_TAU
    assert record["memories"].endswith(f"cache?k=256&temperature={CACHE_TAU}&max_len=2048")
    lm = MemlmLM(model=model, tokenizer=tok, memories=[ds1.path, ng1.path, "cache"], mixture=str(fit), window=256,
                 min_context=64)  # fmt: skip
    page = load_documents("wikitext2", "test")[14].text
    (ll,) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (wikitext_detokenizer({"page": page}),), 0)]
    )
    got = json.loads(out.read_text())["results"]["memlm_wikitext2"]["word_perplexity,none"]
    assert got == pytest.approx(math.exp(-ll / len(re.split(r"\s+", page))), rel=1e-6)
    # two --datastore: two memories at the rule's weights, both checked for leakage
    (_, ds2), _, _ = memories
    two = [*base[: base.index("--mixture")], "--out", str(out), "--memory", f"{ds1.path}?k=8", "--memory",
           f"{ds2.path}?k=8", "--lambda", "0.1"]  # fmt: skip
    assert main(two) == 0
    record = json.loads(out.read_text())
    assert [m["component"] for m in record["memlm"]["components"]] == ["knn", "knn2"]
    assert record["memlm"]["mixture"]["components"] == ["lm", "knn", "knn2"] and record["memlm"]["mixture_fit"] is None
    assert record["leakage"]["memlm_wikitext2"]["memories"] == [f"datastore {ds1.path}", f"datastore {ds2.path}"]


FIXED = {"knn": 0.3, "cache": 0.2}  # the fixed-weight case: λ, λc of the rule


@pytest.mark.parametrize("components",
                         [["lm", "knn", "ngram"], ["lm", "knn", "ngram", "cache"], ["lm", "knn", "cache"]],
                         ids=["datastore-ngram", "with-cache", "fixed-weights-with-cache"])  # fmt: skip
def test_one_mixture_gives_the_same_log_p_in_scoring_generation_wrap_and_lm_eval(tiny_lm, memories, tmp_path,
                                                                                   components):  # fmt: skip
    """The same mixture over the same memories, on one text over several sliding windows: memlm eval's scores
    (its dump of the datastore, ∞-gram and cache, mixed by DumpMixture.logprob), lm-eval's rolling log P of every token,
    and, over the first window (the same context for all), a generation step's distribution at each token and
    ``memlm.wrap``'s forward (no cache in generation: the fit without it). One mixture, the same features everywhere.

    The fixed-weight case checks the rolling log P against the rule computed by hand from the dump's columns
    (Khandelwal et al. 2020, Eq. 2; Grave et al. 2017's cache as a third term):
    p = (1 - λ - λc) p_LM + λ p_kNN(τ) + λc p_cache(τc = 1)."""
    from conftest import Doc

    import memlm
    from memlm.core.distribution import mix
    from memlm.knnlm.cache import CacheComponent
    from memlm.knnlm.generate import MixtureLogitsProcessor
    from memlm.knnlm.scoring import score_tokens
    from memlm.mixing.inputs import memory_logprob
    from memlm.ngram.memory import NgramMemory

    model, tok = tiny_lm
    (ds1, _), (ng1, _), _ = memories
    fixed = "ngram" not in components
    if fixed:
        fit = ";".join(f"{name}={w}" for name, w in FIXED.items())
        spec = f"knn:{ds1.path}?k={K}&temperature={TAU};cache"
    else:
        fit, _ = _gate_file(tmp_path / "fit.json", components, seed=7)
        spec = f"knn:{ds1.path};ngram:{ng1.path}" + (";cache" if "cache" in components else "")
    text = " ".join(d.text for d in make_toy_docs(6, seed=5))
    window, min_context = 40, 12
    lm = MemlmLM(model=model, tokenizer=tok, memories=spec, mixture=str(fit), window=window, min_context=min_context,
                 batch_size=3, prefix_token_id=tok.eos_token_id)  # fmt: skip
    tokens = _ids(tok, text)
    assert len(tokens) > 3 * window  # several windows
    got = lm.rolling_token_logprobs(tokens)
    # memlm eval on the stream [EOS] + text + [EOS]: an empty document, then the text
    docs = [Doc("empty", ""), Doc("text", text)]
    memories = [ds1, *([] if fixed else [NgramMemory(ng1)]), *([CacheComponent()] if "cache" in components else [])]
    ts = score_tokens(model, tok, docs, memories, k=K, window=window, min_context=min_context, progress=False)
    if fixed:
        knn, cache = (ts.columns[n] for n in ("knn", "cache"))
        parts = [torch.from_numpy(ts.lm_logprob), memory_logprob(knn["scores"], knn["values"], ts.targets, TAU),
                 memory_logprob(cache["scores"], cache["values"], ts.targets, 1.0)]  # fmt: skip
        weights = [1 - FIXED["knn"] - FIXED["cache"], FIXED["knn"], FIXED["cache"]]
        scored = mix(parts, weights=weights).double().numpy()
    else:
        scored = DumpMixture.from_dict(json.loads(fit.read_text())).logprob(ts).numpy()
    assert len(scored) == len(tokens) + 1  # the text's tokens, then the final EOS
    np.testing.assert_allclose(got, scored[: len(tokens)], rtol=1e-5)
    if "cache" in components:
        return
    first = window - 1  # tokens of the first window: each read from the start of the text, as a step reads it
    seq = torch.tensor([[tok.eos_token_id, *tokens[:first]]])
    wrapped = memlm.wrap(model, spec, str(fit))(input_ids=seq).logits[0]
    wrap_logp = wrapped[torch.arange(first), torch.tensor(tokens[:first])].double().numpy()
    np.testing.assert_allclose(wrap_logp, scored[:first], rtol=1e-4)
    with torch.no_grad(), MixtureLogitsProcessor(model, spec, str(fit)) as proc:
        for t in (0, 5, first - 1):
            ids = seq[:, : t + 1]
            step = proc(ids, model(input_ids=ids).logits[:, -1])[0]
            assert float(step[tokens[t]]) == pytest.approx(scored[t], rel=1e-4)
