"""The training driver (memlm.training.driver, memlm.registry): a new objective is one class and one registry
line (the worked example of docs/ARCHITECTURE.md), and run folders written by the code before the driver resume with
it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_toy_docs
from safetensors.torch import load_file
from test_cli_npm import _save_tiny_bert
from test_train_lm import write_jsonl
from transformers import AutoTokenizer

from memlm.cli import main
from memlm.data.corpora import corpus_fingerprint, load_corpora
from memlm.errors import MemlmError
from memlm.models.resources import load_encoder, tokenizer_fingerprint
from memlm.models.tokenizer import make_tokenizer
from memlm.registry import OBJECTIVES, make_objective
from memlm.training.driver import Objective, TrainSetup, run_tokenizer, train_objective
from memlm.training.lm import scratch_gpt2
from memlm.training.loop import TrainConfig, causal_lm_loss, describe_callable, lm_batches, train

# --------------------------------------------------------------------------------- worked example: a new objective


def every_other_token_loss(model, batch):
    """Mean cross-entropy of the tokens at odd positions (1, 3, 5, ...), each predicted from its prefix."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits[:, 0:-1:2].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1::2].reshape(-1))


class EveryOtherToken(Objective):
    """A toy objective: a 1x64 GPT-2 from scratch on a BPE of the corpus, trained on every second token."""

    name = "every-other"
    loss_fn = staticmethod(every_other_token_loss)

    def build(self, setup, docs):
        tok = run_tokenizer(setup.folder, "bpe:300", [d.text for d in docs])
        return scratch_gpt2("1x64", tok, n_positions=32, dropout=0.0, seed=setup.config.seed).train(), tok

    def batches(self, docs, tokenizer, config):
        return lm_batches(docs, tokenizer, config.seq_len, config.batch_size, config.seed)


def test_a_new_objective_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "every-other", EveryOtherToken)  # the registry line
    docs = make_toy_docs(40)
    corpus = str(write_jsonl(tmp_path / "c.jsonl", docs))
    cfg = dict(max_steps=4, batch_size=2, seq_len=16, save_every=2, lr=1e-3, warmup_steps=0)

    def run(out, **kw):
        setup = TrainSetup(out, corpus, TrainConfig(**cfg), progress=False, **kw)
        return train_objective(make_objective("every-other"), setup)

    full = run(tmp_path / "full")
    assert run(tmp_path / "split", stop_after=2).final_dir is None
    resumed = run(tmp_path / "split")
    assert full.step == resumed.step == 4 and resumed.losses == pytest.approx(full.losses, rel=1e-6)
    # update 1 is the toy loss of the toy's first batch under the initial weights: the driver used both
    tok = AutoTokenizer.from_pretrained(tmp_path / "full" / "tokenizer")
    first = next(iter(EveryOtherToken().batches(docs, tok, TrainConfig(**cfg))(0)))
    initial = scratch_gpt2("1x64", tok, n_positions=32, dropout=0.0, seed=0)
    with torch.no_grad():
        assert full.losses[0] == pytest.approx(float(every_other_token_loss(initial, first)), rel=1e-5)
    identity = json.loads((tmp_path / "full" / "run.json").read_text())["identity"]
    assert identity["loss"] == "test_train_driver.every_other_token_loss" and identity["corpus"] == corpus
    assert full.valid_loss is None and not any("valid_loss" in e for e in full.log)  # validation None: none
    assert (tmp_path / "full" / "final" / "tokenizer.json").exists()
    with pytest.raises(MemlmError, match="unknown training objective 'nope': use one of lm, .*every-other"):
        make_objective("nope")


def test_every_named_objective_is_registered():
    assert list(OBJECTIVES) == ["lm", "trime", "trime-long", "trime-ext", "npm", "npm-single", "mlm"]
    assert all(make_objective(name).name == name for name in OBJECTIVES)
    with pytest.raises(MemlmError, match="valid_tokens must be >= 0"):
        train_objective(make_objective("lm"), TrainSetup("unused", "unused", TrainConfig(), valid_tokens=-1))


# --------------------------------------------------------------------------------- run folders from before the driver

