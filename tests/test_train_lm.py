"""`memlm train`: tokenizer training, from-scratch GPT-2, resumable runs whose final folder loads everywhere."""

import json

import numpy as np
import pytest
import torch
from conftest import make_toy_docs

from memlm.cli import main
from memlm.errors import MemlmError
from memlm.models.resources import load_causal_lm
from memlm.models.tokenizer import EOS, make_tokenizer, train_bpe
from memlm.training.lm import parse_arch, train_lm
from memlm.training.loop import TrainConfig


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    return path


def test_bpe_roundtrip_and_eos():
    docs = make_toy_docs(40)
    tok = train_bpe([d.text for d in docs], vocab_size=300)
    assert len(tok) <= 300 and tok.eos_token == EOS and tok.eos_token_id == 0
    text = "the cat sat on a mat, über naïve 123"  # unseen bytes still encode (byte-level, no unknowns)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # trained merges shorten frequent words
    assert len(tok("the cat", add_special_tokens=False)["input_ids"]) < len("the cat")


def test_tokenizer_errors():
    with pytest.raises(MemlmError, match="empty corpus"):
        train_bpe(["", "  "], 300)
    with pytest.raises(MemlmError, match="at least 257"):
        train_bpe(["abc"], 100)
    with pytest.raises(MemlmError, match="unknown tokenizer"):
        make_tokenizer("sentencepiece")
    with pytest.raises(MemlmError, match="bpe:<vocab size>"):
        make_tokenizer("bpe:many", ["abc"])


def test_parse_arch():
    assert parse_arch("6x384") == (6, 384, 6)
    assert parse_arch("10m") == (6, 160, 4)
    for bad in ("6x100", "x384", "big"):
        with pytest.raises(MemlmError, match="bad model size"):
            parse_arch(bad)


def test_train_from_scratch_resumes_and_loads(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_toy_docs(60))
    cfg = dict(max_steps=4, batch_size=2, seq_len=16, eval_every=2, save_every=2, lr=1e-3)
    args = dict(scratch="2x64", tokenizer="bpe:300", valid_tokens=64, n_positions=32, progress=False)
    full = train_lm(tmp_path / "a", str(corpus), TrainConfig(**cfg), **args)
    part = train_lm(tmp_path / "b", str(corpus), TrainConfig(**cfg), stop_after=2, **args)
    assert part.final_dir is None
    resumed = train_lm(tmp_path / "b", str(corpus), TrainConfig(**cfg), **args)
    assert [e["loss"] for e in resumed.log] == pytest.approx([e["loss"] for e in full.log], rel=1e-5)
    assert full.valid_ppl is not None and resumed.valid_ppl == pytest.approx(full.valid_ppl, rel=1e-5)
    m1, tok = load_causal_lm(str(full.final_dir))
    m2, _ = load_causal_lm(str(resumed.final_dir))
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        torch.testing.assert_close(p, q, msg=n)
    assert len(tok) == m1.config.vocab_size and m1.config.n_positions == 32


def test_train_cli_and_errors(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_toy_docs(40))
    base = ["train", "--corpus", str(corpus), "--tokenizer", "bpe:300", "--n-positions", "32", "--seq-len", "16"]
    base += ["--batch-size", "2", "--steps", "3", "--valid-tokens", "32", "--eval-every", "0", "--save-every", "0"]
    assert main([*base, "--out", str(tmp_path / "run"), "--from-scratch", "2x64"]) == 0
    assert "trained 3 updates" in capsys.readouterr().out
    assert (tmp_path / "run" / "final" / "tokenizer.json").exists()
    # a sequence longer than the model's positions, an empty corpus and a bad size are one clear line each
    assert main([*base, "--out", str(tmp_path / "r2"), "--from-scratch", "2x64", "--seq-len", "64"]) == 2
    assert "positions" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    bad = [*base, "--out", str(tmp_path / "r3"), "--from-scratch", "2x64"]
    bad[2] = str(tmp_path / "empty.jsonl")
    assert main(bad) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert main([*base, "--out", str(tmp_path / "r4"), "--from-scratch", "6x100"]) == 2
    assert "bad model size" in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["trime", "trime-long", "trime-ext"])
def test_train_cli_trime_losses(tmp_path, capsys, loss):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_toy_docs(40))
    args = ["train", "--corpus", str(corpus), "--tokenizer", "bpe:300", "--n-positions", "32", "--seq-len", "16"]
    args += ["--batch-size", "4", "--steps", "4", "--valid-tokens", "32", "--eval-every", "0", "--save-every", "0"]
    args += ["--loss", loss, "--ce-warmup", "1", "--out", str(tmp_path / "run"), "--from-scratch", "2x64"]
    assert main(args) == 0
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log["config"]["warmup_loss_steps"] == 1 and len(log["log"]) == 4
    assert all(np.isfinite(e["loss"]) for e in log["log"])
