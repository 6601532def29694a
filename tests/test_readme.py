"""Every code example of the documentation runs, top to bottom, as a newcomer would type it.

The pages are README.md and every docs/guides/*.md page (:data:`PAGES`), each run in its own working folder. A page's
```bash and ```python blocks run in the order they appear: every ``memlm ...`` line of a bash block (other shell lines,
such as ``pip install``, are not run), and each Python block as a script (``exec``) in the same folder, so later lines
use what earlier ones wrote (``ds/wiki``, ``valid.npz``, ``gate.npz``, ``runs/lm/final``, ``idx/wiki``). The flags are
as written; only the data is made small (:func:`shrink`): ``--max-tokens`` lowered or added, ``--steps`` and
``--limit`` lowered, NPM eval queries capped, ``memlm demo`` run ``--quick``, generation cut to 8 new tokens; in Python
blocks the named corpora are cut to their first documents, lm-eval's limit to 1 and generation to 8 new tokens. The
named model ``smollm2-135m`` is a tiny random GPT-2 (GPT-2's tokenizer, 1,024 positions) put where memlm caches its
conversion of SmolLM2 (``$MEMLM_HOME/models/smollm2-135m``, the cache :func:`memlm.models.resources.load_causal_lm`
reads); the named corpora and encoder are the real ones. A line that crashes, or exits with an error, fails the test
and names the page and line.

Commands are deterministic, so a line identical to one an earlier page ran over identical inputs (the same flags, and
the same bytes in the files and folders it names: a ``datastore build``, an ``eval`` of the same datastore) is answered
with a copy of what that run wrote, taken right after it; the first run of each is real (:class:`Runs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import gpt2_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config

from memlm.io.fileio import memlm_home

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guides").glob("*.md"))]

# --max-tokens per command: the datastores need >= 1,024 entries for --k 1024 and IVF1024 (ds/wiki), >= 4,096 for
# the sharded IVF4096 (ds/wiki-8); other builds read a few windows, evaluations and calibrations 500 tokens
MAX_TOKENS = {"ds/wiki-8": 9000, "ds/wiki": 2000, "ds/wiki-final": 2000, "ds/lm-att": 1500, "idx/wiki": 2000}
SMALL = {"--steps": "2", "--limit": "1"}


def steps(text: str) -> list[tuple[str, object]]:
    """A page's runnable steps in order: ``("cmd", argv)`` for every ``memlm ...`` line of its bash blocks (comments
    dropped; ``.venv/bin/memlm`` too) and ``("python", code)`` for every Python block."""
    out: list[tuple[str, object]] = []
    for lang, block in re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.S | re.M):
        if lang == "python":
            out.append(("python", block))
            continue
        for line in block.splitlines():
            for cmd in _split_and(shlex.split(line, comments=True)):
                if cmd and Path(cmd[0]).name == "memlm":
                    out.append(("cmd", cmd[1:]))
    return out


def page_commands(text: str) -> list[list[str]]:
    """argv of every ``memlm ...`` command in a page's bash blocks."""
    return [argv for kind, argv in steps(text) if kind == "cmd"]


def _split_and(words: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for w in words:
        if w == "&&":
            out.append([])
        else:
            out[-1].append(w)
    return out


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, flag, value]


def shrink(argv: list[str]) -> list[str]:
    """The same command on small data: only sizes change (tokens read, optimizer steps, documents, queries)."""
    cmd = " ".join(a for a in argv[:2] if not a.startswith("-"))
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    if cmd in ("datastore build", "npm index", "ngram build") or argv[0] == "analyze":
        argv = _set(argv, "--max-tokens", str(MAX_TOKENS.get(out, 2000)))
    elif cmd == "datastore calibrate" or argv[0] in ("eval", "trime-eval"):
        argv = _set(argv, "--max-tokens", "500")
    for flag, value in SMALL.items():
        if flag in argv:
            argv = _set(argv, flag, value)
    if argv[0] == "train":
        argv = _set(argv, "--steps", "2")
        argv = _set(argv, "--valid-tokens", "512")
    if cmd == "npm eval":
        argv = _set(argv, "--max-queries", "8")
    if argv[0] == "analyze":
        argv = _set(argv, "--learned-steps", "5")
    if argv[0] == "demo":
        argv = [*argv, "--quick"]
    if argv[0] == "generate":
        argv = _set(argv, "--max-new-tokens", "8")
    return argv


