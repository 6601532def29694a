"""Generation and ``memlm.wrap`` through the one mixture: under a gate, every step's distribution is
``Σ_i λ_i P_i`` with ``λ = softmax(W (φ - mean) / std + b)`` over the LM, the datastores and the ∞-grams, each component
and each feature computed here in NumPy (p_kNN from an exact search, Khandelwal et al. 2020 Eq. 2; P∞, its effective n
and count from a scan of the reference tokens, Liu et al. 2024); ``memlm generate`` with a gate fitted by ``memlm tune
--mixture gate``; a fit for other memories refused before the model loads; two datastores and two ∞-gram indexes in
one generate call under the fixed-weight rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("infini_gram")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_ngram_multi  # noqa: E402
from conftest import make_toy_docs  # noqa: E402
from test_mixture import synthetic_dump  # noqa: E402
from test_ngram import Brute, _ids  # noqa: E402

from memlm.cli import common, main  # noqa: E402
from memlm.core.mixture import Mixture  # noqa: E402
from memlm.models.keys import KeyCapture  # noqa: E402

K, TAU = 8, 2.0
_corpora = test_ngram_multi._corpora
two_indexes, ds = test_ngram_multi.two_indexes, test_ngram_multi.ds  # its fixtures: two toy indexes, a datastore


@pytest.fixture(scope="module")
def ds2(tmp_path_factory, tiny_lm):
    """A second datastore of the tiny LM over other toy documents (exact index)."""
    from memlm.knnlm.write import write_datastore

    model, tok = tiny_lm
    store = write_datastore(model, tok, make_toy_docs(20, seed=7), tmp_path_factory.mktemp("ds2") / "ds2",
                            window=64, min_context=32, progress=False)  # fmt: skip
    store.build_index(factory="Flat", metric="l2", progress=False)
    return store


def _spec(stores, indexes) -> str:
    """The memory spec of ``stores`` (k = K, τ = TAU) and ``indexes``, in that order."""
    knn = [f"knn:{s.path}?k={K}&temperature={TAU}" for s in stores]
    return ";".join([*knn, *(f"ngram:{ix.path}" for ix in indexes)])


def _knn(store, query: np.ndarray, k: int, tau: float, vocab: int) -> tuple[np.ndarray, dict[str, float]]:
    """p_kNN over the vocabulary by an exact NumPy search (negative squared L2, the k nearest, softmax of score / τ)
    and the retrieval's features: the best score, log Σ exp(s / τ), the best neighbour's value's share, empty."""
    keys, values = np.asarray(store.keys, dtype=np.float64), np.asarray(store.values)
    d = -((keys - query) ** 2).sum(1)
    top = np.argsort(-d, kind="stable")[:k]
    s = d[top]
    w = np.exp((s - s.max()) / tau)
    p = np.zeros(vocab)
    np.add.at(p, values[top], w / w.sum())
    lse = s.max() / tau + np.log(np.exp((s - s.max()) / tau).sum())
    return p, {"top_score": s[0], "logsumexp": lse, "top_value_share": p[values[top[0]]], "empty": 0.0}


def _p_inf(brute: Brute, context: list[int], vocab: int) -> tuple[np.ndarray, dict[str, float]]:
    """P∞ over the vocabulary after ``context`` and its features: log(1 + effective n), log(1 + cnt(suffix)), sparse."""
    ctx = [Brute.START, *context]
    nxt = next((f for n in range(len(ctx), 0, -1) if (f := brute.follow(ctx[len(ctx) - n :]))), brute.follow_all())
    p = np.zeros(vocab)
    np.add.at(p, nxt, 1.0 / len(nxt))
    n = brute.effective_n(context)
    return p, {"log_n": np.log1p(n), "log_count": np.log1p(len(nxt)), "sparse": float(len(set(nxt)) == 1)}


def _components(logits: torch.Tensor, queries: list[np.ndarray], context: list[int], stores, brutes, k, tau):
    """(P_i over the vocabulary by component, φ by feature name) at one context, all in NumPy float64."""
    log_p = torch.log_softmax(logits.double(), -1).numpy()
    comps = {"lm": np.exp(log_p)}
    feats = {"lm_entropy": -(comps["lm"] * log_p).sum(), "lm_max_logprob": log_p.max()}
    for r, (store, q) in enumerate(zip(stores, queries, strict=True)):
        name = "knn" if r == 0 else f"knn{r + 1}"
        comps[name], f = _knn(store, q, k, tau, len(log_p))
        feats.update({f"{name}_{key}": v for key, v in f.items()})
    for r, brute in enumerate(brutes):
        name = "ngram" if r == 0 else f"ngram{r + 1}"
        comps[name], f = _p_inf(brute, context, len(log_p))
        feats.update({f"{name}_{key}": v for key, v in f.items()})
    return comps, feats


