"""``memlm ngram build`` killed at every boundary (a shard split, before and after every progress record, inside every
step of the suffix-array sort, after the manifest) and rerun gives the same bytes as an uninterrupted build: no
document lost or indexed twice. The default run crashes at the first and last boundary of each
kind; ``pytest -m slow`` at every one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("infini_gram")

from conftest import gpt2_tokenizer, make_toy_docs  # noqa: E402

from memlm.io.locking import LOCK_NAME  # noqa: E402
from memlm.ngram import index as ix  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
SHARD_TOKENS, BATCH = 1500, 32  # ~5 shards of ~200 documents, split inside batches of 32
KINDS = {"progress-before", "progress-after", "manifest-before", "manifest-after", "sort", "shard-open"}
TIMING = ("build_seconds", "build_id", "created", "manifest_sha256")  # time-dependent manifest fields


class Crash(BaseException):
    """Stands for kill -9 at a named point (BaseException: no ``except Exception`` of the builder catches it)."""


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def docs():
    return make_toy_docs(200, seed=11)


def _build(tok, docs, out: Path):
    return ix.build_ngram_index(
        tok, docs, out, source={"corpus": "toy"}, shard_tokens=SHARD_TOKENS, progress=False, batch_docs=BATCH
    )


def _contents(folder: Path) -> dict[str, bytes | dict]:
    """Every file of the folder (the lock file aside), the manifest without its time-dependent fields."""
    out: dict[str, bytes | dict] = {}
    for f in sorted(folder.iterdir()):
        if f.name == LOCK_NAME:
            continue
        assert f.is_file(), f"left behind: {f}"
        out[f.name] = f.read_bytes()
    manifest = json.loads(out.pop(ix.MANIFEST))
    out[ix.MANIFEST] = {k: v for k, v in manifest.items() if k not in TIMING}
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tok, docs):
    folder = tmp_path_factory.mktemp("clean") / "ix"
    index = _build(tok, docs, folder)
    shards = index.manifest["shards"]
    assert len(shards) >= 4 and sum(s["documents"] for s in shards) == len(docs)
    assert any(s["documents"] % BATCH for s in shards[:-1])  # some split falls inside a batch
    return _contents(folder)


class Points:
    """Counts the builder's boundaries and raises :class:`Crash` at one of them: ``("progress-before", k)`` /
    ``("progress-after", k)`` around the k-th progress record, ``("manifest-after", 1)``, ``("shard-open", s)`` just
    after ``tokenized.s`` is opened (s >= 1: a shard split), ``("sort", k)`` when the k-th ``rust_indexing`` step
    (make-part, merge or concat) has finished."""

    def __init__(self, monkeypatch, at: tuple[str, int] | None = None):
        self.at, self.seen = at, {}
        real_write, real_run, real_open = ix.atomic_write_json, ix._run, open

        def write(path, obj):
            what = "progress" if Path(path).name == ix.PROGRESS else "manifest"
            self.hit(f"{what}-before")
            real_write(path, obj)
            self.hit(f"{what}-after")

        def run(cmd, what):
            proc = real_run(cmd, what)
            proc.wait()
            self.hit("sort")
            return proc

        def opener(file, mode="r", *a, **k):
            handle = real_open(file, mode, *a, **k)
            name = Path(file).name
            if mode == "ab" and name.startswith("tokenized.") and name != "tokenized.0":
                self.hit("shard-open", int(name.split(".")[1]))
            return handle

        monkeypatch.setattr(ix, "atomic_write_json", write)
        monkeypatch.setattr(ix, "_run", run)
        monkeypatch.setattr(ix, "open", opener, raising=False)

    def hit(self, point: str, number: int | None = None) -> None:
        self.seen[point] = self.seen.get(point, 0) + 1
        if self.at == (point, self.seen[point] if number is None else number):
            raise Crash(self.at)


def _boundaries(monkeypatch, tok, docs, tmp_path) -> list[tuple[str, int]]:
    with monkeypatch.context() as m:
        p = Points(m)
        _build(tok, docs, tmp_path / "count")
    assert set(p.seen) == KINDS
    points = [(name, k) for name, n in p.seen.items() if name != "shard-open" for k in range(1, n + 1)]
    return points + [("shard-open", s) for s in range(1, p.seen["shard-open"] + 1)]


def _crash_and_resume(monkeypatch, tok, docs, clean, tmp_path, points: list[tuple[str, int]]) -> None:
    """For each point: the build crashes there, nothing is published, and a rerun gives the clean build's bytes."""
    for at in points:
        out = tmp_path / f"{at[0]}-{at[1]}"
        with monkeypatch.context() as m, pytest.raises(Crash):
            Points(m, at)
            _build(tok, docs, out)
        assert not (out / ix.MANIFEST).exists() or (out / ix.PROGRESS).exists(), at  # not published yet
        _build(tok, docs, out)
        assert _contents(out) == clean, at


def test_resume_after_a_crash_at_the_first_and_last_boundary_of_each_kind(monkeypatch, tok, docs, clean, tmp_path):
    """Every kind of boundary, at its first and its last occurrence (all of them: the slow test below)."""
    points = _boundaries(monkeypatch, tok, docs, tmp_path)
    last = {kind: max(k for name, k in points if name == kind) for kind, _ in points}
    some = [(name, k) for name, k in points if k in (1, last[name])]
    _crash_and_resume(monkeypatch, tok, docs, clean, tmp_path, some)


@pytest.mark.slow
def test_resume_after_a_crash_at_every_boundary_is_byte_identical(monkeypatch, tok, docs, clean, tmp_path):
    """Every boundary the build passes (pytest -m slow)."""
    _crash_and_resume(monkeypatch, tok, docs, clean, tmp_path, _boundaries(monkeypatch, tok, docs, tmp_path))


def test_resume_after_crashes_at_two_boundaries(monkeypatch, tok, docs, clean, tmp_path):
    """Killed at a shard split, then again inside the next sort: one rerun more, still the same bytes."""
    out = tmp_path / "twice"
    for at in (("shard-open", 2), ("sort", 4)):
        with monkeypatch.context() as m, pytest.raises(Crash):
            Points(m, at)
            _build(tok, docs, out)
    _build(tok, docs, out)
    assert _contents(out) == clean


_KILLED = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import gpt2_tokenizer, make_toy_docs
from memlm.ngram import index as ix
def opener(file, mode="r", *a, **k):
    handle = open(file, mode, *a, **k)
    if mode == "ab" and Path(file).name == "tokenized.{shard}":
        os.kill(os.getpid(), signal.SIGKILL)
    return handle
ix.open = opener
ix.build_ngram_index(gpt2_tokenizer(), make_toy_docs(200, seed=11), {out!r}, source={{"corpus": "toy"}},
                     shard_tokens={shard_tokens}, progress=False, batch_docs={batch})
"""


def test_kill_9_just_after_a_new_shard_appears(tok, docs, clean, tmp_path):
    """The probe's case: kill -9 right after ``tokenized.N`` is created, rerun; the old code indexed the documents
    between the batch start and the split twice (one shard more, exit 0)."""
    out = tmp_path / "killed"
    code = _KILLED.format(tests=str(Path(__file__).parent), out=str(out), shard=2, shard_tokens=SHARD_TOKENS,
                          batch=BATCH)  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (out / "tokenized.2").exists() and (out / ix.PROGRESS).exists()
    _build(tok, docs, out)
    assert _contents(out) == clean
