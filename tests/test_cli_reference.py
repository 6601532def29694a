"""docs/reference/cli.md is generated from ``memlm.cli``'s parser (scripts/cli_reference.py) and cannot go stale."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from memlm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"


def _script():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_cli_reference_is_current():
    """Regenerating the page gives the committed file byte for byte (else: python scripts/cli_reference.py)."""
    assert PAGE.read_text() == _script().render(build_parser()), "stale: run python scripts/cli_reference.py"


def _walk(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name), child
                yield from _walk(child, (*path, name))


def test_every_command_and_option_appears_with_its_help_and_default():
    """Each (nested) command has its own heading, and each of its options a row naming it, its help and default."""
    script, text = _script(), PAGE.read_text()
    cmds = list(_walk(build_parser()))
    assert {"datastore build", "ngram build", "eval", "tune", "generate", "gate train", "npm eval"} <= {
        " ".join(p) for p, _ in cmds
    }
    for path, child in cmds:
        heading = f"`memlm {' '.join(path)}` {{#memlm-{'-'.join(path)}}}"
        assert heading in text, f"no section for memlm {' '.join(path)}"
        section = text.split(heading, 1)[1].split("\n#", 1)[0]
        for action in script.options(child):
            name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest.upper())
            rows = [r for r in section.splitlines() if r.startswith(f"| `{name}`")]
            assert rows, f"memlm {' '.join(path)}: option {name} missing"
            assert script._default(action) in rows[0] and script._help(action) in rows[0]
    eval_rows = text.split("{#memlm-eval}", 1)[1].split("\n#", 1)[0]
    assert "| `--k` `K` | `1024` |" in eval_rows  # the default as the parser has it