def is_slow(argv: list[str]) -> bool:
    """Lines that cost minutes even on small data, run only by ``pytest -m slow`` (:func:`test_every_page_runs_slow`):
    the demo, training (a BPE tokenizer and BM25 over the whole corpora), what reads a trained model (``runs/...``)
    or its dumps (``trime-tune``), the Xu et al. analysis, the NPM lines, Ray clusters and what reads the datastore a
    Ray build writes (``ds/wiki-8``), and OPQ training (~3 CPU minutes even for 5,000 keys)."""
    return (
        argv[0] in {"demo", "train", "analyze", "npm", "trime-tune"}
        or "--ray" in argv
        or any(a.startswith("runs/") or a.startswith("ds/wiki-8") or "OPQ" in a or "opq" in a for a in argv)
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A MEMLM_HOME whose ``smollm2-135m`` is a tiny GPT-2; the corpora and other caches are the real home's."""
    real = memlm_home()
    home = tmp_path_factory.mktemp("memlm-home")
    for entry in real.iterdir():
        if entry.name not in ("models", "demo"):
            (home / entry.name).symlink_to(entry)
    folder = home / "models" / "smollm2-135m"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=1024, vocab_size=50257)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    gpt2_tokenizer().save_pretrained(folder)
    (folder / "memlm-cache.json").write_text(json.dumps({"format": 1, "tiny": "tests/test_readme.py"}))
    return home


def test_pages_list_the_commands_they_document():
    """Every ``memlm`` command (nested ones too) is shown on some page, most lines run in CI, and README's quick start
    has the five commands that matter."""
    from memlm.cli import build_parser

    cmds = [c for page in PAGES for c in page_commands(page.read_text())]
    shown = {" ".join(c[:2]) for c in cmds} | {c[0] for c in cmds}
    missing = [" ".join(path) for path in _command_paths(build_parser()) if " ".join(path) not in shown]
    assert not missing, f"commands no page shows: {missing}"
    readme = {" ".join(c[:2]) for c in page_commands(README.read_text())} | {
        c[0] for c in page_commands(README.read_text())
    }
    assert {"datastore build", "eval", "generate", "ngram build", "tune"} <= readme
    assert len(PAGES) >= 9 and sum(not is_slow(c) for c in cmds) >= 40  # most lines run in CI
    assert shrink(["eval", "--corpus", "wiki", "--max-tokens", "9"]) == ["eval", "--corpus", "wiki", "--max-tokens",
                                                                          "500"]  # fmt: skip


def _command_paths(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name)
                yield from _command_paths(child, (*path, name))


class Runs:
    """What each ``memlm`` line changed in its working folder (files written, rewritten or removed), by its shrunk
    argv and the bytes of the files and folders it names there, recorded right after it ran: a later page's identical
    line over identical inputs gets those changes copied in instead of a rerun (memlm commands are deterministic
    given their inputs, and the named model and corpora are the same for every page). The first run of each is
    real."""

    def __init__(self, root: Path):
        self.root, self.saved = root, {}

    @staticmethod
    def key(argv: list[str], workdir: Path) -> str:
        """The argv and every file under the paths of the working folder it names (``ds/wiki``, ``knn:ds/wiki``,
        ``ds/wiki?k=64``, ``a;b``), by their bytes."""
        h = hashlib.sha256(json.dumps(argv).encode())
        named = {part.split("?")[0].split(":")[-1] for arg in argv for part in arg.split(";")}
        for name in sorted(n for n in named if n and not Path(n).is_absolute() and (workdir / n).exists()):
            for f in sorted(_files(workdir / name)):
                data = os.readlink(f).encode() if f.is_symlink() else f.read_bytes()
                h.update(f"\n{f.relative_to(workdir)}\n".encode() + data)
        return h.hexdigest()

    def restore(self, key: str, workdir: Path) -> bool:
        if key not in self.saved:
            return False
        folder, removed = self.saved[key]
        for f in _files(folder):
            dst = workdir / f.relative_to(folder)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst, follow_symlinks=False)
        for rel in removed:
            (workdir / rel).unlink()
        return True

    def save(self, key: str, workdir: Path, before: dict[Path, tuple[int, int]]) -> None:
        if key in self.saved:
            return
        folder = self.root / str(len(self.saved))
        after = _stats(workdir)
        for rel in (r for r, stat in after.items() if before.get(r) != stat):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(workdir / rel, folder / rel, follow_symlinks=False)
        folder.mkdir(parents=True, exist_ok=True)
        self.saved[key] = (folder, [r for r in before if r not in after])


