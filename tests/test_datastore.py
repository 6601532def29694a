"""Datastore: contents equal a direct forward pass, manifest, refusal of mismatched models, corruption, append."""

import errno
import json
import os

import numpy as np
import pytest
import torch
from conftest import Doc, gpt2_tokenizer, tiny_gpt2

from memlm.errors import MemlmError
from memlm.knnlm.write import write_datastore
from memlm.models.keys import KeyCapture, KeySpec
from memlm.storage.datastore import Datastore


def build(tmp_path, tiny_lm, docs, name="ds", **kw):
    model, tok = tiny_lm
    kw = {"window": 32, "min_context": 8, "batch_size": 3, "progress": False, **kw}
    return write_datastore(model, tok, docs, tmp_path / name, **kw)


def test_entries_equal_direct_forward(tmp_path, tiny_lm):
    model, tok = tiny_lm
    docs = [Doc("a", "one two three four five six seven eight nine ten"), Doc("b", "alpha beta gamma delta")]
    ds = build(tmp_path, tiny_lm, docs, window=64)  # the whole stream fits in one window
    stream = [t for d in docs for t in tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert len(ds) == len(stream) - 1
    np.testing.assert_array_equal(ds.values, stream[1:])
    with KeyCapture(model, KeySpec("ffn_in", -1)) as cap, torch.no_grad():
        model(input_ids=torch.tensor([stream]))
        direct = cap.keys[0, :-1].numpy()
    np.testing.assert_allclose(ds.keys.astype(np.float32), direct, atol=2e-3, rtol=2e-3)
    # provenance: offsets restart in each document
    n_a = len(tok(docs[0].text)["input_ids"]) + 1
    assert ds.offset[n_a - 2] == n_a - 1 and ds.offset[n_a - 1] == 0
    assert len(set(ds.doc_hash.tolist())) == 2


def test_manifest_describes_everything(tmp_path, tiny_lm, toy_docs):
    ds = build(tmp_path, tiny_lm, toy_docs, source={"corpus": "toy"})
    m = json.loads((ds.path / "manifest.json").read_text())
    for key in ("model", "tokenizer", "key", "count", "dtypes", "files", "window", "min_context", "stride", "sources"):
        assert key in m
    assert m["key"] == {"role": "ffn_in", "layer": 1, "dim": 32, "describe": "ffn_in@1"}
    assert m["dtypes"]["keys"] == "float16" and m["dtypes"]["values"] == "int32"
    assert ds.keys.shape == (m["count"], 32) and ds.keys.dtype == np.float16
    assert not (ds.path / "progress.json").exists()
    Datastore.open(ds.path, verify=True)
    # a rerun of a finished build is a no-op
    again = build(tmp_path, tiny_lm, toy_docs, source={"corpus": "toy"})
    assert again.checksum() == ds.checksum()


def test_window_settings_do_not_change_entries_beyond_context(tmp_path, tiny_lm, toy_docs):
    a = build(tmp_path, tiny_lm, toy_docs, name="a", batch_size=1)
    b = build(tmp_path, tiny_lm, toy_docs, name="b", batch_size=5)
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_allclose(a.keys.astype(np.float32), b.keys.astype(np.float32), atol=2e-3)


def test_refuses_other_model_tokenizer_and_role(tmp_path, tiny_lm, toy_docs):
    ds = build(tmp_path, tiny_lm, toy_docs)
    model, tok = tiny_lm
    ds.check_compatible(model, tok, KeySpec("ffn_in", -1))
    with pytest.raises(MemlmError, match="built with model"):
        ds.check_compatible(tiny_gpt2(seed=1), tok)
    other_tok = gpt2_tokenizer()
    other_tok.add_tokens(["<extra-token>"])
    with pytest.raises(MemlmError, match="tokenizer"):
        ds.check_compatible(model, other_tok)
    with pytest.raises(MemlmError, match="holds ffn_in@1 keys"):
        ds.check_compatible(model, tok, KeySpec("final"))


def test_truncated_or_corrupt_files_are_detected(tmp_path, tiny_lm, toy_docs):
    ds = build(tmp_path, tiny_lm, toy_docs)
    keys = ds.path / "keys.bin"
    data = keys.read_bytes()
    keys.write_bytes(data[:-10])
    with pytest.raises(MemlmError, match="truncated"):
        Datastore.open(ds.path)
    keys.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    # same size: the sampled checksum (whole file up to 1 MiB) sees it on every open, the full one on verify
    with pytest.raises(MemlmError, match="sampled checksum"):
        Datastore.open(ds.path)
    with pytest.raises(MemlmError, match="sampled checksum"):
        Datastore.open(ds.path, verify=True)
    keys.write_bytes(data)
    Datastore.open(ds.path, verify=True)
    (ds.path / "manifest.json").write_text("{not json")
    with pytest.raises(MemlmError, match="corrupt"):
        Datastore.open(ds.path)
    with pytest.raises(MemlmError, match="not a memlm datastore"):
        Datastore.open(tmp_path / "nowhere")


def test_empty_corpus_is_an_error(tmp_path, tiny_lm):
    with pytest.raises(MemlmError, match="no tokens"):
        build(tmp_path, tiny_lm, [])


def test_append_adds_a_source(tmp_path, tiny_lm, toy_docs):
    first = build(tmp_path, tiny_lm, toy_docs[:10], source={"corpus": "part1"})
    n1 = len(first)
    both = build(tmp_path, tiny_lm, toy_docs[10:], source={"corpus": "part2"}, append=True)
    alone = build(tmp_path, tiny_lm, toy_docs[10:], name="alone")
    assert len(both) == n1 + len(alone)
    assert [s["corpus"] for s in both.manifest["sources"]] == ["part1", "part2"]
    np.testing.assert_array_equal(both.values[n1:], alone.values)
    Datastore.open(both.path, verify=True)


def test_subsample(tmp_path, tiny_lm, toy_docs):
    ds = build(tmp_path, tiny_lm, toy_docs)
    sub = ds.subsample(tmp_path / "sub", 0.25, seed=1)
    assert len(sub) == round(len(ds) * 0.25)
    assert sub.manifest["subsample"]["fraction"] == 0.25
    Datastore.open(sub.path, verify=True)
    # every kept entry is an entry of the original
    pairs = {(v, o, h) for v, o, h in zip(ds.values.tolist(), ds.offset.tolist(), ds.doc_hash.tolist(), strict=True)}
    assert all(p in pairs for p in zip(sub.values.tolist(), sub.offset.tolist(), sub.doc_hash.tolist(), strict=True))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_is_a_clear_error_and_the_rerun_resumes(tmp_path, tiny_lm, toy_docs, monkeypatch, code):
    import builtins

    import memlm.storage.folder as folder_mod  # the shared append-only writer opens the array files

    lone = build(tmp_path, tiny_lm, toy_docs, name="lone")
    calls = {"keys": 0}

    class FullDisk:
        """keys.bin's handle: the 4th write stores half its bytes, then the disk is full."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            calls["keys"] += 1
            if calls["keys"] >= 4:
                self.f.write(data[: len(data) // 2])
                raise OSError(code, os.strerror(code))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, mode="r", *a, **kw):
        f = builtins.open(path, mode, *a, **kw)
        return FullDisk(f) if str(path).endswith("keys.bin") and "a" in mode else f

    monkeypatch.setattr(folder_mod, "open", fake_open, raising=False)
    with pytest.raises(MemlmError) as e:
        build(tmp_path, tiny_lm, toy_docs, name="full")
    msg = str(e.value)
    assert msg.startswith("disk full while writing") and "keys.bin" in msg
    assert "free space and rerun the same command to resume" in msg
    assert (tmp_path / "full" / "progress.json").exists() and not (tmp_path / "full" / "manifest.json").exists()
    assert not list((tmp_path / "full").glob(".*"))  # no lock file, no temporary file
    monkeypatch.undo()
    resumed = build(tmp_path, tiny_lm, toy_docs, name="full")
    assert resumed.manifest["files"] == lone.manifest["files"]  # byte-identical files (full SHA-256 of each)
    for name in ("keys", "values", "doc_hash", "offset"):
        assert (tmp_path / "full" / f"{name}.bin").read_bytes() == (tmp_path / "lone" / f"{name}.bin").read_bytes()


def test_disk_full_while_writing_progress(tmp_path, tiny_lm, toy_docs, monkeypatch):
    import memlm.io.fileio as fileio

    lone = build(tmp_path, tiny_lm, toy_docs, name="lone")
    real = fileio.os.fsync
    n = {"calls": 0}

    def fsync(fd):  # the 5th write of progress.json (through a temporary file) finds the disk full
        if ".progress.json." in os.readlink(f"/proc/self/fd/{fd}"):
            n["calls"] += 1
            if n["calls"] == 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    with pytest.raises(MemlmError, match="disk full while writing .*progress.json: free space and rerun"):
        build(tmp_path, tiny_lm, toy_docs, name="full")
    monkeypatch.undo()
    assert not [p for p in (tmp_path / "full").iterdir() if p.name.startswith(".")]
    assert build(tmp_path, tiny_lm, toy_docs, name="full").manifest["files"] == lone.manifest["files"]


def test_rebuild_with_other_settings_names_the_api_arguments_in_python(tmp_path, tiny_lm, toy_docs):
    """From Python, a datastore folder holding other settings is refused with the function's arguments (overwrite=True,
    append=True), not the command's flags; under the `memlm` command (memlm.errors.command_line) with the flags."""
    from memlm.errors import command_line

    build(tmp_path, tiny_lm, toy_docs[:10], source={"corpus": "part1"})
    with pytest.raises(MemlmError, match="other settings") as refused:
        build(tmp_path, tiny_lm, toy_docs[10:], source={"corpus": "part2"})
    assert "overwrite=True" in str(refused.value) and "append=True" in str(refused.value)
    assert "--overwrite" not in str(refused.value) and "--append" not in str(refused.value)
    with command_line(), pytest.raises(MemlmError, match="other settings") as refused:
        build(tmp_path, tiny_lm, toy_docs[10:], source={"corpus": "part2"})
    assert "--overwrite" in str(refused.value) and "--append" in str(refused.value)
    with pytest.raises(MemlmError, match="append=True needs an existing datastore"):
        build(tmp_path, tiny_lm, toy_docs, name="new", append=True)
    rebuilt = build(tmp_path, tiny_lm, toy_docs[10:], source={"corpus": "part2"}, overwrite=True)  # the fix named
    assert rebuilt.manifest["sources"][0]["corpus"] == "part2"