def _gate_mix(rec: dict, comps: dict, feats: dict) -> np.ndarray:
    """Σ_i λ_i P_i with λ = softmax(W (φ - mean) / std + b), from a stored mixture's record (Mixture.to_dict)."""
    phi = np.array([feats[f] for f in rec["feature_names"]])
    z = (phi - np.asarray(rec["feature_mean"])) / np.asarray(rec["feature_std"])
    b = np.array([-np.inf if x is None else x for x in rec["b"]])
    a = np.asarray(rec["W"]) @ z + b
    lam = np.exp(a - a.max())
    lam /= lam.sum()
    return sum(w * comps[c] for w, c in zip(lam, rec["components"], strict=True))


def _random_gate(components, feats: list[dict], seed: int) -> Mixture:
    """A gate with random W, b over every feature the steps give, standardised by the features seen in ``feats`` (as
    a fit standardises them), so that every component weighs something and the weights move from row to row."""
    names = list(feats[0])
    phi = np.array([[f[n] for n in names] for f in feats])
    rng = np.random.default_rng(seed)
    c, f = len(components), len(names)
    W, b = rng.normal(0, 0.5, (c, f)), rng.normal(0, 0.3, c)
    W[0], b[0] = 0, 0
    std = np.maximum(phi.std(0), 0.1)  # not below float noise: the tiny LM's entropy is ~ln V at every row
    return Mixture(tuple(components), tuple(names), W, b, phi.mean(0), std)


def test_a_generation_step_under_a_gate_is_the_softmax_weighted_mixture_by_hand(tiny_lm, ds, ds2, two_indexes):
    """One generation step, three rows, two datastores and two ∞-gram indexes under a gate with random W, b: at every
    word of the vocabulary the processor's distribution is the gate's mixture computed in NumPy. Fails on the old code
    (no processor took a gate, nor two datastores)."""
    from memlm.knnlm.generate import MixtureLogitsProcessor

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    rows = [_ids(tok, "the old river ran over the"), _ids(tok, _corpora()[1][-1].text)[:6],
            _ids(tok, "a bird sang in the dog")]  # fmt: skip
    ids = torch.tensor(rows)
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=ids).logits[:, -1]
        queries = cap.keys_by_spec[ds.key_spec][:, -1].double().numpy()
    by_hand = [_components(logits[i], [q, q], row, [ds, ds2], brutes, K, TAU) for i, (row, q) in
               enumerate(zip(rows, queries, strict=True))]  # fmt: skip
    gate = _random_gate(("lm", "knn", "knn2", "ngram", "ngram2"), [f for _, f in by_hand], seed=3)
    memories = _spec([ds, ds2], two_indexes)
    with torch.no_grad(), MixtureLogitsProcessor(model, memories, gate) as proc:
        got = torch.exp(proc(ids, model(input_ids=ids).logits[:, -1]).double()).numpy()
    for i, (comps, feats) in enumerate(by_hand):
        np.testing.assert_allclose(got[i], _gate_mix(gate.to_dict(), comps, feats), rtol=1e-4, atol=1e-7)
    lams = gate.log_weights(np.array([[f[n] for n in gate.feature_names] for _, f in by_hand])).exp().numpy()
    assert (lams.min(0) > 1e-3).all() and np.ptp(lams, axis=0).max() > 0.05  # every component weighs, per row


