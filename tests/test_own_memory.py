"""docs/ARCHITECTURE.md's memory of one's own (``BigramMemory``), run from the page itself: scored into the table,
fitted by the one fitter, reported, and mixed at a generation step, each checked against NumPy."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_toy_docs

from memlm.core.mixture import Mixture
from memlm.knnlm.generate import MixtureLogitsProcessor, generate_text
from memlm.knnlm.scoring import score_tokens
from memlm.mixing.report import fit_table, report

PAGE = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def _blocks() -> list[str]:
    """The page's Python blocks under "A memory of your own": the class, then its use."""
    section = PAGE.read_text().split("### A memory of your own", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _memory_class():
    """The page's first block, executed: its BigramMemory."""
    code = _blocks()[0]
    assert 25 <= len(code.strip().splitlines()) <= 40, "the worked example stays about thirty lines"
    space: dict = {}
    exec(compile(code, str(PAGE), "exec"), space)  # noqa: S102 - the page's own example
    return space["BigramMemory"]


@pytest.fixture(scope="module")
def scored(tiny_lm):
    model, tok = tiny_lm
    docs = make_toy_docs(40, seed=3)
    reference = [t for d in make_toy_docs(60, seed=4) for t in tok(d.text)["input_ids"]]
    memory = _memory_class()(reference)
    table = score_tokens(model, tok, docs, [memory], window=64, min_context=32, progress=False)
    return model, tok, docs, reference, memory, table


def _bigram_p(reference: list[int], prev: int, w: int) -> float:
    """cnt(prev · w) / cnt(prev), counted over the reference stream by brute force."""
    pairs = list(zip(reference, reference[1:], strict=False))
    total = sum(1 for a, _ in pairs if a == prev)
    return sum(1 for a, b in pairs if a == prev and b == w) / total if total else 0.0


def test_its_columns_are_the_bigram_probabilities(scored):
    model, tok, docs, reference, memory, table = scored
    assert table.names() == ("bigram",)
    tokens = {i: tok(d.text)["input_ids"] for i, d in enumerate(docs)}
    lp = table.logprob("bigram").numpy()
    for row in range(0, len(table), 37):
        d, p = int(table.doc_index[row]), int(table.position[row])
        prev = tokens[d][p - 1] if p else -1
        want = _bigram_p(reference, prev, int(table.targets[row])) if p else 0.0
        assert lp[row] == (pytest.approx(math.log(want)) if want > 0 else -math.inf)


def test_the_fitter_and_the_report_mix_it_as_the_formula(scored):
    *_, table = scored
    found = fit_table(table, "constant")
    w = found.mixture.log_weights(np.zeros((1, len(found.mixture.feature_names)))).exp()[0].numpy()
    lm, bigram = np.exp(table.lm_logprob.astype(np.float64)), np.exp(table.logprob("bigram").numpy())
    # EM's fixed point: the mean posterior of the bigram equals its weight (the MLE's stationarity condition)
    post = w[1] * bigram / (w[0] * lm + w[1] * bigram)
    assert post.mean() == pytest.approx(w[1], abs=1e-6)
    rows = report(table, {"base_ppl": Mixture.lm_only(("lm", "bigram")), "bigram_ppl": found.mixture})
    assert rows["bigram_ppl"] == pytest.approx(math.exp(-np.log(w[0] * lm + w[1] * bigram).mean()), rel=1e-9)
    assert rows["bigram_ppl"] < rows["base_ppl"]  # the toy corpora share their word pairs


def test_a_generation_step_mixes_its_distribution(scored):
    model, tok, _, reference, memory, table = scored
    mixture = fit_table(table, "constant").mixture
    prompt = tok("the cat sat on")["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad(), MixtureLogitsProcessor(model, [memory], mixture) as proc:
        got = proc(ids, model(input_ids=ids).logits[:, -1])[0].double()
    w = mixture.log_weights(np.zeros((1, len(mixture.feature_names)))).exp()[0].numpy()
    with torch.no_grad():
        lm = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1).exp().numpy()
    for word in ("the", " mat", " dog", " cat"):
        t = tok(word)["input_ids"][0]
        want = w[0] * lm[t] + w[1] * _bigram_p(reference, prompt[-1], t)
        assert float(got[t].exp()) == pytest.approx(want, rel=1e-4)
    assert generate_text(model, tok, ["the cat"], [memory], mixture, max_new_tokens=3)[0]


def test_the_pages_usage_block_runs_as_written(tiny_lm, capsys):
    """The page's second block, run as written with a tiny model and toy text in its names."""
    from transformers import AutoModelForCausalLM, GPT2Config

    import memlm

    torch.manual_seed(0)  # a tiny GPT-2 that reads memlm eval's default 1,024-token windows
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=1024, vocab_size=50257)
    model, tok = AutoModelForCausalLM.from_config(cfg).eval(), tiny_lm[1]
    space = {"memlm": memlm, "model": model, "tok": tok, "BigramMemory": _memory_class(),
             "reference_text": " ".join(d.text for d in make_toy_docs(60, seed=4)),
             "held_out_docs": make_toy_docs(40, seed=3)}  # fmt: skip
    exec(compile(_blocks()[1], str(PAGE), "exec"), space)  # noqa: S102 - the page's own example
    assert float(capsys.readouterr().out.split()[-1]) > 1
