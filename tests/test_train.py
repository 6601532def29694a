"""The shared training loop: learning, schedule, exact resume, swappable losses, gradient accumulation, errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import gpt2_tokenizer, make_toy_docs, tiny_gpt2
from transformers import GPT2LMHeadModel

from memlm.errors import MemlmError
from memlm.training.loop import (
    TrainConfig,
    causal_lm_loss,
    gpt2_shape_config,
    lm_batches,
    lr_at,
    parse_arch,
    train,
)

TOK = gpt2_tokenizer()


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_training_lowers_loss_and_reports_valid_ppl(tmp_path):
    torch.set_num_threads(2)
    docs = make_toy_docs(20, seed=0) * 2
    batches = lm_batches(docs, TOK, seq_len=32, batch_size=4, seed=0)
    valid = lm_batches(make_toy_docs(6, seed=1), TOK, seq_len=32, batch_size=4, shuffle=False)
    cfg = TrainConfig(lr=3e-3, warmup_steps=3, max_steps=30, batch_size=4, seq_len=32, eval_every=10, seed=0)
    model = tiny_gpt2(0)
    result = train(model, cfg, batches, valid, out_dir=tmp_path, progress=False)

    losses = result.losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses  # ln(50257) ~ 10.8 at start; the 20-word corpus is easy
    ppls = [(e["step"], e["valid_ppl"]) for e in result.log if "valid_ppl" in e]
    assert [s for s, _ in ppls] == [10, 20, 30]
    assert all(math.isfinite(p) and p > 1 for _, p in ppls)
    assert ppls[-1][1] < ppls[0][1]
    assert result.valid_ppl == ppls[-1][1]
    # logged lr follows the schedule formula
    for e in result.log:
        assert e["lr"] == pytest.approx(lr_at(cfg, e["step"] - 1), rel=1e-9)
    logged = json.loads((tmp_path / "log.json").read_text())
    assert [e["loss"] for e in logged["log"]] == losses
    assert all(e["tokens_per_s"] > 0 for e in logged["log"])
    reloaded = GPT2LMHeadModel.from_pretrained(result.final_dir)
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k


def test_lr_schedule_formula():
    cfg = TrainConfig(lr=2.0, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.5)
    assert lr_at(cfg, 1) == pytest.approx(1.0)
    assert lr_at(cfg, 3) == pytest.approx(2.0)
    assert lr_at(cfg, 4) == pytest.approx(2.0)  # cosine starts at its peak
    assert lr_at(cfg, 12) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway through the decay
    assert lr_at(cfg, 16) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75))))
    assert lr_at(cfg, 20) == pytest.approx(0.2)  # decays to 10%
    frac = TrainConfig(lr=1.0, warmup_steps=0.1, max_steps=50, min_lr_ratio=0.0)
    assert frac.resolved_warmup() == 5
    assert lr_at(frac, 4) == pytest.approx(1.0)
    assert lr_at(frac, 50) == pytest.approx(0.0, abs=1e-12)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    torch.set_num_threads(2)
    docs = make_toy_docs(8, seed=2)
    batches = lm_batches(docs, TOK, seq_len=16, batch_size=4, seed=3)  # a few batches per epoch: crosses epochs
    assert 2 <= len(batches) <= 6
    cfg = TrainConfig(lr=2e-3, warmup_steps=2, max_steps=8, batch_size=4, seq_len=16, save_every=2, seed=7)

    whole = tiny_gpt2(0)  # dropout 0.1 on: the RNG state must be restored too
    full = train(whole, cfg, batches, out_dir=tmp_path / "a", progress=False)
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]

    first = tiny_gpt2(0)
    half = train(first, cfg, batches, out_dir=tmp_path / "b", stop_after=4, progress=False)
    assert half.step == 4 and half.final_dir is None
    assert (tmp_path / "b" / "checkpoint-4").is_dir()
    other_init = tiny_gpt2(5)  # the checkpoint's weights replace these
    resumed = train(other_init, cfg, batches, out_dir=tmp_path / "b", progress=False)

    assert resumed.step == 8
    assert resumed.losses == full.losses
    want, got = _params(whole), _params(other_init)
    for k in want:
        assert torch.equal(want[k], got[k]), k

    wrong = tiny_gpt2(0, n_embd=16)
    with pytest.raises(MemlmError, match="another model"):
        train(wrong, cfg, batches, out_dir=tmp_path / "b", progress=False)


def test_custom_loss_and_warmup_loss(tmp_path):
    torch.set_num_threads(2)
    calls: list[str] = []

    def doubled(model, batch):
        calls.append("custom")
        assert "segment_ids" in batch  # extra fields reach the loss
        return causal_lm_loss(model, batch) * 2

    def warm(model, batch):
        calls.append("warmup")
        return causal_lm_loss(model, batch)

    ids = torch.from_numpy(lm_batches(make_toy_docs(10), TOK, seq_len=16, batch_size=64).chunks[:8].copy())
    data = [{"input_ids": ids[i : i + 2], "segment_ids": torch.zeros(2, dtype=torch.long)} for i in range(0, 8, 2)]
    cfg = TrainConfig(lr=1e-4, warmup_steps=0, max_steps=6, grad_accum=2, batch_size=2, seq_len=16, warmup_loss_steps=3)
    result = train(tiny_gpt2(0), cfg, data, loss_fn=doubled, warmup_loss=warm, out_dir=tmp_path, progress=False)
    assert calls == ["warmup"] * 6 + ["custom"] * 6  # 3 updates x 2 micro-batches each
    assert result.losses[3] > 1.6 * result.losses[2]  # the doubled loss is what gets logged

    calls.clear()
    frac = TrainConfig(lr=1e-4, warmup_steps=0, max_steps=4, seq_len=16, warmup_loss_steps=0.5)
    train(tiny_gpt2(0), frac, data, loss_fn=doubled, warmup_loss=warm, out_dir=tmp_path / "f", progress=False)
    assert calls == ["warmup"] * 2 + ["custom"] * 2


def test_grad_accumulation_matches_large_batch(tmp_path):
    torch.set_num_threads(2)
    ids = torch.from_numpy(lm_batches(make_toy_docs(10), TOK, seq_len=16, batch_size=64).chunks[:4].copy())
    # eps=1 makes Adam's first step ~ lr * g (not sign(g)), so a wrongly scaled gradient would show
    common = dict(lr=0.5, eps=1.0, weight_decay=0.01, warmup_steps=0, max_steps=1, seq_len=16, max_grad_norm=None)
    big = _no_dropout(tiny_gpt2(0))
    small = _no_dropout(tiny_gpt2(0))
    start = _params(big)
    r1 = train(
        big,
        TrainConfig(batch_size=4, grad_accum=1, **common),
        [{"input_ids": ids}],
        out_dir=tmp_path / "1",
        progress=False,
    )
    r2 = train(
        small,
        TrainConfig(batch_size=2, grad_accum=2, **common),
        [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}],
        out_dir=tmp_path / "2",
        progress=False,
    )
    assert r1.losses[0] == pytest.approx(r2.losses[0], rel=1e-5)
    a, b = _params(big), _params(small)
    assert any(not torch.equal(a[k], start[k]) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_errors_a_user_can_cause(tmp_path):
    with pytest.raises(MemlmError, match="fewer than one sequence"):
        lm_batches([], TOK, seq_len=16)
    with pytest.raises(MemlmError, match="fewer than one sequence"):
        lm_batches(make_toy_docs(1), TOK, seq_len=100_000)
    with pytest.raises(MemlmError, match="positions"):
        train(tiny_gpt2(0), TrainConfig(seq_len=1024, max_steps=1), [], out_dir=tmp_path, progress=False)
    with pytest.raises(MemlmError, match="no batches"):
        train(tiny_gpt2(0), TrainConfig(seq_len=16, max_steps=1), [], out_dir=tmp_path, progress=False)
    with pytest.raises(MemlmError, match="bad model size"):
        parse_arch("7b")


def test_gpt2_preset_shapes():
    model = GPT2LMHeadModel(gpt2_shape_config(*parse_arch("5m"), 50257, 1024, 0.1))
    assert sum(p.numel() for p in model.parameters()) == 5_370_528  # the size GPT2_SIZES names
    assert parse_arch("50m")[1] == 512 and parse_arch("6x384") == (6, 384, 6)
    assert gpt2_shape_config(*parse_arch("20m"), 1000, 64, 0.0).resid_pdrop == 0.0


def test_no_weight_decay_on_biases_and_norms():
    from memlm.training.loop import _optimizer

    model = tiny_gpt2(0)
    opt = _optimizer(model, TrainConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (name.endswith("weight") and "ln_" not in name), name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_bfloat16_autocast_and_resume_with_other_settings(tmp_path):
    torch.set_num_threads(2)
    batches = lm_batches(make_toy_docs(8), TOK, seq_len=16, batch_size=2, seed=0)
    cfg = TrainConfig(lr=1e-3, max_steps=4, seq_len=16, dtype="bfloat16", save_every=2)
    result = train(tiny_gpt2(0), cfg, batches, batches, out_dir=tmp_path, stop_after=2, progress=False)
    assert all(math.isfinite(x) for x in result.losses)
    assert not list(tmp_path.glob(".*tmp*"))  # temporary folders were renamed into place
    changed = TrainConfig(lr=2e-3, max_steps=4, seq_len=16, dtype="bfloat16", save_every=2)
    with pytest.raises(MemlmError, match="lr differ"):
        train(tiny_gpt2(0), changed, batches, out_dir=tmp_path, progress=False)
    done = train(tiny_gpt2(0), cfg, batches, batches, out_dir=tmp_path, progress=False)
    assert done.step == 4 and done.valid_ppl is not None and (tmp_path / "final" / "config.json").is_file()


def test_device_option_is_checked():
    assert TrainConfig(device="cpu").torch_device() == torch.device("cpu")
    assert TrainConfig().torch_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(MemlmError, match="device must be"):
        TrainConfig(device="gpu0").validate()
    if not torch.cuda.is_available():
        with pytest.raises(MemlmError, match="no CUDA GPU"):
            TrainConfig(device="cuda").validate()


# --------------------------------------------------------------------------------- run identity and crash safety


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    return str(path)


def test_rerun_with_other_corpus_tokenizer_model_or_loss_is_refused(tmp_path, capsys):
    from memlm.cli import main
    from memlm.training.lm import train_lm

    torch.set_num_threads(2)
    corpus = _jsonl(tmp_path / "c.jsonl", make_toy_docs(40))
    other = _jsonl(tmp_path / "o.jsonl", make_toy_docs(40, seed=5))
    cfg = dict(max_steps=4, batch_size=2, seq_len=16, save_every=2, lr=1e-3)
    args = dict(scratch="2x64", tokenizer="bpe:300", valid_tokens=0, n_positions=32, progress=False)
    out = tmp_path / "run"
    part = train_lm(out, corpus, TrainConfig(**cfg), stop_after=2, **args)
    assert part.step == 2
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for change, named in [
        ({"corpus": other}, "corpus_fingerprint"),
        ({"tokenizer": "bpe:400"}, "tokenizer_spec bpe:300 -> bpe:400"),
        ({"scratch": "2x128"}, "init scratch 2x64 -> scratch 2x128"),
        ({"dropout": 0.0}, "dropout 0.1 -> 0.0"),
    ]:
        kw = {"corpus": corpus, **args, **change}
        with pytest.raises(MemlmError) as e:
            train_lm(out, kw.pop("corpus"), TrainConfig(**cfg), **kw)
        assert named in str(e.value) and "--no-resume" in str(e.value), str(e.value)
    from memlm.trime.training import trime_objective

    loss_fn, batches = trime_objective("trime", seq_len=16, batch_size=2)
    with pytest.raises(MemlmError, match="loss memlm.training.loop.causal_lm_loss -> memlm.trime"):
        train_lm(out, corpus, TrainConfig(**cfg), loss_fn=loss_fn, **args)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # refused before anything was written (no tokenizer retrained, no checkpoint)
    # the CLI names the difference in one line
    base = ["train", "--out", str(out), "--from-scratch", "2x64", "--tokenizer", "bpe:300", "--n-positions", "32",
            "--seq-len", "16", "--batch-size", "2", "--steps", "4", "--save-every", "2", "--lr", "1e-3",
            "--valid-tokens", "0", "--dtype", "float32", "--warmup", "0.05", "--weight-decay", "0.1"]  # fmt: skip
    assert main([*base, "--corpus", other]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "corpus" in err and "Traceback" not in err
    # the same settings resume to the uninterrupted result
    done = train_lm(out, corpus, TrainConfig(**cfg), **args)
    full = train_lm(tmp_path / "full", corpus, TrainConfig(**cfg), **args)
    assert done.step == 4 and done.losses == pytest.approx(full.losses, rel=1e-6)
    # --no-resume starts over: the old run's checkpoints are gone, the new settings are recorded
    fresh = train_lm(out, other, TrainConfig(**cfg), resume=False, stop_after=2, **args)
    assert fresh.step == 2 and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "final").exists()
    assert json.loads((out / "run.json").read_text())["identity"]["corpus"] == other


def test_a_loss_recorded_under_a_moved_module_path_is_refused_naming_the_new_one(tmp_path):
    """A run.json that names its loss by a module path that moved (memlm.train before the training package) is
    refused with the function's new path and how to resume; another loss stays the generic refusal."""
    batches = lm_batches(make_toy_docs(8), TOK, seq_len=16, batch_size=2, seed=0)
    cfg = TrainConfig(lr=1e-3, max_steps=4, seq_len=16, save_every=2)
    train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, stop_after=2, progress=False)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["identity"]["loss"] == "memlm.training.loop.causal_lm_loss"
    record["identity"]["loss"] = "memlm.train.causal_lm_loss"
    (tmp_path / "run.json").write_text(json.dumps(record))
    with pytest.raises(MemlmError) as e:
        train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)
    msg = str(e.value)
    assert "loss memlm.train.causal_lm_loss is now memlm.training.loop.causal_lm_loss" in msg, msg
    assert "module paths that moved" in msg and "run.json" in msg and "--no-resume" in msg
    record["identity"]["loss"] = "memlm.train.another_loss"
    (tmp_path / "run.json").write_text(json.dumps(record))
    with pytest.raises(MemlmError, match="other settings") as e:
        train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)
    assert "moved" not in str(e.value)
    record["identity"]["loss"] = "memlm.training.loop.causal_lm_loss"  # the new name written in: the run resumes
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False).step == 4


