"""``memlm demo``'s ∞-gram indexes go through the paper's decontamination (Liu et al. 2024, App. B) like ``memlm ngram
build``: against the valid and test splits of every corpus the demo evaluates, recorded in the index's manifest."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("infini_gram")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import Doc, gpt2_tokenizer  # noqa: E402
from test_ngram_decontaminate import _brute, _text  # noqa: E402


def test_demo_indexes_are_decontaminated_and_record_it(monkeypatch, tmp_path):
    """The demo's index build (_ngram_memory, the path run_demo takes) with stand-in corpora: the reference documents
    the brute-force transcription of the rule finds in any evaluated split (wiki and news, valid and test) are not
    indexed, the manifest records the rule and the four sets; with decontaminate=False all are indexed."""
    import memlm.data.corpora as corpora
    import memlm.experiments.demo as demo

    rng = random.Random(5)
    evals = {(c, s): [Doc(f"{c}-{s}{i}", _text(rng, 40)) for i in range(2)] for c in ("wiki", "news")
             for s in ("valid", "test")}  # fmt: skip
    train = [Doc(f"t{i}", _text(rng, 30)) for i in range(12)]
    train += [Doc(f"leak-{c}-{s}", "Intro: " + ds[0].text) for (c, s), ds in evals.items()]
    rng.shuffle(train)

    def load(name, split="test"):
        return list(train) if split == "train" else list(evals[(name, split)])

    monkeypatch.setattr(demo, "load_documents", load)
    monkeypatch.setattr(corpora, "load_documents", load)
    tok = gpt2_tokenizer()
    cfg = demo.DemoConfig(ngram_tokens=None)
    memory = demo._ngram_memory(cfg, tok, "wiki", tmp_path)
    m = memory.index.manifest
    _, drop = _brute(train, [d for ds in evals.values() for d in ds])
    assert sum(drop) == 4 and all(d.id.startswith("leak") for d, x in zip(train, drop, strict=True) if x)
    assert m["documents"] == len(train) - 4
    rec = m["sources"][0]["decontamination"]
    assert sorted(rec["eval_sets"]) == ["news:test", "news:valid", "wiki:test", "wiki:valid"]
    assert sorted(d["id"] for d in rec["dropped"]) == sorted(d.id for d, x in zip(train, drop, strict=True) if x)
    assert "App. B" in rec["rule"] and rec["n"] == 13 and rec["threshold"] == 0.8
    assert m["sources"][0]["documents"] == len(train) - 4
    off = demo._ngram_memory(demo.DemoConfig(decontaminate=False), tok, "news", tmp_path)
    assert off.index.manifest["documents"] == len(train) and "decontamination" not in off.index.manifest["sources"][0]
    assert cfg.digest() != demo.DemoConfig(decontaminate=False).digest()  # a cached undecontaminated run is not reused
    # the indexed documents' hashes are recorded as `memlm ngram build` records them, for eval's leakage check
    from memlm.leakage import document_record

    kept = [d for d, x in zip(train, drop, strict=True) if not x]
    assert m["sources"][0]["document_hashes"] == document_record(kept)
