"""Every number in the documentation has a committed file behind it: each path under ``docs/results/`` or
``benchmarks/`` that README.md, docs/**/*.md or a benchmarks README names exists, and each result file a results page
names in backticks (``key_types.json``, ``speed/allocator.log``, relative to ``docs/results/``) is committed."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

#: A repository path as the docs write it: ``docs/results/...`` or ``benchmarks/...``, with ``*`` and ``{a,b}``.
PATH = re.compile(r"(?<![\w/.-])((?:docs/results|benchmarks)/[\w./*{},-]*[\w*}])")
#: A result file named in backticks on a results page.
RESULT_FILE = re.compile(r"`([\w./*{},<>-]+\.(?:json|log|png|txt|out|time))`")
#: File names that name a format memlm writes (a datastore's manifest, a run's log), not a committed result.
FORMATS = {"manifest.json", "shards.json", "progress.json", "log.json", "run.json", "results.json"}
#: Folders a results page's command writes to or reads from outside the repository.
OUTSIDE = ("runs/", "data/", "ds/", "idx/", "src/", "tests/", "benchmarks/")


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return pages + sorted((ROOT / "benchmarks").rglob("README.md"))


def _results_pages() -> list[Path]:
    return sorted(RESULTS.glob("*.md")) + sorted(p for p in RESULTS.rglob("*.md") if p.parent != RESULTS)


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (shell brace expansion, one level at a time)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [e for part in match.group(1).split(",") for e in _expand(head + part + tail)]


def _exists(relative: str) -> bool:
    return all(any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() for p in _expand(relative))


def _committed_results() -> list[str]:
    return [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()]


def _named_result_exists(name: str, page: Path, committed: list[str]) -> bool:
    """``name`` (relative to the page's folder or to ``docs/results/``, or the tail of a path below it) is a file."""
    name = re.sub(r"<[^>]*>", "*", name.removeprefix("docs/results/"))
    folder = page.parent.relative_to(RESULTS).as_posix() if page.parent != RESULTS else ""
    for pattern in _expand(name):
        candidates = [pattern, f"*/{pattern}"] + ([f"{folder}/{pattern}"] if folder else [])
        if not any(fnmatch.fnmatch(f, c) for f in committed for c in candidates):
            return False
    return True


def _lines(path: Path):
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        yield number, line, in_code


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_or_benchmarks_path_exists(page: Path) -> None:
    missing = []
    for number, line, _ in _lines(page):
        for match in PATH.finditer(line):
            path = match.group(1).rstrip(".,")
            if "$" in line[match.start() : match.end() + 2] or "<" in path:
                continue  # a shell variable or a placeholder: a path to be written, not one that is committed
            if not _exists(path):
                missing.append(f"{page.relative_to(ROOT)}:{number} {path}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("page", _results_pages(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_result_file_a_results_page_names_is_committed(page: Path) -> None:
    committed = _committed_results()
    missing = []
    for number, line, in_code in _lines(page):
        if in_code:
            continue  # commands: their outputs under runs/ are not committed
        for match in RESULT_FILE.finditer(line):
            name = match.group(1)
            if name in FORMATS or name.startswith(OUTSIDE):
                continue
            if not _named_result_exists(name, page, committed):
                missing.append(f"{page.relative_to(ROOT)}:{number} {name}")
    assert not missing, "\n".join(missing)


def test_the_path_check_finds_a_missing_file() -> None:
    assert _exists("docs/results/knnlm_sweeps.json")
    assert _exists("docs/results/demo_{full,quick}_fresh_home_avx2.log")
    assert not _exists("docs/results/demo_{full,none}_fresh_home_avx2.log")
    committed = _committed_results()
    assert _named_result_exists("bbc_exact_verbalizers/bbc-npm.json", RESULTS / "npm.md", committed)
    assert not _named_result_exists("npm/bbc-npm.json", RESULTS / "npm.md", committed)
