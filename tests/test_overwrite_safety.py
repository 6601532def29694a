"""``--overwrite`` replaces only an artifact of its own kind and only the files that kind writes; anything else in the
folder is refused by name with nothing changed; ``--memory-gb`` out of range is one error before the model loads
(the probe's data-loss cases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("infini_gram")

from conftest import gpt2_tokenizer, make_toy_docs  # noqa: E402

from memlm.cli import common, main  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.io.locking import LOCK_NAME  # noqa: E402
from memlm.knnlm.write import write_datastore
from memlm.ngram.index import NgramIndex, build_ngram_index  # noqa: E402
from memlm.storage.datastore import Datastore  # noqa: E402

USER_FILES = {"metadata.json": b'{"mine": 1}', "table.csv": b"a,b\n1,2\n", "offset.txt": b"42\n"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("corpus") / "toy.jsonl"
    f.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(12, seed=1)))
    return f


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm):
    """A kNN datastore and an ∞-gram index, each in its own folder (copied by the tests that change them)."""
    model, tok = tiny_lm
    root = tmp_path_factory.mktemp("built")
    docs = make_toy_docs(12, seed=1)
    write_datastore(model, tok, docs, root / "ds", window=16, min_context=4, batch_size=2, progress=False)
    build_ngram_index(gpt2_tokenizer(), docs, root / "ng", source={"corpus": "toy"}, progress=False)
    return root


def _copy(built: Path, name: str, dst: Path, extra: dict[str, bytes] | None = None) -> Path:
    shutil.copytree(built / name, dst)
    for fname, data in (extra or {}).items():
        (dst / fname).write_bytes(data)
    return dst


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes (the writer lock's holder note aside: a refused writer may have taken the lock)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != LOCK_NAME}


def run(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # a usage error of argparse (memlm.cli.validate.ArgumentParser)
        rc = e.code
    return rc, capsys.readouterr().err


def one_error(rc: int, err: str) -> str:
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """The refusals come before the model loads."""
    monkeypatch.setattr(common, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def ngram_build(model, corpus, out, *extra):
    return ("ngram", "build", "--model", model, "--corpus", corpus, "--out", out, "--no-calibrate", *extra)


def ds_build(model, corpus, out, *extra):
    return ("datastore", "build", "--model", model, "--corpus", corpus, "--out", out, "--window", "16",
            "--min-context", "4", "--batch-size", "2", "--no-index", *extra)  # fmt: skip


# ------------------------------------------------------------------------------------------------ ngram build


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_ngram_build_over_a_datastore_is_refused(capsys, no_model, tiny_lm_dir, corpus, built, tmp_path, overwrite):
    """The probe deleted the datastore's manifest.json and offset.bin (glob ``offset.*``) and wrote an index over it."""
    ds = _copy(built, "ds", tmp_path / "ds")
    before = snapshot(ds)
    line = one_error(*run(capsys, *ngram_build(tiny_lm_dir, corpus, ds, *overwrite)))
    assert "holds a datastore, not an ∞-gram index" in line and "new --out" in line, line
    assert "--overwrite to" not in line
    assert snapshot(ds) == before
    Datastore.open(ds, verify=True)


def test_ngram_build_overwrite_refuses_a_users_files(capsys, no_model, tiny_lm_dir, corpus, built, tmp_path):
    """The probe deleted a user's metadata.json, table.csv and offset.txt (glob ``<kind>.*``)."""
    for name, folder in (("with an index", _copy(built, "ng", tmp_path / "a", USER_FILES)), ("alone", tmp_path / "b")):
        folder.mkdir(exist_ok=True)
        for fname, data in USER_FILES.items():
            (folder / fname).write_bytes(data)
        before = snapshot(folder)
        line = one_error(*run(capsys, *ngram_build(tiny_lm_dir, corpus, folder, "--overwrite")))
        assert "metadata.json, offset.txt, table.csv" in line and "nothing was deleted" in line, (name, line)
        assert snapshot(folder) == before, name
    NgramIndex.open(tmp_path / "a", verify=True)


