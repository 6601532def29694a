"""What opening an ∞-gram index checks, and that ``memlm eval`` says it: the full SHA-256 of the
smallest files up to ``FULL_CHECK_BYTES``, the sampled one of the rest; a suffix array flipped between the sampled
blocks is caught in full and named as sampled-only beyond the budget."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("infini_gram")

from conftest import gpt2_tokenizer, make_toy_docs  # noqa: E402

from memlm.cli import main  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.io import fileio  # noqa: E402
from memlm.ngram import index as ix  # noqa: E402

BLOCKS, BLOCK = 4, 64  # a sample of 4 blocks of 64 bytes, so that the toy index's table is sampled, not read whole


@pytest.fixture
def small_samples(monkeypatch):
    for module in (fileio, ix):
        monkeypatch.setattr(module, "SAMPLE_BLOCKS", BLOCKS)
        monkeypatch.setattr(module, "SAMPLE_BLOCK_BYTES", BLOCK)


@pytest.fixture
def flipped(small_samples, tmp_path):
    """An index whose table.0 has every byte outside the sampled blocks flipped (size and sample unchanged)."""
    out = tmp_path / "ix"
    ix.build_ngram_index(gpt2_tokenizer(), make_toy_docs(60, seed=3), out, source={"corpus": "toy"}, progress=False)
    table = out / "table.0"
    data = bytearray(table.read_bytes())
    assert len(data) > BLOCKS * BLOCK
    last = len(data) - BLOCK
    sampled = {p for i in range(BLOCKS) for p in range(last * i // (BLOCKS - 1), last * i // (BLOCKS - 1) + BLOCK)}
    for p in range(len(data)):
        if p not in sampled:
            data[p] ^= 0xFF
    table.write_bytes(bytes(data))
    return out


def test_the_default_budget_reads_a_typical_index_whole(flipped):
    with pytest.raises(MemlmError, match="checksum mismatch in .*table.0"):
        ix.NgramIndex.open(flipped)


def test_beyond_the_budget_the_check_is_sampled_and_says_so(flipped, monkeypatch):
    monkeypatch.setattr(ix, "FULL_CHECK_BYTES", 0)
    index = ix.NgramIndex.open(flipped)  # the sample cannot see it
    rec = index.integrity
    assert rec["check"] == "sampled" and rec["bytes_checked"] < rec["bytes"]
    assert f"memlm ngram info --verify {flipped}" in rec["note"]
    with pytest.raises(MemlmError, match="checksum mismatch in .*table.0"):
        ix.NgramIndex.open(flipped, verify=True)


def test_a_sound_index_reports_a_full_check(small_samples, tmp_path):
    out = tmp_path / "ix"
    index = ix.build_ngram_index(gpt2_tokenizer(), make_toy_docs(20), out, source={"corpus": "toy"}, progress=False)
    assert index.integrity["check"] == "full" and index.integrity["bytes_checked"] == index.manifest["bytes"]


def test_eval_reports_what_was_checked(flipped, monkeypatch, tiny_lm_dir, tmp_path, capsys):
    """``memlm eval --ngram``: one stderr line and ``ngram_integrity`` in the result JSON."""
    monkeypatch.setattr(ix, "FULL_CHECK_BYTES", 0)
    text = tmp_path / "eval.jsonl"
    text.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(4, seed=9)))
    capsys.readouterr()
    rc = main(["eval", "--model", str(tiny_lm_dir), "--corpus", str(text), "--memory", str(flipped), "--window", "64",
               "--min-context", "32", "--max-tokens", "200", "--json", str(tmp_path / "r.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "checksums sampled:" in err and "memlm ngram info --verify" in err
    rec = json.loads((tmp_path / "r.json").read_text())["ngram_integrity"]
    assert rec["check"] == "sampled" and "memlm ngram info --verify" in rec["note"]
