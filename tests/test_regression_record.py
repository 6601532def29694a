"""Same numbers: README's commands with explicit weights give what they gave when ``tests/regression/record.json``
was written (perplexities to 1e-6 relative, the same greedy text, the same lm-eval metrics, the demo's rows).

The recorded numbers are the contract. When an interface changes (e.g. ``--datastore`` and ``--ngram`` become one
memory spec, or a result key is renamed), the invocation in ``tests/regression/make_record.py`` (``COMMANDS``,
``BUILD``, ``outputs``, ``demo_rows``) is updated and the numbers must stay; the record is rewritten
(``python tests/regression/make_record.py``) only for a change that is meant to move them, said so in its commit.

Recorded: ``memlm eval`` with a datastore (explicit λ, τ, k), with an ∞-gram and with both (explicit λ_sparse, λ_dense),
with the continuous cache; the dumps of valid and test and ``memlm tune`` on them (the fitted weights and test
perplexities, the rule and the guarded fit); ``eval`` with no weight flags (the datastore's stored fit: the same
``mixture_ppl`` as ``--mixture stored``, beside ``knn_ppl``, the rule at the fit's mean weight and τ), with ``--mixture
stored`` and with ``--mixture fit.json``; greedy ``memlm generate`` with a datastore, an ∞-gram and both; ``memlm
lm-eval`` on ``memlm_wikitext2``; and the demo's table row (``memlm.experiments.demo._row``) with the memories' stored
fits.
Every command runs in this process on a tiny random GPT-2 named ``smollm2-135m`` and the real corpora cut to a few
hundred tokens; the model, datastore and ∞-gram index are built once for the module.
"""

from __future__ import annotations

import json
import math

import pytest
from regression.make_record import COMMANDS, RECORD, run_all

RECORDED = json.loads(RECORD.read_text())
RTOL = 1e-6


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    """Every recorded command run again, in order, on a model, datastore and index built once."""
    return run_all(tmp_path_factory.mktemp("regression"), keep_going=True)


def differences(expected: dict, got: dict) -> list[str]:
    """What in ``got`` differs from ``expected``: a missing key, a float off by more than RTOL (relative), any other
    value not equal (token counts, text, chosen weights); None stands for an infinite perplexity. Keys only in
    ``got`` are new outputs, not differences."""
    if "error" in got:
        return [got["error"]]
    out = []
    for key, want in expected.items():
        if key not in got:
            out.append(f"{key}: missing (recorded {want!r})")
            continue
        have = got[key]
        if want is None:
            same = have is None or (isinstance(have, float) and not math.isfinite(have))
        elif isinstance(want, float) and isinstance(have, int | float) and not isinstance(have, bool):
            same = math.isclose(have, want, rel_tol=RTOL, abs_tol=0.0)
        else:
            same = have == want
        if not same:
            out.append(f"{key}: {have!r}, recorded {want!r}")
    return out


def test_record_covers_every_command():
    assert set(RECORDED["outputs"]) == {*COMMANDS, "demo"}
    assert all(RECORDED["outputs"].values())
    assert len(RECORDED["memlm_commit"]) == 40


@pytest.mark.parametrize("name", [*COMMANDS, "demo"])
def test_same_numbers(recomputed, name):
    diffs = differences(RECORDED["outputs"][name], recomputed[name])
    assert not diffs, f"memlm {' '.join(COMMANDS[name][0]) if name in COMMANDS else name}:\n" + "\n".join(diffs)


def test_differences_catch_a_change():
    """The comparison fails on a perplexity moved by 1e-5, a token count, a text or a key that went missing."""
    rec = {"knn_ppl": 100.0, "tokens": 7, "text": "a b", "knn_only_ppl": None}
    assert differences(rec, dict(rec)) == []
    assert differences(rec, {**rec, "knn_ppl": 100.0 * (1 + 5e-7)}) == []
    assert differences(rec, {**rec, "knn_ppl": 100.0 * (1 + 1e-5)})
    assert differences(rec, {**rec, "tokens": 8})
    assert differences(rec, {**rec, "text": "a c"})
    assert differences(rec, {**rec, "knn_only_ppl": 5.0})
    assert differences(rec, {k: v for k, v in rec.items() if k != "knn_ppl"})
