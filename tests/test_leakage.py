"""Leakage refused at evaluation time (memlm.leakage): each kind of overlap between the evaluated
documents and a memory's recorded sources is refused with one error naming it, and allowed (and recorded) with
--allow-overlap; memlm tune refuses a --test dump of other memories or another model than --valid, and a --valid
dump of a test split."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import Doc, gpt2_tokenizer, make_toy_docs

from memlm.cli import main
from memlm.data.corpora import corpus_fingerprint, load_documents
from memlm.errors import MemlmError
from memlm.leakage import Evaluated, check_dumps, check_leakage, document_record


def _jsonl(path, docs) -> str:
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    return str(path)


def _stream(tok, docs) -> np.ndarray:
    ids = tok([d.text for d in docs], add_special_tokens=False)["input_ids"]
    return np.concatenate([np.r_[t, tok.eos_token_id] for t in ids]).astype(np.int32)


def _datastore(sources, values=None, path="ds"):
    """A stand-in with what the check reads of a datastore: its manifest's sources and its stored next tokens."""
    values = np.zeros(0, dtype=np.int32) if values is None else values
    return SimpleNamespace(path=path, manifest={"sources": sources}, values=values)


def _named(corpus: str, split: str, n: int = 3) -> Evaluated:
    docs = load_documents(corpus, split)[:n]
    return Evaluated(docs, corpus, split, corpus_fingerprint(docs))


# ------------------------------------------------------------------------------------------- the kinds of overlap


@pytest.mark.parametrize(
    ("memory_split", "eval_split", "refused"),
    [("train", "train", True), ("all", "test", True), ("train", "all", True), ("train", "test", False)],
)
def test_named_corpus_and_split(memory_split, eval_split, refused):
    """A memory built on a named corpus leaks into an evaluation of the same split, or where either side is 'all';
    train vs test of the same corpus (document-level splits) does not."""
    ev = _named("bbc", eval_split)
    ds = _datastore([{"corpus": "wiki,bbc", "split": memory_split}])
    if not refused:
        rec = check_leakage(ev, ds)
        assert rec["overlap"] == [] and rec["allow_overlap"] is False
        return
    with pytest.raises(MemlmError) as e:
        check_leakage(ev, ds)
    msg = str(e.value)
    assert "datastore ds" in msg and f"split {eval_split} evaluated, split {memory_split} in memory" in msg
    assert "--allow-overlap" in msg and msg.count("\n") == 0
    rec = check_leakage(ev, ds, allow_overlap=True)
    assert rec["allow_overlap"] is True and rec["overlap"][0]["memory"] == "datastore ds"
    assert rec["overlap"][0]["documents"] == (3 if eval_split == memory_split or "all" in (eval_split, memory_split)
                                              else 0)  # fmt: skip


def test_files_holding_the_same_documents_are_found_by_their_hashes():
    """Documents of a named corpus copied into a file (other ids, other corpus name) are found by the text hashes the
    build recorded; a memory without the record says that it could only compare names (a note)."""
    train = load_documents("bbc", "train")[:50]
    ds = _datastore([{"corpus": "bbc", "split": "train", "document_hashes": document_record(train)}])
    copied = [Doc(f"my/{i}", "  " + d.text + "\n") for i, d in enumerate(train[10:14])]
    other = [Doc("x", "a text of its own")]
    ev = Evaluated(copied + other, "my.jsonl", "test", corpus_fingerprint(copied + other))
    with pytest.raises(MemlmError, match=r"datastore ds holds 4 of the 5 evaluated documents"):
        check_leakage(ev, ds)
    rec = check_leakage(Evaluated(other, "my.jsonl", "test"), ds)
    assert rec["overlap"] == [] and rec["notes"] == []
    old = _datastore([{"corpus": "bbc", "split": "train"}])
    rec = check_leakage(ev, old)  # no hashes, no near-copy stream: not found (the note says what was compared)
    assert rec["overlap"] == [] and "record no document hashes" in rec["notes"][0]


