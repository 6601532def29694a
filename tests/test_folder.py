"""The folder format shared by datastores and phrase indexes (memlm.storage.folder), pinned on a toy format of its
own."""

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.io import schema
from memlm.storage.folder import AppendWriter, FolderFormat, manifest_digest

TOY = FolderFormat(
    kind="toy store",
    title="a toy store",
    arrays={"vec": "float16", "ids": "int32", "pos": "int64"},
    wide="vec",
    dim_field=("shape", "dim"),
    format_version=3,
    manifest_schema=schema.Obj(
        required={"format_version": schema.Int(), "count": schema.Int(min=0), "files": schema.Obj()},
        optional={"manifest_sha256": schema.Str()},
    ),
    progress_schema=schema.Obj(required={"config": schema.Obj(), "count": schema.Int(min=0)}),
    builder="build_toy",
    fix="delete the toy",
    progress_fix="delete progress.json",
    resume="run build_toy again",
    verify_command="toy verify",
)
DIM = 4


def rows(start, n):
    """``n`` deterministic rows starting at row ``start``."""
    r = np.arange(start, start + n)
    return {"vec": np.outer(r % 512, np.arange(1, DIM + 1)) / 8, "ids": r * 3, "pos": r + 10**10}


def build(folder, batches, crash_after=None):
    """Write ``batches`` (row counts) and publish; with ``crash_after=i``: batch ``i`` is written but the writer dies
    before its commit (nothing published)."""
    with TOY.writing(folder, "build a toy"):
        if TOY.progress_path(folder).exists():
            state = TOY.read_progress(folder)
        else:
            state = {"config": {"x": 1}, "count": 0}
            TOY.start(folder, state)
        done = state.get("batches", 0)
        with TOY.appender(folder, DIM, state) as w:
            for i, n in enumerate(batches[done:], start=done):
                w.append(**rows(w.count, n))
                if i == crash_after:
                    return None
                w.commit(batches=i + 1)
        manifest = {"format_version": 3, "count": w.count, "shape": {"dim": DIM}}
        return TOY.publish(folder, manifest)


def open_toy(folder, verify=False):
    manifest = TOY.read_manifest(folder)
    return manifest, TOY.open_arrays(folder, manifest, verify)


def test_round_trip(tmp_path):
    folder = tmp_path / "t"
    manifest = build(folder, [3, 5, 2])
    assert sorted(p.name for p in folder.iterdir()) == ["ids.bin", "manifest.json", "pos.bin", "vec.bin"]
    read, arrays = open_toy(folder, verify=True)
    assert read == manifest and read["count"] == 10 and read["dtypes"] == dict(TOY.arrays)
    assert read["manifest_sha256"] == manifest_digest(read)
    for name, dtype in TOY.arrays.items():
        f = folder / f"{name}.bin"
        assert read["files"][name]["dtype"] == dtype
        assert read["files"][name]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
        assert "sample_sha256" in read["files"][name]
        assert isinstance(arrays[name], np.memmap) and not arrays[name].flags.writeable
        np.testing.assert_array_equal(arrays[name], rows(0, 10)[name].astype(dtype))
    assert arrays["vec"].shape == (10, DIM)
    assert TOY.is_complete(folder)


def test_empty_folder_opens_with_empty_arrays(tmp_path):
    folder = tmp_path / "t"
    build(folder, [])
    _, arrays = open_toy(folder, verify=True)
    assert arrays["vec"].shape == (0, DIM) and arrays["ids"].shape == (0,)


def test_the_manifest_checksum_scheme_is_fixed():
    """SHA-256 of the canonical JSON (sorted keys, no spaces) of every field but manifest_sha256: folders written by
    any memlm version keep opening."""
    m = {"b": [1, 2.5, None], "a": {"z": "é", "y": True}, "manifest_sha256": "0" * 64}
    body = '{"a":{"y":true,"z":"\\u00e9"},"b":[1,2.5,null]}'
    assert manifest_digest(m) == hashlib.sha256(body.encode()).hexdigest()