@pytest.mark.parametrize("bad", ["random", "{}", "[]", "types"])
def test_malformed_run_record_or_checkpoint_state(tmp_path, bad):
    batches = lm_batches(make_toy_docs(8), TOK, seq_len=16, batch_size=2, seed=0)
    cfg = TrainConfig(lr=1e-3, max_steps=4, seq_len=16, save_every=2)
    train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, stop_after=2, progress=False)
    blob = {"random": b"\x93\x00garbage", "{}": b"{}", "[]": b"[]", "types": b'{"format": 3, "identity": []}'}[bad]
    (tmp_path / "run.json").write_bytes(blob)
    with pytest.raises(MemlmError, match="run.json is not a valid training-run record") as e:
        train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)
    assert "\n" not in str(e.value)
    (tmp_path / "run.json").unlink()
    state = tmp_path / "checkpoint-2" / "training_state.pt"
    good = state.read_bytes()
    for broken in (good[: len(good) // 2], b"", os.urandom(100)):
        state.write_bytes(broken)
        with pytest.raises(MemlmError, match="training_state.pt is unreadable"):
            train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)
    torch.save({"step": "two"}, state)
    with pytest.raises(MemlmError, match="not a valid checkpoint state"):
        train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)


def test_disk_full_during_a_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    batches = lm_batches(make_toy_docs(8), TOK, seq_len=16, batch_size=2, seed=0)
    cfg = TrainConfig(lr=1e-3, max_steps=4, seq_len=16, save_every=2)
    real = torch.save

    def full(obj, f, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(MemlmError, match="disk full while writing .*: free space and rerun the same command"):
        train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False)
    monkeypatch.setattr(torch, "save", real)
    assert not (tmp_path / ".memlm.lock").exists()
    assert train(tiny_gpt2(0), cfg, batches, out_dir=tmp_path, progress=False).step == 4
