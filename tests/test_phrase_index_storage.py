"""NPM phrase index storage: writer lock, index identity, schema checks, changed settings on rerun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_npm_inference import tiny_bert

from memlm.errors import MemlmError
from memlm.models.resources import load_encoder
from memlm.npm.phrase_index import PhraseIndex, build_phrase_index

SRC = str(Path(__file__).resolve().parents[1] / "src")
DOCS = ["the cat sat on the mat in new york city", "a dog ran in the park by the old river", "birds sang all day"]
OTHER = ["the old river ran past new york city", "a cat and a dog sat in the park", "rain fell all night long"]


@pytest.fixture(scope="module")
def tok():
    return load_encoder("minilm-l6")[1]


@pytest.fixture(scope="module")
def model(tok):
    return tiny_bert(tok)


def build(model, tok, docs, out, **kw):
    return build_phrase_index(model, tok, docs, out, max_length=8, batch_size=2, **kw)


def test_index_of_another_phrase_index_is_refused(tmp_path, model, tok):
    a, b = build(model, tok, DOCS, tmp_path / "a"), build(tiny_bert(tok, 3), tok, DOCS, tmp_path / "b")
    assert len(a) == len(b)  # same size: only the identity tells them apart
    a.search(a.vectors[:2].astype("float32"), 3)
    for name in ("index.faiss", "index.faiss.json"):
        shutil.copy(tmp_path / "b" / name, tmp_path / "a" / name)
    with pytest.raises(MemlmError, match="not built from the npm-phrase-index"):
        PhraseIndex.open(tmp_path / "a").search(a.vectors[:2].astype("float32"), 3)


@pytest.mark.parametrize("target", ["manifest.json", "docs.json", "progress.json"])
@pytest.mark.parametrize("blob", [b"", b"{}", b"[]", b"\xff\x00 not json", b'{"ids": 5, "count": "x"}'])
def test_malformed_metadata_is_one_error(tmp_path, model, tok, target, blob):
    out = tmp_path / "p"
    build(model, tok, DOCS, out)
    (out / target).write_bytes(blob)
    opener = (lambda: build(model, tok, DOCS, out)) if target == "progress.json" else (lambda: PhraseIndex.open(out))
    with pytest.raises(MemlmError) as e:
        opener()
    assert target in str(e.value) and "\n" not in str(e.value)


def test_changed_settings_on_rerun_are_named_and_overwrite_replaces(tmp_path, model, tok):
    out = tmp_path / "p"
    build(model, tok, DOCS, out)
    with pytest.raises(MemlmError, match="factory Flat -> HNSW8"):
        build(model, tok, DOCS, out, factory="HNSW8")
    with pytest.raises(MemlmError, match="corpus"):
        build(model, tok, OTHER, out)
    with pytest.raises(MemlmError, match="encoder"):
        build(tiny_bert(tok, 1), tok, DOCS, out)
    new = build(model, tok, OTHER, out, overwrite=True)
    ref = build(model, tok, OTHER, tmp_path / "ref")
    assert new.manifest["files"] == ref.manifest["files"]


HOLD = """
import sys
from memlm.io.locking import folder_lock
with folder_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_second_writer_is_refused(tmp_path, model, tok):
    out = tmp_path / "p"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env={**os.environ, "PYTHONPATH": SRC},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(MemlmError, match=f"another memlm process is writing there \\(pid {proc.pid}"):
            build(model, tok, DOCS, out)
        assert sorted(p.name for p in out.iterdir()) == [".memlm.lock"]
    finally:
        proc.communicate("\n", timeout=30)
    assert len(build(model, tok, DOCS, out)) > 0
    assert json.loads((out / "index.faiss.json").read_text())["source"]["kind"] == "npm-phrase-index"
