"""The package's layout rules (issue 15), read from the source with `ast`: imports point only
downward (commands -> engines -> model), no import cycle (module-level or lazy), no top-level name
defined in two modules, and no source file over 400 lines without a reason stated at its top."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "elmokit"

# The floors, lowest first: a module may import from its own floor or a lower one.
FLOORS = [
    {"elmokit.io", "elmokit.textfiles", "elmokit.jsonfiles", "elmokit.devices", "elmokit.extras", "elmokit.kernels",
     "elmokit.progress", "elmokit.tokenizer", "elmokit.cachedir"},  # leaf utilities
    {"elmokit.model"},
    {"elmokit.sources"},  # where a model comes from: finds its files, reads them with elmokit.model
    {"elmokit.inference", "elmokit.training", "elmokit.hub"},
    {"elmokit.tasks"},
    {"elmokit.commands", "elmokit.serve", "elmokit.cli", "elmokit.__main__", "elmokit",
     "elmokit.integrations",  # adapters to other libraries: nothing in elmokit imports them but `elmo convert`
     "elmokit.ray", "elmokit.ray_corpus"},  # Ray Data: only `elmo embed --ray` imports them
]
# A protocol rather than a repeated definition: every subcommand module has these two.
PROTOCOL_NAMES = {"register", "run"}
# Names that other libraries' users call, each in its own namespace, and each a different thing:
# `hub.load` is TF-Hub's (a module from a handle), `tasks.load` Flair's habit (a trained task run);
# `ELMoEmbeddings` is the name Flair's users and LangChain's users each know (token vs sentence vectors).
FOREIGN_API_NAMES = {"load": {"elmokit.hub", "elmokit.tasks.run"},
                     "ELMoEmbeddings": {"elmokit.integrations.flair", "elmokit.integrations.langchain"}}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.with_suffix("").relative_to(SRC).parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every elmokit module `name` imports, at module level, inside a function or for types."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))  # TYPE_CHECKING imports count too: use a Protocol
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        found.update(target for target in targets if target in modules and target != name)
    return found


def _floor(name: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes if prefix != "elmokit"):
            return level
    assert name == "elmokit", f"{name} is on no floor: add it to FLOORS"
    return len(FLOORS) - 1


def test_imports_point_downward():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "elmokit":  # the package's public names come from every floor
            continue
        for target in _imports(name, path, modules):
            if target != "elmokit" and _floor(target) > _floor(name):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that point upward:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, modules) if not modules[t].name == "__init__.py"}
             for name, path in modules.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_top_level_name_defined_twice():
    where = collections.defaultdict(list)
    for name, path in _modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                where[node.name].append(name)
    twice = {name: places for name, places in where.items() if len(places) > 1 and name not in PROTOCOL_NAMES
             and set(places) != FOREIGN_API_NAMES.get(name)}
    assert not twice, "\n".join(f"{name}: {', '.join(places)}" for name, places in sorted(twice.items()))


def test_files_a_reader_can_hold():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > 400 and not any("Why this file is long" in line for line in lines[:40]):
            long.append(f"{path.relative_to(SRC)}: {len(lines)} lines")
    assert not long, "files over 400 lines without a reason at the top:\n" + "\n".join(long)
