"""The import graph of src/memlm (docs/ARCHITECTURE.md): layers only import downwards, no import cycles, and one
place turns retrieved (scores, values) into distributions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "memlm"

# lowest first; a package may import its own layer and the layers below, never above (docs/ARCHITECTURE.md). Entries
# are packages under memlm or top-level modules (memlm/leakage.py): every module of a package shares its layer.
LAYERS = [
    {"errors", "io"},
    {"core"},
    {"data"},
    {"models"},
    {"storage", "retrieval"},
    {"mixing", "training"},
    {"knnlm", "xu2023", "trime", "npm", "ngram", "leakage"},
    {"registry", "lmeval", "experiments", "cli"},
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


def _package(module: str) -> str:
    """The package of ``module``: ``memlm.storage.index`` -> ``memlm.storage``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> int:
    """The layer of ``module``'s package in LAYERS."""
    name = _package(module).split(".", 1)[1]
    found = [i for i, layer in enumerate(LAYERS) if name in layer]
    if not found:
        raise AssertionError(f"{module} is in no layer: add {name} to LAYERS and docs/ARCHITECTURE.md")
    return found[0]


def test_layers_name_each_package_once():
    named = [entry for layer in LAYERS for entry in layer]
    assert len(named) == len(set(named)) and all("." not in entry for entry in named), named


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


FAISS_MODULES = {
    "memlm.storage.index",
    "memlm.storage.searcher",
    "memlm.storage.sharded_index",
}  # the index and searcher modules


def test_faiss_is_imported_only_by_the_index_and_searcher_modules():
    bad = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] == "faiss" for n in names) and module not in FAISS_MODULES:
                bad.append(f"{module}:{node.lineno}")
    assert not bad, "FAISS imported outside " + ", ".join(sorted(FAISS_MODULES)) + ":\n" + "\n".join(bad)


BENCHMARKS = SRC.parents[1] / "benchmarks"


def test_nothing_below_the_command_line_imports_it():
    """No library module and no benchmark imports ``memlm.cli``: the command line parses, calls the library, prints
    (a benchmark runs ``python -m memlm.cli`` as a user would, or calls the library)."""
    bad = [
        f"{module} imports {imp}"
        for module, path in _modules().items()
        if not module.startswith("memlm.cli")
        for imp in _imports(path, module, top_level_only=False)
        if imp == "memlm.cli" or imp.startswith("memlm.cli.")
    ]
    for path in sorted(BENCHMARKS.rglob("*.py")):
        name = "benchmarks." + ".".join(path.relative_to(BENCHMARKS).with_suffix("").parts)
        bad += [f"{name} imports {imp}" for imp in _imports(path, name, top_level_only=False)
                if imp == "memlm.cli" or imp.startswith("memlm.cli.")]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """No cycle in the import graph, counting imports at every level (inside functions too, where a cycle would only
    hide from Python's import machinery, not from a reader)."""
    mods = _modules()
    graph = {}
    for module, path in mods.items():
        deps = set()
        for imp in _imports(path, module, top_level_only=False):
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


def _package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> {package it imports: the module imports behind that edge}, counting every import: inside functions
    (a cycle there only hides from Python's import machinery, not from a reader) and under ``TYPE_CHECKING`` (an
    annotation names the other package's type: the dependency is real). The root package (``memlm/__init__.py``,
    the public API loaded on first use) is left out: it names every layer on purpose."""
    mods = _modules()
    graph: dict[str, dict[str, set[str]]] = {}
    for module, path in mods.items():
        if module == "memlm":
            continue
        graph.setdefault(_package(module), {})
        for imp in _imports(path, module, top_level_only=False):
            target = next((m for m in (imp, imp.rsplit(".", 1)[0]) if m in mods and m != "memlm"), None)
            if target is not None and _package(target) != _package(module):
                graph[_package(module)].setdefault(_package(target), set()).add(f"{module} -> {target}")
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, {})):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_package_import_cycles():
    graph = _package_graph()
    cycle = _cycle(graph)
    assert cycle is None, (
        "package import cycle: "
        + " -> ".join(cycle)
        + "\n"
        + "\n".join(f"  {a} -> {b}: " + ", ".join(sorted(graph[a][b])) for a, b in zip(cycle, cycle[1:], strict=False))
    )


def test_the_package_cycle_check_finds_a_cycle():
    graph = {"memlm.a": {"memlm.b": {"x"}}, "memlm.b": {"memlm.c": {"y"}}, "memlm.c": {"memlm.a": {"z"}}}
    assert _cycle(graph) == ["memlm.a", "memlm.b", "memlm.c", "memlm.a"]
    assert _cycle({"memlm.a": {"memlm.b": {"x"}}, "memlm.b": {}}) is None


def test_the_import_scan_counts_imports_inside_functions(tmp_path):
    """``_imports`` sees a function-level, relative and TYPE_CHECKING import, not only the top-level ones."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memlm.models.keys import KeySpec\n"
        "def f():\n    from memlm.storage import datastore\n    from ..core import tuning\n"
    )
    assert _imports(path, "memlm.knnlm.mod", top_level_only=False) >= {
        "memlm.models.keys",
        "memlm.storage.datastore",
        "memlm.core.tuning",
    }


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


