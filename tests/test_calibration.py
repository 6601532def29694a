"""Self-calibrating datastores: the held-out slice, the one mixture fitted on it, and its use by eval / generate /
lm-eval."""

import json

import numpy as np
import pytest
from conftest import Doc, gpt2_tokenizer, make_toy_docs
from test_reliability import memlm

from memlm.core.config import RetrievalConfig
from memlm.data.windows import doc_hash
from memlm.knnlm.calibration import holdout_split, knn_parameters


def test_holdout_split_is_deterministic_disjoint_and_sized():
    tok = gpt2_tokenizer()
    docs = make_toy_docs(200, seed=5)
    kept, held, info = holdout_split(docs, tok, fraction=0.05, min_tokens=100)
    assert {d.id for d in kept}.isdisjoint({d.id for d in held}) and len(kept) + len(held) == len(docs)
    assert [d.id for d in kept] == [d.id for d in docs if d.id not in {h.id for h in held}]  # corpus order kept
    n = [len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in docs]
    total, taken = sum(n), sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in held)
    assert info["text_tokens"] == taken and info["corpus_tokens"] == total
    assert info["tokens"] == taken + len(held) - 1  # scored as calibration scores them: EOS after each, less the first
    assert info["tokens"] >= 0.05 * total and taken <= 0.2 * total  # at least the fraction, never over the cap
    assert info["tails"] == []  # enough whole documents: none is cut
    # the same documents in another order give the same slice (it depends on ids and texts, not positions)
    _, held2, info2 = holdout_split(list(reversed(docs)), tok, fraction=0.05, min_tokens=100)
    assert {d.id for d in held2} == {d.id for d in held} and info2["ids_sha256"] == info["ids_sha256"]
    # min_tokens dominates a small fraction
    _, held3, info3 = holdout_split(docs, tok, fraction=0.001, min_tokens=300)
    assert info3["tokens"] >= 300 and len(held3) < len(held) + 50


def test_holdout_slice_is_capped_at_a_few_thousand_tokens():
    """A large share of a large corpus holds out HOLDOUT_MAX_TOKENS (8,192), not the share: calibration's LM pass
    costs the same whatever the corpus's size; a min_tokens over the cap still wins."""
    from memlm.knnlm.calibration import HOLDOUT_MAX_TOKENS

    tok = gpt2_tokenizer()
    docs = make_toy_docs(3000, seed=7)  # ~100k tokens: a 50% share would be ~50k, the 20% share cap ~20k
    _, held, info = holdout_split(docs, tok, fraction=0.5, min_tokens=100)
    assert info["corpus_tokens"] * 0.2 > 2 * HOLDOUT_MAX_TOKENS
    # whole documents until the goal: at most one document (<= 60 words here) of text over it
    assert info["tokens"] >= HOLDOUT_MAX_TOKENS and info["text_tokens"] <= HOLDOUT_MAX_TOKENS + 100
    assert "short_of_minimum" not in info
    _, _, bigger = holdout_split(docs, tok, fraction=0.5, min_tokens=12_000)
    assert bigger["tokens"] >= 12_000 and bigger["text_tokens"] <= 12_100


