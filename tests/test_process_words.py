"""What a user reads says what the library does, not how it was made: no work-session numbers, issue numbers, "lent"
machines, "machine A/B", engineers called helpers or "the lead", or private absolute paths, in README.md, CHANGELOG.md,
CONTRIBUTING.md, docs/**/*.md, the names of the files under docs/results, and the comments and string literals
(docstrings, printed text) of src/memlm and benchmarks/ (plus benchmarks' shell scripts and READMEs)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (name, pattern). Each names the process sense only: a Python / HTTP / Ray "session", a helper *function*, "the
#: leading documents" or a "machine" that runs a benchmark do not match.
PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (
        "session",
        re.compile(
            r"(?<![A-Za-z0-9.])(?<!HTTP )(?<!http )(?<!Ray )(?<!ray )(?<!client )"
            r"[Ss]essions?(?=\d|\b)(?!\()(?!\s*=)(?!_?scope)"
        ),
    ),
    ("issue number", re.compile(r"(?i)\bissues?\s*#?\d+")),
    ("lent", re.compile(r"(?i)\blent\b")),
    ("machine A/B", re.compile(r"\b[Mm]achines? [AB]\b")),
    (
        "helper (an engineer)",
        re.compile(
            r"(?i)\b(?:a|the|another|one|by|with|our)\s+(?:[\w-]+\s+)?helpers?(?:'s?)?\s+(?:ran|runs|measured|wrote|"
            r"found|said|reported|tests|branch|did)\b|\bhelpers'\s|\bbusy with (?:a |the )?helpers?\b"
        ),
    ),
    ("the lead", re.compile(r"(?i)\bthe lead\b(?!ing)")),
    ("a test run of mine", re.compile(r"(?i)\ba test run of mine\b")),
    ("this laptop", re.compile(r"(?i)\bthis laptop\b")),
    ("private path", re.compile(r"(?<![\w.~$}-])/(?:work|tmp|root)/")),
]

#: A "session" that is technical, where the word does occur: pytest's fixture scope.
_TECHNICAL = re.compile(r"""scope\s*=\s*["']session["']""")


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, word, line) for each process word in ``text``."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        scrubbed = _TECHNICAL.sub("", line)
        for name, pattern in PATTERNS:
            if pattern.search(scrubbed):
                out.append((number, name, line.strip()))
    return out


def python_findings(source: str) -> list[tuple[int, str, str]]:
    """Process words in the comments and string literals (docstrings, f-string text) of Python ``source``."""
    out = []
    kinds = {tokenize.COMMENT, tokenize.STRING}
    kinds |= {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in kinds:
            continue
        for offset, name, line in findings(token.string):
            out.append((token.start[0] + offset - 1, name, line))
    return out


def _text_files() -> list[Path]:
    files = [ROOT / n for n in ("CHANGELOG.md", "CONTRIBUTING.md") if (ROOT / n).exists()]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted(p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in {".md", ".sh", ".txt"})
    return files


def _python_files() -> list[Path]:
    return sorted((ROOT / "src" / "memlm").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))


def _report(hits: list[str]) -> str:
    return f"{len(hits)} process word(s) where a user reads them:\n" + "\n".join(hits[:200])


def _text_hits(paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        for number, name, line in findings(path.read_text(encoding="utf-8")):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {name}: {line[:160]}")
    return hits


def test_readme_has_no_process_words():
    hits = _text_hits([ROOT / "README.md"])
    assert not hits, _report(hits)


def test_docs_and_project_files_have_no_process_words():
    hits = _text_hits(_text_files())
    assert not hits, _report(hits)


def test_source_comments_and_strings_have_no_process_words():
    hits = []
    for path in _python_files():
        for number, name, line in python_findings(path.read_text(encoding="utf-8")):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {name}: {line[:160]}")
    assert not hits, _report(hits)


def test_result_file_names_have_no_process_words():
    hits = []
    for path in sorted((ROOT / "docs" / "results").rglob("*")):
        relative = path.relative_to(ROOT).as_posix()
        for name, pattern in PATTERNS:
            if pattern.search(path.name.replace("_", " ")) or pattern.search(path.name):
                hits.append(f"{relative}: {name}")
    assert not hits, _report(hits)


@pytest.mark.parametrize(
    "line, word",
    [
        ("Measured in session 44 on the AMX host.", "session"),
        ("see docs/results/speed/int8_session41.json", "session"),
        ("(sessions 41-43) p99 0.059", "session"),
        ('"Session 40" in BENCHMARKS', "session"),
        ("the mixture everywhere (issue 35)", "issue number"),
        ("Issue #12 item 4", "issue number"),
        ("no device machine was lent", "lent"),
        ("on machine B (AVX2)", "machine A/B"),
        ("helpers' tests ran beside it", "helper (an engineer)"),
        ("run by the ev-intervals helper's branch", "helper (an engineer)"),
        ("the machine was busy with a helper and tests", "helper (an engineer)"),
        ("the lead runs it after merging", "the lead"),
        ("a test run of mine took 40 s", "a test run of mine"),
        ("on this laptop", "this laptop"),
        ("MEMLM_HOME=/tmp/fresh-home memlm demo", "private path"),
        ("--work /work/data/imdb", "private path"),
    ],
)
def test_a_planted_process_word_is_found(line, word):
    assert [name for _, name, _ in findings(f"first line\n{line}\n")] == [word]
    assert findings(f"first line\n{line}\n")[0][0] == 2


@pytest.mark.parametrize(
    "line",
    [
        "s = requests.Session()",
        "an HTTP session per worker",
        "Ray session logs",
        '@pytest.fixture(scope="session")',
        "a helper function that pads the batch",
        "the leading documents up to this many tokens",
        "a machine with 2 cores; an AMX machine",
        "Silent failure of an excellent plan",
        "tokens/s on tmp/ data, ~/work/x, $HOME/tmp/x",
        "the issue of ties in the ranking",
    ],
)
def test_technical_uses_are_not_flagged(line):
    assert findings(line) == []


def test_python_scan_reads_comments_and_strings_only():
    source = 'session = 1  # fine\nx = "the code of session 44"\n# issue 35\ndef f():\n    """Docstring."""\n'
    assert [(n, w) for n, w, _ in python_findings(source)] == [(2, "session"), (3, "issue number")]