def test_ngram_build_api_refuses_too(built, tmp_path):
    """The Python API checks the same (the CLI's check is only the early copy)."""
    tok, docs = gpt2_tokenizer(), make_toy_docs(12, seed=1)
    ds = _copy(built, "ds", tmp_path / "ds")
    before = snapshot(ds)
    with pytest.raises(MemlmError, match="holds a datastore, not an ∞-gram index"):
        build_ngram_index(tok, docs, ds, source={"corpus": "toy"}, overwrite=True, progress=False)
    assert snapshot(ds) == before
    ng = _copy(built, "ng", tmp_path / "ng", {"offset.txt": b"42\n"})
    before = snapshot(ng)
    with pytest.raises(MemlmError, match=r"not part of an ∞-gram index: offset\.txt; overwrite=True replaces only"):
        build_ngram_index(tok, docs, ng, source={"corpus": "other"}, overwrite=True, progress=False)
    assert snapshot(ng) == before


def test_ngram_build_overwrite_replaces_its_own_index(built, tmp_path):
    """Only the index's files in the folder: --overwrite replaces them (a fresh build's bytes, no file left over)."""
    tok = gpt2_tokenizer()
    ng = _copy(built, "ng", tmp_path / "ng")
    (ng / "tokenized.7").write_bytes(b"stray shard")  # an index's own name: the overwrite removes it
    new = build_ngram_index(tok, make_toy_docs(20, seed=2), ng, source={"corpus": "b"}, overwrite=True, progress=False)
    ref = build_ngram_index(tok, make_toy_docs(20, seed=2), tmp_path / "ref", source={"corpus": "b"}, progress=False)
    assert {k: v["sha256"] for k, v in new.manifest["files"].items()} == {
        k: v["sha256"] for k, v in ref.manifest["files"].items()
    }
    assert sorted(p.name for p in ng.iterdir()) == sorted(p.name for p in ref.path.iterdir())


def test_a_users_offset_file_does_not_look_like_index_files(built, tmp_path):
    """A fresh build beside a user's files (no --overwrite): they are not taken for a broken index, and are kept."""
    out = tmp_path / "mixed"
    out.mkdir()
    for fname, data in USER_FILES.items():
        (out / fname).write_bytes(data)
    build_ngram_index(gpt2_tokenizer(), make_toy_docs(12, seed=1), out, source={"corpus": "toy"}, progress=False)
    assert all((out / f).read_bytes() == d for f, d in USER_FILES.items())


# ------------------------------------------------------------------------------------------------ datastore


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_datastore_build_over_an_ngram_index_is_refused(capsys, no_model, tiny_lm_dir, corpus, built, tmp_path,
                                                        overwrite):  # fmt: skip
    """The probe replaced the index's manifest with a datastore's (exit 0)."""
    ng = _copy(built, "ng", tmp_path / "ng")
    before = snapshot(ng)
    line = one_error(*run(capsys, *ds_build(tiny_lm_dir, corpus, ng, *overwrite)))
    assert "holds an ∞-gram index, not a datastore" in line and "--overwrite to" not in line, line
    assert snapshot(ng) == before
    NgramIndex.open(ng, verify=True)


def test_datastore_build_api_over_an_ngram_index_is_refused(tiny_lm, built, tmp_path):
    model, tok = tiny_lm
    ng = _copy(built, "ng", tmp_path / "ng")
    before = snapshot(ng)
    with pytest.raises(MemlmError, match="holds an ∞-gram index, not a datastore"):
        write_datastore(model, tok, make_toy_docs(4), ng, window=16, min_context=4, overwrite=True, progress=False)
    assert snapshot(ng) == before


