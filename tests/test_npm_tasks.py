"""NPM evaluation tasks: cloze probes and EM by length, corpus update, BBC classification, `memlm npm eval`."""

from __future__ import annotations

import json
import math

import pytest
from test_cli_npm import _error_line, _save_tiny_bert

from memlm.cli import main
from memlm.data.corpora import Document
from memlm.errors import MemlmError
from memlm.experiments import npm_tasks as tasks
from memlm.models.resources import load_encoder
from memlm.npm.inference import LabelScores

REFERENCE = [
    Document("r0", "The river Thames flows through London in England. It was crossed by Roman engineers in 43."),
    Document("r1", "Marie Curie was born in Warsaw in 1867. She later moved to Paris to study physics."),
    Document("r2", "The Great Wall of China was built over many centuries. Much of it dates from the Ming dynasty."),
    Document("r3", "Mount Everest lies in the Himalayas on the border of Nepal and China. It is 8849 metres high."),
    Document("r4", "Johann Sebastian Bach composed music in Leipzig for many years. He died there in 1750."),
]
HELD_OUT = [
    Document(
        "h0",
        "Many tourists visit London every summer. The famous scientist Marie Curie won two prizes.",
        {"title": "Travel"},
    ),  # fmt: skip
    Document("h1", "The composer lived in Leipzig until 1750 and wrote cantatas. Nothing else is Unknownword here."),
    Document("h2", "Climbers from Nepal guide expeditions up the mountain. The Ming dynasty ruled for centuries."),
]


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


def test_cloze_probes_are_reachable_masked_and_deterministic(tok):
    probes = tasks.cloze_probes(HELD_OUT, REFERENCE, tok, n=None, seed=0)
    assert probes == tasks.cloze_probes(HELD_OUT, REFERENCE, tok, n=None, seed=0)
    assert len(probes) >= 4
    ref = " ".join(d.text for d in REFERENCE)
    for p in probes:
        assert tasks._find_word(ref, p.answer) >= 0, p  # the exact answer string is in the reference corpus
        assert p.query.count(tok.mask_token) == 1
        filled = p.query.replace(tok.mask_token, p.answer)
        assert filled == p.sentence or filled == f"Travel: {p.sentence}"
        assert not p.sentence.startswith(p.answer)  # never the sentence start
        assert p.answer_tokens == len(tok(p.answer, add_special_tokens=False)["input_ids"])
        assert p.kind in ("entity", "number") and p.doc_id in {"h0", "h1", "h2"}
    answers = {p.answer for p in probes}
    assert answers <= {"London", "Marie Curie", "Leipzig", "1750", "Nepal", "Ming"}
    assert "Unknownword" not in answers and "Nothing" not in answers
    # n and per_length caps; another seed draws other candidates in the same sentences
    assert len(tasks.cloze_probes(HELD_OUT, REFERENCE, tok, n=2)) == 2
    capped = tasks.cloze_probes(HELD_OUT, REFERENCE, tok, n=None, per_length=1)
    assert max(sum(p.bucket == b for p in capped) for b in tasks.LENGTH_BUCKETS) == 1
    with pytest.raises(MemlmError, match="empty"):
        tasks.cloze_probes(HELD_OUT, [Document("e", " ")], tok)


def _probe(tok, answer, i):
    n = len(tok(answer, add_special_tokens=False)["input_ids"])
    return tasks.ClozeProbe(f"p{i}", f"q{i} [MASK] .", answer, n, "entity", "d", f"q{i} {answer} .")


