"""``memlm demo``'s memories go through the paper's decontamination (Liu et al. 2024, App. B) like ``memlm ngram
build``: against the test split of every corpus the demo evaluates, recorded with the memories' source."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import Doc, gpt2_tokenizer  # noqa: E402
from test_ngram_decontaminate import _brute, _text  # noqa: E402


def test_demo_training_text_is_decontaminated_and_records_it(monkeypatch):
    """The demo's training text (_training_text, the path run_demo takes) with stand-in corpora: the reference
    documents the brute-force transcription of the rule finds in any evaluated split (wiki and imdb test) are in
    neither memory nor the calibration slice, the source records the rule and the two sets; with decontaminate=False
    all are kept."""
    import memlm.data.corpora as corpora
    import memlm.experiments.demo as demo

    rng = random.Random(5)
    evals = {c: [Doc(f"{c}-test{i}", _text(rng, 40)) for i in range(2)] for c in ("wiki", "imdb")}
    train = [Doc(f"t{i}", _text(rng, 30)) for i in range(40)]
    train += [Doc(f"leak-{c}", "Intro: " + ds[0].text) for c, ds in evals.items()]
    rng.shuffle(train)

    def load(name, split="test"):
        return list(train) if split == "train" else list(evals[name])

    monkeypatch.setattr(demo, "load_documents", load)
    monkeypatch.setattr(corpora, "load_documents", load)
    tok = gpt2_tokenizer()
    cfg = demo.DemoConfig(ngram_tokens=None, holdout_tokens=200, datastore_tokens=300)
    ds_docs, ngram_docs, held, source = demo._training_text(cfg, tok, "wiki")
    _, drop = _brute(train, [d for ds in evals.values() for d in ds])
    dropped = {d.id for d, x in zip(train, drop, strict=True) if x}
    assert dropped == {"leak-wiki", "leak-imdb"}
    ids = {d.id for d in ngram_docs} | {d.id for d in held}
    assert len(ids) == len(train) - 2 and not ids & dropped and {d.id for d in ds_docs} <= {d.id for d in ngram_docs}
    assert not {d.id for d in held} & {d.id for d in ngram_docs}  # the slice is in neither memory
    rec = source["decontamination"]
    assert sorted(rec["eval_sets"]) == ["imdb:test", "wiki:test"]
    assert sorted(d["id"] for d in rec["dropped"]) == sorted(dropped)
    assert "App. B" in rec["rule"] and rec["n"] == 13 and rec["threshold"] == 0.8
    off = demo.DemoConfig(decontaminate=False, ngram_tokens=None, holdout_tokens=200, datastore_tokens=300)
    _, ngram_off, held_off, source_off = demo._training_text(off, tok, "imdb")
    assert len(ngram_off) + len(held_off) == len(train) and "decontamination" not in source_off
    assert cfg.digest() != off.digest()  # a cached undecontaminated run is not reused
    # the documents a memory holds are recorded as `memlm ngram build` records them, for eval's leakage check
    from memlm.leakage import document_record

    assert demo._record(source, ngram_docs)["document_hashes"] == document_record(ngram_docs)
