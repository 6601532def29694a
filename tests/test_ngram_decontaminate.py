"""Decontamination of an ∞-gram reference corpus (Liu et al. 2024, App. B: BFF, n = 13, whole documents dropped
when at least 80% of their n-grams are in the evaluation set), against a plain-Python transcription of the rule."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Doc  # noqa: E402

from memlm.errors import MemlmError  # noqa: E402
from memlm.ngram.decontaminate import bff_tokens, decontaminate, overlap_fractions  # noqa: E402

WORDS = [f"w{i}" for i in range(40)] + ["the", "a", "of", "river", "park", "bird", "sang", "ran", "dog", "cat"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _brute(documents, eval_docs, n=13, min_n=5, threshold=0.8) -> tuple[list[float], list[bool]]:
    """The rule as the paper and BFF's ``process_file`` (--whole-document) state it, on Python tuples: a document's
    n-grams are its windows of n tokens (repeats counted), or all its tokens when it has min_n..n-1 of them, none below;
    the filter is the set of the evaluation documents' n-grams (made the same way); dropped iff contained / total >=
    threshold. Tokens: bff_tokens of the lowercased text."""

    def grams(text: str) -> list[tuple]:
        t = bff_tokens(text.lower())
        if len(t) >= n:
            return [tuple(t[i : i + n]) for i in range(len(t) - n + 1)]
        return [tuple(t)] if len(t) >= min_n else []

    filt = {g for d in eval_docs for g in grams(d.text)}
    fractions, drop = [], []
    for d in documents:
        g = grams(d.text)
        f = sum(x in filt for x in g) / len(g) if g else float("nan")
        fractions.append(f)
        drop.append(bool(g) and f >= threshold)
    return fractions, drop


def test_bff_tokens_are_unicode_word_segments():
    """split_word_bounds's examples in the unicode-segmentation crate's documentation (BFF's tokenizer), whitespace
    segments left out as BFF's ``tokenize`` does."""
    assert bff_tokens('The quick ("brown")  fox') == ["The", "quick", "(", '"', "brown", '"', ")", "fox"]
    words = [t for t in bff_tokens('The quick ("brown") fox can\'t jump 32.3 feet, right?') if t[0].isalnum()]
    assert words == ["The", "quick", "brown", "fox", "can't", "jump", "32.3", "feet", "right"]


def test_copy_is_dropped_short_overlap_is_kept():
    rng = random.Random(1)
    test_doc = Doc("t0", _text(rng, 80))
    short_eval = Doc("t1", "w1 w2 w3 w4 w5 w6 w7 w8")  # 8 tokens: one n-gram of all of them
    words = test_doc.text.split()
    docs = [
        Doc("copy", test_doc.text),
        Doc("upper", test_doc.text.upper()),  # lowercased before matching
        Doc("framed", "intro words here " + test_doc.text + " and a short outro"),  # 68 of 75 13-grams inside
        # every 12-token piece of the test document, each followed by a word it never has: no 13-gram in common
        Doc("pieces", " ".join(" ".join(words[i : i + 12]) + " zz" for i in range(0, 72, 12))),
        Doc("half", " ".join(words[:40]) + " " + _text(random.Random(7), 40)),
        Doc("short", "w1 w2 w3 w4 w5 w6 w7 w8"),
        Doc("tiny", "w1 w2 w3 w4"),  # under 5 tokens: no n-gram, always kept
        Doc("other", _text(random.Random(9), 60)),
    ]
    kept, rec = decontaminate(docs, {"test": [test_doc, short_eval]})
    assert [d.id for d in kept] == ["pieces", "half", "tiny", "other"]
    assert [d["id"] for d in rec["dropped"]] == ["copy", "upper", "framed", "short"]
    assert rec["dropped_documents"] == 4 and rec["eval_sets"]["test"]["dropped_documents"] == 4
    res = overlap_fractions(docs, {"test": [test_doc, short_eval]})
    assert res["fraction"]["all"][3] == 0.0 and 0.3 < res["fraction"]["all"][4] < 0.8
    assert np.isnan(res["fraction"]["all"][6])


def _spliced(rng: random.Random, pool: list[list[str]], n: int, filler) -> list[str]:
    """``n`` texts of 1-4 parts: a run of up to 60 tokens of an evaluation document (60%) or ``filler(k)`` text."""
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.6:
                src = rng.choice(pool)
                a = rng.randrange(len(src))
                parts.append(" ".join(src[a : a + rng.randint(1, 60)]))
            else:
                parts.append(filler(rng.randint(1, 30)))
        texts.append(" ".join(parts))
    return texts


def test_overlap_rule_matches_brute_force():
    """Random documents spliced from evaluation text and other text at every mix, short and long, in several
    evaluation sets: the fractions and drop decisions equal the brute force's (one filter over all sets; each set
    alone too)."""
    rng = random.Random(4)
    evals = {"a": [Doc(f"a{i}", _text(rng, rng.randint(3, 120))) for i in range(6)],
             "b": [Doc(f"b{i}", _text(rng, rng.randint(3, 60))) for i in range(4)]}  # fmt: skip
    pool = [d.text.split() for ds in evals.values() for d in ds]
    docs = [Doc(f"d{i}", t) for i, t in enumerate(_spliced(rng, pool, 300, lambda k: _text(rng, k)))]
    docs += [Doc("ea", evals["a"][0].text + " " + evals["b"][0].text)]  # half in each set: dropped by the union
    for n, threshold in ((13, 0.8), (5, 0.5), (3, 1.0)):
        kept, rec = decontaminate(docs, evals, n=n, threshold=threshold)
        want_f, want_drop = _brute(docs, [d for ds in evals.values() for d in ds], n, 5, threshold)
        res = overlap_fractions(docs, evals, n=n)
        np.testing.assert_array_equal(res["fraction"]["all"], np.array(want_f))
        assert [d.id for d in kept] == [d.id for d, x in zip(docs, want_drop, strict=True) if not x]
        for name, ds in evals.items():
            f, drop = _brute(docs, ds, n, 5, threshold)
            np.testing.assert_array_equal(res["fraction"][name], np.array(f))
            assert rec["eval_sets"][name]["dropped_documents"] == sum(drop)
        assert 0 < rec["dropped_documents"] < len(docs)


def test_cli_build_decontaminates_and_records_it(tiny_lm_dir, tmp_path, capsys):
    """memlm ngram build --decontaminate FILE: the copying document is not indexed, the manifest says what was dropped
    and by which rule, and the same command again finds the build done (the record is deterministic)."""
    pytest.importorskip("infini_gram")
    from memlm.cli import main
    from memlm.cli.ngram import decontamination_sets
    from memlm.ngram.index import NgramIndex

    rng = random.Random(3)
    test_docs = [Doc(f"t{i}", _text(rng, 50)) for i in range(3)]
    train = [Doc(f"d{i}", _text(rng, 40)) for i in range(20)] + [Doc("leak", "Intro: " + test_docs[1].text)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in train))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in test_docs))
    argv = ["ngram", "build", "--model", str(tiny_lm_dir), "--corpus", str(tmp_path / "train.jsonl"), "--out",
            str(tmp_path / "ix"), "--holdout", "0", "--decontaminate", str(tmp_path / "test.jsonl")]  # fmt: skip
    assert main(argv) == 0
    m = NgramIndex.open(tmp_path / "ix").manifest
    assert m["documents"] == 20
    rec = m["sources"][0]["decontamination"]
    assert rec["dropped"][0]["id"] == "leak" and rec["dropped_documents"] == 1 and rec["n"] == 13
    assert rec["threshold"] == 0.8 and "App. B" in rec["rule"] and rec["dropped_tokens"] > 50
    assert rec["eval_sets"][str(tmp_path / "test.jsonl")]["documents"] == 3
    capsys.readouterr()
    assert main(argv) == 0
    assert "nothing to do" in capsys.readouterr().err
    # the default: the valid and test splits of every named corpus read for train (none with --split all), and the
    # sets named besides (a corpus name alone: both splits); "none": nothing
    assert decontamination_sets("wiki,x.jsonl,imdb", "train", None) == ["wiki:valid", "wiki:test", "imdb:valid",
                                                                          "imdb:test"]  # fmt: skip
    assert decontamination_sets("wiki", "all", None) == [] and decontamination_sets("wiki", "train", "none") == []
    assert decontamination_sets("wiki", "train", "wikitext2:test, imdb, wiki:test") == [
        "wiki:valid", "wiki:test", "wikitext2:test", "imdb:valid", "imdb:test"]  # fmt: skip
    assert decontamination_sets("wiki", "all", "x.jsonl") == ["x.jsonl"]
    with pytest.raises(MemlmError, match="--decontaminate needs"):
        decontamination_sets("wiki", "train", " , ")