def _ntok(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_holdout_split_edge_cases():
    tok = gpt2_tokenizer()
    docs = make_toy_docs(10, seed=1)
    assert holdout_split(docs, tok, fraction=0.0)[1] == []
    # two documents, a goal far over the cap: the slice stops at 20% of the corpus and the datastore keeps the rest
    kept, held, info = holdout_split(docs[:2], tok, fraction=0.5, min_tokens=10_000)
    total = sum(_ntok(tok, d.text) for d in docs[:2])
    assert 0 < info["text_tokens"] <= 0.2 * total and "short_of_minimum" in info
    assert sum(_ntok(tok, d.text) for d in kept) >= 0.8 * total - 2


def _one_file(n_docs: int = 60) -> str:
    """One long text in paragraphs, like a .txt file of speeches."""
    return "\n\n".join(d.text[:1].upper() + d.text[1:] + "." for d in make_toy_docs(n_docs, seed=3))


def test_one_document_holds_out_its_tail_at_a_paragraph():
    """A one-document corpus (a .txt file) is calibrated too: its tail is held out (nothing was, before)."""
    tok = gpt2_tokenizer()
    text = _one_file()
    doc = Doc("speeches.txt", text)
    total = _ntok(tok, text)
    kept, held, info = holdout_split([doc], tok, fraction=0.05, min_tokens=200)
    assert len(kept) == 1 and len(held) == 1 and info["whole_documents"] == 0
    head, tail = kept[0].text, held[0].text
    assert kept[0].id == "speeches.txt" and held[0].id == "speeches.txt#tail"
    assert text.startswith(head) and text.endswith(tail) and len(head) + len(tail) <= len(text)
    assert text[len(head) : len(text) - len(tail)].strip() == ""  # nothing lost between head and tail
    cut = info["tails"][0]
    assert cut["boundary"] == "paragraph" and text[: cut["from_char"]].endswith("\n\n")
    assert info["tokens"] == _ntok(tok, tail) >= max(0.05 * total, 200)  # the goal is met ...
    assert _ntok(tok, tail) <= 0.2 * total  # ... under the cap
    # deterministic (a resumed build holds out the same tail), and the cut is part of the slice's identity
    assert holdout_split([doc], tok, fraction=0.05, min_tokens=200)[2]["ids_sha256"] == info["ids_sha256"]
    other = holdout_split([doc], tok, fraction=0.15, min_tokens=200)[2]
    assert other["tails"][0]["from_char"] < cut["from_char"] and other["ids_sha256"] != info["ids_sha256"]


def test_few_long_documents_top_up_with_the_longest_tail():
    """Whole documents first; when they fall short of the goal (every one is over the cap), the longest's tail."""
    tok = gpt2_tokenizer()
    big, small = Doc("big", _one_file(60)), Doc("small", _one_file(20))
    kept, held, info = holdout_split([small, big], tok, fraction=0.1, min_tokens=50)
    assert [d.id for d in held] == ["big#tail"] and [d.id for d in kept] == ["small", "big"]
    assert kept[0].text == small.text and big.text.startswith(kept[1].text)
    assert info["tokens"] >= 0.1 * (_ntok(tok, big.text) + _ntok(tok, small.text))


class _Fake:
    def __init__(self, manifest, n, path="ds"):
        self.manifest, self._n, self.path = manifest, n, path

    def __len__(self):
        return self._n


def _fit_record(weight: float = 0.1, temperature: float = 3.0) -> dict:
    """A stored fit of the LM and a datastore: constant weights, ``weight`` the datastore's, at τ ``temperature``."""
    from memlm.core.mixture import Mixture, MixtureFit
    from memlm.mixing.dump import DumpMixture

    mixture = Mixture.constant(("lm", "knn"), [1 - weight, weight])
    fit = MixtureFit(mixture, 500, 8, 400, 100, "documents", {"constant": -1.0}, [1 - weight, weight])
    return DumpMixture(fit, temperature, 8, rule_weights={"knn": weight}).to_dict()


def test_knn_parameters_precedence(capsys):
    cal = {"k": 8, "tokens": 500, "count": 10, "base_ppl": 9.0, "mixture_ppl": 8.0, "mixture": _fit_record()}
    ds = _Fake({"calibration": cal}, 10)
    assert knn_parameters(ds)[:2] == (0.1, 3.0)  # the stored fit's mean weight and its τ
    assert "mixture fitted at calibration on 500 held-out tokens" in capsys.readouterr().err
    assert knn_parameters(ds, lam=0.5)[:2] == (0.5, 3.0)  # a given value wins, the other comes from the calibration
    assert knn_parameters(ds, 0.5, 2.0)[:2] == (0.5, 2.0)
    assert knn_parameters(_Fake({}, 10))[:2] == (0.25, 1.0)  # no calibration: the fallback, said so
    assert "fallback" in capsys.readouterr().err
    assert knn_parameters(_Fake({"calibration": cal}, 11))[:2] == (0.25, 1.0)  # stale (another entry count)


def test_a_calibration_of_an_older_memlm_is_refused_with_the_fix():
    """A record with the grid's λ, τ beside the fit (or a fit without its rule summary): one error, recalibrate."""
    from memlm.errors import MemlmError
    from memlm.knnlm.calibration import stored_mixture

    new = {"k": 8, "tokens": 500, "count": 10, "base_ppl": 9.0, "mixture_ppl": 8.0, "mixture": _fit_record()}
    bare = {k: v for k, v in new["mixture"].items() if k != "rule_weights"}
    for old in ({**new, "lambda": 0.1, "temperature": 3.0}, {**new, "mixture": bare}):
        ds = _Fake({"calibration": old}, 10)
        ds.key_spec = "ffn_in"
        for read in (knn_parameters, stored_mixture):
            with pytest.raises(MemlmError, match=r"ds/manifest.json: its calibration was written by an older memlm.*"
                               r"recalibrate it: rerun the `memlm datastore build`"):  # fmt: skip
                read(ds)


def test_datastore_weights_leave_the_lm_and_the_cache_a_weight(capsys):
    """One datastore whose calibrated weight leaves the cache too little: lowered to 1 - λc and said so (a given λ is
    kept); several whose weights and the cache's reach 1: one error."""
    from memlm.errors import MemlmError
    from memlm.knnlm.calibration import datastore_weights

    cal = {"k": 8, "tokens": 500, "count": 10, "base_ppl": 9.0, "mixture_ppl": 8.0, "mixture": _fit_record(0.9)}
    ds = _Fake({"calibration": cal}, 10)
    assert datastore_weights([ds], cache_lambda=0.2)[0][:2] == (pytest.approx(0.8), 3.0)
    assert "λ lowered to 0.8 so that λ + --cache-lambda <= 1" in capsys.readouterr().err
    assert datastore_weights([ds], lam=0.9, cache_lambda=0.2)[0][0] == 0.9
    assert datastore_weights([ds])[0][:2] == (0.9, 3.0)
    with pytest.raises(MemlmError, match=r"the datastores' λ's \(0.9, 0.9\) and the cache's sum to 1.8"):
        datastore_weights([ds, ds])


def _rule(cal: dict) -> tuple[float, float]:
    """The fixed-weight rule's (λ, τ) of a calibration: its stored fit's mean weight and τ."""
    return cal["mixture"]["rule_weights"]["knn"], cal["mixture"]["temperature"]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm_dir):
    root = tmp_path_factory.mktemp("cal")
    docs = make_toy_docs(80, seed=7)
    (root / "train.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    (root / "test").mkdir()
    for d in make_toy_docs(4, seed=70):  # text outside the datastore (eval refuses what it holds: memlm.leakage)
        (root / "test" / f"{d.id}.txt").write_text(d.text)
    ds = root / "ds"
    args = ["--model", str(tiny_lm_dir), "--corpus", str(root / "train.jsonl"), "--out", str(ds)]
    r = memlm("datastore", "build", *args, "--window", "32", "--min-context", "8", "--holdout", "0.1",
              "--calibration-k", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return root, ds, docs, r


def test_build_holds_out_and_calibrates(built):
    root, ds, docs, r = built
    manifest = json.loads((ds / "manifest.json").read_text())
    holdout, cal = manifest["sources"][0]["holdout"], manifest["calibration"]
    assert holdout["documents"] > 0 and holdout["tokens"] >= 0.1 * holdout["corpus_tokens"]
    assert f"calibrated: held-out ppl {cal['base_ppl']:.3f} -> {cal['mixture_ppl']:.3f} (k=16" in r.stderr
    assert not {"lambda", "temperature", "grid"} & set(cal)  # one stored weight: the fit
    assert cal["count"] == manifest["count"] and cal["k"] == 16 and cal["tokens"] > 0
    # the held-out documents are not in the datastore; every other document is
    from memlm.storage.datastore import Datastore

    stored = set(np.unique(np.asarray(Datastore.open(ds).doc_hash)).tolist())
    tok = gpt2_tokenizer()
    _, held, _ = holdout_split(docs, tok, fraction=0.1)
    assert {d.id for d in held} and not stored & {doc_hash(d.id, d.text) for d in held}
    assert stored == {doc_hash(d.id, d.text) for d in docs if d.id not in {h.id for h in held}}
    # rerunning the build changes nothing and does not recalibrate
    model_dir = r.args[r.args.index("--model") + 1]
    r2 = memlm("datastore", "build", "--model", model_dir, "--corpus", str(root / "train.jsonl"), "--out", str(ds),
               "--window", "32", "--min-context", "8", "--holdout", "0.1", "--calibration-k", "16")  # fmt: skip
    assert r2.returncode == 0, r2.stderr
    assert "calibration already recorded" in r2.stderr


def test_eval_without_flags_uses_the_calibration(built, tmp_path):
    root, ds, _, _ = built
    cal = json.loads((ds / "manifest.json").read_text())["calibration"]
    common = ["eval", "--corpus", str(root / "test"), "--memory", str(ds), "--k", "16", "--window", "32",
              "--min-context", "8"]  # fmt: skip
    r = memlm(*common, "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    lam, tau = _rule(cal)
    assert f"kNN-LM parameters: λ={lam:g}, τ={tau:g}: the mean weights of the" in r.stderr
    res = json.loads((tmp_path / "a.json").read_text())
    assert (res["lambda"], res["temperature"]) == (lam, tau)
    assert "held-out" in res["parameters_from"]
    # flags override the calibration
    r = memlm(*common, "--lambda", "0.6", "--temperature", "7", "--json", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())
    assert (res["lambda"], res["temperature"]) == (0.6, 7.0) and res["parameters_from"] == "given"


def test_eval_mixture_stored_applies_the_build_time_fit(built, tmp_path):
    """memlm eval --mixture stored scores the datastore's own fit: mixture_ppl is the stored DumpMixture's log P on
    the eval's dump; with two memories, or a memory without a fit, one clear error."""
    from memlm.core.distribution import perplexity
    from memlm.knnlm.calibration import stored_mixture
    from memlm.knnlm.table import TokenTable
    from memlm.storage.datastore import Datastore

    root, ds, _, _ = built
    common = ["eval", "--corpus", str(root / "test"), "--memory", str(ds), "--k", "16", "--window", "32",
              "--min-context", "8"]  # fmt: skip
    r = memlm(*common, "--mixture", "stored", "--dump", str(tmp_path / "d.npz"), "--json", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "m.json").read_text())
    fit = stored_mixture(Datastore.open(ds))
    want = perplexity(fit.logprob(TokenTable.load(tmp_path / "d.npz")))
    assert res["mixture_ppl"] == pytest.approx(want, rel=1e-9)
    assert res["mixture"]["from"] == "the memory's build-time calibration"
    r = memlm(*common, "--memory", "cache", "--mixture", "stored")
    assert r.returncode != 0 and "give exactly one datastore or one ∞-gram index (--memory)" in r.stderr


def test_eval_defaults_to_the_stored_fit_and_flags_give_the_fixed_weights(built, tmp_path):
    """No weight flags: eval applies the datastore's stored mixture, the same mixture_ppl as --mixture stored, and
    says so in one line; --lambda/--temperature: the fixed weights only (no mixture_ppl), the rule's formula."""
    from memlm.knnlm.table import TokenTable

    root, ds, _, _ = built
    common = ["eval", "--corpus", str(root / "test"), "--memory", str(ds), "--k", "16", "--window", "32",
              "--min-context", "8"]  # fmt: skip
    r = memlm(*common, "--dump", str(tmp_path / "d.npz"), "--json", str(tmp_path / "default.json"))
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("mixture: ")]
    assert len(line) == 1 and f"stored with {ds}'s calibration" in line[0], r.stderr
    r = memlm(*common, "--mixture", "stored", "--json", str(tmp_path / "stored.json"))
    assert r.returncode == 0, r.stderr
    default, stored = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("default", "stored"))
    assert default["mixture_ppl"] == stored["mixture_ppl"] and default["mixture_form"] == stored["mixture_form"]
    assert default["mixture"]["fit"] == stored["mixture"]["fit"]
    assert default["intervals"]["mixture_ppl"] == stored["intervals"]["mixture_ppl"]
    assert default["knn_ppl"] == stored["knn_ppl"]  # the calibrated rule's row beside it, unchanged
    r = memlm(*common, "--lambda", "0.3", "--temperature", "2", "--json", str(tmp_path / "fixed.json"))
    assert r.returncode == 0, r.stderr
    fixed = json.loads((tmp_path / "fixed.json").read_text())
    assert "mixture_ppl" not in fixed and "mixture" not in fixed and "mixture: " not in r.stderr
    ts = TokenTable.load(tmp_path / "d.npz")
    s = ts.columns["knn"]["scores"][:, :16].astype(np.float64) / 2
    p_knn = np.zeros(len(ts))
    for i in range(len(ts)):
        w = np.exp(s[i] - s[i].max())
        p_knn[i] = w[ts.columns["knn"]["values"][i, :16] == ts.targets[i]].sum() / w.sum()
    want = np.exp(-np.log(0.7 * np.exp(ts.lm_logprob.astype(np.float64)) + 0.3 * p_knn).mean())
    assert fixed["knn_ppl"] == pytest.approx(want, rel=1e-5)


