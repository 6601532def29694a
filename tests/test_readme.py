"""Every command line in README.md runs, top to bottom, as a newcomer would type it (issue 24, items 11 and 12).

The ```bash blocks are parsed and every ``memlm ...`` line is run in order, in one working folder (later lines use
what earlier ones wrote: ``ds/wiki``, ``valid.npz``, ``gate.npz``, ``runs/lm/final``, ``idx/wiki``), with the flags
as written. Only the data is made small (:func:`shrink`): ``--max-tokens`` lowered or added, ``--steps`` and
``--limit`` lowered, NPM eval queries capped, ``memlm demo`` run ``--quick``. The named model ``smollm2-135m`` is a
tiny random GPT-2 (GPT-2's tokenizer, 1,024 positions) put where memlm caches its conversion of SmolLM2
(``$MEMLM_HOME/models/smollm2-135m``, the cache :func:`memlm.models.resources.load_causal_lm` reads); the named corpora
and encoder are the real ones. Then the Python block runs, after the command lines, as README presents it. A README
line that crashes, or exits with an error, fails this test and names the line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import gpt2_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config

from memlm.io.fileio import memlm_home

README = Path(__file__).resolve().parents[1] / "README.md"
SRC = str(Path(__file__).resolve().parents[1] / "src")

# --max-tokens per command: the datastores need >= 1,024 entries for --k 1024 and IVF1024 (ds/wiki), >= 4,096 for
# the sharded IVF4096 (ds/wiki-8); everything else reads a few windows
MAX_TOKENS = {"ds/wiki-8": 9000, "ds/wiki": 2000, "ds/wiki-final": 2000, "ds/lm-att": 1500, "idx/wiki": 2000}
SMALL = {"--steps": "2", "--limit": "1"}


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands(text: str) -> list[list[str]]:
    """argv of every ``memlm ...`` command in README's bash blocks (comments dropped; ``.venv/bin/memlm`` too)."""
    commands = []
    for block in bash_blocks(text):
        for line in block.splitlines():
            for cmd in _split_and(shlex.split(line, comments=True)):
                if cmd and Path(cmd[0]).name == "memlm":
                    commands.append(cmd[1:])
    return commands


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
    elif argv[0] == "eval":
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
    return argv


def is_slow(argv: list[str]) -> bool:
    """README lines that cost minutes even on small data, run only by ``pytest -m slow``
    (:func:`test_every_readme_line_runs_slow`): the demo, training (a BPE tokenizer and BM25 over the whole corpora),
    what reads a trained model (``runs/...``), the Xu et al. analysis, the NPM lines, Ray clusters and what reads the
    datastore a Ray build writes (``ds/wiki-8``), and OPQ training (~3 CPU minutes even for 5,000 keys)."""
    return (
        argv[0] in {"demo", "train", "analyze", "npm"}
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


def test_readme_lists_the_commands_it_documents():
    cmds = readme_commands(README.read_text())
    firsts = {c[0] for c in cmds}
    assert {"datastore", "index", "eval", "tune", "generate", "gate", "lm-eval", "train", "npm", "analyze"} <= firsts
    assert len(cmds) >= 30
    assert sum(not is_slow(c) for c in cmds) >= 20  # most lines run in CI
    assert shrink(["eval", "--corpus", "wiki", "--max-tokens", "9"]) == ["eval", "--corpus", "wiki", "--max-tokens",
                                                                          "1000"]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The folder README's lines run in, one after the other (the Python block after the command lines)."""
    return tmp_path_factory.mktemp("readme-run")


def run_readme_lines(home, workdir, monkeypatch, capsys, slow: bool) -> list[str]:
    """Run README's ``memlm`` lines in order (with ``slow``: all of them, else those not :func:`is_slow`)."""
    from memlm.cli import main

    monkeypatch.setenv("MEMLM_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(workdir)
    ran = []
    for argv in readme_commands(README.read_text()):
        if is_slow(argv) and not slow:
            continue
        small = shrink(argv)
        t0 = time.perf_counter()
        try:
            rc = main(small)
        except SystemExit as exit_:  # argparse
            rc = exit_.code
        out = capsys.readouterr()
        print(f"{time.perf_counter() - t0:6.1f} s  memlm {shlex.join(small)}", file=sys.__stderr__)
        assert rc == 0, f"README line `memlm {shlex.join(argv)}` (run as `memlm {shlex.join(small)}`) exited " \
                        f"{rc}:\n{out.err[-3000:]}"  # fmt: skip
        ran.append(argv[0])
    return ran


def test_every_readme_line_runs(home, workdir, monkeypatch, capsys):
    """Each ``memlm`` line of README.md that is not :func:`is_slow`, in order, exits 0 (in this process, as the
    ``memlm`` command would run it): the kNN-LM lines, evaluation options, generation, lm-eval, pruning."""
    ran = run_readme_lines(home, workdir, monkeypatch, capsys, slow=False)
    assert {"datastore", "index", "eval", "tune", "generate", "gate", "lm-eval"} <= set(ran) and len(ran) >= 20


@pytest.mark.slow
def test_every_readme_line_runs_slow(home, tmp_path, monkeypatch, capsys):
    """Every ``memlm`` line of README.md, in order, exits 0 (the slow ones too: demo, training, NPM, analysis, Ray)."""
    ran = run_readme_lines(home, tmp_path, monkeypatch, capsys, slow=True)
    assert len(ran) == len(readme_commands(README.read_text()))


def python_block(text: str) -> str:
    (block,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return block


def test_readme_python_block_runs(home, workdir):
    """README's Python block, run after the command lines in the same folder (ds/wiki is there), with the corpora cut
    to their first documents (train 30: > 1,024 entries for k = 1024; test 10) and lm_eval's limit to 1 document."""
    code = python_block(README.read_text())
    first = {"train": 30, "test": 10}
    small = re.sub(r'load_documents\(("\w+"), "(\w+)"\)', lambda m: f"{m.group(0)}[:{first.get(m.group(2), 10)}]", code)
    small = re.sub(r"limit=\d+\)", "limit=1)", small)
    assert small.count(")[:") == code.count("load_documents(") >= 2 and "limit=1)" in small
    env = {**os.environ, "MEMLM_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    env.setdefault("MEMLM_DEFAULT_DTYPE", "float32")
    r = subprocess.run([sys.executable, "-c", small], cwd=workdir, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