def test_build_decontaminates_against_valid_and_test_of_each_named_corpus(monkeypatch):
    """The build's default sets (the valid and the test split of a named corpus) against a randomized brute force:
    reference documents spliced from valid text, from test text, from both, and clean ones; the plain-Python
    transcription of the 13-gram / 80% rule decides which go (against valid and test together, and each alone), and
    decontaminate_reference drops exactly those, and records each split's count and fingerprint."""
    import memlm.data.corpora as corpora
    from memlm.ngram.decontaminate import decontaminate_reference, decontamination_sets

    rng = random.Random(21)
    split_docs = {s: [Doc(f"{s}{i}", _text(rng, rng.randint(20, 90))) for i in range(5)] for s in ("valid", "test")}
    monkeypatch.setattr(corpora, "load_documents", lambda name, split="test": list(split_docs[split]))
    docs = []
    for s in ("valid", "test"):
        pool = [d.text.split() for d in split_docs[s]]
        docs += [Doc(f"{s}-{i}", t) for i, t in enumerate(_spliced(rng, pool, 120, lambda k: _text(rng, k)))]
    docs += [Doc("both", split_docs["valid"][0].text + " " + split_docs["test"][0].text)]
    docs += [Doc(f"clean{i}", _text(random.Random(100 + i), 40)) for i in range(20)]
    rng.shuffle(docs)
    names = decontamination_sets("wiki", "train", None)
    assert names == ["wiki:valid", "wiki:test"]
    kept, rec = decontaminate_reference(docs, names)
    _, drop = _brute(docs, split_docs["valid"] + split_docs["test"])
    assert [d.id for d in kept] == [d.id for d, x in zip(docs, drop, strict=True) if not x]
    for s in ("valid", "test"):
        _, alone = _brute(docs, split_docs[s])
        assert rec["eval_sets"][f"wiki:{s}"]["dropped_documents"] == sum(alone) >= 3
        assert rec["eval_sets"][f"wiki:{s}"]["fingerprint"] == corpora.corpus_fingerprint(split_docs[s])
        assert any(d.id.startswith(f"{s}-") for d, x in zip(docs, alone, strict=True) if x)
    assert "both" in {d["id"] for d in rec["dropped"]} and not any(d.id.startswith("clean") and x for d, x in
                                                                     zip(docs, drop, strict=True))  # fmt: skip
    assert decontaminate_reference(docs, []) == (docs, None)