def test_wrap_forward_under_a_gate_is_the_mixture_at_every_position(tiny_lm, ds, two_indexes):
    """``memlm.wrap(model, memories=[ds, index], mixture=gate)``: at every position the forward's distribution is the
    gate's mixture by hand, the ∞-gram reading the row up to that position (the old forward refused an ∞-gram); its
    loss the mean NLL under it."""
    import memlm

    model, tok = tiny_lm
    brute = Brute(tok, _corpora()[0])
    seq = _ids(tok, "the old river ran over the park while a bird")
    ids = torch.tensor([seq])
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=ids).logits[0]
        queries = cap.keys_by_spec[ds.key_spec][0].double().numpy()
    by_hand = [_components(logits[t], [queries[t]], seq[: t + 1], [ds], [brute], K, TAU) for t in range(len(seq))]
    gate = _random_gate(("lm", "knn", "ngram"), [f for _, f in by_hand], seed=5)
    knn_lm = memlm.wrap(model, _spec([ds], two_indexes[:1]), gate)
    out = knn_lm(input_ids=ids, labels=ids)
    nll = []
    for t, (comps, feats) in enumerate(by_hand):
        want = _gate_mix(gate.to_dict(), comps, feats)
        np.testing.assert_allclose(torch.exp(out.logits[0, t].double()).numpy(), want, rtol=1e-4, atol=1e-7)
        if t + 1 < len(seq):
            nll.append(-np.log(want[seq[t + 1]]))
    assert float(out.loss) == pytest.approx(np.mean(nll), rel=1e-4)
    lams = gate.log_weights(np.array([[f[n] for n in gate.feature_names] for _, f in by_hand])).exp().numpy()
    assert (lams.min(0) > 1e-3).all()  # the ∞-gram and the datastore weigh at every position


