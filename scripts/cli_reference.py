"""Write docs/reference/cli.md from ``memlm.cli``'s argparse parser: every command, nested ones too, and every option
with its help and default. ``tests/test_cli_reference.py`` regenerates it and fails if the committed file differs.

    python scripts/cli_reference.py            # rewrite docs/reference/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/reference/cli.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "reference" / "cli.md"

HEADER = """# Command line reference

Every `memlm` command and option, generated from the argument parsers in `memlm.cli` by `scripts/cli_reference.py`
(do not edit by hand: `python scripts/cli_reference.py` rewrites this page, and `tests/test_cli_reference.py` fails
when it is out of date). `memlm COMMAND --help` prints the same text. Every command exits with one `error: ...` line
and status 2 on bad input.
"""


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


Command = tuple[tuple[str, ...], str, argparse.ArgumentParser]


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[Command]:
    """(path, help, parser) of every command under ``parser``, depth first in the order ``--help`` lists them."""
    sub = _subparsers(parser)
    if sub is None:
        return []
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = []
    for name, child in sub.choices.items():
        out.append(((*prefix, name), helps.get(name, ""), child))
        out.extend(commands(child, (*prefix, name)))
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
        return "flag"
    d = action.default
    if d is None or d is argparse.SUPPRESS:
        return "required" if action.required else ""
    if isinstance(d, (list, tuple)):
        d = " ".join(str(x) for x in d)
    return f"`{d}`" if str(d) != "" else '`""`'


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": ""}
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(f"`{c}`" for c in action.choices)
        text = f"{text} (one of {choices})" if text else f"one of {choices}"
    return _cell(text)


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
        return names
    return f"`{action.metavar or action.dest.upper()}`" + (" ..." if action.nargs in ("*", "+") else "")


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
    ]


def render(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    lines = [HEADER, "## Commands", ""]
    for path, help_, _ in cmds:
        anchor = "memlm-" + "-".join(path)
        lines.append(f"{'  ' * (len(path) - 1)}- [`memlm {' '.join(path)}`](#{anchor}): {_cell(help_)}")
    for path, help_, child in cmds:
        lines += ["", f"{'#' * min(len(path) + 1, 4)} `memlm {' '.join(path)}` {{#{'memlm-' + '-'.join(path)}}}", ""]
        if help_:
            lines += [_cell(help_) + ".", ""]
        if child.description and child.description != help_:
            lines += [_cell(child.description), ""]
        sub = _subparsers(child)
        if sub is not None:
            lines += ["Subcommands: " + ", ".join(f"`{n}`" for n in sub.choices) + ".", ""]
        opts = options(child)
        if opts:
            lines += ["| option | default | help |", "| --- | --- | --- |"]
            lines += [f"| {_name(a)} | {_default(a)} | {_help(a)} |" for a in opts]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page differs, write nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    from memlm.cli import build_parser

    text = render(build_parser())
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'stale; run python scripts/cli_reference.py'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(commands(build_parser()))} commands)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