@pytest.mark.parametrize("crash_after", [0, 1, 2])
def test_resume_after_a_crash_mid_write_truncates_to_the_durable_rows(tmp_path, crash_after):
    batches = [3, 5, 2, 4]
    ref = build(tmp_path / "ref", batches)
    folder = tmp_path / "t"
    assert build(folder, batches, crash_after=crash_after) is None
    state = json.loads((folder / "progress.json").read_text())
    durable = sum(batches[:crash_after])
    assert state["count"] == durable and state.get("batches", 0) == crash_after
    # the uncommitted batch is on disk past the durable rows, and a torn write leaves half a row more
    assert (folder / "vec.bin").stat().st_size == (durable + batches[crash_after]) * DIM * 2
    with open(folder / "ids.bin", "ab") as f:
        f.write(b"\x01\x02")
    with pytest.raises(MemlmError, match="has an unfinished build \\(progress.json\\).*run build_toy again"):
        TOY.read_manifest(folder)
    assert not TOY.is_complete(folder)
    with TOY.appender(folder, DIM, dict(state)):  # opening truncates every array to the recorded count
        pass
    assert (folder / "vec.bin").stat().st_size == durable * DIM * 2
    assert (folder / "ids.bin").stat().st_size == durable * 4
    resumed = build(folder, batches)
    assert resumed["files"] == ref["files"]  # byte-identical arrays: no row lost or duplicated
    assert not (folder / "progress.json").exists()
    open_toy(folder, verify=True)


def test_rows_must_agree_across_arrays(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    with TOY.appender(folder, DIM, {"config": {}, "count": 0}) as w:
        bad = rows(0, 3)
        bad["ids"] = bad["ids"][:2]
        with pytest.raises(ValueError, match="ids has shape"):
            w.append(**bad)
        with pytest.raises(ValueError, match="vec has shape"):
            w.append(**{**rows(0, 3), "vec": np.zeros((3, DIM + 1))})


@pytest.mark.parametrize("how", ["truncated", "extended", "missing"])
def test_a_memmap_of_the_wrong_size_is_refused(tmp_path, how):
    folder = tmp_path / "t"
    build(folder, [3, 5])
    f = folder / "pos.bin"
    data = f.read_bytes()
    if how == "missing":
        f.unlink()
        said = "is missing"
    else:
        f.write_bytes(data[:-3] if how == "truncated" else data + b"\0" * 8)
        said = f"is {len(data) - 3 if how == 'truncated' else len(data) + 8} bytes, the manifest says {len(data)}"
    with pytest.raises(MemlmError) as e:
        open_toy(folder)
    assert str(e.value) == f"toy store file {f} {said} (truncated or corrupt); rebuild the toy store with build_toy"


def test_changed_bytes_are_refused(tmp_path):
    folder = tmp_path / "t"
    build(folder, [3, 5])
    f = folder / "ids.bin"
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF
    f.write_bytes(bytes(data))  # same size: the sampled checksum (whole file below 1 MiB) sees it
    with pytest.raises(MemlmError, match=f"ids.bin is corrupt .*sampled checksum.*`toy verify {folder}` checks"):
        open_toy(folder)


def test_verify_compares_the_full_sha256(tmp_path):
    folder = tmp_path / "t"
    build(folder, [300_000])  # vec.bin: 2.4 MB, larger than the sampled checksum reads
    f = folder / "vec.bin"
    with open(f, "r+b") as h:  # one byte between two sampled blocks
        h.seek(4096 + 100)
        b = h.read(1)
        h.seek(4096 + 100)
        h.write(bytes([b[0] ^ 1]))
    open_toy(folder)  # the sampled checksum does not see it
    with pytest.raises(MemlmError, match=f"checksum mismatch in {f}: the file is corrupt; rebuild the toy store"):
        open_toy(folder, verify=True)


def test_a_tampered_manifest_is_refused(tmp_path):
    folder = tmp_path / "t"
    build(folder, [3, 5])
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "count": 7}))
    with pytest.raises(MemlmError, match="manifest.json was changed after the build .*manifest_sha256.*delete the toy"):
        TOY.read_manifest(folder)
    path.write_text(json.dumps({**m, "dtypes": {**m["dtypes"], "ids": "int64"}}))
    with pytest.raises(MemlmError, match="was changed after the build"):
        TOY.read_manifest(folder)
    path.write_text(json.dumps({**m, "format_version": 4}))
    with pytest.raises(MemlmError, match="has toy store format 4, this memlm reads 3"):
        TOY.read_manifest(folder)
    path.write_text(json.dumps(m)[:40])
    with pytest.raises(MemlmError, match="not a valid toy store manifest .*truncated or corrupt.*delete the toy"):
        TOY.read_manifest(folder)
    path.unlink()
    with pytest.raises(MemlmError, match="is not a toy store \\(no manifest.json\\): build one with build_toy"):
        TOY.read_manifest(folder)


