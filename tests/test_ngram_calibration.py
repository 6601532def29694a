"""``memlm ngram build``'s calibration (memlm.knnlm.calibration.calibrate_ngram): the one guarded mixture of the LM and
the index, fitted on the held-out slice's one scored dump and stored in the index's manifest, with its summary as the
rule's λ_sparse / λ_dense."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("infini_gram")

from conftest import make_toy_docs  # noqa: E402
from test_reliability import memlm  # noqa: E402

from memlm.errors import MemlmError  # noqa: E402
from memlm.knnlm.calibration import (  # noqa: E402
    calibration_summary,
    has_stored_mixture,
    holdout_split,
    stored_mixture,
)
from memlm.ngram.index import NgramIndex  # noqa: E402
from memlm.ngram.memory import NgramMemory  # noqa: E402
from memlm.storage.folder import manifest_digest  # noqa: E402

WINDOW = ["--window", "64", "--stride", "32"]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm_dir):
    root = tmp_path_factory.mktemp("ngcal")
    docs = make_toy_docs(80, seed=2)
    (root / "docs.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    args = ["ngram", "build", "--model", str(tiny_lm_dir), "--corpus", str(root / "docs.jsonl"), "--out",
            str(root / "ix"), "--holdout", "0.1", *WINDOW]  # fmt: skip
    r = memlm(*args)
    assert r.returncode == 0, r.stderr
    return root, root / "ix", docs, args, r


def test_build_stores_the_mixture_fitted_on_the_held_out_dump(built, tiny_lm):
    """The stored fit is fit_table's guarded fit on the held-out dump scored again here (LM + this ∞-gram): same
    form, sizes, weights, log P per token; its rule weights are its mean weight where P∞ is sparse and where it is
    not; no other weight is recorded beside it; the build says what it fitted on and warns below
    memlm.core.mixture's sizes, with the fix."""
    from memlm.core.mixture import MIN_FIT_TOKENS
    from memlm.knnlm.evaluate import add_memory, lm_scores
    from memlm.mixing.dump import DumpMixture
    from memlm.mixing.report import fit_table

    root, ix, docs, _, r = built
    model, tok = tiny_lm
    index = NgramIndex.open(ix)
    cal = index.manifest["calibration"]
    assert not {"lambda_sparse", "lambda_dense"} & set(cal)  # one stored weight: the fit
    stored = stored_mixture(index)
    assert isinstance(stored, DumpMixture) and stored.mixture.components == ("lm", "ngram")
    assert stored.temperature is None and stored.k is None
    assert stored_mixture(NgramMemory(index)).to_dict() == stored.to_dict()  # a memory over the index: the same
    _, held, _ = holdout_split(docs, tok, 0.1)
    ts, _, _ = lm_scores(model, tok, held, window=64, stride=32, progress=False)
    add_memory(ts, NgramMemory(index), held, tok)
    again = fit_table(ts, "guarded")
    sizes = ("form", "tokens", "documents", "fit_tokens", "kept_tokens")
    assert [getattr(stored.fit, s) for s in sizes] == [getattr(again.fit, s) for s in sizes]
    assert stored.fit.tokens == cal["tokens"]
    np.testing.assert_allclose(stored.fit.mean_weights, again.fit.mean_weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stored.logprob(ts).numpy(), again.logprob(ts).numpy(), rtol=1e-6, atol=1e-8)
    assert DumpMixture.from_dict(stored.to_dict()).to_dict() == stored.to_dict()
    w = stored.mixture.log_weights(again.inputs(ts).features).exp()[:, 1].numpy()
    sparse = np.asarray(ts.columns["ngram"]["sparse"], dtype=bool)
    np.testing.assert_allclose(stored.rule_weights["ngram"], [w[sparse].mean(), w[~sparse].mean()], rtol=1e-6)
    f = stored.fit
    assert "calibrating the mixture on" in r.stderr
    assert f"mixture of lm + ngram: {f.form}, fitted on {f.tokens:,} held-out tokens of {f.documents:,} documents" in (
        r.stderr
    )
    assert f.tokens < MIN_FIT_TOKENS and f"warning: fitted on {f.tokens:,} tokens (fewer than {MIN_FIT_TOKENS:,})" in (
        r.stderr
    )
    assert "memlm tune --mixture guarded" in r.stderr.split("warning: fitted on")[1]  # the fix


