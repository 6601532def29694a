"""The import graph of src/memlm (docs/ARCHITECTURE.md): layers only import downwards, no import cycles, and one
place turns retrieved (scores, values) into distributions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "memlm"

# lowest first; a module may import its own layer and the layers below, never above (docs/ARCHITECTURE.md)
LAYERS = [
    {"errors", "fileio", "locking", "schema"},
    {"core"},
    {"resources", "corpora", "windows", "tokenizer", "keys", "forward", "plots"},
    {"folder", "datastore", "index", "sharded", "sharded_index", "ray_backend", "retrieval"},
    {"train", "train_lm", "knnlm", "xu2023", "trime", "npm", "ngram"},
    {"lmeval", "demo", "validate", "cli"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["memlm", *parts])] = p
    return out


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The memlm modules ``path`` imports: ``from a import b`` is module ``a.b`` when that is a module, else ``a``."""
    mods = _modules()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("memlm")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("memlm"):
                found |= {f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names}
    return found


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def test_every_module_has_a_layer():
    for module in _modules():
        if module != "memlm":
            _layer(module)


def test_no_upward_imports():
    mods = _modules()
    bad = []
    for module, path in mods.items():
        if module == "memlm":
            continue
        for imp in _imports(path, module, top_level_only=False):
            target = next((m for m in (imp, imp.rsplit(".", 1)[0]) if m in mods and m != "memlm"), None)
            if target is not None and _layer(target) > _layer(module):
                bad.append(f"{module} imports {target}")
    assert not bad, "upward imports:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycles():
    mods = _modules()
    graph = {}
    for module, path in mods.items():
        deps = set()
        for imp in _imports(path, module, top_level_only=True):
            target = next((m for m in (imp, imp.rsplit(".", 1)[0]) if m in mods), None)
            if target is not None and target != module:
                deps.add(target)
        graph[module] = deps
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d) :], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


@pytest.mark.parametrize("pattern", [r"logsumexp\(.*(masked_fill|hit)", r"log_softmax\((scores|sims|s)\s*/"])
def test_one_place_turns_retrieved_entries_into_distributions(pattern):
    """A softmax over retrieved entries (masked by value / target hits) lives in core/distribution.py only."""
    hits = []
    for path in _modules().values():
        if path == SRC / "core" / "distribution.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                hits.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not hits, "retrieval -> distribution outside core.distribution:\n" + "\n".join(hits)