def test_datastore_build_overwrite_refuses_a_users_files(capsys, no_model, tiny_lm_dir, corpus, built, tmp_path):
    ds = _copy(built, "ds", tmp_path / "ds", USER_FILES)
    before = snapshot(ds)
    line = one_error(*run(capsys, *ds_build(tiny_lm_dir, corpus, ds, "--overwrite")))
    assert "not part of a datastore: metadata.json, offset.txt, table.csv" in line and "nothing was deleted" in line
    assert snapshot(ds) == before


def test_datastore_prune_overwrite_over_an_ngram_index_is_refused(capsys, built, tmp_path):
    ng = _copy(built, "ng", tmp_path / "ng")
    before = snapshot(ng)
    line = one_error(*run(capsys, "datastore", "prune", built / "ds", "--out", ng, "--overwrite"))
    assert "holds an ∞-gram index, not a datastore" in line, line
    assert snapshot(ng) == before


def test_an_unknown_manifest_alone_is_not_deleted(capsys, no_model, tiny_lm_dir, corpus, tmp_path):
    """Another tool's manifest.json (no memlm file beside it) is refused, not taken for a damaged index."""
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my dataset"}')
    for command in (ngram_build, ds_build):
        line = one_error(*run(capsys, *command(tiny_lm_dir, corpus, out, "--overwrite")))
        assert "manifest.json" in line and "nothing was deleted" in line, line
    assert (out / "manifest.json").read_text() == '{"name": "my dataset"}'


# ------------------------------------------------------------------------------------------------ --memory-gb


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "0.001"])
def test_memory_gb_out_of_range_is_one_error_before_the_model_loads(capsys, no_model, tiny_lm_dir, corpus, tmp_path,
                                                                    value):  # fmt: skip
    """0 and -1 hung (the sort's split never ended), nan was a traceback after the model loaded."""
    line = one_error(*run(capsys, *ngram_build(tiny_lm_dir, corpus, tmp_path / "ix", "--memory-gb", value)))
    assert "--memory-gb" in line, line
    assert not (tmp_path / "ix").exists()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 0.001, "4"])
def test_memory_gb_checked_by_the_api(value, tmp_path):
    with pytest.raises(MemlmError, match="memory_gb"):
        build_ngram_index(gpt2_tokenizer(), make_toy_docs(3), tmp_path / "ix", memory_gb=value, progress=False)
    assert not (tmp_path / "ix").exists()


def test_least_memory_builds_the_same_index(built, tmp_path):
    """At the least memory allowed the sort still ends, with the default's bytes."""
    small = build_ngram_index(gpt2_tokenizer(), make_toy_docs(12, seed=1), tmp_path / "small", source={"corpus": "toy"},
                              memory_gb=0.01, progress=False)  # fmt: skip
    ref = NgramIndex.open(built / "ng")
    assert small.manifest["files"] == ref.manifest["files"]


def test_opening_the_other_kind_names_it(built):
    """Opening one kind's folder as the other names what it holds (the schema error advised a rebuild over it)."""
    with pytest.raises(MemlmError, match="holds a datastore, not an ∞-gram index: give an ∞-gram index's folder"):
        NgramIndex.open(built / "ds")
    with pytest.raises(MemlmError, match="holds an ∞-gram index, not a datastore: give a datastore's folder"):
        Datastore.open(built / "ng")


def test_prune_and_subsample_replace_only_a_datastore(capsys, built, tmp_path):
    """Another tool's manifest.json (or a user's file) in the output folder is refused by name, nothing deleted."""
    for extra in ({"manifest.json": b'{"name": "my dataset"}'}, {"notes.txt": b"mine"}):
        out = tmp_path / next(iter(extra)).replace(".", "_")
        out.mkdir()
        for fname, data in extra.items():
            (out / fname).write_bytes(data)
        line = one_error(*run(capsys, "datastore", "prune", built / "ds", "--out", out, "--overwrite"))
        assert next(iter(extra)) in line and "nothing was deleted" in line, line
        with pytest.raises(MemlmError, match="nothing was deleted"):
            Datastore.open(built / "ds").subsample(out, 0.5)
        assert snapshot(out) == extra
