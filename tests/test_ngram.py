"""The ∞-gram memory (memlm.ngram): P∞ against a brute-force scan of the token stream (Liu et al. 2024, Sec. 3's
definition, written here from the paper), the sparse flag, tokenizer refusal, resume after kill -9, and the mixture at
λ = 0 equal to the LM."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("infini_gram")

from conftest import Doc, gpt2_tokenizer, make_toy_docs  # noqa: E402

from memlm.errors import MemlmError  # noqa: E402
from memlm.ngram.index import KINDS, NgramIndex, build_ngram_index  # noqa: E402
from memlm.ngram.memory import NgramMemory  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def corpus():
    # toy documents over 20 words, plus a few repeated documents (long matches, sparse estimates)
    docs = make_toy_docs(60, seed=3)
    docs += [Doc("rep1", "the old river ran over the park while a bird sang"), Doc("rep2", docs[5].text)]
    return docs


@pytest.fixture(scope="module")
def index(tmp_path_factory, tok, corpus):
    return build_ngram_index(
        tok, corpus, tmp_path_factory.mktemp("ng") / "ix", source={"corpus": "toy"}, progress=False
    )


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Brute:
    """The reference corpus as one list: each document is (START, its tokens); the token after an occurrence is the
    next list item, with START or the end of the list read as EOS (a document ends there)."""

    START = -7

    def __init__(self, tok, docs):
        self.eos = tok.eos_token_id
        self.seq: list[int] = []
        for d in docs:
            self.seq += [self.START, *_ids(tok, d.text)]

    def follow(self, suffix: list[int]) -> list[int]:
        """The next token (EOS at a document end) after every occurrence of ``suffix``."""
        k, out = len(suffix), []
        for i in range(len(self.seq) - k + 1):
            if self.seq[i : i + k] == suffix:
                j = i + k
                out.append(self.eos if j == len(self.seq) or self.seq[j] == self.START else self.seq[j])
        return out

    def infgram(self, context: list[int], target: int, max_n: int | None = None):
        """(P∞(target), cnt(suffix), effective n, sparse) with the context after a document START."""
        ctx = [self.START, *context]
        longest = len(ctx) if max_n is None else min(len(ctx), max_n - 1)
        for length in range(longest, -1, -1):
            nxt = self.follow(ctx[len(ctx) - length :]) if length else self.follow_all()
            if nxt:
                return nxt.count(target) / len(nxt), len(nxt), self.effective_n(context, max_n), len(set(nxt)) == 1
        raise AssertionError("the empty suffix always occurs")

    def effective_n(self, context: list[int], max_n: int | None = None) -> int:
        """The paper's effective n of the target ``w_i`` after ``context = w_1 .. w_{i-1}`` (Sec. 3): the largest
        ``n <= i`` with ``cnt(w_{i-n+1} .. w_{i-1}) > 0`` (words only: no document-start marker), at most ``max_n``."""
        i = len(context) + 1
        for n in range(i if max_n is None else min(i, max_n), 0, -1):
            if n == 1 or self.follow(context[len(context) - (n - 1) :]):
                return n
        raise AssertionError("n = 1 always qualifies")

    def follow_all(self) -> list[int]:
        return [self.eos if t == self.START else t for t in self.seq]


def _check(memory, brute, docs_tokens, max_n=None):
    positions = [np.arange(len(d)) for d in docs_tokens]
    got = memory.score_documents(docs_tokens, positions)
    i = 0
    for d in docs_tokens:
        for p in range(len(d)):
            prob, count, n, sparse = brute.infgram(list(map(int, d[:p])), int(d[p]), max_n)
            assert got.count[i] == count, (p, d[: p + 1])
            assert got.n[i] == n
            assert bool(got.sparse[i]) == sparse
            assert math.isclose(math.exp(got.logprob[i]), prob, rel_tol=1e-5, abs_tol=0.0), (prob, got.logprob[i])
            i += 1
    return got


def test_infgram_matches_brute_force(tok, corpus, index):
    brute = Brute(tok, corpus)
    memory = NgramMemory(index)
    eos = tok.eos_token_id
    evals = [d.text for d in make_toy_docs(6, seed=11)] + [corpus[5].text, corpus[-2].text[:30]]
    docs = [np.array([*_ids(tok, t), eos]) for t in evals]
    got = _check(memory, brute, docs)
    assert got.sparse.any() and not got.sparse.all()  # both kinds occur
    assert got.n.max() > 10  # the repeated document gives long suffixes
    assert np.isneginf(got.logprob).any()  # and some targets never follow their suffix


def test_fixed_n_matches_brute_force(tok, corpus, index):
    brute = Brute(tok, corpus)
    docs = [np.array([*_ids(tok, corpus[5].text), tok.eos_token_id])]
    got = _check(NgramMemory(index, max_n=3), brute, docs, max_n=3)
    assert got.n.max() == 3


def test_positions_subset_and_search_distribution(tok, corpus, index):
    """Scoring some positions gives what scoring all gives there; search() returns P∞ as (log count, token) pairs."""
    from memlm.core.distribution import knn_distribution

    memory = NgramMemory(index)
    d = np.array([*_ids(tok, corpus[7].text), tok.eos_token_id])
    full = memory.score_documents([d], [np.arange(len(d))])
    some = np.array([0, 3, 4, 9, len(d) - 1])
    part = memory.score_documents([d], [some])
    np.testing.assert_array_equal(part.count, full.count[some])
    np.testing.assert_array_equal(part.n, full.n[some])
    np.testing.assert_array_equal(part.logprob, full.logprob[some])
    brute = Brute(tok, corpus)
    ctx = list(map(int, d[:6]))
    r = memory.search([ctx], k=64)
    dist = knn_distribution(torch.as_tensor(r.scores), torch.as_tensor(r.values), len(tok), 1.0)[0].exp()
    nxt = None
    for length in range(len(ctx) + 1, 0, -1):
        nxt = brute.follow([Brute.START, *ctx][-length:])
        if nxt:
            break
    for w in set(nxt):
        assert math.isclose(float(dist[w]), nxt.count(w) / len(nxt), rel_tol=1e-5)
    assert int(r.ids[0, 0]) == full.n[6]


def test_cold_positions_equal_the_walk(tok, corpus, index):
    """Each position scored alone (its longest suffix found from scratch: a few steps down, then a binary search over
    the length) gives what the left-to-right walk gives there, deep into contexts far longer than any match."""
    memory = NgramMemory(index)
    d = np.array([*_ids(tok, " ".join(doc.text for doc in corpus[3:7])), tok.eos_token_id])
    full = memory.score_documents([d], [np.arange(len(d))])
    checked = range(0, len(d), max(1, len(d) // 40))
    assert sum(full.n[p] + 5 < p + 1 for p in checked) > 5  # cold starts that drop past the linear steps
    for p in checked:
        one = memory.score_documents([d], [np.array([p])])
        assert (one.count[0], one.n[0], one.logprob[0]) == (full.count[p], full.n[p], full.logprob[p]), p


def test_index_under_a_folder_named_like_an_engine_file(tok, corpus, index, tmp_path):
    # the engine sorts files by words in their whole path: under ".../writes_table_0/" every file looked like a suffix
    # array and the engine crashed (segmentation fault), so the check runs in a child process
    moved = tmp_path / "test_writes_table_0" / "offsets" / "ix"
    shutil.copytree(index.path, moved)
    code = (
        "import sys, json; from memlm.ngram.memory import NgramMemory; "
        "r = NgramMemory(sys.argv[1]).search([[1, 2]], 16); "
        "print(json.dumps([r.scores.tolist(), r.values.tolist()]))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code, str(moved)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = NgramMemory(index).search([[1, 2]], 16)
    assert json.loads(out.stdout) == [r.scores.tolist(), r.values.tolist()]


def test_sparse_flag_on_a_unique_continuation(tok, tmp_path):
    docs = [Doc("a", "alpha beta gamma delta"), Doc("b", "alpha beta gamma delta"), Doc("c", "alpha beta zeta")]
    ix = build_ngram_index(tok, docs, tmp_path / "ix", progress=False)
    memory = NgramMemory(ix)
    ids = _ids(tok, "alpha beta gamma delta")
    got = memory.score_documents([np.array([*ids, tok.eos_token_id])], [np.arange(len(ids) + 1)])
    # after "alpha beta" two continuations (gamma twice, zeta once): dense, P∞(gamma) = 2/3
    k = len(_ids(tok, "alpha beta"))
    assert not got.sparse[k] and math.isclose(math.exp(got.logprob[k]), 2 / 3, rel_tol=1e-6)
    # after "alpha beta gamma" only "delta": sparse, P∞ = 1; at the end only EOS follows (document ends)
    assert got.sparse[k + 1] and got.logprob[k + 1] == 0.0
    assert got.sparse[-1] and got.logprob[-1] == 0.0


def test_refuses_another_tokenizer(index):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "<eos>": 2}
    small = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="a")), eos_token="<eos>")
    NgramIndex.open(index.path).check_tokenizer(gpt2_tokenizer())
    with pytest.raises(MemlmError, match="another tokenizer"):
        NgramIndex.open(index.path).check_tokenizer(small)


def test_manifest_records_and_refuses_edits(index, tmp_path):
    import shutil

    m = index.manifest
    assert m["token_dtype"] == "u16" and m["tokens"] > 0 and m["sources"][0]["corpus"] == "toy"
    assert set(m["files"]) == {f"{k}.0" for k in KINDS}
    copy = tmp_path / "copy"
    shutil.copytree(index.path, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["tokens"] += 1
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(MemlmError, match="changed after the build"):
        NgramIndex.open(copy)


def test_u32_for_large_vocabularies():
    from memlm.ngram.index import token_dtype_for

    assert token_dtype_for(50257)[0] == "u16" and token_dtype_for(65535)[0] == "u32"


def test_shards_give_the_same_probabilities(tok, corpus, index, tmp_path):
    sharded = build_ngram_index(tok, corpus, tmp_path / "sh", shard_tokens=300, progress=False)
    assert len(sharded.manifest["shards"]) > 2
    d = [np.array([*_ids(tok, t.text), tok.eos_token_id]) for t in (corpus[5], make_toy_docs(2, seed=5)[1])]
    pos = [np.arange(len(x)) for x in d]
    a, b = NgramMemory(index).score_documents(d, pos), NgramMemory(sharded).score_documents(d, pos)
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_array_equal(a.n, b.n)
    np.testing.assert_array_equal(a.sparse, b.sparse)
    np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-6)


_BUILD = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import gpt2_tokenizer, make_toy_docs
from memlm.ngram import index as ix
docs = make_toy_docs(3000, seed=4)
if {slow}:
    real = ix._suffix_array
    def slow(*a, **k):
        print("SORTING", flush=True)
        time.sleep(30)
    ix._suffix_array = slow
    orig = ix._tokenize
    def tok_slow(tokenizer, documents, out, state, *a):
        class Slow(list):
            def __getitem__(self, s):
                time.sleep(0.05)
                return list.__getitem__(self, s)
        return orig(tokenizer, Slow(documents), out, state, *a)
    ix._tokenize = tok_slow
ix.build_ngram_index(gpt2_tokenizer(), docs, {out!r}, progress=False, batch_docs=64)
print("DONE", flush=True)
"""


