"""`memlm train --objective npm`, `memlm npm index|predict|classify` on tiny random BERTs (MiniLM's tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_toy_docs
from test_train_lm import write_jsonl
from transformers import BertConfig, BertModel

from memlm.cli import main
from memlm.models.resources import load_encoder

QUERY = "the cat sat on [MASK] mat"


def _save_tiny_bert(path, tok, seed):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def berts(tmp_path_factory):
    """Two tiny random BERT folders (seeds 0 and 1) with the uncased WordPiece tokenizer of minilm-l6."""
    tok = load_encoder("minilm-l6")[1]
    return [_save_tiny_bert(tmp_path_factory.mktemp(f"bert{s}"), tok, s) for s in (0, 1)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", make_toy_docs(12))


@pytest.fixture(scope="module")
def index(berts, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("npm") / "idx"
    assert main(["npm", "index", "--encoder", str(berts[0]), "--corpus", str(corpus), "--out", str(out),
                 "--max-length", "16", "--batch-size", "4"]) == 0  # fmt: skip
    return out


def _error_line(capsys) -> str:
    """The one `error: ...` line of a refused command (model-loading progress bars may come before it)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("error: "), err
    return errors[0]


def test_train_npm_writes_final(berts, corpus, tmp_path, capsys):
    base = ["train", "--corpus", str(corpus), "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--lr", "1e-3",
            "--dtype", "float32", "--warmup", "0", "--valid-tokens", "300", "--save-every", "0"]  # fmt: skip
    assert main([*base, "--objective", "npm", "--model", str(berts[0]), "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "trained 3 updates (npm)" in out and "valid loss" in out
    final = tmp_path / "a" / "final"
    model, tok = load_encoder(str(final))
    assert type(model).__name__ == "BertModel" and tok.mask_token_id == 103
    log = json.loads((tmp_path / "a" / "log.json").read_text())["log"]
    assert len(log) == 3 and all(math.isfinite(e["loss"]) for e in log) and "valid_loss" in log[-1]
    # NPM SINGLE from scratch with the tokenizer of an encoder folder
    args = [*base, "--objective", "npm-single", "--from-scratch", "1x64", "--tokenizer", str(berts[0])]
    assert main([*args, "--n-positions", "32", "--steps", "1", "--out", str(tmp_path / "b")]) == 0
    model, _ = load_encoder(str(tmp_path / "b" / "final"))
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 1
    # causal-LM losses do not go with an NPM objective; a causal LM still needs --from-scratch or --model
    assert main([*base, "--objective", "npm", "--loss", "trime", "--model", str(berts[0]), "--out", str(tmp_path)]) == 2
    assert "error: --loss trime" in capsys.readouterr().err
    assert main([*base, "--objective", "npm", "--detach-memory", "--model", str(berts[0]), "--out", str(tmp_path)]) == 2
    assert "--detach-memory is a TRIME ablation" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*base, "--out", str(tmp_path / "c")])
    assert e.value.code == 2
    assert "one of the arguments --from-scratch --model is required" in capsys.readouterr().err


def test_index_predict_and_refuse_other_encoder(index, berts, capsys):
    capsys.readouterr()
    assert main(["npm", "predict", "--index", str(index), "--k", "16", "--top", "3", QUERY]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"query: {QUERY}") and "  1. " in out and "[[" in out and "p=" in out
    assert main(["npm", "predict", "--index", str(index), "--k", "16", "--top", "5", "--json", QUERY]) == 0
    data = json.loads(capsys.readouterr().out)
    preds = data["predictions"]
    assert 1 <= len(preds) <= 5 and preds[0]["phrase"] and preds[0]["top_span"]["context"]
    assert all(a["score"] >= b["score"] for a, b in zip(preds, preds[1:], strict=False))
    assert main(["npm", "predict", "--index", str(index), "--single", "--bm25", "--k", "8", "--json", QUERY]) == 0
    single = json.loads(capsys.readouterr().out)["predictions"]
    assert single and all(p["top_span"]["context"].count("[[") == 1 for p in single)
    # an index built by another encoder: one error line, exit 2
    assert main(["npm", "predict", "--index", str(index), "--encoder", str(berts[1]), QUERY]) == 2
    assert "not comparable" in _error_line(capsys)
    assert main(["npm", "predict", "--index", str(index), "the cat sat on the mat"]) == 2  # no [MASK]
    assert "exactly one [MASK]" in _error_line(capsys)


def test_index_rerun_and_resume(index, berts, corpus, tmp_path, capsys, monkeypatch):
    args = ["npm", "index", "--encoder", str(berts[0]), "--corpus", str(corpus), "--max-length", "16",
            "--batch-size", "4"]  # fmt: skip
    capsys.readouterr()
    assert main([*args, "--out", str(index)]) == 0  # finished: returned as is
    assert "already built" in capsys.readouterr().err
    # interrupted after the first batch of blocks, then resumed: the same vectors as the uninterrupted build
    from memlm.npm import phrase_index

    real, calls = phrase_index.encode_sequences, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(phrase_index, "encode_sequences", flaky)
    assert main([*args, "--out", str(tmp_path / "idx")]) == 130
    assert (tmp_path / "idx" / "progress.json").exists()
    monkeypatch.setattr(phrase_index, "encode_sequences", real)
    assert main([*args, "--out", str(tmp_path / "idx")]) == 0
    assert (tmp_path / "idx" / "vectors.bin").read_bytes() == (index / "vectors.bin").read_bytes()
    # the same folder with another encoder is refused
    assert main([*args[:2], "--encoder", str(berts[1]), *args[4:], "--out", str(tmp_path / "idx")]) == 2
    _error_line(capsys)


def test_classify_normalised(index, capsys):
    capsys.readouterr()
    labels = "animal=cat,dog,bird;place=park,river,mat"
    query = "the dog ran in the [MASK]."
    assert main(["npm", "classify", "--index", str(index), "--labels", labels, "--k", "64", "--json", query]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["probs"]) == {"animal", "place"} and sum(res["probs"].values()) == pytest.approx(1.0)
    assert res["label"] in res["probs"]
    assert main(["npm", "classify", "--index", str(index), "--labels", labels, "--single", query]) == 0
    out = capsys.readouterr().out
    probs = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("  ")]
    assert len(probs) == 2 and sum(probs) == pytest.approx(1.0, abs=2e-4) and "label: " in out
    with pytest.raises(SystemExit, match="2"):  # a usage error, refused while the command line is parsed
        main(["npm", "classify", "--index", str(index), "--labels", "animal=cat", query])
    assert "at least two labels" in _error_line(capsys)


def test_train_npm_refuses_other_corpus_on_resume(berts, corpus, tmp_path, capsys):
    """An encoder run (NPM / MLM) records its corpus, encoder and tokenizer: a rerun with another corpus names it."""
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "text": "a completely different corpus " * 40}) + "\n")
    base = ["train", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--lr", "1e-3", "--dtype", "float32",
            "--warmup", "0", "--valid-tokens", "0", "--save-every", "1", "--model", str(berts[0])]  # fmt: skip
    for objective in ("npm", "mlm"):
        out = tmp_path / objective
        args = [*base, "--objective", objective, "--out", str(out)]
        assert main([*args, "--corpus", str(corpus)]) == 0
        capsys.readouterr()
        assert main([*args, "--corpus", str(other)]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "other settings (corpus" in errors[0], err
        assert json.loads((out / "run.json").read_text())["identity"]["corpus"] == str(corpus)
        assert main([*args, "--corpus", str(corpus)]) == 0  # the same settings resume
