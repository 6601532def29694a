"""Property-based fuzzing (hypothesis): CLI numeric arguments and manifest/progress contents never give a traceback.

Each property: any input ends in success or in one ``error: ...`` line with exit 2 (``MemlmError`` in the library),
never another exception. A numeric argument is accepted exactly when it is valid. CI runs a bounded number of
examples; ``-m slow`` runs a larger campaign (``FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_toy_docs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlm.cli import main
from memlm.errors import MemlmError

CI_EXAMPLES = 30
SLOW_EXAMPLES = 1000


class _Reached(Exception):
    """Raised in place of loading the model: the arguments were accepted."""


def _run(argv: list[str]) -> tuple[int | str, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code: int | str = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except _Reached:
            code = "reached"
    return code, err.getvalue()


def _one_error(code, err: str) -> bool:
    return code == 2 and "Traceback" not in err and sum(line.startswith("error:") for line in err.splitlines()) == 1


# numbers as a user may type them: integers of any size and sign, floats incl. nan/inf, text, empty
NUMBERS = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e11", "", " ", "0x10", "1_000", "abc", "--", "-0", "+3", "1e-320"]),
    st.text(max_size=6),
)


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _pos_int(t):
    v = _as_int(t)
    return v is not None and v >= 1


def _nonneg_int(t):
    v = _as_int(t)
    return v is not None and v >= 0


def _k(t):
    v = _as_int(t)
    return v is not None and 1 <= v <= 1 << 20


def _prob(t):
    v = _as_float(t)
    return v is not None and math.isfinite(v) and 0 <= v <= 1


def _pos_float(t):
    v = _as_float(t)
    return v is not None and math.isfinite(v) and v > 0


EVAL_FLAGS = {
    "--k": _k,
    "--lambda": _prob,
    "--temperature": _pos_float,
    "--batch-size": _pos_int,
    "--max-tokens": _pos_int,
    "--nprobe": _pos_int,
    "--cache-lambda": _prob,
    "--window": lambda t: _pos_int(t) and int(t) > 8,  # --min-context 8 must stay below it
}


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory, tiny_lm):
    from memlm.knnlm.write import write_datastore

    root = tmp_path_factory.mktemp("fuzz")
    model, tok = tiny_lm
    write_datastore(model, tok, make_toy_docs(8, seed=2), root / "ds", window=32, min_context=8, progress=False)
    return root / "ds"


def _eval_property(ds_dir, flag: str, value: str) -> None:
    import memlm.cli.common as cli

    def reached(*_a, **_k):
        raise _Reached

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "_load_model", reached)
        argv = ["eval", "--corpus", "wiki", "--memory", str(ds_dir), "--min-context", "8", "--window", "32"]
        code, err = _run([*argv, "--k", "4", flag, value] if flag != "--k" else [*argv, flag, value])
    valid = EVAL_FLAGS[flag](value)
    if flag == "--k" and valid and int(value) > 1024:
        valid = False  # larger than the datastore (and than the default): refused up front
    if valid:
        assert code == "reached", (flag, value, code, err)
    else:
        assert _one_error(code, err), (flag, value, code, err)


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(sorted(EVAL_FLAGS)), value=NUMBERS)
def test_fuzz_eval_numbers(ds_dir, flag, value):
    """A numeric argument of ``memlm eval`` is accepted (the model would load) iff valid; else one error line."""
    _eval_property(ds_dir, flag, value)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(sorted(EVAL_FLAGS)), value=NUMBERS)
def test_fuzz_eval_numbers_campaign(ds_dir, flag, value):
    _eval_property(ds_dir, flag, value)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    from memlm.knnlm.table import TokenTable
    from memlm.mixing.datastore import DatastoreComponent

    rng = np.random.default_rng(0)
    n = 30
    path = tmp_path_factory.mktemp("fuzz-dump") / "valid.npz"
    table = TokenTable(
        targets=rng.integers(0, 50, n),
        lm_logprob=np.log(rng.random(n) + 1e-3).astype(np.float32),
        doc_index=np.zeros(n, np.int32),
        lm_entropy=(3 * rng.random(n)).astype(np.float32),
        lm_max_logprob=np.log(rng.random(n) + 1e-3).astype(np.float32),
    )
    table.add(DatastoreComponent(None, 8), {"scores": -np.sort(rng.random((n, 8)), axis=1).astype(np.float32),
                                            "values": rng.integers(0, 50, (n, 8)).astype(np.int32)})  # fmt: skip
    table.save(path)
    return path


TUNE_FLAGS = {
    "--k": lambda t: _k(t) and int(t) <= 8,  # the dump holds 8 neighbours
    "--temperatures": _pos_float,
    "--cache-temperatures": _pos_float,
}


def _tune_property(dump, flag: str, value: str) -> None:
    code, err = _run(["tune", "--valid", str(dump), flag, value])
    if TUNE_FLAGS[flag](value):  # a τ so small that p_kNN underflows on every token leaves nothing to fit: said so
        underflow = flag == "--temperatures" and _one_error(code, err) and "every token probability 0" in err
        assert code == 0 or underflow, (flag, value, err)
    else:
        assert _one_error(code, err), (flag, value, code, err)


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(sorted(TUNE_FLAGS)), value=NUMBERS)
def test_fuzz_tune_numbers(dump, flag, value):
    """``memlm tune`` runs to the end on a valid number and refuses an invalid one (``--k -3`` was k = 13)."""
    _tune_property(dump, flag, value)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(sorted(TUNE_FLAGS)), value=NUMBERS)
def test_fuzz_tune_numbers_campaign(dump, flag, value):
    _tune_property(dump, flag, value)


# ------------------------------------------------------------------------------------------ metadata files

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mutated(original: dict, data) -> bytes:
    """The original manifest with one (possibly nested) value replaced or removed, random JSON, or random bytes."""
    kind = data.draw(st.sampled_from(["replace", "drop", "json", "bytes", "truncate"]))
    if kind == "bytes":
        return data.draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(data.draw(JSON)).encode()
    text = json.dumps(original).encode()
    if kind == "truncate":
        return text[: data.draw(st.integers(0, max(len(text) - 1, 0)))]
    doc = json.loads(text)
    key = data.draw(st.sampled_from(sorted(doc)))
    if kind == "drop":
        del doc[key]
    else:
        doc[key] = data.draw(JSON)
    return json.dumps(doc).encode()


def _manifest_property(ds_dir: Path, tmp: Path, data) -> None:
    from memlm.storage.datastore import Datastore

    work = tmp / "ds"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(ds_dir, work)
    original = json.loads((ds_dir / "manifest.json").read_text())
    (work / "manifest.json").write_bytes(_mutated(original, data))
    try:
        Datastore.open(work)
    except MemlmError:
        pass


@settings(max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_manifest(ds_dir, tmp_path_factory, data):
    """Opening a datastore whose manifest.json is mutated, random JSON or random bytes: MemlmError or success."""
    _manifest_property(ds_dir, tmp_path_factory.mktemp("m"), data)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_manifest_campaign(ds_dir, tmp_path_factory, data):
    _manifest_property(ds_dir, tmp_path_factory.mktemp("m"), data)


def _progress_property(tiny_lm, tmp: Path, data) -> None:
    """An interrupted build whose progress.json is damaged: the rerun resumes or says what is wrong."""
    from memlm.knnlm.write import write_datastore

    model, tok = tiny_lm
    out = tmp / "ds"
    shutil.rmtree(out, ignore_errors=True)
    docs = make_toy_docs(3, seed=4)
    progress = {"config": {"window": 32}, "base": {"count": 0, "manifest": None}, "windows_done": 1, "count": 5,
                "seconds": 0.0}  # fmt: skip
    out.mkdir()
    (out / "progress.json").write_bytes(_mutated(progress, data))
    try:
        write_datastore(model, tok, docs, out, window=32, min_context=8, progress=False)
    except MemlmError:
        pass


@settings(max_examples=CI_EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_progress(tiny_lm, tmp_path_factory, data):
    """A damaged progress.json (mutated, random JSON, random bytes, truncated): MemlmError or a finished build."""
    _progress_property(tiny_lm, tmp_path_factory.mktemp("p"), data)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES // 4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_progress_campaign(tiny_lm, tmp_path_factory, data):
    _progress_property(tiny_lm, tmp_path_factory.mktemp("p"), data)