# run.json of `memlm train` as main wrote it before the driver (commit 5f764d8; losses under their current module
# paths), for the setups of SETUPS below stopped after 2 updates ({corpus}, {bert}: the paths; {tokenizer}: the
# tokenizer's fingerprint).
OLD_RUN_JSON = {
    "lm": r"""{
  "format": "memlm-train-run",
  "identity": {
    "batches": null,
    "corpus": "{corpus}",
    "corpus_fingerprint": "d1c1033cce308aa9",
    "dropout": 0.1,
    "init": "scratch 2x64",
    "loss": "memlm.training.loop.causal_lm_loss",
    "n_positions": 32,
    "tokenizer": "{tokenizer}",
    "tokenizer_spec": "bpe:300",
    "warmup_loss": null
  }
}
""",
    "trime-long": r"""{
  "format": "memlm-train-run",
  "identity": {
    "batches": "memlm.trime.training.trime_objective.<locals>.batches{\"batch_size\": 4, \"bm25_k\": 20, \"kind\": \"long\", \"m\": 2, \"packing\": \"bm25\", \"seed\": 0, \"seq_len\": 16}",
    "corpus": "{corpus}",
    "corpus_fingerprint": "d1c1033cce308aa9",
    "dropout": 0.1,
    "init": "scratch 2x64",
    "loss": "memlm.trime.training.TrimeObjective{\"detach_memory\": false, \"drop_local_p\": 0.9, \"generator\": null, \"kind\": \"long\", \"scale\": null}",
    "n_positions": 32,
    "tokenizer": "{tokenizer}",
    "tokenizer_spec": "bpe:300",
    "warmup_loss": "memlm.training.loop.causal_lm_loss"
  }
}
""",  # noqa: E501
    "npm": r"""{
  "format": "memlm-train-run",
  "identity": {
    "corpus": "{corpus}",
    "corpus_fingerprint": "d1c1033cce308aa9",
    "init": "encoder {bert}",
    "loss": "memlm.npm.objective.NpmObjective{\"budget\": 0.15, \"kind\": \"npm\", \"mask_e\": 103, \"mask_s\": 103, \"max_repeat\": 10, \"max_span\": 10, \"max_spans\": 128, \"p\": 0.5, \"pad_id\": 0, \"reduction\": \"sum\", \"seed\": 0}",
    "tokenizer": "{tokenizer}",
    "warmup_loss": null
  }
}
""",  # noqa: E501
    "mlm": r"""{
  "format": "memlm-train-run",
  "identity": {
    "corpus": "{corpus}",
    "corpus_fingerprint": "d1c1033cce308aa9",
    "init": "encoder {bert}",
    "loss": "memlm.npm.mlm.MlmObjective{\"mask_id\": 103, \"prob\": 0.15, \"seed\": 0, \"vocab_size\": 30522}",
    "tokenizer": "{tokenizer}",
    "warmup_loss": null
  }
}
""",  # noqa: E501
}  # fmt: skip

COMMON = ["--seq-len", "16", "--batch-size", "4", "--steps", "4", "--lr", "1e-3", "--dtype", "float32",
          "--save-every", "2", "--eval-every", "2"]  # fmt: skip
LM = ["--from-scratch", "2x64", "--tokenizer", "bpe:300", "--n-positions", "32", "--valid-tokens", "32"]
SETUPS = {
    "lm": LM,
    "trime-long": [*LM, "--loss", "trime-long", "--segments-per-doc", "2", "--ce-warmup", "1"],
    "npm": ["--objective", "npm", "--model", "{bert}", "--valid-tokens", "40", "--warmup", "0"],
    "mlm": ["--objective", "mlm", "--model", "{bert}", "--valid-tokens", "40", "--warmup", "0"],
}
# the TrainConfig main's `memlm train` made of those flags
OLD_CONFIG = dict(lr=1e-3, weight_decay=0.1, max_steps=4, batch_size=4, grad_accum=1, seq_len=16, dtype="float32",
                  save_every=2, seed=0, device="auto")  # fmt: skip
OLD_CHANGES = {"lm": dict(warmup_steps=0.05, eval_every=2, warmup_loss_steps=0),
               "trime-long": dict(warmup_steps=0.05, eval_every=2, warmup_loss_steps=1.0),
               "npm": dict(warmup_steps=0.0, eval_every=0), "mlm": dict(warmup_steps=0.0, eval_every=0)}  # fmt: skip