def test_same_fingerprint_is_the_same_corpus():
    docs = make_toy_docs(5, seed=2)
    ev = Evaluated(docs, "a.jsonl", "test", corpus_fingerprint(docs))
    with pytest.raises(MemlmError, match="the same corpus content"):
        check_leakage(ev, _datastore([{"corpus": "b.jsonl", "split": "test", "fingerprint": corpus_fingerprint(docs)}]))


def _near_copies(docs):
    """Each document with its last word changed: all but a few of its 13-grams kept (>= 80% for long documents)."""
    out = []
    for i, d in enumerate(docs):
        words = d.text.split()
        out.append(Doc(f"near{i}", " ".join(words[:-1] + ["zebra"])))
    return out


def _long_docs(n: int, seed: int) -> list[Doc]:
    return [d for d in make_toy_docs(200, seed=seed) if len(d.text.split()) >= 45][:n]


def test_near_copies_in_a_datastore_by_the_13_gram_rule():
    """A datastore without document hashes still refuses near-copies of its documents (>= 80% of their model-token
    13-grams in its stored next tokens), and not unrelated documents of the same vocabulary."""
    tok = gpt2_tokenizer()
    stored, unrelated = _long_docs(6, seed=5), _long_docs(4, seed=6)
    ds = _datastore([{"corpus": "toy.jsonl", "split": "test"}], values=_stream(tok, stored))
    near = _near_copies(stored[:3])
    with pytest.raises(MemlmError, match=r"3 near-copies \(>= 80% of their 13-grams in it\)"):
        check_leakage(Evaluated(near + unrelated, "e.jsonl", "test"), ds, tokenizer=tok)
    assert check_leakage(Evaluated(unrelated, "e.jsonl", "test"), ds, tokenizer=tok)["overlap"] == []
    # a document with under 80% of its 13-grams in the datastore is no near-copy
    half = [Doc("h", " ".join(stored[0].text.split()[:20] + unrelated[0].text.split()[:40]))]
    assert check_leakage(Evaluated(half, "e.jsonl", "test"), ds, tokenizer=tok)["overlap"] == []


def test_near_copies_in_an_ngram_index_by_count_queries(tmp_path):
    """The same rule on an ∞-gram index, looked up by the engine's counts; the record names the index."""
    from memlm.ngram.index import build_ngram_index
    from memlm.ngram.memory import NgramMemory

    tok = gpt2_tokenizer()
    stored, unrelated = _long_docs(6, seed=7), _long_docs(3, seed=8)
    memory = NgramMemory(build_ngram_index(tok, stored, tmp_path / "ix", source={"corpus": "toy"}, progress=False))
    ev = Evaluated(_near_copies(stored[:2]) + unrelated, "e.jsonl", "test")
    with pytest.raises(MemlmError, match=rf"∞-gram index {tmp_path / 'ix'} holds 2 near-copies"):
        check_leakage(ev, None, memory, tok)
    rec = check_leakage(ev, None, [memory], tok, allow_overlap=True)
    assert rec["overlap"][0]["near_copies"] == 2 and rec["overlap"][0]["documents"] == 0
    assert check_leakage(Evaluated(unrelated, "e.jsonl", "test"), None, memory, tok)["overlap"] == []


# ------------------------------------------------------------------------------------------------ the commands


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm_dir):
    """A datastore and an ∞-gram index built by the commands from one file (so they record the document hashes)."""
    root = tmp_path_factory.mktemp("leak")
    train = _jsonl(root / "train.jsonl", make_toy_docs(40, seed=11))
    common = ["--model", str(tiny_lm_dir), "--corpus", train, "--dtype", "float32"]
    assert main(["datastore", "build", *common, "--out", str(root / "ds"), "--window", "64", "--min-context", "32",
                 "--factory", "Flat", "--holdout", "0"]) == 0  # fmt: skip
    assert main(["ngram", "build", *common, "--out", str(root / "ix"), "--holdout", "0"]) == 0
    return root