def _greedy_by_hand(model, prompt: list[int], steps: int, stores, brutes, mix, k=K, tau=TAU) -> list[int]:
    """Greedy decoding from ``mix(components, features)`` computed in NumPy at every step."""
    seq = list(prompt)
    for _ in range(steps):
        with torch.no_grad(), KeyCapture(model, [stores[0].key_spec] if stores else []) as cap:
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            q = cap.keys_by_spec[stores[0].key_spec][0, -1].double().numpy() if stores else None
        comps, feats = _components(logits, [q] * len(stores), seq, stores, brutes, k, tau)
        seq.append(int(mix(comps, feats).argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def gate_fit(tmp_path_factory):
    """``memlm tune --mixture gate`` on a dump with a datastore's neighbours and one ∞-gram (no cache) where the
    neighbours hold the target exactly when the nearest is close: a gate on the top score beats constant weights."""
    root = tmp_path_factory.mktemp("fit")
    valid = synthetic_dump(0, n=1200).select(["knn", "ngram"])
    close = valid.columns["knn"]["scores"][:, :1] > np.median(valid.columns["knn"]["scores"][:, 0])
    held = valid.columns["knn"]["values"] >= 0
    valid.columns["knn"]["values"] = np.where(
        held, np.where(close, valid.targets[:, None], (valid.targets[:, None] + 1) % 12), -1
    )
    valid.save(root / "v.npz")
    fit = root / "fit.json"
    argv = ["tune", "--valid", str(root / "v.npz"), "--mixture", "guarded", "--temperatures", "2", "--json", str(fit)]
    assert main(argv) == 0
    return fit


def test_cli_generate_with_a_tuned_gate_file(tiny_lm, tiny_lm_dir, ds, two_indexes, gate_fit, capsys):
    """``memlm generate --mixture FIT.json`` (a gate fitted by memlm tune --mixture gate): greedy decoding picks the
    argmax of the stored gate's mixture by hand at every step, the kNN term at the fit's τ and k (not --k's 64)."""
    model, tok = tiny_lm
    rec = json.loads(gate_fit.read_text())["mixture"]
    assert rec["fit"]["form"] == "gate" and rec["fit"]["mixture"]["components"] == ["lm", "knn", "ngram"]
    assert rec["k"] == 8 and rec["temperature"] == 2.0
    prompt = "the old river"
    argv = ["generate", "--model", str(tiny_lm_dir), "--memory", str(ds.path), "--memory", str(two_indexes[0].path),
            "--mixture", str(gate_fit), "--prompt", prompt, "--max-new-tokens", "5", "--greedy", "--dtype",
            "float32"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "mixture: gate from" in err and "kNN-LM parameters" not in err  # the fit's weights, not λ's
    brute = Brute(tok, _corpora()[0])
    gate = rec["fit"]["mixture"]
    want = _greedy_by_hand(model, _ids(tok, prompt), 5, [ds], [brute], lambda c, f: _gate_mix(gate, c, f),
                           k=rec["k"], tau=rec["temperature"])  # fmt: skip
    assert out.startswith(prompt + tok.decode(want) + "\n")
    assert main([arg for arg in argv if arg not in ("--mixture", str(gate_fit))]) == 0  # the fixed-weight rule
    assert capsys.readouterr().out.splitlines()[0] != out.splitlines()[0]  # the fit decided the text
    # the same file through the Python API, at every word of one step: the fit's k and τ win over k=64 given
    from memlm.knnlm.generate import MixtureLogitsProcessor

    seq = _ids(tok, prompt)
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        q = cap.keys_by_spec[ds.key_spec][0, -1].double().numpy()
    comps, feats = _components(logits, [q], seq, [ds], [brute], rec["k"], rec["temperature"])
    memories = f"knn:{ds.path}?k=64;{two_indexes[0].path}"
    with torch.no_grad(), MixtureLogitsProcessor(model, memories, gate_fit) as proc:
        assert (proc.components[0].k, proc.components[0].temperature) == (rec["k"], rec["temperature"])
        got = torch.exp(proc(torch.tensor([seq]), model(input_ids=torch.tensor([seq])).logits[:, -1])[0].double())
    np.testing.assert_allclose(got.numpy(), _gate_mix(gate, comps, feats), rtol=1e-4, atol=1e-7)


def test_cli_generate_refuses_a_fit_for_other_memories_before_loading_the_model(
    tiny_lm_dir, ds, two_indexes, gate_fit, tmp_path, monkeypatch, capsys
):
    """A fit applies only to the memories it was fitted on (lm, knn, ngram here): another set of memories, weights
    given beside it, or a fit that holds the cache (generation has none) are each refused with one error, before
    any model is loaded."""
    monkeypatch.setattr(common, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    base = ["generate", "--model", str(tiny_lm_dir), "--prompt", "the cat", "--mixture", str(gate_fit)]
    a, b = (str(ix.path) for ix in two_indexes)
    cases = [
        (["--memory", a], "fitted on components lm, knn, ngram; these memories give lm, ngram"),
        (["--memory", f"{ds.path};{a}", "--memory", b], "these memories give lm, knn, ngram, ngram2"),
        (["--memory", str(ds.path), "--memory", a, "--lambda", "0.3"], "leave out --lambda"),
    ]
    with_cache = synthetic_dump(1, n=400)
    with_cache.save(tmp_path / "c.npz")
    assert (
        main(["tune", "--valid", str(tmp_path / "c.npz"), "--mixture", "guarded", "--json", str(tmp_path / "c.json")])
        == 0
    )
    capsys.readouterr()
    cases.append(
        (["--memory", str(ds.path), "--memory", a, "--mixture", str(tmp_path / "c.json")], "no continuous cache")
    )
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error:")] and message in err, err


def test_two_datastores_and_two_indexes_in_one_generate_call(tiny_lm, tiny_lm_dir, ds, ds2, two_indexes, capsys):
    """``memlm generate --memory A --memory B --memory X --memory Y`` with fixed weights: greedy decoding picks the
    argmax of (1 - 2λ - Σ_r λ_r(c)) p_LM + λ p_kNN,A + λ p_kNN,B + Σ_r λ_r(c) P∞_r by hand at every step, and
    ``generate_text`` with the same spec and the weights as one mixture gives the same text."""
    from memlm.knnlm.generate import generate_text

    model, tok = tiny_lm
    brutes = [Brute(tok, docs) for docs in _corpora()]
    lam, pairs = 0.2, [(0.3, 0.1), (0.2, 0.05)]
    prompt = "the old river"
    a, b = (str(ix.path) for ix in two_indexes)
    argv = ["generate", "--model", str(tiny_lm_dir), "--memory", f"{ds.path}?k={K}", "--memory", f"{ds2.path}?k={K}",
            "--memory", a, "--memory", b, "--lambda", str(lam), "--temperature", str(TAU),
            "--ngram-lambda-sparse", "0.3", "0.2", "--ngram-lambda-dense", "0.1", "0.05", "--prompt", prompt,
            "--max-new-tokens", "5", "--greedy", "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out

    def rule(comps, feats):
        lam_r = [p[0] if feats[f"{n}_sparse"] else p[1] for n, p in zip(("ngram", "ngram2"), pairs, strict=True)]
        p = (1 - 2 * lam - sum(lam_r)) * comps["lm"] + lam * comps["knn"] + lam * comps["knn2"]
        return p + lam_r[0] * comps["ngram"] + lam_r[1] * comps["ngram2"]

    want = _greedy_by_hand(model, _ids(tok, prompt), 5, [ds, ds2], brutes, rule)
    assert out.startswith(prompt + tok.decode(want) + "\n")
    weights = f"knn={lam};knn2={lam};ngram=0.3/0.1;ngram2=0.2/0.05"
    text = generate_text(model, tok, [prompt], memories=_spec([ds, ds2], two_indexes), mixture=weights,
                         max_new_tokens=5)  # fmt: skip
    assert text[0] == tok.decode(want)
