"""Every ``memlm`` command line the documentation shows is one the current parser accepts: each ``memlm ...`` in a
code block or inline code span of README.md and docs/**/*.md, and each memlm call in benchmarks/**/*.sh, names an
existing (sub)command and only options that command has. Nothing is executed: the line is only parsed."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from memlm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]

#: A memlm call inside a code line: ``memlm``, ``$MEMLM``/``$M`` (scripts set them to memlm), a path ending in
#: ``/memlm``, or ``python -m memlm.cli``; the command word follows.
CALL = re.compile(
    r"""(?:^|(?<=[\s;|&(`#]))(?:"?\$(?:MEMLM|M)"?|(?:[\w./-]*/)?memlm|\S*python\S* -m memlm\.cli) (?=[a-z])"""
)
#: Where a call written in a line ends: a pipe, redirection, list operator, a backtick, or prose after it.
END = re.compile(r"\s*(?:[;|>`+(]|&&|2>|\s#|[,:]\s)")
#: An inline code span of a page (it may wrap onto the next line of its paragraph).
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
#: A token that is a value, not an option (a negative number).
NUMBER = re.compile(r"-\d")
#: A placeholder where a command word would be (``memlm COMMAND --help``).
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with their ``\\`` continuations joined."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].rstrip().endswith("\\"):
            out[-1] = out[-1].rstrip()[:-1] + " " + line.strip()
        else:
            out.append(line)
    return out


def _calls(code: str) -> list[tuple[str, bool]]:
    """The memlm calls of one line of code, each as ``memlm ...``, and whether it sits in a ``#`` comment (where
    "memlm" may be prose: such a call counts only when its word is a command)."""
    found = []
    for match in CALL.finditer(code):
        rest = END.split(code[match.end() :], maxsplit=1)[0]
        found.append(("memlm " + rest.strip(), "#" in code[: match.start()]))
    return found


def _code_lines(path: Path) -> tuple[list[str], str]:
    """A page's lines inside fenced or indented code blocks (continuations joined), and its prose with the code
    blocks blanked."""
    code: list[str] = []
    prose: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced or (
            line.startswith("    ")
            and (line.strip().startswith(("memlm ", "$ memlm ", "# ")) or (code and code[-1].endswith("\\")))
        ):
            code.append(line.strip().removeprefix("$ "))
            prose.append("")
        else:
            prose.append(line)
    return _joined(code), "\n".join(prose)


def _page_commands(path: Path) -> list[tuple[str, bool]]:
    """The memlm calls of a page's code blocks, and its inline code spans that start with ``memlm ``."""
    code, prose = _code_lines(path)
    found = [call for line in code for call in _calls(line)]
    for paragraph in re.split(r"\n\s*\n", prose):
        spans = [" ".join(s.split()) for s in SPAN.findall(paragraph)]
        found += [(s, False) for s in spans if s.startswith("memlm ")]
    return found


def _script_commands(path: Path) -> list[tuple[str, bool]]:
    """The memlm calls of a shell script (continuations joined)."""
    return [call for line in _joined(path.read_text().splitlines()) for call in _calls(line)]


def _commands() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    scripts = sorted((ROOT / "benchmarks").rglob("*.sh"))
    pairs = [(p, c) for p in pages for c in _page_commands(p)] + [(p, c) for p in scripts for c in _script_commands(p)]
    commands = set(_subparsers(build_parser()))
    return [
        (p.relative_to(ROOT).as_posix(), command)
        for p, (command, comment) in pairs
        if not comment or command.split()[1] in commands
    ]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in a prose span: split on blanks
        return command.split()


def _problems(command: str, root: argparse.ArgumentParser) -> list[str]:
    """What the parser would refuse in ``command``: an unknown (sub)command, or an option its command lacks."""
    tokens, parser, path = _tokens(command)[1:], root, ["memlm"]
    while (children := _subparsers(parser)) and tokens and not tokens[0].startswith("-"):
        if PLACEHOLDER.fullmatch(tokens[0]):
            return []
        if tokens[0] not in children:
            return [f"unknown command {' '.join(path)} {tokens[0]!r}"]
        path.append(tokens[0])
        parser, tokens = children[tokens[0]], tokens[1:]
    if _subparsers(parser) and tokens and not {"-h", "--help"} & set(tokens):
        return [f"{' '.join(path)} needs a subcommand"]
    known = set(parser._option_string_actions)
    options = [t.split("=", 1)[0] for t in tokens if t.startswith("-") and t != "-" and not NUMBER.match(t)]
    return [f"{' '.join(path)} has no option {o}" for o in options if "$" not in o and o not in known]


COMMANDS = _commands()


def test_commands_are_found():
    """The extraction sees the pages' and scripts' commands (a broken pattern would pass every check vacuously)."""
    sources = {p for p, _ in COMMANDS}
    assert len(COMMANDS) > 100
    assert "README.md" in sources and any(p.endswith(".sh") for p in sources)
    assert any(c.startswith("memlm tune ") for _, c in COMMANDS)


def test_the_check_refuses_what_the_parser_lacks():
    """An unknown option, an unknown command and a group without its subcommand are refused; a valid line is not."""
    parser = build_parser()
    assert _problems("memlm tune --valid v.npz --test t.npz --json f.json", parser) == []
    assert _problems("memlm datastore build --corpus wiki --out ds --max-tokens 1000", parser) == []
    assert _problems("memlm tune --valid v.npz --cache-lambdas 0 0.1", parser)
    assert _problems("memlm tunes --valid v.npz", parser)
    assert _problems("memlm datastore --out ds", parser)


@pytest.mark.parametrize(("source", "command"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_documented_command_parses(source: str, command: str):
    """The current parser has the command's (sub)command and every option it names."""
    assert not _problems(command, build_parser()), f"{source}: {command}"