def _class_chars() -> dict[str, list[str]]:
    """Characters of every Word_Break class, per the regex module's Unicode tables (BFF's tokens come from its \\b)."""
    import regex

    names = ["ALetter", "Numeric", "ExtendNumLet", "MidLetter", "MidNum", "MidNumLet", "Single_Quote",
             "Double_Quote", "WSegSpace", "CR", "LF", "Newline", "Extend", "Format", "ZWJ", "Katakana",
             "Hebrew_Letter", "Regional_Indicator", "Extended_Pictographic", "Other"]  # fmt: skip
    rng = random.Random(0)
    chars = "".join(map(chr, [*range(0x3000), *rng.sample(range(0x3000, 0x110000), 20000)]))
    out = {}
    for name in names:
        prop = r"\p{Extended_Pictographic}" if name == "Extended_Pictographic" else rf"\p{{Word_Break={name}}}"
        found = regex.findall(prop, chars)
        out[name] = found[:12] + rng.sample(found, min(12, len(found)))
    out["space"] = [c for c in map(chr, range(0x3100)) if c.isspace()]
    return out


def test_fast_split_equals_the_regex_module_on_every_word_break_class():
    """The numpy word splitting (UAX #29's rules for the common Word_Break classes) gives bff_tokens's tokens (the
    regex module's \\b) on every 3-character string over one or two characters of each class and on random strings
    of characters of every class; a text with any character of the classes it leaves to the regex module is flagged."""
    from memlm.ngram.decontaminate import _CX, _WS, _classes, _code_points, _word_breaks

    def fast(text: str) -> list[str] | None:
        c = _classes()[_code_points(text)]
        if (c == _CX).any():
            return None
        cut = np.flatnonzero(_word_breaks(c))
        return [text[a:b] for a, b in zip(cut[:-1], cut[1:], strict=True) if c[a] < _WS]

    by_class = _class_chars()
    simple = "aZé9_:.,;'\"’‘·\u2024 \u3000\t\n\r\x0b\x85\xa0\u2028-!?中😀"
    for t in itertools_product(simple, 3):
        assert fast(t) == bff_tokens(t), repr(t)
    pool = [c for cs in by_class.values() for c in cs]
    rng = random.Random(5)
    fast_ones = 0
    for _ in range(4000):
        src = simple if rng.random() < 0.5 else pool
        t = "".join(rng.choice(src) for _ in range(rng.randint(0, 40)))
        got = fast(t)
        fast_ones += got is not None
        assert got is None or got == bff_tokens(t), repr(t)
    assert fast_ones > 2000
    complex_ = ["Extend", "Format", "ZWJ", "Katakana", "Hebrew_Letter", "Regional_Indicator"]
    assert all(fast("a" + c + "b") is None for k in complex_ for c in by_class[k])
    assert fast("a\u202fb") is None  # whitespace that ExtendNumLet's rules join to letters: the regex module's


