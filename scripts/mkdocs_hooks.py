"""MkDocs hook: the Python API page lists memlm's public names from ``memlm._API`` (read from the source, so the page
follows the package without importing torch), each rendered by mkdocstrings from its docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

INIT = Path(__file__).resolve().parents[1] / "src" / "memlm" / "__init__.py"
MARK = "<!-- public-api -->"


def public_api() -> dict[str, str]:
    """``{name: module}`` of the names ``import memlm`` exports (the ``_API`` table of ``memlm/__init__.py``)."""
    for node in ast.parse(INIT.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "_API" for t in targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no _API table in {INIT}: update scripts/mkdocs_hooks.py")


def on_page_markdown(markdown: str, page, **_) -> str:
    if MARK not in markdown:
        return markdown
    blocks = [f"::: {module}.{name}" for name, module in public_api().items()]
    return markdown.replace(MARK, "\n\n".join(blocks))


#: A Sphinx cross-reference role as mkdocstrings leaves it in the HTML (``:func:`x``` becomes ``:func:<code>x</code>``);
#: ``~`` keeps only the last dotted part, as Sphinx shows it.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|data|meth|mod|attr|obj|exc|const):<code>(~?)([^<]*)</code>")


def _role(match: re.Match[str]) -> str:
    name = match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, page, **_) -> str:
    """The docstrings' Sphinx roles (``:func:``, ``:class:``, ...) rendered as the plain code names they refer to."""
    return SPHINX_ROLE.sub(_role, html)
