"""The MLM baseline of NPM: BERT masking statistics, the loss against brute force, head tying, training, predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_npm_inference import tiny_bert

from memlm.errors import MemlmError
from memlm.models.forward import right_pad
from memlm.models.resources import load_encoder
from memlm.npm import mlm


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


def test_masking_80_10_10_statistics(tok):
    rng = np.random.default_rng(0)
    special = mlm._special_ids(tok)
    ids = torch.from_numpy(rng.integers(1000, len(tok), size=(400, 250)))
    ids[:, 0], ids[:, -1] = tok.cls_token_id, tok.sep_token_id
    att = torch.ones_like(ids)
    att[:50, 200:] = 0  # padding is never selected
    masked, labels = mlm.mlm_mask(ids, att, tok.mask_token_id, special, len(tok), np.random.default_rng(1))
    sel = labels != -100
    eligible = (att == 1) & (ids != tok.cls_token_id) & (ids != tok.sep_token_id)
    assert not sel[~eligible].any()
    assert torch.equal(labels[sel], ids[sel])
    frac = sel.sum().item() / eligible.sum().item()
    assert frac == pytest.approx(0.15, abs=0.005)
    n = sel.sum().item()
    to_mask = (masked[sel] == tok.mask_token_id).sum().item() / n
    unchanged = (masked[sel] == ids[sel]).sum().item() / n
    random_ = 1 - to_mask - unchanged
    assert to_mask == pytest.approx(0.8, abs=0.015)
    assert unchanged == pytest.approx(0.1, abs=0.01) and random_ == pytest.approx(0.1, abs=0.01)
    assert not np.isin(masked[sel & (masked != tok.mask_token_id)].numpy(), [i for i in special]).any()
    assert torch.equal(masked[~sel], ids[~sel])
    # a short batch still gets one target; a draw is a function of the generator only
    short = torch.tensor([[tok.cls_token_id, 2000, tok.sep_token_id]])
    _, lab = mlm.mlm_mask(short, None, tok.mask_token_id, special, len(tok), np.random.default_rng(5))
    assert (lab != -100).sum() == 1 and lab[0, 1] == 2000
    a = mlm.mlm_mask(ids, att, tok.mask_token_id, special, len(tok), np.random.default_rng(7))
    b = mlm.mlm_mask(ids, att, tok.mask_token_id, special, len(tok), np.random.default_rng(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(MemlmError, match="probability"):
        mlm.mlm_mask(ids, att, tok.mask_token_id, special, len(tok), np.random.default_rng(0), prob=0.0)


def test_head_tied_and_loss_equals_brute_force(tok):
    enc = tiny_bert(tok)
    model = mlm.mlm_model(enc)
    assert type(model).__name__ == "BertForMaskedLM"
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    assert torch.equal(emb, enc.get_input_embeddings().weight)
    assert torch.equal(model.base_model.encoder.layer[1].output.dense.weight, enc.encoder.layer[1].output.dense.weight)
    assert mlm.mlm_model(model) is model
    model.eval()
    loss_fn = mlm.MlmObjective(tok, seed=3)
    texts = ["the cat sat on the mat while the dog ran in the park", "a bird sang over the old river"]
    enc_ids = [[tok.cls_token_id, *tok(t, add_special_tokens=False)["input_ids"], tok.sep_token_id] for t in texts]
    ids, att = right_pad(enc_ids, tok.pad_token_id)
    batch = {"input_ids": ids, "attention_mask": att, "mask_seed": torch.tensor(11)}
    loss = loss_fn(model, batch)
    masked, labels = loss_fn.mask(batch)
    assert torch.equal(masked, loss_fn.mask(batch)[0])  # deterministic in (seed, mask_seed)
    with torch.no_grad():
        logits = model(input_ids=masked, attention_mask=att).logits.double()
    terms = []
    for r in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if labels[r, t] != -100:
                row = logits[r, t]
                terms.append(-(row[labels[r, t]] - torch.logsumexp(row, 0)).item())
    assert terms and float(loss.detach()) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    loss.backward()  # differentiable
    assert model.get_input_embeddings().weight.grad is not None


def test_train_load_and_predict(tok, tmp_path):
    from test_cli_npm import _save_tiny_bert

    from memlm.cli import main

    folder = _save_tiny_bert(tmp_path / "bert", tok, 0)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "d{i}", "text": "the cat sat on the mat number {i} while the dog ran"}}\n'
                              for i in range(6)))  # fmt: skip
    args = ["train", "--objective", "mlm", "--model", str(folder), "--corpus", str(corpus), "--steps", "2",
            "--batch-size", "2", "--seq-len", "16", "--dtype", "float32", "--warmup", "0", "--valid-tokens", "40",
            "--save-every", "0", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    model, tk = mlm.load_mlm(str(tmp_path / "run" / "final"))
    assert type(model).__name__ == "BertForMaskedLM"
    with pytest.raises(MemlmError, match="not a masked LM"):
        mlm.load_mlm(str(folder))
    assert main([*args[:-1], str(tmp_path / "x"), "--max-span", "3"]) == 2
    preds = mlm.mlm_fill(model, tk, "the cat sat on the [MASK] .", top=3)
    assert len(preds) == 3 and all(len(tk(p.phrase, add_special_tokens=False)["input_ids"]) == 1 for p in preds)
    assert preds[0].prob >= preds[1].prob
    res = mlm.mlm_classify(model, tk, "the cat sat on the [MASK] .", {"a": ["cat", "new york"], "b": ["dog"]})
    assert sum(res.probs.values()) == pytest.approx(1.0) and res.matched
    logp = mlm._mask_log_probs(model, tk, "the cat sat on the [MASK] .")
    cat, dog = tk.convert_tokens_to_ids(["cat", "dog"])
    assert res.probs["a"] == pytest.approx(math.exp(logp[cat]) / (math.exp(logp[cat]) + math.exp(logp[dog])))
    with pytest.raises(MemlmError, match="no single-token verbalizer"):
        mlm.mlm_classify(model, tk, "a [MASK] .", {"a": ["new york"], "b": ["dog"]})
    with pytest.raises(MemlmError, match="exactly one"):
        mlm.mlm_fill(model, tk, "no mask here")
    with pytest.raises(MemlmError, match="masked-LM head"):
        mlm.mlm_fill(tiny_bert(tk), tk, "a [MASK] .")