def _old_causal_lm_run(name: str, out, corpus: str, config: TrainConfig):
    """main's train_lm._train_lm (before the driver), for SETUPS' causal LMs, stopped after 2 updates."""
    from memlm.trime.training import trime_objective

    loss_fn, warmup_loss, batches = causal_lm_loss, causal_lm_loss, None
    if name == "trime-long":
        loss_fn, batches = trime_objective(name, seq_len=16, batch_size=4, seed=0, segments_per_doc=2)
    docs = load_corpora(corpus, "train")
    identity = {"corpus": corpus, "corpus_fingerprint": corpus_fingerprint(docs), "init": "scratch 2x64",
                "tokenizer_spec": "bpe:300", "n_positions": 32, "dropout": 0.1,
                "batches": describe_callable(batches)}  # fmt: skip
    tok = make_tokenizer("bpe:300", [d.text for d in docs])
    tok.save_pretrained(out / "tokenizer")
    lm = scratch_gpt2("2x64", tok, 32, 0.1, config.seed)
    train_batches = batches(docs, tok) if batches else lm_batches(docs, tok, 16, 4, config.seed)
    valid = lm_batches(load_corpora(corpus, "valid"), tok, 16, 4, shuffle=False)
    valid.chunks = valid.chunks[: max(1, 32 // 16)].copy()
    train(lm, config, train_batches, valid, loss_fn=loss_fn, out_dir=out, warmup_loss=warmup_loss, stop_after=2,
          progress=False, tokenizer=tok, identity={**identity, "tokenizer": tokenizer_fingerprint(tok)})  # fmt: skip


def _old_encoder_run(name: str, out, corpus: str, config: TrainConfig, bert: str):
    """main's train_npm / train_mlm (before the driver), for SETUPS' encoders, stopped after 2 updates."""
    from memlm.npm.mlm import MlmObjective, mlm_model
    from memlm.npm.objective import npm_batches, npm_objective

    docs = load_corpora(corpus, "train")
    model, tok = load_encoder(bert, dtype="float32")
    if name == "npm":
        model.train()
        loss_fn, factory = npm_objective("npm", seq_len=16, batch_size=4, seed=0, budget=None, max_span=None)
        batches = factory(docs, tok)
    else:
        torch.manual_seed(config.seed)
        model = mlm_model(model)
        model.train()
        loss_fn = MlmObjective(tok, prob=0.15, seed=0)
        batches = npm_batches(docs, tok, seq_len=16, batch_size=4, seed=0)
    identity = {"corpus": corpus, "corpus_fingerprint": corpus_fingerprint(docs), "init": f"encoder {bert}",
                "tokenizer": tokenizer_fingerprint(tok)}  # fmt: skip
    train(model, config, batches, None, loss_fn=loss_fn, out_dir=out, warmup_loss=None, stop_after=2, progress=False,
          tokenizer=tok, identity=identity)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    corpus = str(write_jsonl(root / "c.jsonl", make_toy_docs(40)))
    return corpus, str(_save_tiny_bert(root / "bert", load_encoder("minilm-l6")[1], 0))


@pytest.mark.parametrize("name", list(SETUPS))
def test_a_run_folder_written_before_the_driver_resumes(name, world, tmp_path, capsys):
    torch.set_num_threads(2)
    corpus, bert = world
    old, new = tmp_path / "old", tmp_path / "new"
    config = TrainConfig(**OLD_CONFIG, **OLD_CHANGES[name])
    if name in ("npm", "mlm"):
        _old_encoder_run(name, old, corpus, config, bert)
    else:
        _old_causal_lm_run(name, old, corpus, config)
    tokenizer = tokenizer_fingerprint(AutoTokenizer.from_pretrained(old / "checkpoint-2"))
    expected = OLD_RUN_JSON[name].replace("{corpus}", corpus).replace("{bert}", bert)
    run_json = (old / "run.json").read_text()
    assert run_json == expected.replace("{tokenizer}", tokenizer)  # the folder is the one main wrote
    old_log = json.loads((old / "log.json").read_text())
    argv = ["train", "--corpus", corpus, *COMMON, *(a.replace("{bert}", bert) for a in SETUPS[name])]
    assert main([*argv, "--out", str(old)]) == 0  # resumes (a refused identity or config exits 2)
    assert main([*argv, "--out", str(new)]) == 0  # the same run uninterrupted
    assert "trained 4 updates" in capsys.readouterr().out
    assert (old / "run.json").read_text() == run_json
    resumed, full = (json.loads((d / "log.json").read_text()) for d in (old, new))
    assert resumed["config"] == full["config"] == old_log["config"]
    assert resumed["log"][:2] == old_log["log"]  # continued from the old checkpoint, not started over
    for key in ("loss", "valid_loss"):
        got, want = ([e.get(key, math.nan) for e in run["log"]] for run in (resumed, full))
        assert got == pytest.approx(want, rel=1e-5, nan_ok=True), key
    a, b = load_file(old / "final" / "model.safetensors"), load_file(new / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)
