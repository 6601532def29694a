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

Builds are deterministic, so a ``datastore build`` or ``ngram build`` line identical to one an earlier page ran (same
flags, named model and corpus) is answered with a copy of the folder that run wrote, taken right after it; the first
run of each is real (:class:`Builds`).
"""

from __future__ import annotations

import json
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
# the sharded IVF4096 (ds/wiki-8); everything else reads a few windows
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
    if cmd in ("datastore build", "datastore calibrate", "npm index", "ngram build") or argv[0] == "analyze":
        argv = _set(argv, "--max-tokens", str(MAX_TOKENS.get(out, 2000)))
    elif argv[0] in ("eval", "trime-eval"):
        argv = _set(argv, "--max-tokens", "1000")
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
                                                                          "1000"]  # fmt: skip


def _command_paths(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name)
                yield from _command_paths(child, (*path, name))


class Builds:
    """Copies of the folders that ``datastore build`` and ``ngram build`` lines wrote, by their (shrunk) argv, taken
    right after each ran: a later page's identical line (named model and corpus only) gets a copy instead of a rerun."""

    def __init__(self, root: Path):
        self.root, self.saved = root, {}

    @staticmethod
    def key(argv: list[str]) -> tuple[str, ...] | None:
        from memlm.data.corpora import CORPORA
        from memlm.models.resources import MODELS

        def value(flag):
            return argv[argv.index(flag) + 1] if flag in argv else None

        if " ".join(argv[:2]) not in ("datastore build", "ngram build") or "--out" not in argv or "--append" in argv:
            return None
        if value("--model") not in (None, *MODELS) or not set((value("--corpus") or "?").split(",")) <= set(CORPORA):
            return None
        return tuple(argv)

    def restore(self, argv: list[str], workdir: Path) -> bool:
        key = self.key(argv)
        if key not in self.saved:
            return False
        out = workdir / argv[argv.index("--out") + 1]
        shutil.copytree(self.saved[key], out, symlinks=True)
        return True

    def save(self, argv: list[str], workdir: Path) -> None:
        key = self.key(argv)
        if key is not None and key not in self.saved:
            self.saved[key] = self.root / str(len(self.saved))
            shutil.copytree(workdir / argv[argv.index("--out") + 1], self.saved[key], symlinks=True)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return Builds(tmp_path_factory.mktemp("builds"))


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


def run_page(page: Path, home, workdir, builds, monkeypatch, capsys, slow: bool) -> list[str]:
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
        if builds.restore(small, workdir):
            rc, how = 0, "copied from an earlier page's identical build"
        else:
            try:
                rc = main(small)
            except SystemExit as exit_:  # argparse
                rc = exit_.code
            how = ""
            if rc == 0:
                builds.save(small, workdir)
        out = capsys.readouterr()
        print(f"{time.perf_counter() - t0:6.1f} s  {page.name}: memlm {shlex.join(small)} {how}", file=sys.__stderr__)
        assert rc == 0, f"{page.name} line `memlm {shlex.join(argv)}` (run as `memlm {shlex.join(small)}`) exited " \
                        f"{rc}:\n{out.err[-3000:]}"  # fmt: skip
        ran.append(argv[0])
    return ran


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_runs(page, home, builds, tmp_path, monkeypatch, capsys):
    """Each step of the page that is not slow, in order, succeeds: ``memlm`` lines exit 0 (in this process, as the
    ``memlm`` command would run them) and Python blocks raise nothing."""
    ran = run_page(page, home, tmp_path, builds, monkeypatch, capsys, slow=False)
    want = {"README.md": {"datastore", "eval", "generate", "ngram", "tune", "python"},
            "knn-lm.md": {"datastore", "index", "eval", "tune", "gate", "python"},
            "lm-eval.md": {"lm-eval", "python"}, "extending.md": {"python"}}  # fmt: skip
    assert want.get(page.name, set()) <= set(ran)
    assert ran or page.name in ("training.md", "scaling.md")  # those two pages are all slow lines


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_runs_slow(page, home, builds, tmp_path, monkeypatch, capsys):
    """Every step of the page, in order, succeeds (the slow ones too: demo, training, NPM, analysis, Ray)."""
    ran = run_page(page, home, tmp_path, builds, monkeypatch, capsys, slow=True)
    assert len(ran) == len(steps(page.read_text()))