def itertools_product(chars: str, k: int):
    import itertools

    return ("".join(p) for p in itertools.product(chars, repeat=k))


def test_fast_path_matches_brute_force_on_unicode_text(monkeypatch):
    """overlap_fractions and decontaminate (numpy splitting and hashing, forked workers over small chunks) against the
    plain-Python transcription _brute, on random documents of Unicode words, numbers with separators, punctuation,
    curly quotes, CJK, emoji, combining marks, Hebrew, mixed case and odd whitespace, spliced from evaluation text:
    long ones, short ones (5-12 tokens: one n-gram; < 5: none) and ones at exactly 80% and just under."""
    import memlm.ngram.decontaminate as dec

    rng = random.Random(11)
    vocab = ["Über", "straße", "ΣΊΣΥΦΟΣ", "İstanbul", "naïve", "café", "3.14", "1,000,000", "can't", "l’été",
             "e.g.", "a_b", "x:y", "中文字", "カタカナ", "שלום", "é", "😀", "👩\u200d💻", "—", "“quoted”", "(",
             ")", "!", "?", "...", "#tag", "@home", "100%", "$5", "the", "of", "and", "river", "w1", "w2"]  # fmt: skip
    spaces = [" ", " ", " ", "  ", "\n", "\t", "\r\n", "\xa0", "\u3000", "\u2028", "\u202f", ""]

    def text(k: int) -> str:
        return "".join(rng.choice(vocab) + rng.choice(spaces) for _ in range(k)).strip()

    evals = {"a": [Doc(f"a{i}", text(rng.randint(3, 150))) for i in range(8)],
             "b": [Doc(f"b{i}", text(rng.randint(5, 12))) for i in range(4)]}  # fmt: skip
    pool = [bff_tokens(d.text) for ds in evals.values() for d in ds]
    docs = [Doc(f"d{i}", t.upper() if rng.random() < 0.1 else t) for i, t in enumerate(_spliced(rng, pool, 400, text))]
    # exactly 80%: 16 tokens of an evaluation document (4 windows) and one token not after them there (a 5th window)
    run = ["über", "3.14", "l’été", "中", "文", "1,000", "can't", "—", "naïve", "(", "x", ")", "😀", "e.g", ".", "w2"]
    evals["a"].append(Doc("a_run", " ".join(run) + " end of it"))
    evals["b"].append(Doc("b_short", "Σ é 3.14 “q” ! x"))  # 8 tokens: one n-gram of all of them
    docs += [Doc("at80", " ".join(run) + " zzz"), Doc("under80", " ".join(run[:15]) + " zzz")]
    evals["b"].append(Doc("b_split", "ab c d e f"))  # the same characters as "a bc d e f", other tokens
    docs += [Doc("short", "σ É\t3.14“Q” !x"), Doc("tiny", "w1 w2 !"), Doc("empty", ""), Doc("resplit", "a bc d e f")]
    assert [len(bff_tokens(d.text)) for d in docs[-6:]] == [17, 16, 8, 3, 0, 5]
    monkeypatch.setattr(dec, "_CHUNK_CHARS", 700)  # many chunks: the forked workers share them
    all_eval = [d for ds in evals.values() for d in ds]
    for workers in (1, 2):
        kept, rec = decontaminate(docs, evals, workers=workers)
        res = overlap_fractions(docs, evals, workers=workers)
        want_f, want_drop = _brute(docs, all_eval)
        np.testing.assert_array_equal(res["fraction"]["all"], np.array(want_f))
        assert res["tokens"].tolist() == [len(bff_tokens(d.text.lower())) for d in docs]
        assert [d.id for d in kept] == [d.id for d, x in zip(docs, want_drop, strict=True) if not x]
        for name, ds in evals.items():
            np.testing.assert_array_equal(res["fraction"][name], np.array(_brute(docs, ds)[0]))
        f = dict(zip([d.id for d in docs], res["fraction"]["all"], strict=True))
        assert f["at80"] == 0.8 and f["under80"] == 0.75 and f["short"] == 1.0 and np.isnan(f["tiny"])
        assert f["resplit"] == 0.0
        dropped = {d["id"] for d in rec["dropped"]}
        assert {"at80", "short"} <= dropped and not {"under80", "tiny", "empty"} & dropped
        assert 5 < rec["dropped_documents"] < len(docs) - 50