def test_eval_with_two_calibrated_memories_takes_the_guarded_choice(built, tiny_lm_dir, tmp_path):
    """A datastore and an ∞-gram index, each calibrated at build: eval with no weight flags scores the calibration
    slices with both, and applies the combination only if it beats each memory's own fit there, else the best one
    alone (what it chose is the best on the slices); the mixture_ppl is that candidate's on the eval's dump."""
    pytest.importorskip("infini_gram")
    from memlm.core.distribution import perplexity
    from memlm.knnlm.calibration import stored_mixture
    from memlm.knnlm.default_mixture import combine
    from memlm.knnlm.table import TokenTable
    from memlm.ngram.index import NgramIndex
    from memlm.storage.datastore import Datastore

    root, ds, _, _ = built
    ix = tmp_path / "ix"
    r = memlm("ngram", "build", "--model", str(tiny_lm_dir), "--corpus", str(root / "train.jsonl"), "--out", str(ix),
              "--window", "32", "--stride", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((ix / "manifest.json").read_text())["calibration"]["slice"]  # the slice's text is kept
    common = ["eval", "--corpus", str(root / "test"), "--memory", str(ds), "--memory", str(ix), "--k", "16",
              "--window", "32", "--min-context", "8", "--allow-overlap"]  # fmt: skip
    r = memlm(*common, "--dump", str(tmp_path / "d.npz"), "--json", str(tmp_path / "two.json"))
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("mixture: ")]
    assert len(line) == 1 and "checked on the calibration slices" in line[0], r.stderr
    res = json.loads((tmp_path / "two.json").read_text())
    ll = res["mixture"]["fit"]["heldout_loglik"]
    assert set(ll) == {"combined", "knn", "ngram"}
    best = max(("knn", "ngram"), key=lambda n: ll[n])
    combined = "the memories' stored fits combined" in line[0]
    assert combined or f"{best}'s stored fit alone" in line[0]
    assert not combined or ll["combined"] > ll[best]  # chosen only when it beats the best alone (by 2 SE)
    chosen = "combined" if combined else best
    fits = [stored_mixture(Datastore.open(ds)), stored_mixture(NgramIndex.open(ix))]
    keep = None if chosen == "combined" else [chosen == "knn", chosen == "ngram"]
    want = combine(fits, ["knn", "ngram"], keep)
    assert res["mixture"]["fit"]["mixture"] == want.fit.mixture.to_dict()
    ts = TokenTable.load(tmp_path / "d.npz")
    assert res["mixture_ppl"] == pytest.approx(perplexity(want.logprob(ts)), rel=1e-9)
    # one memory's fit in the space of both gives exactly that memory's stored mixture
    alone = combine(fits, ["knn", "ngram"], [True, False])
    np.testing.assert_allclose(alone.logprob(ts).numpy(), _alone(fits[0], ts), rtol=1e-9, atol=1e-12)