def _run_build(out: Path, slow: bool) -> subprocess.Popen:
    code = _BUILD.format(tests=str(Path(__file__).parent), out=str(out), slow=slow)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_resume_after_kill_gives_identical_index(tok, tmp_path):
    """kill -9 mid-tokenizing, rerun and kill -9 mid-sort, rerun: the same bytes as an uninterrupted build."""
    killed = tmp_path / "killed"
    p = _run_build(killed, slow=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        prog = killed / "progress.json"
        if prog.exists() and json.loads(prog.read_text())["docs_done"] >= 640:
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.wait()
    state = json.loads((killed / "progress.json").read_text())
    assert 0 < state["docs_done"] < 3000 and not (killed / "manifest.json").exists()
    with open(killed / "tokenized.0", "ab") as f:  # a batch written after the last record: the rerun truncates it
        f.write(b"\x01\x02" * 7)
    p = _run_build(killed, slow=True)  # resumes tokenizing, then is killed while sorting
    for line in p.stdout:
        if "SORTING" in line:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert json.loads((killed / "progress.json").read_text())["docs_done"] == 3000
    assert _run_build(killed, slow=False).wait(timeout=120) == 0
    clean = build_ngram_index(tok, make_toy_docs(3000, seed=4), tmp_path / "clean", progress=False, batch_docs=64)
    a = NgramIndex.open(killed, verify=True)
    assert set(a.manifest["files"]) == set(clean.manifest["files"])
    for name in a.manifest["files"]:
        assert a.manifest["files"][name]["sha256"] == clean.manifest["files"][name]["sha256"], name


def test_rerun_with_other_corpus_is_refused(tok, corpus, index):
    with pytest.raises(MemlmError, match="other settings"):
        build_ngram_index(tok, corpus, index.path, source={"corpus": "other"}, progress=False)
    again = build_ngram_index(tok, corpus, index.path, source={"corpus": "toy"}, progress=False)
    assert again.manifest["build_id"] == index.manifest["build_id"]


def test_mixture_at_lambda_zero_is_the_lm_exactly(tiny_lm, corpus, index):
    from memlm.core.distribution import perplexity
    from memlm.knnlm.scoring import score_tokens
    from memlm.mixing.dump import rule_logprob
    from memlm.mixing.report import fit_summary, fit_table

    model, tok = tiny_lm
    evals = make_toy_docs(5, seed=21)
    ts = score_tokens(model, tok, evals, [NgramMemory(index)], window=64, min_context=32, progress=False)
    lm = torch.from_numpy(ts.lm_logprob)
    mixed = rule_logprob(ts, {"ngram": (0.0, 0.0)})  # the rule eval mixes by, at λ_sparse = λ_dense = 0
    assert torch.equal(mixed, lm.double())
    # the dump's statistics are those of a direct query; the fitted rule never does worse than λ = 0
    brute = Brute(tok, corpus)
    for i in [0, 5, 17, len(ts) - 1]:
        d = [t for t in _ids(tok, evals[int(ts.doc_index[i])].text)] + [tok.eos_token_id]
        prob, count, n, sparse = brute.infgram(d[: int(ts.position[i])], int(ts.targets[i]))
        assert (
            ts.columns["ngram"]["count"][i],
            ts.columns["ngram"]["n"][i],
            bool(ts.columns["ngram"]["sparse"][i]),
        ) == (count, n, sparse)
    best = fit_summary(fit_table(ts, "rule"))
    assert best["ppl"] <= perplexity(lm) + 1e-9
    weights = {"ngram": (best["ngram_sparse"], best["ngram_dense"])}  # one ∞-gram: the rule's own weights, exact
    assert math.isclose(perplexity(rule_logprob(ts, weights)), best["ppl"], rel_tol=1e-9)


def test_cli_build_eval_tune(tiny_lm_dir, tmp_path, capsys):
    from memlm.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(80, seed=2)))
    out = tmp_path / "ix"
    assert (
        main(
            [
                "ngram",
                "build",
                "--model",
                str(tiny_lm_dir),
                "--corpus",
                str(docs),
                "--out",
                str(out),
                "--holdout",
                "0.1",
                "--window",
                "64",
                "--stride",
                "32",
            ]
        )
        == 0
    )
    cal = NgramIndex.open(out).manifest["calibration"]
    sparse, dense = cal["mixture"]["rule_weights"]["ngram"]  # the stored fit's mean weight per state
    assert cal["tokens"] > 0 and 0 <= sparse <= 1 and 0 <= dense <= 1
    dump = tmp_path / "valid.npz"
    args = [
        "eval",
        "--model",
        str(tiny_lm_dir),
        "--corpus",
        str(docs),
        "--memory",
        str(out),
        "--window",
        "64",
        "--min-context",
        "32",
        "--max-tokens",
        "400",
        "--allow-overlap",  # the index's own documents (memlm.leakage would refuse them)
    ]
    assert main([*args, "--dump", str(dump), "--json", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert (res["lambda_sparse"], res["lambda_dense"]) == (sparse, dense) and "effective_n" in res
    assert main(["tune", "--valid", str(dump), "--test", str(dump), "--json", str(tmp_path / "t.json")]) == 2
    assert "holds 11 of the 11 evaluated documents" in capsys.readouterr().err  # the dump records the overlap
    tune = ["tune", "--valid", str(dump), "--test", str(dump), "--allow-overlap", "--json", str(tmp_path / "t.json")]
    assert main(tune) == 0
    assert json.loads((tmp_path / "t.json").read_text())["test"]["mixture_ppl"] > 0
    assert main(["ngram", "info", str(out), "--verify"]) == 0


def test_token_sources_point_at_documents_holding_the_suffix(tok, corpus, index):
    """Each token's longest matching suffix is the brute-force longest, and every document named holds it."""
    from memlm.ngram.generate import token_sources

    memory = NgramMemory(index)
    ids = _ids(tok, "the dog ran") + _ids(tok, " " + corpus[5].text.split(" ", 3)[-1])[:12]
    brute = Brute(tok, corpus)
    texts = {d.id: [Brute.START, *_ids(tok, d.text)] for d in corpus}
    for i, rec in zip(range(3, len(ids)), token_sources(memory, ids, 3, n_docs=3), strict=True):
        ctx = [Brute.START, *ids[: i + 1]]
        longest = max(n for n in range(0, len(ctx) + 1) if n == 0 or brute.follow(ctx[len(ctx) - n :]))
        assert rec["suffix_len"] == longest and rec["token"] == ids[i]
        suffix = ctx[len(ctx) - longest :]
        assert rec["count"] == len(brute.follow(suffix)) and rec["documents"]
        for d in rec["documents"]:
            seq = texts[d["id"]]
            assert any(seq[j : j + longest] == suffix for j in range(len(seq)))


def test_cli_generate_with_ngram_and_sources(tiny_lm_dir, index, capsys):
    from memlm.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_lm_dir),
                "--memory",
                str(index.path),
                "--prompt",
                "the cat sat",
                "--max-new-tokens",
                "5",
                "--greedy",
                "--show-sources",
                "1",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("the cat sat") and "occurrences" in out


def test_cli_eval_with_datastore_and_ngram(tiny_lm, tiny_lm_dir, corpus, index, toy_docs, tmp_path):
    """LM + kNN + ∞-gram in one eval, even when the separately set weights sum past 1; tune then mixes all four."""
    from memlm.cli import main
    from memlm.knnlm.write import write_datastore

    model, tok = tiny_lm
    ds = write_datastore(model, tok, toy_docs, tmp_path / "ds", window=64, min_context=32, progress=False)
    ds.build_index(factory="Flat", metric="l2", progress=False)
    docs = tmp_path / "e.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(6, seed=31)))
    dump, res = tmp_path / "d.npz", tmp_path / "r.json"
    argv = ["eval", "--model", str(tiny_lm_dir), "--corpus", str(docs), "--memory", str(ds.path), "--k", "8",
            "--memory", str(index.path), "--lambda", "0.5", "--temperature", "1", "--ngram-lambda-sparse", "0.9",
            "--ngram-lambda-dense", "0.2", "--window", "64", "--min-context", "32", "--dump", str(dump),
            "--json", str(res)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(res.read_text())
    assert r["knn_ngram_weights"]["lambda_sparse"] == pytest.approx(0.45) and r["knn_ngram_ppl"] > 0
    # every row with its interval, every difference paired, the buckets counted in each memory's corpus
    for key in ("base_ppl", "knn_ppl", "ngram_ppl", "knn_ngram_ppl"):
        row = r["intervals"][key]
        assert row["ppl"] == pytest.approx(r[key]) and row["low"] <= row["ppl"] <= row["high"]
    for system, ref in (("knn_ppl", "base_ppl"), ("ngram_ppl", "base_ppl"), ("knn_ngram_ppl", "base_ppl"),
                        ("knn_ngram_ppl", "knn_ppl")):  # fmt: skip
        diff = r["differences"][f"{system} vs {ref}"]
        assert diff["relative_change"] == pytest.approx(r[system] / r[ref] - 1, rel=1e-6)
    assert r["bootstrap"]["documents"] == 6
    from memlm.knnlm.table import TokenTable

    d = TokenTable.load(dump)
    values = np.bincount(np.fromfile(ds.path / "values.bin", dtype=np.int32), minlength=int(d.targets.max()) + 1)
    all_tokens = Brute(tok, corpus).follow_all()  # the ∞-gram's unigram counts, EOS = document ends
    for system, counts in (("knn_ppl", values[d.targets]), ("ngram_ppl", [all_tokens.count(t) for t in d.targets])):
        rows = r["frequency_buckets"][system]["rows"]
        assert sum(row["tokens"] for row in rows) == len(d)
        for row in rows:
            hi = row["count_max"] if row["count_max"] is not None else np.inf
            assert row["tokens"] == sum(row["count_min"] <= c <= hi for c in counts), (system, row)
    assert main(["tune", "--valid", str(dump), "--temperatures", "1", "10", "--json", str(tmp_path / "t.json")]) == 0
    best = json.loads((tmp_path / "t.json").read_text())["best"]
    assert {"knn", "temperature", "ngram_sparse", "ngram_dense"} <= set(best) and best["form"] == "rule"


def test_generate_with_datastore_and_ngram_is_the_three_way_mixture(tiny_lm, tiny_lm_dir, toy_docs, corpus, index,
                                                                    tmp_path, capsys):  # fmt: skip
    """One generation step with both memories: (1 - λ - λ_∞) p_LM + λ p_kNN + λ_∞ P∞, with p_kNN from an exact
    NumPy search (Khandelwal et al. Eq. 2) and P∞ from a scan of the reference tokens (Liu et al. 2024 Sec. 3)."""
    from memlm.cli import main
    from memlm.knnlm.generate import MixtureLogitsProcessor
    from memlm.knnlm.write import write_datastore
    from memlm.models.keys import KeyCapture

    model, tok = tiny_lm
    ds = write_datastore(model, tok, toy_docs, tmp_path / "ds", window=64, min_context=32, progress=False)
    ds.build_index(factory="Flat", metric="l2", progress=False)
    lam, ls, ld, k, tau = 0.3, 0.5, 0.2, 8, 2.0
    seq = _ids(tok, "the old river ran over the")
    memories = f"knn:{ds.path}?k={k}&temperature={tau};ngram:{index.path}"
    with torch.no_grad(), MixtureLogitsProcessor(model, memories, f"knn={lam};ngram={ls}/{ld}") as proc:
        logits = model(input_ids=torch.tensor([seq])).logits[:, -1]
        got = torch.exp(proc(torch.tensor([seq]), logits)[0].double()).numpy()
    # the reference, by hand
    with torch.no_grad(), KeyCapture(model, [ds.key_spec]) as cap:
        model(input_ids=torch.tensor([seq]))
        q = cap.keys_by_spec[ds.key_spec][0, -1].double().numpy()
    p_lm = torch.softmax(logits[0].double(), -1).numpy()
    d = -((np.asarray(ds.keys, dtype=np.float64) - q) ** 2).sum(1)
    top = np.argsort(-d, kind="stable")[:k]
    w = np.exp((d[top] - d[top].max()) / tau)
    p_knn = np.zeros_like(p_lm)
    np.add.at(p_knn, np.asarray(ds.values)[top], w / w.sum())
    brute = Brute(tok, corpus)
    ctx = [Brute.START, *seq]
    nxt = next((f for n in range(len(ctx), 0, -1) if (f := brute.follow(ctx[len(ctx) - n :]))), brute.follow_all())
    p_inf = np.zeros_like(p_lm)
    for t in nxt:
        p_inf[t] += 1 / len(nxt)
    lam_inf = ls if len(set(nxt)) == 1 else ld
    want = (1 - lam - lam_inf) * p_lm + lam * p_knn + lam_inf * p_inf
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    assert p_inf.max() > 0 and p_knn.max() > 0  # both memories contributed
    # the CLI takes both memories at once and still lists the ∞-gram's sources
    argv = ["generate", "--model", str(tiny_lm_dir), "--memory", f"{ds.path};{index.path}",
            "--prompt", "the cat sat", "--max-new-tokens", "4", "--greedy", "--show-sources", "1", "--dtype",
            "float32", "--lambda", "0.9", "--ngram-lambda-sparse", "0.5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat sat") and "occurrences" in out


def _brute_p_inf(brute, context: list[int], vocab: int) -> tuple[np.ndarray, bool]:
    """P∞(. | context) over the vocabulary and its sparse flag, by scanning the reference tokens."""
    ctx = [Brute.START, *context]
    nxt = next((f for n in range(len(ctx), 0, -1) if (f := brute.follow(ctx[len(ctx) - n :]))), brute.follow_all())
    p = np.zeros(vocab)
    for t in nxt:
        p[t] += 1 / len(nxt)
    return p, len(set(nxt)) == 1


def test_lm_eval_adapter_with_ngram_equals_brute_force(tiny_lm, corpus, index):
    """lm-eval's rolling and loglikelihood requests with an ∞-gram: (1 - λ_∞(c)) p_LM + λ_∞(c) P∞ per token, P∞
    and the sparse flag from a scan of the reference tokens; generation runs through the same mixture."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from memlm.lmeval.model import MemlmLM

    model, tok = tiny_lm
    ls, ld = 0.6, 0.3
    lm = MemlmLM(model=model, tokenizer=tok, memories=f"ngram:{index.path}", mixture=f"ngram={ls}/{ld}", window=64,
                 min_context=32)  # fmt: skip
    bare = MemlmLM(model=model, tokenizer=tok, window=64, min_context=32)
    assert lm.memory_settings["memories"] == f"ngram:{index.path}?k=1000"  # the spec records k
    brute = Brute(tok, corpus)
    tokens = _ids(tok, "the old river ran over the park while the cat sat on a mat")
    lm_lp = bare.rolling_token_logprobs(tokens)
    got = lm.rolling_token_logprobs(tokens)
    want = []
    for t in range(len(tokens)):
        p_inf, sparse = _brute_p_inf(brute, tokens[:t], lm.vocab_size)
        lam = ls if sparse else ld
        want.append(math.log((1 - lam) * math.exp(lm_lp[t]) + lam * p_inf[tokens[t]]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.allclose(got, lm_lp)  # the ∞-gram changed something
    # loglikelihood: context + continuation, the greedy flag from the mixed distribution
    ctx, cont = _ids(tok, "the old river"), _ids(tok, " ran over the park")
    (ll, greedy), = lm._loglikelihood_tokens([(("a", "b"), ctx, cont)])  # fmt: skip
    seq = ctx + cont
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
    total, all_greedy = 0.0, True
    for pos in range(len(ctx) - 1, len(seq) - 1):
        p_lm = torch.softmax(logits[pos], -1).numpy()
        p_inf, sparse = _brute_p_inf(brute, seq[: pos + 1], len(p_lm))
        lam = ls if sparse else ld
        p = (1 - lam) * p_lm + lam * p_inf
        total += math.log(p[seq[pos + 1]])
        all_greedy &= int(p.argmax()) == seq[pos + 1]
    assert ll == pytest.approx(total, rel=1e-5) and greedy == all_greedy
    out = lm.generate_until([Instance("generate_until", {}, ("the old river", {"until": ["\n"], "max_gen_toks": 4}),
                                      0)])  # fmt: skip
    assert isinstance(out[0], str) and out[0]


def test_token_counts_are_the_unigram_counts_p_inf_uses(tok, corpus, index):
    """The ∞-gram's frequency buckets count each target among the index's tokens as P∞ counts a 1-gram (EOS: the
    documents' ends), by brute force over the corpus."""
    brute = Brute(tok, corpus).follow_all()
    ids = np.array([tok.eos_token_id, *sorted(set(brute))[:40], 50000, brute[3], brute[3]])
    assert NgramMemory(index).token_counts(ids).tolist() == [brute.count(int(t)) for t in ids]


def test_several_references_mixture_and_fit():
    """Two ∞-gram references with their own weights: the rule's mixture equals the formula computed in NumPy, and the
    rule fitted on them (EM per joint sparse state) is no worse than either reference alone at its best weights on a
    grid (Liu et al. 2024's interpolation, one (λ_sparse, λ_dense) pair per reference)."""
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.dump import mix_by_rule
    from memlm.mixing.report import fit_summary, fit_table
    from memlm.ngram.step import NgramComponent

    rng = np.random.default_rng(5)
    n = 400
    lm = np.log(rng.uniform(0.01, 0.5, n))
    refs_np = []
    for hit in (0.6, 0.3):
        p = np.where(rng.uniform(size=n) < hit, rng.uniform(0.3, 1.0, n), 0.0)
        sparse = (p == 1.0) | (rng.uniform(size=n) < 0.3)
        with np.errstate(divide="ignore"):
            refs_np.append((np.log(p), sparse))
    refs = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in refs_np]
    knn = np.log(rng.uniform(0.0, 0.6, n))
    ws = [(0.3, 0.05), (0.1, 0.2)]
    comps = {"lm": torch.from_numpy(lm), "knn": torch.from_numpy(knn), "ngram": refs[0][0], "ngram2": refs[1][0]}
    flags = {"ngram": refs[0][1], "ngram2": refs[1][1]}
    got = mix_by_rule(comps, {"knn": 0.2, "ngram": ws[0], "ngram2": ws[1]}, flags).numpy()

    def by_hand(w, lam=0.0):  # Σ λ_i P_i with λ_r = λ_sparse,r where reference r is sparse, else λ_dense,r (NumPy)
        l1, l2 = np.where(refs_np[0][1], *w[0]), np.where(refs_np[1][1], *w[1])
        return np.log((1 - lam - l1 - l2) * np.exp(lm) + lam * np.exp(knn) + l1 * np.exp(refs_np[0][0])
                      + l2 * np.exp(refs_np[1][0]))  # fmt: skip

    np.testing.assert_allclose(got, by_hand(ws, 0.2), rtol=1e-10)
    ts = TokenTable(targets=np.zeros(n, dtype=np.int64), doc_index=np.arange(n, dtype=np.int32) // 50,
                    lm_logprob=lm.astype(np.float32), lm_entropy=np.ones(n, dtype=np.float32),
                    lm_max_logprob=np.full(n, -0.5, dtype=np.float32))  # fmt: skip
    for logp, sparse in refs_np:
        ts.add(NgramComponent(None), {"logprob": logp.astype(np.float32), "count": np.ones(n, dtype=np.int64),
                                      "n": np.full(n, 3, dtype=np.int32), "sparse": sparse})  # fmt: skip
    best = fit_summary(fit_table(ts, "rule"))

    def ppl(w):
        return float(np.exp(-by_hand(w).mean()))

    grid = (0.0, 0.05, 0.1, 0.2, 0.4)
    for r in range(2):  # each reference alone, its best pair on a grid: the joint fit does at least as well
        alone = min(ppl([(a, b) if i == r else (0.0, 0.0) for i in range(2)]) for a in grid for b in grid)
        assert best["ppl"] <= alone * (1 + 1e-6)
