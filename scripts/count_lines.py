"""Lines of code in src/memlm by package: lines that are not blank, not comments and not docstrings.

    python scripts/count_lines.py [SRC] [--json OUT]
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from collections import Counter
from pathlib import Path


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by module, class and function docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(path: Path) -> int:
    """Lines holding at least one token that is not a comment, newline or docstring."""
    text = path.read_text()
    skip = docstring_lines(ast.parse(text))
    seen: set[int] = set()
    ignore = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in ignore:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in skip:
                seen.add(line)
    return len(seen)


def count(src: Path) -> dict[str, int]:
    by_package: Counter[str] = Counter()
    for p in sorted(src.rglob("*.py")):
        rel = p.relative_to(src).parts
        package = rel[0] if len(rel) > 1 else "(top-level modules)"
        by_package[package] += code_lines(p)
    return dict(sorted(by_package.items()))


def main(argv: list[str]) -> None:
    src = Path(argv[0]) if argv and not argv[0].startswith("--") else Path(__file__).resolve().parents[1] / "src/memlm"
    counts = count(src)
    total = sum(counts.values())
    for name, n in counts.items():
        print(f"{name:24s} {n:6d}")
    print(f"{'total':24s} {total:6d}")
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps({"by_package": counts, "total": total}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