def test_member_lookup_equals_isin():
    """The presence bitmap + binary search lookup of n-gram hashes answers as np.isin, at the ends of the range too."""
    from memlm.ngram.decontaminate import _distinct, _member, _table

    rng = np.random.default_rng(0)
    ends = np.array([0, 2**64 - 1], dtype=np.uint64)
    for size in (0, 1, 3, 1000, 200_000):
        ref = _distinct(np.concatenate([rng.integers(0, 2**64, size, dtype=np.uint64), ends[: min(size, 2)]]))
        q = np.concatenate([ref[::3], ref[:50] + np.uint64(1), rng.integers(0, 2**64, 5000, dtype=np.uint64), ends])
        assert (_member(q, ref, _table(ref)) == np.isin(q, ref)).all() and (_member(q, ref) == np.isin(q, ref)).all()


@pytest.mark.parametrize("n", [1, 2, 3, 6, 13])
def test_windows_for_every_n_and_min_n(n):
    """The n-grams hashed all at once (windows across the stream of all documents, kept inside each one; short
    documents one n-gram of all their tokens) give the transcription's fractions for every n and min_n, empty and
    one-token documents included."""
    rng = random.Random(n)
    evals = {"a": [Doc(f"a{i}", _text(rng, rng.randint(0, 40))) for i in range(6)]}
    pool = [d.text.split() for d in evals["a"] if d.text]
    docs = []
    for i in range(150):
        src = rng.choice(pool)
        a = rng.randrange(len(src))
        docs.append(Doc(f"d{i}", " ".join(src[a : a + rng.randint(0, 20)]) + " " + _text(rng, rng.randint(0, 3))))
    for min_n in (1, 3, 5):
        res = overlap_fractions(docs, evals, n=n, min_n=min_n)
        np.testing.assert_array_equal(res["fraction"]["all"], np.array(_brute(docs, evals["a"], n=n, min_n=min_n)[0]))