def test_builds_record_the_documents_they_hold_and_info_shows_only_their_count(built, capsys):
    """datastore build and ngram build record the text hashes of the documents they indexed (after the held-out slice
    and decontamination); `info` prints their count, not the hashes."""
    docs = make_toy_docs(40, seed=11)
    for folder, info in (("ds", ["datastore", "info"]), ("ix", ["ngram", "info"])):
        rec = json.loads((built / folder / "manifest.json").read_text())["sources"][0]["document_hashes"]
        assert rec["count"] == 40 and rec["uint64_b64"] == document_record(docs)["uint64_b64"]
        capsys.readouterr()
        assert main([*info, str(built / folder)]) == 0
        out = capsys.readouterr().out
        assert '"count": 40' in out and "uint64_b64" not in out


def _eval_args(tiny_lm_dir, corpus, *extra):
    return ["eval", "--model", str(tiny_lm_dir), "--corpus", corpus, "--window", "64", "--min-context", "32",
            "--dtype", "float32", *extra]  # fmt: skip


def test_eval_refuses_a_file_of_the_memorys_documents_and_records_allow_overlap(built, tiny_lm_dir, tmp_path, capsys):
    """memlm eval with a datastore and an index built from train.jsonl, on another file holding 3 of its documents
    (new ids): one error line naming both memories and the count; --allow-overlap runs and records it."""
    docs = make_toy_docs(40, seed=11)
    mixed = _jsonl(tmp_path / "mixed.jsonl", [Doc(f"copy{i}", d.text) for i, d in enumerate(docs[:3])]
                   + make_toy_docs(4, seed=12))  # fmt: skip
    args = _eval_args(tiny_lm_dir, mixed, "--memory", str(built / "ds"), "--memory", str(built / "ix"))
    capsys.readouterr()
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    assert f"datastore {built / 'ds'} holds 3 of the 7 evaluated documents" in err[0]
    assert f"∞-gram index {built / 'ix'} holds 3 of the 7" in err[0] and "--allow-overlap" in err[0]
    assert f"3 by text hash in its source {built / 'train.jsonl'}" in err[0]
    assert main([*args, "--allow-overlap", "--json", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["leakage"]["allow_overlap"] is True
    assert [o["documents"] for o in res["leakage"]["overlap"]] == [3, 3]
    clean = _jsonl(tmp_path / "clean.jsonl", make_toy_docs(4, seed=12))
    assert (
        main([*_eval_args(tiny_lm_dir, clean, "--memory", str(built / "ds")), "--json", str(tmp_path / "c.json")]) == 0
    )
    assert json.loads((tmp_path / "c.json").read_text())["leakage"] == {
        "allow_overlap": False, "overlap": [], "notes": [], "memories": [f"datastore {built / 'ds'}"]}  # fmt: skip


def test_generate_refuses_a_prompt_copied_from_the_memory(built, tiny_lm_dir, capsys):
    doc = next(d for d in make_toy_docs(40, seed=11) if len(d.text.split()) > 30)
    base = ["generate", "--model", str(tiny_lm_dir), "--dtype", "float32", "--max-new-tokens", "2", "--greedy"]
    for memory in (["--memory", str(built / "ix")], ["--memory", f"knn:{built / 'ds'}"]):
        capsys.readouterr()
        assert main([*base, *memory, "--prompt", doc.text]) == 2
        assert "the prompt leaks into the memory" in capsys.readouterr().err
        assert main([*base, *memory, "--prompt", doc.text, "--allow-overlap"]) == 0
        assert main([*base, *memory, "--prompt", "the cat sat"]) == 0  # short and free: not refused


def test_lm_eval_refuses_a_memory_holding_the_task_split(tiny_lm_dir, tmp_path, capsys):
    """memlm lm-eval's memlm_bbc_topic evaluates bbc's test split: an index over bbc (split all) is refused before
    the harness runs."""
    pytest.importorskip("lm_eval")
    from memlm.ngram.index import build_ngram_index

    tok = gpt2_tokenizer()
    ix = tmp_path / "ix"
    build_ngram_index(tok, make_toy_docs(5), ix, source={"corpus": "bbc", "split": "all"}, progress=False)
    args = ["lm-eval", "--model", str(tiny_lm_dir), "--tasks", "memlm_bbc_topic", "--memory", str(ix), "--limit", "1"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "task memlm_bbc_topic (bbc, split test) leaks into the memory" in err and "split all in memory" in err


# ------------------------------------------------------------------------------------------------ memlm tune


@pytest.fixture(scope="module")
def dumps(built, tiny_lm_dir, tmp_path_factory):
    """valid/test dumps of a clean file with the datastore, with the index, and with a second index."""
    from memlm.ngram.index import build_ngram_index

    root = tmp_path_factory.mktemp("dumps")
    valid = _jsonl(root / "valid.jsonl", make_toy_docs(6, seed=21))
    test = _jsonl(root / "test.jsonl", make_toy_docs(6, seed=22))
    other = root / "ix2"
    build_ngram_index(gpt2_tokenizer(), make_toy_docs(30, seed=23), other, source={"corpus": "toy2"}, progress=False)
    out = {}
    for name, corpus in (("valid", valid), ("test", test)):
        for mem, flags in (("ds", ["--memory", str(built / "ds"), "--lambda", "0.25"]),
                           ("ix", ["--memory", str(built / "ix")]), ("ix2", ["--memory", str(other)])):  # fmt: skip
            out[f"{name}_{mem}"] = root / f"{name}_{mem}.npz"
            assert main([*_eval_args(tiny_lm_dir, corpus, *flags), "--dump", str(out[f"{name}_{mem}"])]) == 0
    return out


def _edited(dumps, name, tmp_path, **meta):
    from memlm.knnlm.table import TokenTable

    ts = TokenTable.load(dumps[name])
    for k, v in meta.items():
        if isinstance(v, dict):
            ts.meta[k] = {**ts.meta.get(k, {}), **v}
        else:
            ts.meta[k] = v
    path = tmp_path / f"{name}-edited{len(list(tmp_path.glob('*.npz')))}.npz"
    ts.save(path)
    return str(path)


def test_tune_refuses_a_test_dump_of_another_index(dumps, capsys):
    """The one-index ∞-gram path (the issue's case: tuned on index A, a test ppl printed for a dump of index B)."""
    assert main(["tune", "--valid", str(dumps["valid_ix"]), "--test", str(dumps["test_ix"])]) == 0
    capsys.readouterr()
    assert main(["tune", "--valid", str(dumps["valid_ix"]), "--test", str(dumps["test_ix2"])]) == 2
    err = capsys.readouterr().err
    assert "was scored with other memories or another model" in err and "∞-gram indexes (build ids)" in err


def test_tune_refuses_a_test_dump_of_another_datastore_or_model(dumps, tmp_path, capsys):
    assert main(["tune", "--valid", str(dumps["valid_ds"]), "--test", str(dumps["test_ds"])]) == 0
    rebuilt = _edited(dumps, "test_ds", tmp_path, datastore_build_id="0" * 32)
    other_model = _edited(dumps, "test_ds", tmp_path, model="another-model")
    for test, what in ((rebuilt, "datastore"), (other_model, "model"), (str(dumps["test_ix"]), "datastore")):
        capsys.readouterr()
        assert main(["tune", "--valid", str(dumps["valid_ds"]), "--test", test]) == 2
        assert f"({what} " in capsys.readouterr().err


def test_tune_refuses_a_valid_dump_of_a_test_split(dumps, tmp_path, capsys):
    for split in ("test", "all"):
        valid = _edited(dumps, "valid_ds", tmp_path, source={"corpus": "wikitext2", "split": split})
        capsys.readouterr()
        assert main(["tune", "--valid", valid]) == 2
        assert f"a dump of wikitext2's {split} split" in capsys.readouterr().err
    assert main(["tune", "--valid", _edited(dumps, "valid_ds", tmp_path, source={"corpus": "wikitext2",
                                                                                  "split": "valid"})]) == 0  # fmt: skip


def test_tune_refuses_dumps_whose_text_is_in_their_memory(dumps, built, tmp_path, capsys):
    """A dump made with --allow-overlap carries the overlap its eval found: tune refuses it unless --allow-overlap
    too; a dump from before the check is compared from its recorded source and the memory's manifest."""
    overlap = [{"memory": "datastore x", "sources": [], "documents": 2, "near_copies": 0, "of": 6}]
    allowed = _edited(dumps, "valid_ds", tmp_path, leakage={"allow_overlap": True, "overlap": overlap})
    capsys.readouterr()
    assert main(["tune", "--valid", allowed]) == 2
    assert "datastore x holds 2 of the 6 evaluated documents" in capsys.readouterr().err
    assert main(["tune", "--valid", allowed, "--allow-overlap", "--json", str(tmp_path / "t.json")]) == 0
    rec = json.loads((tmp_path / "t.json").read_text())["leakage"]
    assert rec["allow_overlap"] is True and rec["valid"]["overlap"] == overlap
    train = str(built / "train.jsonl")
    fp = json.loads((built / "ds" / "manifest.json").read_text())["sources"][0]["fingerprint"]
    old = _edited(dumps, "valid_ds", tmp_path, leakage=None, source={"corpus": train, "fingerprint": fp})
    assert main(["tune", "--valid", old]) == 2
    assert "the same corpus content" in capsys.readouterr().err


def test_check_dumps_compares_every_memory_of_the_pair():
    def dump(**meta):
        return SimpleNamespace(meta={"model": "m", "source": {"corpus": "a.txt", "split": "valid"}, **meta})

    knn = {"kind": "knn", "datastore": "ds", "datastore_entries": 10}
    same = {"datastore_build_id": "b1", "components": {"knn": knn}}
    check_dumps(dump(**same), dump(**same))
    ngram = {"kind": "ngram", "ngram": "ix", "ngram_build_id": "n1"}
    others = ({**same, "components": {"knn": {**knn, "datastore_entries": 11}}}, {**same, "datastore_build_id": "b2"},
              {}, {**same, "components": {"knn": knn, "ngram": ngram}})  # fmt: skip
    for other in others:
        with pytest.raises(MemlmError, match="other memories or another model"):
            check_dumps(dump(**same), dump(**other))


def test_eval_on_split_all_of_the_memorys_named_corpus(tiny_lm_dir, tmp_path, capsys):
    """memlm eval --split all of the named corpus an index was built on (its train split) is refused before the
    forward pass; its test split is not (a note says the index records no document hashes)."""
    from memlm.ngram.index import build_ngram_index

    ix = tmp_path / "ix"
    build_ngram_index(gpt2_tokenizer(), make_toy_docs(5), ix, source={"corpus": "bbc", "split": "train"},
                      progress=False)  # fmt: skip
    args = [*_eval_args(tiny_lm_dir, "bbc", "--memory", str(ix), "--max-tokens", "200")]
    capsys.readouterr()
    assert main([*args, "--split", "all"]) == 2
    err = capsys.readouterr().err
    assert f"∞-gram index {ix} holds" in err and "bbc: split all evaluated, split train in memory" in err
    assert main([*args, "--split", "test", "--json", str(tmp_path / "r.json")]) == 0
    rec = json.loads((tmp_path / "r.json").read_text())["leakage"]
    assert rec["overlap"] == [] and "record no document hashes" in rec["notes"][0]