# Every normaliser (logsumexp / (log_)softmax / logaddexp.reduce) outside core/distribution.py, by file and function,
# with why it is not one over retrieved entries. Anything else that normalises fails the test below: a softmax over
# retrieved (scores, values) belongs in memlm.core.distribution (npm/inference.py's _group had its
# own logsumexp over the retrieved spans, which the line patterns above did not see).
NORMALISERS_OUTSIDE_CORE = {
    ("models/forward.py", "logprob_statistics"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("knnlm/generate.py", "MixtureLogitsProcessor.__call__"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("knnlm/wrap.py", "KNNLM.forward"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("lmeval/model.py", "MemlmLM._loglikelihood_tokens"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("npm/mlm.py", "_mask_log_probs"): "the MLM baseline's log-softmax over its vocabulary (no retrieval)",
    ("npm/mlm.py", "mlm_classify"): "the MLM baseline's label scores from its vocabulary log-probs (no retrieval)",
    ("trime/inference.py", "_forward_segments"): "logsumexp_v E_v f, the LM's vocabulary normaliser (TRIME Eq. 5)",
    ("trime/loss.py", "trime_logprob"): "logsumexp_v E_v f, the LM's vocabulary normaliser (TRIME Eq. 5)",
    ("xu2023/generalized.py", "eq5_logprobs"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("xu2023/generalized.py", "eq5_target_logprob"): "the LM's log-softmax over its vocabulary (p_LM)",
    ("xu2023/generalized.py", "LearnedWds._grouped"): "a trained output matrix's softmax over all its n V rows",
    ("xu2023/generalized.py", "LearnedWds.log_probs"): "a trained output matrix's softmax over all its n V rows",
    ("xu2023/generalized.py", "LearnedWds.target_logprob"): "a trained output matrix's softmax over all its n V rows",
}


def _normaliser_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function's qualified name, line) of each logsumexp / softmax / log_softmax / logaddexp.reduce call
    (as a method, attribute or bare name) in ``tree``."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                reduce_of_logaddexp = (
                    name == "reduce" and isinstance(f, ast.Attribute) and getattr(f.value, "attr", None) == "logaddexp"
                )
                if name in ("logsumexp", "softmax", "log_softmax") or reduce_of_logaddexp:
                    found.append((where or "<module>", child.lineno))
            walk(child, inner)

    walk(tree, "")
    return found


def test_every_normaliser_outside_core_is_a_known_non_retrieval_one():
    seen, bad = set(), []
    for path in _modules().values():
        rel = str(path.relative_to(SRC))
        if rel == "core/distribution.py":
            continue
        for where, line in _normaliser_calls(ast.parse(path.read_text())):
            seen.add((rel, where))
            if (rel, where) not in NORMALISERS_OUTSIDE_CORE:
                bad.append(f"{rel}:{line} in {where}")
    assert not bad, (
        "a normaliser outside core.distribution (move a softmax over retrieved entries into memlm.core.distribution, "
        "or list a vocabulary one in NORMALISERS_OUTSIDE_CORE with why):\n" + "\n".join(bad)
    )
    stale = set(NORMALISERS_OUTSIDE_CORE) - seen
    assert not stale, f"NORMALISERS_OUTSIDE_CORE lists functions with no normaliser any more: {sorted(stale)}"


def test_the_normaliser_scan_sees_the_forms_it_claims():
    src = """
import numpy as np, torch
from scipy.special import logsumexp
def f(lv):
    total = float(torch.logsumexp(lv[0], 0))
    return np.logaddexp.reduce(lv), logsumexp(lv), lv.softmax(-1), np.logaddexp(lv, lv)
class C:
    def g(self, x):
        return torch.nn.functional.log_softmax(x, -1)
"""
    assert _normaliser_calls(ast.parse(src)) == [("f", 5), ("f", 6), ("f", 6), ("f", 6), ("C.g", 9)]


RETRIEVAL_PATH = ["storage/searcher.py", "retrieval.py", "core", "knnlm/evaluate.py", "knnlm/generate.py",
                  "knnlm/pointer.py", "knnlm/prune.py", "knnlm/wrap.py", "lmeval/model.py", "trime/inference.py",
                  "ngram/memory.py", "ngram/mixture.py"]  # fmt: skip
# The main path: scoring (the table and every component), fitting, the report, generation, wrap, lm-eval and
# calibration. Its functions are held to 60 lines of code and 8 parameters; the rest of the retrieval path to 80 / 10.
MAIN_PATH = ["core", "mixing", "retrieval.py", "storage/searcher.py", "knnlm/scoring.py", "knnlm/table.py",
             "knnlm/memories.py", "knnlm/cache.py", "knnlm/evaluate.py", "knnlm/calibration.py",
             "knnlm/default_mixture.py", "knnlm/generate.py", "knnlm/wrap.py", "lmeval", "ngram/memory.py",
             "ngram/step.py", "ngram/mixture.py"]  # fmt: skip
# Kernels whose positional signature their reference tests pin (raw arrays in, no memory or config): the forward pass
# over windows and RetoMaton's pointer walk over a datastore's arrays. Every other function on the path takes a
# memory and a config (RetrievalConfig / TrimeEvalConfig), the older keywords as ``**options``.
PARAMETER_KERNELS = {"knnlm/evaluate.py:lm_scores", "knnlm/pointer.py:pointer_retrieve"}


def _functions(parts: list[str], root: Path = SRC):
    """``(where, lines of code, parameters)`` of every function under ``parts``: its lines without its docstring (a
    method's docstring carries its equation and paper, which no size rule should shorten), ``self``/``cls`` not
    counted as parameters."""
    for part in parts:
        target = root / part
        for path in sorted(target.rglob("*.py") if target.is_dir() else [target]):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    first = node.body[0]
                    if (
                        isinstance(first, ast.Expr)
                        and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)
                    ):
                        lines -= first.end_lineno - first.lineno + 1
                    a = node.args
                    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                    n = len([x for x in names if x not in ("self", "cls")])
                    yield f"{path.relative_to(root)}:{node.name}", lines, n


@pytest.mark.parametrize(
    ("parts", "most_lines", "most_parameters"),
    [(MAIN_PATH, 60, 8), (RETRIEVAL_PATH, 80, 10)],
    ids=["main-path", "retrieval-path"],
)
def test_no_function_on_the_path_is_over_its_size(parts, most_lines, most_parameters):
    """Settings travel as one config (the config is the input), not as keyword lists; a function does one thing."""
    over = []
    for where, lines, n in _functions(parts):
        if lines > most_lines:
            over.append(f"{where} ({lines} lines of code)")
        if n > most_parameters and where not in PARAMETER_KERNELS:
            over.append(f"{where} ({n} parameters)")
    assert not over, "\n".join(over)


def test_the_size_scan_counts_code_not_the_docstring(tmp_path):
    (tmp_path / "m.py").write_text('def f(a, b, self):\n    """doc\n\n    more doc\n    """\n    x = 1\n    return x\n')
    assert list(_functions(["m.py"], tmp_path)) == [("m.py:f", 3, 2)]


def _subcommands(parser) -> list:
    """Every leaf subparser of ``parser`` (``memlm datastore build``, ``memlm eval``, ...)."""
    import argparse

    leaves = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                leaves += _subcommands(sub) or [sub]
    return leaves


def test_every_command_carries_its_own_check():
    """A command's pre-flight check is registered with its subparser and lives in the command's module
    ("commands own their checks"), not in a table elsewhere keyed by function name."""
    from memlm.cli import build_parser

    checked, bad = 0, []
    for sub in _subcommands(build_parser()):
        func, check = sub.get_default("func"), sub.get_default("check")
        if check is None:
            continue
        checked += 1
        if check.__module__ != func.__module__:
            bad.append(f"{sub.prog}: {func.__module__}.{func.__name__} checked by {check.__module__}.{check.__name__}")
    assert checked >= 5 and not bad, "\n".join(bad)  # (most single-value checks are argparse converters)


def test_benchmarks_import_only_names_that_exist():
    """Every ``from memlm.x import y`` in benchmarks/ and scripts/ names a module and a name memlm has: a module moved
    or a function renamed in src/ breaks the scripts behind the published results otherwise unnoticed."""
    import importlib

    root = SRC.parents[1]
    missing = []
    for path in sorted([*(root / "benchmarks").rglob("*.py"), *(root / "scripts").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("memlm")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                missing.append(f"{path.relative_to(root)}:{node.lineno} {node.module} ({e})")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(root)}:{node.lineno} {node.module}.{alias.name}")
    assert not missing, missing