def test_evaluate_cloze_em_and_length_breakdown(tok):
    golds = ["Paris", "New York City", "Thessaloniki", "Abdülhamid", "1867", "Leipzig"]
    probes = [_probe(tok, g, i) for i, g in enumerate(golds)]
    preds = {"q0 [MASK] .": "paris", "q1 [MASK] .": "new york", "q2 [MASK] .": "thessaloniki.",
             "q3 [MASK] .": "abdulhamid", "q4 [MASK] .": "1867", "q5 [MASK] .": None}  # fmt: skip
    res = tasks.evaluate_cloze(probes, preds.__getitem__, tok)
    assert res["n"] == 6 and res["em"] == pytest.approx(4 / 6)
    assert [r["correct"] for r in res["predictions"]] == [True, False, True, True, True, False]
    by = res["by_length"]
    assert sum(v["n"] for v in by.values()) == 6 and sum(v["correct"] for v in by.values()) == 4
    for p in probes:
        assert p.bucket == tasks.length_bucket(p.answer_tokens)
    for b, v in by.items():
        want = [i for i, p in enumerate(probes) if p.bucket == b]
        assert v["n"] == len(want)
        assert v["correct"] == sum(res["predictions"][i]["correct"] for i in want)
        assert v["em"] is None if not want else v["em"] == v["correct"] / v["n"]
    assert res["macro_em"] == pytest.approx(sum(v["em"] for v in by.values() if v["n"]) / sum(1 for v in by.values()
                                                                                              if v["n"]))  # fmt: skip
    assert res["speed"]["queries"] == 6 and res["speed"]["peak_rss_mb"] > 0
    assert tasks.exact_match(tok, "São Paulo", "sao paulo") and not tasks.exact_match(tok, None, "x")
    assert [tasks.length_bucket(n) for n in (1, 2, 3, 4, 9)] == ["1", "2", "3", "4+", "4+"]


def test_corpus_update_edits_only_the_source_passage(tok, tmp_path):
    ups = tasks.update_probes(REFERENCE, tok, n=3, seed=0)
    assert 1 <= len(ups) <= 3 and len({u.passage for u in ups}) == len(ups)
    for u in ups:
        passage = REFERENCE[u.passage].text
        assert tasks._find_word(passage, u.probe.answer) >= 0 and tasks._find_word(passage, u.replacement) < 0
        assert u.probe.doc_id == REFERENCE[u.passage].id and u.replacement != u.probe.answer
        assert (u.replacement[0].isdigit()) == (u.probe.kind == "number")
    edited = tasks.edit_corpus(REFERENCE, ups)
    touched = {u.passage for u in ups}
    for i, (a, b) in enumerate(zip(REFERENCE, edited, strict=True)):
        if i not in touched:
            assert b is a
            continue
        want = a.text
        for u in ups:
            if u.passage == i:
                want = want.replace(u.probe.answer, u.replacement)
        assert b.text == want and b.id == a.id and b.meta["edited"]
    # the small original / edited indexes (tiny random BERT: only the bookkeeping is checked here)
    from test_npm_inference import tiny_bert

    model = tiny_bert(tok)
    res = tasks.corpus_update_probe(model, tok, ups, REFERENCE, tmp_path / "upd", distractors=1, max_length=24)
    assert res["n"] == len(ups) and res["passages"] == len(ups) + 1 and res["distractors"] == 1
    assert (tmp_path / "upd" / "original" / "manifest.json").exists()
    assert (tmp_path / "upd" / "edited" / "manifest.json").exists()
    assert [r["answer"] for r in res["edited"]["predictions"]] == [u.replacement for u in ups]
    # brute force: every probe answered again from the two indexes with the library's NPM prediction (k = 4096)
    from memlm.npm.inference import npm_predict
    from memlm.npm.phrase_index import PhraseIndex

    by_q = {u.probe.query: u for u in ups}
    orig_pi, edit_pi = (PhraseIndex.open(tmp_path / "upd" / v) for v in ("original", "edited"))
    orig = {q: npm_predict(model, tok, orig_pi, q, top=1)[0].phrase for q in by_q}
    edit = {q: npm_predict(model, tok, edit_pi, q, top=1)[0].phrase for q in by_q}
    assert [r["prediction"] for r in res["original"]["predictions"]] == [orig[u.probe.query] for u in ups]
    assert [r["prediction"] for r in res["edited"]["predictions"]] == [edit[u.probe.query] for u in ups]
    n = len(ups)
    assert res["original_em"] == sum(tasks.exact_match(tok, orig[q], u.probe.answer) for q, u in by_q.items()) / n
    assert res["updated_em"] == sum(tasks.exact_match(tok, edit[q], u.replacement) for q, u in by_q.items()) / n
    assert res["stale"] == sum(tasks.exact_match(tok, edit[q], u.probe.answer) for q, u in by_q.items()) / n

    # an oracle that reads its answer from the index's corpus (the word after the query's left context) follows the edit
    def oracle(pi):
        text = tasks.normalize_text(" ".join(pi.block_text(tok, b) for b in range(pi.n_blocks)))

        def predict(query):
            left = tasks.answer_key(tok, query.split(tok.mask_token)[0])
            u = next(u for u in ups if u.probe.query == query)
            return next(a for a in (u.probe.answer, u.replacement) if f"{left} {tasks.answer_key(tok, a)}" in text)

        return predict

    res = tasks.corpus_update_probe(model, tok, ups, REFERENCE, tmp_path / "upd", distractors=1, max_length=24,
                                    predict=oracle)  # fmt: skip
    assert res["original_em"] == 1 and res["updated_em"] == 1 and res["stale"] == 0
    with pytest.raises(MemlmError, match="not in passage"):
        tasks.edit_corpus(REFERENCE, [tasks.UpdateProbe(ups[0].probe, (ups[0].passage + 1) % 5, "X")])