def _files(path: Path) -> list[Path]:
    """The files (and links) under ``path``, or ``path`` itself."""
    if path.is_symlink() or not path.is_dir():
        return [path]
    walk = ((Path(d), [*names, *(x for x in dirs if (Path(d) / x).is_symlink())]) for d, dirs, names in os.walk(path))
    return [d / n for d, names in walk for n in names]


def _stats(workdir: Path) -> dict[Path, tuple[int, int]]:
    return {f.relative_to(workdir): (f.lstat().st_size, f.lstat().st_mtime_ns) for f in _files(workdir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("runs"))


def shrink_python(code: str) -> str:
    """A Python block on small data: named corpora cut to their first documents (train 30: > 1,024 entries for
    k = 1024; else 10), lm-eval's ``limit`` to 1, generation to 8 new tokens."""
    first = {"train": 30, "test": 10}
    small, n = re.subn(
        r'load_documents\(("[\w-]+"), "(\w+)"\)', lambda m: f"{m.group(0)}[:{first.get(m.group(2), 10)}]", code
    )
    assert n == code.count("load_documents("), "a load_documents call the test cannot shrink"
    small = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", small)
    return re.sub(r"limit=\d+\)", "limit=1)", small)


def is_slow_python(code: str) -> bool:
    """A Python block that reads what a slow line wrote (a trained model under ``runs/``, the sharded ``ds/wiki-8``)."""
    return "runs/" in code or "ds/wiki-8" in code


def run_page(page: Path, home, workdir, runs, monkeypatch, capsys, slow: bool) -> list[str]:
    """Run a page's steps in order (with ``slow``: all of them, else those not :func:`is_slow`); the names of the
    commands run, and ``python`` for each Python block."""
    from memlm.cli import main

    monkeypatch.setenv("MEMLM_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(workdir)
    ran = []
    for kind, item in steps(page.read_text()):
        t0 = time.perf_counter()
        if kind == "python":
            if is_slow_python(item) and not slow:
                continue
            try:
                exec(compile(shrink_python(item), f"{page.name} (python block)", "exec"), {"__name__": "__main__"})
            except Exception as e:
                raise AssertionError(f"{page.name}: a Python block failed: {type(e).__name__}: {e}") from e
            capsys.readouterr()
            print(f"{time.perf_counter() - t0:6.1f} s  {page.name}: python block", file=sys.__stderr__)
            ran.append("python")
            continue
        argv = item
        if is_slow(argv) and not slow:
            continue
        small = shrink(argv)
        key, before = runs.key(small, workdir), _stats(workdir)
        if runs.restore(key, workdir):
            rc, how = 0, "(its output copied from an earlier page's identical run)"
        else:
            try:
                rc = main(small)
            except SystemExit as exit_:  # argparse
                rc = exit_.code
            how = ""
            if rc == 0:
                runs.save(key, workdir, before)
        out = capsys.readouterr()
        print(f"{time.perf_counter() - t0:6.1f} s  {page.name}: memlm {shlex.join(small)} {how}", file=sys.__stderr__)
        assert rc == 0, f"{page.name} line `memlm {shlex.join(argv)}` (run as `memlm {shlex.join(small)}`) exited " \
                        f"{rc}:\n{out.err[-3000:]}"  # fmt: skip
        ran.append(argv[0])
    return ran


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_runs(page, home, runs, tmp_path, monkeypatch, capsys):
    """Each step of the page that is not slow, in order, succeeds: ``memlm`` lines exit 0 (in this process, as the
    ``memlm`` command would run them) and Python blocks raise nothing."""
    ran = run_page(page, home, tmp_path, runs, monkeypatch, capsys, slow=False)
    want = {"README.md": {"datastore", "eval", "generate", "ngram", "tune", "python"},
            "knn-lm.md": {"datastore", "index", "eval", "tune", "gate", "python"},
            "lm-eval.md": {"lm-eval", "python"}, "extending.md": {"python"}}  # fmt: skip
    assert want.get(page.name, set()) <= set(ran)
    assert ran or page.name in ("training.md", "scaling.md")  # those two pages are all slow lines


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_runs_slow(page, home, runs, tmp_path, monkeypatch, capsys):
    """Every step of the page, in order, succeeds (the slow ones too: demo, training, NPM, analysis, Ray)."""
    ran = run_page(page, home, tmp_path, runs, monkeypatch, capsys, slow=True)
    assert len(ran) == len(steps(page.read_text()))