def test_ngram_info_shows_the_stored_fit(built):
    r = memlm("ngram", "info", str(built[1]))
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)["calibration"]["mixture"]
    assert fit["form"] in ("lm", "constant", "gate") and fit["tokens"] > 0
    assert set(fit["mean_weights"]) == {"lm", "ngram"} and sum(fit["mean_weights"].values()) == pytest.approx(1.0)
    assert "W" not in json.dumps(fit)


def _edited_copy(ix, tmp_path, edit):
    out = tmp_path / "ix"
    shutil.copytree(ix, out)
    m = json.loads((out / "manifest.json").read_text())
    edit(m["calibration"])
    m["manifest_sha256"] = manifest_digest(m)
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def test_a_corrupt_stored_fit_is_one_clear_error_and_a_rerun_refits_it(built, tmp_path):
    root, ix, _, args, _ = built

    def corrupt(cal):
        cal["mixture"]["fit"]["mixture"]["feature_names"] = ["lm_entropy"]  # W no longer fits

    out = _edited_copy(ix, tmp_path, corrupt)
    index = NgramIndex.open(out)
    with pytest.raises(MemlmError, match=r"manifest.json: the mixture stored with its calibration cannot be used .*"
                       r"rerun the `memlm ngram build` command"):  # fmt: skip
        stored_mixture(index)
    assert not has_stored_mixture(index) and "cannot be used" in calibration_summary(index)["mixture"]["problem"]
    rerun = [str(out) if a == str(ix) else a for a in args]
    r = memlm(*rerun)
    assert r.returncode == 0 and "calibrating the mixture" in r.stderr, r.stderr
    assert stored_mixture(NgramIndex.open(out)).to_dict()["fit"]["mixture"] == stored_mixture(
        NgramIndex.open(ix)).to_dict()["fit"]["mixture"]  # fmt: skip
    r = memlm(*rerun)  # now current: nothing to do
    assert r.returncode == 0 and "calibration already recorded" in r.stderr, r.stderr


def test_an_index_calibrated_by_an_older_memlm_is_refused_until_rebuilt(built, tmp_path):
    """A calibration with the grid's λ_sparse / λ_dense beside the fit: one error that says to rebuild; info shows
    the problem; eval's default weights refuse it too."""
    from memlm.knnlm.calibration import ngram_parameters

    out = _edited_copy(built[1], tmp_path, lambda cal: cal.update(lambda_sparse=0.3, lambda_dense=0.1))
    for read in (stored_mixture, ngram_parameters):
        with pytest.raises(MemlmError, match=r"written by an older memlm .*lambda_sparse, lambda_dense.*rerun the "
                           r"`memlm ngram build` command"):  # fmt: skip
            read(NgramIndex.open(out))
    assert "older memlm" in calibration_summary(NgramIndex.open(out))["problem"]


def test_calibration_adds_no_forward_pass(built, tiny_lm):
    """The mixture comes from one LM pass: the forward calls of lm_scores alone."""
    from memlm.knnlm.calibration import calibrate_ngram
    from memlm.knnlm.evaluate import lm_scores

    model, tok = tiny_lm
    held = make_toy_docs(20, seed=5)
    calls = []
    hook = model.register_forward_hook(lambda m, a, kw, out: calls.append(int(kw["input_ids"].numel())),
                                       with_kwargs=True)  # fmt: skip
    try:
        cal = calibrate_ngram(model, tok, NgramMemory(NgramIndex.open(built[1])), held, 64, 32, progress=False)
        during = list(calls)
        calls.clear()
        lm_scores(model, tok, held, window=64, stride=32, progress=False)
    finally:
        hook.remove()
    assert during and during == calls and cal["mixture"]["fit"]["tokens"] == cal["tokens"]