BBC = [
    Document("sport/1", "Arsenal won the football match on Saturday.", {"topic": "sports"}),
    Document("sport/2", "The tennis final was played in London.", {"topic": "sports"}),
    Document("business/1", "Shares fell as the market reacted to the bank.", {"topic": "business"}),
    Document("tech/1", "A new phone and its software were shown.", {"topic": "tech"}),
]


def test_bbc_classification_metrics_and_query(tok):
    def fake(query, verbalizers):
        assert query.endswith(tasks.BBC_TEMPLATE)
        if "football" in query or "shares" in query.lower():
            return LabelScores({y: float(y == "sport") for y in verbalizers}, {y: 0.0 for y in verbalizers}, True)
        return LabelScores({y: 1 / len(verbalizers) for y in verbalizers}, {y: -math.inf for y in verbalizers}, False)

    res = tasks.bbc_classification(fake, tok, BBC, limit_tokens=64)
    # sport/1 right, business/1 wrong (sport), the two unmatched are wrong (no prediction)
    assert res["n"] == 4 and res["accuracy"] == pytest.approx(1 / 4)
    assert res["unmatched"] == pytest.approx(0.5)
    per = res["per_label"]
    assert per["sport"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert per["business"]["accuracy"] == 0.0 and per["tech"]["n"] == 1 and per["politics"]["accuracy"] is None
    assert sum(r["n"] for r in per.values()) == 4
    assert [r["pred"] for r in res["predictions"]] == ["sport", None, "sport", None]
    # confusion[gold][pred], counted by hand from the four documents above
    assert res["confusion"] == {"business": {"sport": 1}, "sport": {"none": 1, "sport": 1}, "tech": {"none": 1}}
    assert tasks.bbc_label(BBC[0]) == "sport"
    long_text = " ".join(["economy"] * 500)
    q = tasks.bbc_query(tok, long_text, limit_tokens=40)
    from memlm.npm.encoder import masked_query

    assert q.endswith(tasks.BBC_TEMPLATE) and len(masked_query(tok, q)[0]) <= 40
    m = tasks.classification_metrics(["a", "b", "b"], ["a", "a", "b"], ["a", "b"])
    assert m["accuracy"] == pytest.approx(2 / 3) and m["per_label"]["b"]["accuracy"] == 0.5
    with pytest.raises(MemlmError, match="topic"):
        tasks.bbc_classification(fake, tok, [Document("x", "text")])
    sub10, sub30 = (tasks.reference_subset(REFERENCE * 4, f, seed=1) for f in (0.1, 0.3))
    assert len(sub10) == 2 and len(sub30) == 6 and all(any(d is e for e in sub30) for d in sub10)


def test_cli_npm_eval_end_to_end(tok, tmp_path, capsys):
    bert = _save_tiny_bert(tmp_path / "bert", tok, 0)
    other = _save_tiny_bert(tmp_path / "bert1", tok, 1)
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in REFERENCE))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in HELD_OUT))
    bbc = tmp_path / "bbc.jsonl"
    bbc.write_text("".join(json.dumps({"id": d.id, "text": d.text, **d.meta}) + "\n" for d in BBC))
    idx = tmp_path / "idx"
    assert main(["npm", "index", "--encoder", str(bert), "--corpus", str(ref), "--out", str(idx),
                 "--max-length", "24"]) == 0  # fmt: skip
    base = ["npm", "eval", "--index", str(idx), "--k", "8"]
    out = tmp_path / "cloze.json"
    assert main([*base, "--task", "cloze", "--corpus", str(held), "--json", str(out), "--predictions"]) == 0
    text = capsys.readouterr().out
    assert "cloze: npm" in text and "4+" in text and "queries/s" in text
    res = json.loads(out.read_text())
    assert res["task"] == "cloze" and res["n"] >= 4 and len(res["predictions"]) == res["n"]
    assert sum(v["n"] for v in res["by_length"].values()) == res["n"]
    # brute force: the CLI's answers are the library's NPM top-1 phrase with k = 8, and EM counts them
    from memlm.npm.inference import npm_classify, npm_predict
    from memlm.npm.phrase_index import PhraseIndex

    model, mtok = load_encoder(str(bert))
    pi = PhraseIndex.open(idx)
    rows = res["predictions"]
    assert [r["prediction"] for r in rows] == [npm_predict(model, mtok, pi, r["query"], k=8, top=1)[0].phrase
                                               for r in rows]  # fmt: skip
    assert all(r["correct"] == tasks.exact_match(mtok, r["prediction"], r["answer"]) for r in rows)
    assert res["em"] == sum(r["correct"] for r in rows) / len(rows)
    out = tmp_path / "bbc.json"
    assert main([*base, "--task", "bbc", "--corpus", str(bbc), "--bm25", "--single", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 4 and set(res["per_label"]) == set(tasks.BBC_VERBALIZERS) and "predictions" not in res
    assert "npm-single +bm25 top-3" in res["model"]
    out = tmp_path / "bbc-pred.json"
    assert main([*base, "--task", "bbc", "--corpus", str(bbc), "--bm25", "--single", "--json", str(out),
                 "--predictions"]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    want = []  # the library's NPM SINGLE closed-set answer (k = 8, BM25 top 3, tau 5) for each article
    for d in BBC:
        r = npm_classify(model, mtok, pi, tasks.bbc_query(mtok, d.text, tasks.encoder_limit(model, mtok)),
                         tasks.BBC_VERBALIZERS, single=True, k=8, bm25_passages=3)  # fmt: skip
        want.append(r.label if r.matched else None)
    assert [r["pred"] for r in res["predictions"]] == want and res["article_tokens"] == 256
    # --article-tokens: the query keeps that many article tokens before the template ([MASK] moves forward)
    out = tmp_path / "bbc-short.json"
    assert main([*base, "--task", "bbc", "--corpus", str(bbc), "--single", "--json", str(out), "--predictions",
                 "--article-tokens", "3"]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    short = [tasks.bbc_query(mtok, d.text, tasks.encoder_limit(model, mtok), max_tokens=3) for d in BBC]
    assert all(len(mtok(q.removesuffix(tasks.BBC_TEMPLATE), add_special_tokens=False)["input_ids"]) <= 3 for q in short)
    full = [tasks.bbc_query(mtok, d.text, tasks.encoder_limit(model, mtok)) for d in BBC]
    assert all(a != b for a, b in zip(short, full, strict=True))  # every article is cut
    want = [npm_classify(model, mtok, pi, q, tasks.BBC_VERBALIZERS, single=True, k=8) for q in short]
    assert res["article_tokens"] == 3
    assert [r["pred"] for r in res["predictions"]] == [w.label if w.matched else None for w in want]
    for r, w in zip(res["predictions"], want, strict=True):  # the scores of the short queries, not the full ones
        assert r["probs"] == pytest.approx(w.probs, abs=1e-6)
    assert res["unmatched"] == sum(w is None for w in want) / 4
    assert res["accuracy"] == sum(w == tasks.bbc_label(d) for w, d in zip(want, BBC, strict=True)) / 4
    out = tmp_path / "upd.json"
    assert main([*base, "--task", "update", "--max-queries", "2", "--distractors", "1", "--work",
                 str(tmp_path / "w"), "--json", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    assert res["n"] >= 1 and {"original_em", "updated_em", "stale"} <= set(res)
    capsys.readouterr()
    # refusals: one error line, exit 2
    assert main([*base, "--task", "cloze", "--encoder", str(other), "--corpus", str(held)]) == 2
    assert "not comparable" in _error_line(capsys)
    assert main([*base, "--task", "bbc", "--mlm", str(bert), "--single"]) == 2
    assert "do not apply" in _error_line(capsys)
    assert main([*base, "--task", "bbc", "--mlm", str(bert)]) == 2
    assert "not a masked LM" in _error_line(capsys)
    none = tmp_path / "none.jsonl"
    none.write_text(json.dumps({"text": "the cat sat on the mat with Zorblax today and Quibble yesterday."}) + "\n")
    assert main([*base, "--task", "cloze", "--corpus", str(none)]) == 2  # no answer of these occurs in ref
    assert "no cloze probe" in _error_line(capsys)
