"""The shared training loop: learning, schedule, exact resume, swappable losses, gradient accumulation, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import gpt2_tokenizer, make_toy_docs, tiny_gpt2
from transformers import GPT2LMHeadModel

from memlm.errors import MemlmError
from memlm.train import (
    TrainConfig,
    causal_lm_loss,
    gpt2_config,
    gpt2_param_count,
    lm_batches,
    lr_at,
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
    with pytest.raises(MemlmError, match="unknown GPT-2 size"):
        gpt2_config("7b")


def test_gpt2_config_param_counts():
    cfg = gpt2_config("5m", vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == gpt2_param_count(4, 96, 1000, 64)
    assert gpt2_param_count(4, 96) == 5_370_528
    assert gpt2_config(50_000_000).n_embd == 512
    assert gpt2_config("20m", dropout=0.0).resid_pdrop == 0.0


def test_no_weight_decay_on_biases_and_norms():
    from memlm.train import _optimizer

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