def _alone(fit, ts) -> np.ndarray:
    """The stored one-memory fit on a dump of more memories: its own components and features only."""
    from memlm.mixing.inputs import mixture_inputs

    inp = mixture_inputs(ts, fit.temperature or 1.0, fit.k)
    cols = [inp.components.index(c) for c in fit.mixture.components]
    feats = [inp.feature_names.index(f) for f in fit.mixture.feature_names]
    return fit.mixture.logprob(inp.logprobs[:, cols], inp.features[:, feats]).numpy()


def test_python_consumers_default_to_the_stored_fit(built, tiny_lm, capsys):
    """generate_text, MixtureLogitsProcessor, wrap and MemlmLM with one calibrated datastore and no mixture mix by
    its stored fit (the same text as mixture= that fit) and say so; given weights they mix by the fixed-weight rule."""
    from memlm.knnlm.calibration import stored_mixture
    from memlm.knnlm.generate import MixtureLogitsProcessor, generate_text
    from memlm.knnlm.wrap import wrap
    from memlm.storage.datastore import Datastore

    model, tok = tiny_lm
    _, ds, _, _ = built
    fit = stored_mixture(Datastore.open(ds))
    capsys.readouterr()
    memory = f"{ds}?k=16"
    proc = MixtureLogitsProcessor(model, [memory])
    assert proc.fit.to_dict() == fit.to_dict() and proc.mixture.mixture.to_dict() == fit.mixture.to_dict()
    assert f"stored with {ds}'s calibration" in capsys.readouterr().err
    assert wrap(model, memory).fit.to_dict() == fit.to_dict()
    assert wrap(model, memory, "stored").fit.to_dict() == fit.to_dict()
    assert wrap(model, f"{memory}&temperature=2", "knn=0.3").fit is None
    assert MixtureLogitsProcessor(model, [memory], "knn=0.3").fit is None
    kw = {"max_new_tokens": 6}
    by_default = generate_text(model, tok, ["the history of"], memory, **kw)
    assert by_default == generate_text(model, tok, ["the history of"], memory, mixture=fit, **kw)
    pytest.importorskip("lm_eval")
    from memlm.lmeval.model import MemlmLM

    lm = MemlmLM(model, tok, str(ds), window=32, min_context=8)
    assert lm.fit is not None and lm.fit.to_dict() == fit.to_dict() and lm.mixture.to_dict() == fit.mixture.to_dict()
    assert MemlmLM(model, tok, str(ds), "knn=0.3", window=32, min_context=8).fit is None


