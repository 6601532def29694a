"""Eval does not trust a datastore blindly; changed settings on rerun are never ignored; malformed metadata is one
clear error. Every case: exit status 2, exactly one `error:` line, no traceback, and (for refusals) no file changed."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import make_toy_docs

from memlm.cli import main
from memlm.storage.datastore import Datastore

W = ["--window", "16", "--min-context", "4", "--batch-size", "2"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    for name, n, seed in (("small", 12, 0), ("big", 20, 1), ("other", 12, 2)):
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(n, seed=seed))
        )
    return root


def run(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(rc, err):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def build(capsys, model, corpus, out, *extra):
    rc, _, err = run(capsys, "datastore", "build", "--model", model, "--corpus", corpus, "--out", out, *W, *extra)
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_lm_dir, corpora):
    """a: the datastore under test (l2 Flat index); b: same size, other keys (final); c: a larger one."""
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name, corpus, extra in (("a", "small", []), ("b", "small", ["--key", "final"]), ("c", "big", [])):
        assert main(["datastore", "build", "--model", str(tiny_lm_dir), "--corpus", str(corpora / f"{corpus}.jsonl"),
                     "--out", str(root / name), *W, *extra]) == 0  # fmt: skip
        out[name] = root / name
    assert len(Datastore.open(out["a"])) == len(Datastore.open(out["b"])) < len(Datastore.open(out["c"]))
    return out


@pytest.fixture
def ds(tmp_path, stores):
    dst = tmp_path / "ds"
    shutil.copytree(stores["a"], dst)
    return dst


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def eval_args(tiny_lm_dir, corpora, ds, *extra):
    return ["eval", "--model", tiny_lm_dir, "--corpus", corpora / "other.jsonl", "--memory", ds, "--k", "8", *W[:4],
            *extra]  # fmt: skip


def test_good_datastore_evaluates(capsys, tiny_lm_dir, corpora, ds):
    for search in ("index", "exact"):
        rc, out, err = run(capsys, *eval_args(tiny_lm_dir, corpora, ds, "--search", search))
        assert rc == 0, err
        assert "knn_ppl" in out


def _set_manifest(ds, edit, reseal=False):
    m = json.loads((ds / "manifest.json").read_text())
    edit(m)
    if reseal:
        from memlm.storage.datastore import _manifest_digest

        m["manifest_sha256"] = _manifest_digest(m)
    (ds / "manifest.json").write_text(json.dumps(m))


def _old_style(m):
    """A manifest as an older memlm wrote it: no sampled checksums, no values range, no self-checksum."""
    for f in m["files"].values():
        f.pop("sample_sha256", None)
    for k in ("values_range", "manifest_sha256", "build_id"):
        m.pop(k, None)


CASES = {
    # another datastore's index of the same size (index and its sidecar copied over)
    "foreign_index_same_size": ("index", "not built from the datastore"),
    # only the index file replaced: the sidecar's checksums no longer match it
    "foreign_index_file_only": ("index", "does not match index.faiss.json"),
    # a larger foreign index (ids past the end of values.bin: an IndexError before)
    "larger_foreign_index": ("index", "not built from the datastore"),
    "missing_sidecar_index": ("index", "has no index.faiss.json"),
    "missing_sidecar_exact": ("exact", "has no index.faiss.json"),
    # an ip index beside its old l2 sidecar: exact search would have used l2
    "stale_sidecar_exact": ("exact", "does not match index.faiss.json"),
    "stale_sidecar_index": ("index", "does not match index.faiss.json"),
    "values_out_of_vocab": ("index", "corrupt"),
    "values_negative_old_manifest": ("index", "outside the tokenizer's vocabulary"),
    "values_out_of_vocab_old_manifest": ("exact", "outside the tokenizer's vocabulary"),
    "hand_edited_key_role": ("index", "changed after the build"),
    "corrupt_keys_exact": ("exact", "sampled checksum"),
    "keys_swapped_with_other_datastore": ("exact", "sampled checksum"),
    "manifest_random_bytes": ("index", "not a valid datastore manifest"),
    "manifest_empty_object": ("index", "format_version: missing"),
    "manifest_list": ("index", "expected an object"),
    "manifest_wrong_type": ("index", "count: expected an integer"),
    "manifest_truncated": ("index", "truncated or corrupt"),
    "manifest_bad_role": ("index", "invalid key"),
    "sidecar_garbage": ("index", "not a valid index sidecar"),
    "sidecar_wrong_metric_type": ("exact", "metric: expected a string"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_refuses_untrustworthy_datastore(case, capsys, tiny_lm_dir, corpora, ds, stores):
    search, expected = CASES[case]
    side = ds / "index.faiss.json"
    if case == "foreign_index_same_size":
        shutil.copy(stores["b"] / "index.faiss", ds / "index.faiss")
        shutil.copy(stores["b"] / "index.faiss.json", side)
    elif case == "foreign_index_file_only":
        shutil.copy(stores["b"] / "index.faiss", ds / "index.faiss")
    elif case == "larger_foreign_index":
        shutil.copy(stores["c"] / "index.faiss", ds / "index.faiss")
        shutil.copy(stores["c"] / "index.faiss.json", side)
    elif case.startswith("missing_sidecar"):
        side.unlink()
    elif case.startswith("stale_sidecar"):
        l2 = side.read_bytes()
        Datastore.open(ds).build_index(factory="Flat", metric="ip", progress=False)
        side.write_bytes(l2)
    elif case.startswith("values"):
        if "old_manifest" in case:
            _set_manifest(ds, _old_style)
        v = np.fromfile(ds / "values.bin", dtype=np.int32)
        v[len(v) // 2] = -3 if "negative" in case else 50257 + 7
        v.tofile(ds / "values.bin")
    elif case == "hand_edited_key_role":
        _set_manifest(ds, lambda m: m["key"].update(role="final", describe="final@1"))
    elif case == "corrupt_keys_exact":
        k = bytearray((ds / "keys.bin").read_bytes())
        k[1000:1064] = os.urandom(64)
        (ds / "keys.bin").write_bytes(bytes(k))
    elif case == "keys_swapped_with_other_datastore":
        shutil.copy(stores["b"] / "keys.bin", ds / "keys.bin")
    elif case == "manifest_random_bytes":
        (ds / "manifest.json").write_bytes(os.urandom(300))
    elif case == "manifest_empty_object":
        (ds / "manifest.json").write_text("{}")
    elif case == "manifest_list":
        (ds / "manifest.json").write_text("[]")
    elif case == "manifest_wrong_type":
        _set_manifest(ds, lambda m: m.update(count="many"))
    elif case == "manifest_truncated":
        raw = (ds / "manifest.json").read_bytes()
        (ds / "manifest.json").write_bytes(raw[: len(raw) // 2])
    elif case == "manifest_bad_role":
        _set_manifest(ds, lambda m: m["key"].update(role="banana"), reseal=True)
    elif case == "sidecar_garbage":
        side.write_bytes(b"\x00\xff garbage")
    elif case == "sidecar_wrong_metric_type":
        meta = json.loads(side.read_text())
        meta["metric"] = 3
        side.write_text(json.dumps(meta))
    before = snapshot(ds)
    rc, _, err = run(capsys, *eval_args(tiny_lm_dir, corpora, ds, "--search", search))
    assert expected in one_error(rc, err)
    assert snapshot(ds) == before


@pytest.mark.parametrize("bad", ["random", "{}", "[]", "truncated", "types"])
def test_malformed_manifest_in_every_datastore_command(bad, capsys, tiny_lm_dir, corpora, ds):
    path = ds / "manifest.json"
    raw = path.read_bytes()
    path.write_bytes(
        {
            "random": os.urandom(200),
            "{}": b"{}",
            "[]": b"[]",
            "truncated": raw[:-40],
            "types": raw.replace(b'"window": 16', b'"window": "16"'),
        }[bad]
    )
    before = snapshot(ds)
    for args in (
        ["datastore", "info", ds],
        ["datastore", "info", ds, "--verify"],
        ["index", "build", ds],
        ["datastore", "build", "--model", tiny_lm_dir, "--corpus", corpora / "small.jsonl", "--out", ds, *W],
        ["generate", "--model", tiny_lm_dir, "--memory", ds, "--prompt", "the cat"],
    ):
        rc, _, err = run(capsys, *args)
        line = one_error(rc, err)
        assert "manifest.json" in line and ("--overwrite" in line or "rebuild" in line), line
    assert snapshot(ds) == before


@pytest.mark.parametrize("bad", ["truncated", "empty", "[]", "types"])
def test_malformed_progress_file_on_resume(bad, capsys, tiny_lm_dir, corpora, tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    good = {"config": {}, "base": {"count": 0, "manifest": None}, "windows_done": 0, "count": 0, "seconds": 0.0}
    raw = json.dumps(good).encode()
    (out / "progress.json").write_bytes(
        {"truncated": raw[:20], "empty": b"", "[]": b"[]", "types": json.dumps({**good, "count": -5}).encode()}[bad]
    )
    rc, _, err = run(capsys, "datastore", "build", "--model", tiny_lm_dir, "--corpus", corpora / "small.jsonl",
                     "--out", out, *W)  # fmt: skip
    line = one_error(rc, err)
    assert "progress.json" in line and "--overwrite" in line
    rc, _, err = run(capsys, "datastore", "info", out)
    assert "unfinished build" in one_error(rc, err)
    # --overwrite discards it and builds
    rc, _, err = run(capsys, "datastore", "build", "--model", tiny_lm_dir, "--corpus", corpora / "small.jsonl",
                     "--out", out, *W, "--overwrite", "--no-index")  # fmt: skip
    assert rc == 0, err


def test_info_verify(capsys, ds):
    rc, out, err = run(capsys, "datastore", "info", ds, "--verify")
    assert rc == 0, err
    assert "checksums OK" in out and "the index (full SHA-256" in out
    info = json.loads(out[: out.rindex("}") + 1])
    assert info["index"]["usable"] and info["index"]["metric"] == "l2" and info["build_id"]
    # a one-byte change in the index file: caught (whole-file hash at this size, full hash on --verify)
    data = bytearray((ds / "index.faiss").read_bytes())
    data[-5] ^= 1
    (ds / "index.faiss").write_bytes(bytes(data))
    rc, _, err = run(capsys, "datastore", "info", ds, "--verify")
    assert "its index cannot be used" in one_error(rc, err)
    rc, out, err = run(capsys, "datastore", "info", ds)  # without --verify: reported, not fatal
    assert rc == 0, err
    index = json.loads(out)["index"]
    assert index["usable"] is False and "does not match" in index["problem"]


# ------------------------------------------------------------------------------------ changed settings on rerun


def test_rerun_with_changed_settings_is_refused(capsys, tiny_lm_dir, corpora, ds, stores):
    small = corpora / "small.jsonl"
    base = ["datastore", "build", "--model", tiny_lm_dir, "--out", ds]
    before = snapshot(ds)
    rc, _, err = run(capsys, *base, "--corpus", small, *W)
    assert rc == 0 and "already built" in err
    assert "already built" in err
    for extra, named in [
        (["--corpus", small, "--window", "32", "--min-context", "4"], "window 16 -> 32"),
        (["--corpus", small, *W, "--key", "final"], "key ffn_in@1 -> final@1"),
        (["--corpus", small, *W, "--max-tokens", "50"], "max-tokens None -> 50"),
        (["--corpus", corpora / "other.jsonl", *W], "corpus"),
        (["--corpus", small, *W, "--split", "valid"], "split train -> valid"),
        (["--corpus", small, *W, "--dtype", "bfloat16"], "dtype float32 -> bfloat16"),
        (["--corpus", small, *W, "--metric", "ip"], "already has an index Flat (l2)"),
    ]:
        rc, _, err = run(capsys, *base, *extra)
        line = one_error(rc, err)
        assert named in line, line
        assert "--overwrite" in line or "memlm index build" in line, line
        assert snapshot(ds) == before
    # --overwrite replaces it with the new settings (equal to a fresh build with them)
    rc, _, err = run(capsys, *base, "--corpus", small, "--window", "32", "--min-context", "4", "--overwrite")
    assert rc == 0, err
    fresh = ds.parent / "fresh"
    build(capsys, tiny_lm_dir, small, fresh, "--window", "32", "--min-context", "4")
    assert Datastore.open(ds).manifest["files"] == Datastore.open(fresh).manifest["files"]
    assert Datastore.open(ds).manifest["window"] == 32


def test_append_rerun_does_not_duplicate(capsys, tiny_lm_dir, corpora, ds):
    base = ["datastore", "build", "--model", tiny_lm_dir, "--out", ds, *W, "--append"]
    n = len(Datastore.open(ds))
    rc, _, err = run(capsys, *base, "--corpus", corpora / "other.jsonl")
    assert rc == 0, err
    n2 = len(Datastore.open(ds))
    assert n2 > n
    rc, _, err = run(capsys, *base, "--corpus", corpora / "other.jsonl")
    assert rc == 0 and "nothing to append" in err
    assert len(Datastore.open(ds)) == n2
    rc, _, err = run(capsys, *base, "--corpus", corpora / "big.jsonl", "--window", "32")
    assert "window 16 -> 32" in one_error(rc, err)
