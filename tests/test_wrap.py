"""``memlm.wrap``: an HF causal LM as a kNN-LM in one line; its forward is Eq. 3 at every position (checked against a
NumPy brute force), its loss the mean NLL under it, its generate the same tokens as generate_text; the public API."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from conftest import make_toy_docs
from test_datastore import build

import memlm
from memlm.errors import MemlmError
from memlm.knnlm.generate import generate_text
from memlm.models.keys import KeyCapture
from memlm.storage.index import build_index


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_lm):
    store = build(tmp_path_factory.mktemp("wrap-ds"), tiny_lm, make_toy_docs(30, seed=8), window=48, min_context=16)
    build_index(store.keys, store.index_path, factory="Flat", metric="l2", progress=False)
    return store


def test_forward_is_the_knn_lm_at_every_position(tiny_lm, ds):
    model, tok = tiny_lm
    lam, tau, k = 0.4, 3.0, 6
    knn_lm = memlm.wrap(model, f"knn:{ds.path}?k={k}&temperature={tau}", f"knn={lam}", tokenizer=tok)
    ids = torch.tensor([tok("the cat sat on a mat while the dog ran")["input_ids"]])
    out = knn_lm(input_ids=ids, labels=ids)
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        logits = model(input_ids=ids).logits[0].double()
        keys = cap.keys_by_spec[ds.key_spec][0].double().numpy()
    all_keys, values = np.asarray(ds.keys, dtype=np.float64), np.asarray(ds.values)
    nll = []
    for t in range(ids.shape[1]):
        p_lm = torch.softmax(logits[t], -1).numpy()
        d = -((all_keys - keys[t]) ** 2).sum(1)
        top = np.argsort(-d, kind="stable")[:k]
        w = np.exp((d[top] - d[top].max()) / tau)
        p_knn = np.zeros_like(p_lm)
        np.add.at(p_knn, values[top], w / w.sum())
        want = (1 - lam) * p_lm + lam * p_knn
        np.testing.assert_allclose(torch.exp(out.logits[0, t].double()).numpy(), want, rtol=1e-4, atol=1e-7)
        if t + 1 < ids.shape[1]:
            nll.append(-np.log(want[ids[0, t + 1]]))
    assert float(out.loss) == pytest.approx(np.mean(nll), rel=1e-4)
    assert knn_lm.config is model.config  # everything else is the wrapped model's


def test_generate_follows_the_knn_lm(tiny_lm, ds):
    model, tok = tiny_lm
    memory = f"{ds.path}?k=8&temperature=1"
    knn_lm = memlm.wrap(model, memory, "knn=0.9")
    ids = tok("the old river", return_tensors="pt")
    got = knn_lm.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(got[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    want = generate_text(model, tok, ["the old river"], memory, "knn=0.9", max_new_tokens=6)
    bare = generate_text(model, tok, ["the old river"], max_new_tokens=6)
    assert text == want[0] and text != bare[0]


def test_wrap_refuses_another_model(tiny_lm, ds):
    from conftest import tiny_gpt2

    with pytest.raises(MemlmError, match="not this one"):
        memlm.wrap(tiny_gpt2(1), ds)


def test_public_api_is_lazy_and_complete():
    import subprocess

    code = "import sys, memlm; assert 'torch' not in sys.modules; [getattr(memlm, n) for n in memlm.__all__]"
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError):
        memlm.no_such_name  # noqa: B018


def test_the_public_example_builds_a_memory_usable_as_it_is(tmp_path, monkeypatch):
    """The example of ``memlm``'s docstring and docs/ARCHITECTURE.md, line for line on a tiny LM (context 1024, so the
    default window fits): ``build_datastore`` is what ``memlm datastore build`` does (held-out slice, index,
    calibration), so ``wrap`` finds an index and the calibrated λ, τ, and generates."""
    from conftest import gpt2_tokenizer
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=1024)).eval()
    tok = gpt2_tokenizer()
    monkeypatch.chdir(tmp_path)
    docs = memlm.limit_documents(memlm.load_documents("wiki", "train"), tok, 6_000)
    ds = memlm.build_datastore(model, tok, docs, "ds/wiki")
    knn_lm = memlm.wrap(model, ds)
    assert ds.index_path.exists() and "calibration" in ds.manifest  # what the command line's build leaves
    assert len(ds) < sum(len(tok(d.text)["input_ids"]) + 1 for d in docs)  # a slice held out of the entries
    ids = tok("The city of", return_tensors="pt")
    out = knn_lm.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