def test_sharded_build_is_calibrated_too(tmp_path, tiny_lm_dir):
    """`--shards N` holds out the same slice, calibrates on the merged shards and records it in shards.json."""
    docs = make_toy_docs(60, seed=11)
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    out = tmp_path / "sharded"
    args = ["--model", str(tiny_lm_dir), "--corpus", str(corpus), "--out", str(out), "--window", "32"]
    r = memlm("datastore", "build", *args, "--min-context", "8", "--shards", "2", "--holdout", "0.1",
              "--calibration-k", "8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    from memlm.storage.sharded import open_datastore

    ds = open_datastore(out)
    cal = ds.manifest["calibration"]
    assert cal["count"] == len(ds) and cal["k"] == 8
    assert json.loads((out / "shards.json").read_text())["calibration"] == cal
    assert knn_parameters(ds, announce=False)[:2] == _rule(cal)


def test_rerun_with_another_holdout_is_refused(built, tmp_path):
    """The held-out slice is part of the settings a rerun compares. It was ignored: a rerun with another --holdout,
    or over a datastore built before --holdout existed, found 'nothing to do' and calibrated on a 'held-out' slice
    that was in the datastore."""
    import shutil

    from memlm.storage.folder import manifest_digest

    root, ds, _, r = built
    model_dir = r.args[r.args.index("--model") + 1]
    rerun = ["datastore", "build", "--model", model_dir, "--corpus", str(root / "train.jsonl"), "--window", "32",
             "--min-context", "8", "--calibration-k", "16"]  # fmt: skip
    before = (ds / "manifest.json").read_bytes()
    r2 = memlm(*rerun, "--out", str(ds), "--holdout", "0")
    assert r2.returncode == 2 and "held-out slice" in r2.stderr and "-> none" in r2.stderr, r2.stderr
    assert (ds / "manifest.json").read_bytes() == before
    # --append of the same corpus with another slice adds nothing (the corpus is there; it would be stored twice)
    r2 = memlm(*rerun, "--out", str(ds), "--holdout", "0", "--append")
    assert r2.returncode == 0 and "nothing to append" in r2.stderr, r2.stderr
    assert (ds / "manifest.json").read_bytes() == before
    # a datastore built before --holdout existed: no slice recorded, no calibration
    old = tmp_path / "old"
    shutil.copytree(ds, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["sources"][0]["holdout"], m["calibration"]
    m["manifest_sha256"] = manifest_digest(m)
    (old / "manifest.json").write_text(json.dumps(m))
    r3 = memlm(*rerun, "--out", str(old), "--holdout", "0.1")
    assert r3.returncode == 2 and "held-out slice none" in r3.stderr and "datastore calibrate" in r3.stderr, r3.stderr
    assert "calibration" not in json.loads((old / "manifest.json").read_text())


@pytest.fixture(scope="module")
def onefile(tmp_path_factory, tiny_lm_dir):
    """A datastore built from one .txt file (one document)."""
    root = tmp_path_factory.mktemp("onefile")
    (root / "speeches.txt").write_text(_one_file(120))
    args = ["--model", str(tiny_lm_dir), "--corpus", str(root / "speeches.txt"), "--window", "32", "--min-context",
            "8", "--calibration-k", "16"]  # fmt: skip
    r = memlm("datastore", "build", *args, "--out", str(root / "ds"), "--holdout", "0.05")
    assert r.returncode == 0, r.stderr
    return root, root / "ds", args, r


def test_one_file_corpus_is_calibrated_on_its_tail(onefile, tiny_lm):
    """A one-document corpus gets a held-out tail (before: 'no calibration: nothing held out'), kept out of the
    entries: none of its 16-token spans is in the datastore, while the head's all are."""
    from memlm.knnlm.calibration import text_overlap
    from memlm.storage.datastore import Datastore

    root, ds_path, _, r = onefile
    assert "calibrated: held-out ppl" in r.stderr and "no calibration" not in r.stderr, r.stderr
    ds = Datastore.open(ds_path)
    hold, cal = ds.manifest["sources"][0]["holdout"], ds.manifest["calibration"]
    assert hold["documents"] == 1 and hold["tails"][0]["of"] == "speeches.txt"
    assert cal["tokens"] == hold["tokens"] and cal["holdout_ids"] == hold["ids_sha256"]
    _, tok = tiny_lm
    text = (root / "speeches.txt").read_text().strip()
    head, tail = Doc("h", text[: hold["tails"][0]["from_char"]]), Doc("t", text[hold["tails"][0]["from_char"] :])
    shared, spans = text_overlap(ds, [tail], tok)
    assert spans > 100 and shared == 0
    shared, spans = text_overlap(ds, [head], tok)
    assert shared >= 0.95 * spans
    # the tail is one document: its fit sees it as 512-token blocks (memlm.core.mixture.token_blocks)
    from memlm.core.mixture import BLOCK_TOKENS
    from memlm.knnlm.calibration import stored_mixture

    fit = stored_mixture(ds).fit
    assert cal["tokens"] > BLOCK_TOKENS and fit.documents == -(-cal["tokens"] // BLOCK_TOKENS)
    assert len(cal["slice"]) == 1 and cal["slice"][0]["text"] == text[hold["tails"][0]["from_char"] :]


def test_token_blocks_cut_documents_only_below_the_minimum():
    """Fewer than 8 documents: each cut into 512-token blocks in order (a document's last block shorter, a short
    document one block); 8 or more: the index as it is."""
    from memlm.core.mixture import token_blocks

    doc = np.r_[np.zeros(1100, int), np.ones(100, int), np.full(600, 2)]
    blocks = token_blocks(doc)
    assert np.array_equal(np.bincount(blocks), [512, 512, 76, 100, 512, 88])
    assert (np.diff(blocks) >= 0).all()
    many = np.repeat(np.arange(8), 700)
    assert token_blocks(many) is many or np.array_equal(token_blocks(many), many)


def test_rerun_without_the_slice_is_refused_and_named_text_calibrates(onefile, tmp_path):
    """`--holdout 0` over a datastore built with a slice names the difference; `memlm datastore calibrate` refuses
    the datastore's own text (whole or in part) and tunes on other text, which eval then reports; a run with another
    k says so; the result's retrieval record holds the λ, τ and index used."""
    import shutil

    from memlm.mixing.dump import DumpMixture

    root, ds0, args, _ = onefile
    r = memlm("datastore", "build", *args, "--out", str(ds0), "--holdout", "0")
    assert r.returncode == 2 and "held-out slice" in r.stderr and "datastore calibrate" in r.stderr, r.stderr
    ds = tmp_path / "ds"
    shutil.copytree(ds0, ds)
    model = args[args.index("--model") + 1]
    r = memlm("datastore", "calibrate", str(ds), "--model", model, "--corpus", str(root / "speeches.txt"))
    assert r.returncode == 2 and "is the corpus datastore" in r.stderr, r.stderr
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "speeches.txt").write_text((root / "speeches.txt").read_text()[:3000])
    r = memlm("datastore", "calibrate", str(ds), "--model", model, "--corpus", str(tmp_path / "part"))
    assert r.returncode == 2 and "-token spans" in r.stderr and "are in datastore" in r.stderr, r.stderr
    (tmp_path / "other.txt").write_text("\n\n".join(d.text for d in make_toy_docs(30, seed=99)))
    r = memlm("datastore", "calibrate", str(ds), "--model", model, "--corpus", str(tmp_path / "other.txt"), "--k",
              "16")  # fmt: skip
    assert r.returncode == 0 and "calibrated: held-out ppl" in r.stderr, r.stderr
    cal = json.loads((ds / "manifest.json").read_text())["calibration"]
    assert cal["text"]["named"] and cal["text"]["corpus"] == str(tmp_path / "other.txt") and cal["k"] == 16
    # the mixture is fitted on the named text too, and said so (with the size warning: 30 short documents)
    fit = DumpMixture.from_dict(cal["mixture"])
    assert (fit.fit.tokens, fit.k, fit.mixture.components) == (cal["tokens"], 16, ("lm", "knn"))
    assert f"mixture of lm + knn: {fit.fit.form}" in r.stderr and "warning: fitted on" in r.stderr
    common = ["eval", "--corpus", str(tmp_path / "other.txt"), "--memory", str(ds), "--window", "32",
              "--min-context", "8", "--memory", "cache", "--cache-lambda", "0.05"]  # fmt: skip
    r = memlm(*common, "--k", "16", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0 and "named with memlm datastore calibrate" in r.stderr and "note:" not in r.stderr
    ret = json.loads((tmp_path / "a.json").read_text())["retrieval"]
    assert (ret["lam"], ret["temperature"]) == _rule(cal)  # were None
    assert ret["cache_lambda"] == 0.05 and ret["index"] == str(ds / "index.faiss")  # were 0.0 and absent
    r = memlm(*common, "--k", "8")
    assert r.returncode == 0 and "note: this run uses k=8 (calibrated with k=16)" in r.stderr, r.stderr
    # another index swapped in by `memlm index build` (it was used without a word)
    r = memlm("index", "build", str(ds), "--factory", "IVF4,Flat")
    assert r.returncode == 0, r.stderr
    r = memlm(*common, "--k", "16")
    assert (
        r.returncode == 0
        and "note: this run uses index index.faiss (IVF4,Flat) (calibrated on index.faiss (Flat))" in r.stderr
    ), r.stderr


# ----------------------------------------------------------------- the guarded mixture fitted at calibration


def _held_out_dump(ds, docs, tok, model, k=16):
    """The build's held-out slice scored again, independently of memlm.knnlm.calibration (as the test above)."""
    from memlm.knnlm.evaluate import add_neighbours, lm_scores

    _, held, _ = holdout_split(docs, tok, fraction=0.1)
    ts, q, _ = lm_scores(model, tok, held, [ds.key_spec], window=32, min_context=8, progress=False)
    add_neighbours(ts, q[ds.key_spec], ds, k=k, progress=False)
    return ts


def test_build_stores_the_mixture_fitted_on_the_held_out_dump(built, tiny_lm):
    """The one fit stored in the manifest is fit_table's guarded fit on the held-out dump, τ searched at the τ where
    EM's constant mixture is most likely and its neighbours: same form, τ, sizes, weights and held-out
    log-likelihoods, the same log P on every token, and its rule weights its mean weight; what it was measured with is
    recorded; the build says what it fitted on and warns that the slice is under memlm.core.mixture's minimum
    sizes."""
    from memlm.core.mixture import MIN_FIT_TOKENS
    from memlm.core.tuning import DEFAULT_TEMPERATURES
    from memlm.knnlm.calibration import near_temperatures, stored_mixture
    from memlm.mixing.dump import DumpMixture
    from memlm.mixing.report import fit_table
    from memlm.storage.datastore import Datastore

    root, ds_path, docs, r = built
    model, tok = tiny_lm
    ds = Datastore.open(ds_path)
    cal = ds.manifest["calibration"]
    stored = stored_mixture(ds)
    assert isinstance(stored, DumpMixture) and stored.mixture.components == ("lm", "knn")
    ts = _held_out_dump(ds, docs, tok, model)
    tau = fit_table(ts, "constant", DEFAULT_TEMPERATURES, 16).temperature
    again = fit_table(ts, "guarded", near_temperatures(DEFAULT_TEMPERATURES, tau), 16)
    assert (stored.fit.form, stored.temperature, stored.k) == (again.fit.form, again.temperature, 16)
    sizes = ("tokens", "documents", "fit_tokens", "kept_tokens")
    assert [getattr(stored.fit, s) for s in sizes] == [getattr(again.fit, s) for s in sizes]
    assert stored.fit.tokens == cal["tokens"]
    # τ searched next to the constant mixture's most likely; the rule weight is the fit's mean weight
    assert [s["temperature"] for s in stored.search] == near_temperatures(DEFAULT_TEMPERATURES, tau)
    assert stored.rule_weights["knn"] == pytest.approx(stored.fit.mean_weights[1], rel=1e-9)
    assert (cal["k"], cal["search"], cal["scores"]) == (16, "index", "index")
    assert cal["index"]["file"] == "index.faiss" and cal["index"]["factory"]
    for form, value in again.fit.heldout_loglik.items():
        assert stored.fit.heldout_loglik[form] == pytest.approx(value, rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(stored.fit.mean_weights, again.fit.mean_weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stored.logprob(ts).numpy(), again.logprob(ts).numpy(), rtol=1e-6, atol=1e-8)
    assert DumpMixture.from_dict(stored.to_dict()).to_dict() == stored.to_dict()  # round-trips
    # the build's messages: sizes, the form chosen, and the warning below the stated size
    f = stored.fit
    assert f"mixture of lm + knn: {f.form}, τ={stored.temperature:g}, fitted on {f.tokens:,} held-out tokens of " \
        f"{f.documents:,} documents" in r.stderr, r.stderr  # fmt: skip
    assert f.tokens < MIN_FIT_TOKENS
    assert f"warning: fitted on {f.tokens:,} tokens (fewer than {MIN_FIT_TOKENS:,})" in r.stderr
    assert "memlm datastore calibrate" in r.stderr.split("warning: fitted on")[1]  # with the fix


def test_datastore_info_shows_the_stored_fit(built):
    root, ds_path, _, _ = built
    r = memlm("datastore", "info", str(ds_path))
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)["calibration"]["mixture"]
    assert fit["form"] in ("lm", "constant", "gate") and fit["tokens"] > 0 and fit["documents"] > 0
    assert set(fit["mean_weights"]) == {"lm", "knn"} and sum(fit["mean_weights"].values()) == pytest.approx(1.0)
    assert "W" not in json.dumps(fit) and fit["warnings"]  # a summary, not the matrices


def test_calibration_warns_below_the_stated_size_only(built, tiny_lm, capsys):
    """Under MIN_FIT_TOKENS tokens or MIN_FIT_DOCUMENTS documents the fit warns (with the fix); a slice of 4,096+
    tokens in 8+ documents does not."""
    from memlm.core.mixture import MIN_FIT_DOCUMENTS, MIN_FIT_TOKENS
    from memlm.knnlm.calibration import calibrate, report_mixture
    from memlm.mixing.dump import DumpMixture
    from memlm.storage.datastore import Datastore

    model, tok = tiny_lm
    ds = Datastore.open(built[1])
    large = make_toy_docs(170, seed=71)
    fit = DumpMixture.from_dict(calibrate(model, tok, ds, large, RetrievalConfig(k=16), progress=False)["mixture"])
    assert fit.fit.tokens >= MIN_FIT_TOKENS and fit.fit.documents >= MIN_FIT_DOCUMENTS and not fit.fit.warnings
    report_mixture(fit, "FIX")
    assert "warning" not in capsys.readouterr().err
    few = large[:5]  # fewer documents and tokens
    fit = DumpMixture.from_dict(calibrate(model, tok, ds, few, RetrievalConfig(k=16), progress=False)["mixture"])
    assert fit.fit.documents == 5 and len(fit.fit.warnings) == 1
    report_mixture(fit, "FIX")
    err = capsys.readouterr().err
    assert f"(fewer than {MIN_FIT_TOKENS:,}) and 5 documents (fewer than {MIN_FIT_DOCUMENTS:,})" in err
    assert err.count("warning:") == 1 and err.rstrip().endswith("(FIX)")


def test_calibration_adds_no_forward_pass(built, tiny_lm):
    """The mixture comes from one LM pass over the slice: as many forward calls, on as many tokens, as
    lm_scores alone makes."""
    from memlm.knnlm.calibration import calibrate
    from memlm.knnlm.evaluate import lm_scores
    from memlm.storage.datastore import Datastore

    model, tok = tiny_lm
    ds = Datastore.open(built[1])
    held = make_toy_docs(20, seed=72)
    calls = []
    hook = model.register_forward_hook(lambda m, a, kw, out: calls.append(int(kw["input_ids"].numel())),
                                       with_kwargs=True)  # fmt: skip
    try:
        cal = calibrate(model, tok, ds, held, RetrievalConfig(k=16), progress=False)
        during = list(calls)
        calls.clear()
        lm_scores(model, tok, held, [ds.key_spec], window=32, min_context=8, progress=False)
    finally:
        hook.remove()
    assert during and during == calls and "mixture" in cal


def _corrupt_copy(ds_path, tmp_path, edit):
    import shutil

    from memlm.storage.folder import manifest_digest

    out = tmp_path / "corrupt"
    shutil.copytree(ds_path, out)
    m = json.loads((out / "manifest.json").read_text())
    edit(m["calibration"]["mixture"])
    m["manifest_sha256"] = manifest_digest(m)
    (out / "manifest.json").write_text(json.dumps(m))
    return out


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r["fit"]["mixture"].__setitem__("W", [[1.0]]),  # wrong shape
        lambda r: r["fit"]["mixture"].__setitem__("components", ["lm", "ngram"]),  # not this memory's
        lambda r: r.__setitem__("cache_temperature", 1.0),  # a cache term a datastore's fit has not (a bad τ is
        # refused when the datastore opens: tests/test_adversarial.py)
        lambda r: r["fit"].pop("options"),
        lambda r: r.__setitem__("fit", 3),
    ],
)
def test_a_corrupt_stored_fit_is_one_clear_error(built, tmp_path, edit):
    from memlm.errors import MemlmError
    from memlm.knnlm.calibration import calibration_summary, has_stored_mixture, stored_mixture
    from memlm.retrieval import DatastoreMemory
    from memlm.storage.datastore import Datastore

    ds = Datastore.open(_corrupt_copy(built[1], tmp_path, edit))
    for memory in (ds, DatastoreMemory(ds)):
        with pytest.raises(MemlmError, match=r"manifest.json: the mixture stored with its calibration cannot be used"
                           r".*recalibrate it: rerun the `memlm datastore build`"):  # fmt: skip
            stored_mixture(memory)
    assert not has_stored_mixture(ds) and "cannot be used" in calibration_summary(ds)["mixture"]["problem"]


def test_a_rerun_recalibrates_a_corrupt_or_missing_fit(built, tmp_path):
    """A datastore calibrated before the fit existed (or with a corrupt one) gets one from a rerun of its build."""
    from memlm.knnlm.calibration import stored_mixture
    from memlm.storage.datastore import Datastore

    root, ds_path, _, r = built
    out = _corrupt_copy(ds_path, tmp_path, lambda rec: rec.clear())
    args = r.args[r.args.index("build") + 1 :]
    r2 = memlm("datastore", "build", *[str(out) if a == str(ds_path) else a for a in args])
    assert r2.returncode == 0 and "calibrating the mixture" in r2.stderr, r2.stderr
    assert stored_mixture(Datastore.open(out)).to_dict()["fit"]["mixture"] == stored_mixture(
        Datastore.open(ds_path)).to_dict()["fit"]["mixture"]  # fmt: skip


def test_calibration_searches_the_mixtures_temperature_next_to_the_constant_mixtures():
    from memlm.knnlm.calibration import near_temperatures

    grid = [0.1, 1.0, 3.0, 10.0, 100.0]
    assert near_temperatures(grid, 3.0) == [1.0, 3.0, 10.0]
    assert near_temperatures(grid, 0.1) == [0.1, 1.0]
    assert near_temperatures(list(reversed(grid)), 100.0) == [10.0, 100.0]


def test_shared_calibration_is_each_memorys_own_in_one_pass(built, tiny_lm, tmp_path):
    """calibrate_shared: one forward pass over a slice both memories held out gives the records calibrate and
    calibrate_ngram give (each with its own pass, the datastore's windows), and the slice's scores with both."""
    pytest.importorskip("infini_gram")
    from memlm.knnlm.calibration import calibrate, calibrate_ngram, calibrate_shared
    from memlm.ngram.index import build_ngram_index
    from memlm.ngram.memory import NgramMemory
    from memlm.storage.datastore import Datastore

    model, tok = tiny_lm
    ds = Datastore.open(built[1])
    ngram = NgramMemory(build_ngram_index(tok, make_toy_docs(80, seed=81), tmp_path / "idx", progress=False))
    held = make_toy_docs(20, seed=82)
    calls = []
    hook = model.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    try:
        knn, grams, ts = calibrate_shared(model, tok, (ds, ngram), held, RetrievalConfig(k=16), progress=False)
        shared = len(calls)
        calls.clear()
        alone = calibrate(model, tok, ds, held, RetrievalConfig(k=16), progress=False)
        assert shared == len(calls)
    finally:
        hook.remove()
    window, stride = knn["window"], knn["stride"]
    own = calibrate_ngram(model, tok, ngram, held, window=window, stride=stride, progress=False)
    for mine, theirs in ((knn, alone), (grams, own)):
        assert {k: v for k, v in mine.items() if k != "seconds"} == {k: v for k, v in theirs.items() if k != "seconds"}
    assert ts.names() == ("knn", "ngram") and len(ts) == knn["tokens"]