def test_a_manifest_without_the_newer_checksums_still_opens(tmp_path):
    """Folders written before sampled checksums and manifest_sha256 existed: sizes and full checksums still apply."""
    folder = tmp_path / "t"
    build(folder, [3, 5])
    m = json.loads((folder / "manifest.json").read_text())
    m.pop("manifest_sha256")
    for f in m["files"].values():
        f.pop("sample_sha256")
    (folder / "manifest.json").write_text(json.dumps({**m, "note": "hand-written"}))
    open_toy(folder, verify=True)


def test_stray_arrays_and_overwrite(tmp_path):
    folder = tmp_path / "t"
    build(folder, [3])
    (folder / "manifest.json").unlink()
    with pytest.raises(MemlmError, match="holds toy store files but no manifest or progress file"):
        TOY.start(folder, {"config": {}, "count": 0})
    (folder / ".vec.bin.123-abcd.tmp").write_bytes(b"x")
    (folder / "other.txt").write_text("kept")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(MemlmError, match="not part of a toy store: other.txt; overwrite=True replaces only"):
        with TOY.writing(folder, "build a toy", overwrite=True):
            pass
    assert sorted(p.name for p in folder.iterdir() if p.name != ".memlm.lock") == before  # nothing deleted
    (folder / "other.txt").unlink()
    with TOY.writing(folder, "build a toy", overwrite=True):
        assert sorted(p.name for p in folder.iterdir()) == [".memlm.lock"]
    assert sorted(p.name for p in folder.iterdir()) == []


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    import memlm.storage.folder as folder_mod

    folder = tmp_path / "t"
    build(folder, [3], crash_after=0)
    state = TOY.read_progress(folder)
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("ids.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(folder_mod.os, "fsync", fsync)
    with pytest.raises(MemlmError, match=f"disk full while writing {folder / 'ids.bin'}: free space and rerun"):
        with AppendWriter(TOY, folder, DIM, state) as w:
            w.append(**rows(0, 2))
            w.commit()
    monkeypatch.undo()
    assert TOY.read_progress(folder)["count"] == 0  # nothing recorded: the rerun starts from the durable rows


def _vm_flags(path) -> list[str]:
    """VmFlags of this process's mappings of ``path`` (Linux /proc/self/smaps)."""
    flags, current = [], None
    for line in open("/proc/self/smaps").read().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0] and ":" not in line.split()[0]:
            current = line.split()[-1] if len(line.split()) >= 6 else None
        elif line.startswith("VmFlags:") and current == str(path):
            flags.append(line)
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_advise_random_marks_the_mapping_for_scattered_reads(tmp_path):
    """advise_random sets MADV_RANDOM on the memory map (smaps flag 'rr'), also through a sharded array's parts,
    and DatastoreMemory does it for exact rescoring, where the keys of scattered ids are read."""
    from memlm.storage.folder import advise_random
    from memlm.storage.sharded import ShardedArray

    folder = tmp_path / "t"
    build(folder, [3, 5, 2])
    _, arrays = open_toy(folder)
    vec = arrays["vec"]
    assert _vm_flags(folder / "vec.bin") and not any(" rr" in f for f in _vm_flags(folder / "vec.bin"))
    assert advise_random(vec) == 1
    assert all(" rr" in f for f in _vm_flags(folder / "vec.bin"))
    other = tmp_path / "u"
    build(other, [4])
    _, more = open_toy(other)
    assert advise_random(ShardedArray([more["vec"], more["vec"]])) == 2
    assert all(" rr" in f for f in _vm_flags(other / "vec.bin"))
    assert advise_random(np.zeros((3, 2))) == 0  # not a memory map: left alone
