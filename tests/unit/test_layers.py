"""Layers point one way: every import of every project module (module level, inside functions, under
``TYPE_CHECKING``, and ``importlib.import_module("…")`` with a literal name) goes to its own layer or one the map
below allows, and no project modules import each other around a loop.

The layer map, bottom to top (``x.*`` is ``x`` and everything under it):

============  ===================================================================================================
kernel        ``producer.{contract,catalog,settings,bus,logs,readiness,metrics_server}`` and the scheduler→worker
              contract ``producer.orders`` (orders, queue routing, object-store key layout) with its Celery side
              ``producer.broker`` (and ``producer.file_backend`` / ``producer.file_transport``, its embedded
              result backend and broker transport). Imports only
              the kernel.
engine        ``workers.engine.*`` and the model code its registry loads by name (``workers.toy.model``, with the
              toy world and its checker). Imports only ``producer.contract``, ``producer.catalog`` and the engine.
client        ``producer.sdk``, ``producer.cli_produce`` (``chorus produce``): the kernel and the client.
scheduler     ``chorus_sched.*``: the kernel and the scheduler.
workers       ``workers.*`` (Celery app and tasks, runner, store, donors, results, metrics, ``chorus worker``,
              ``chorus generate``): the kernel, the engine and the workers. Never the scheduler, nor it them.
top           benchmarks ``workers.bench.*``, the local stack ``producer.local.*``, toy training and evaluation
              ``workers.toy.*``, the Grafana dashboard builder and its pictures (``infra/grafana``): any layer
              but the CLI root.
root          ``producer.cli``, the CLI root: wires the commands of every layer, and ``producer.cli_root``, its
              global options. Nothing imports them.
============  ===================================================================================================

Cycles are looked for among the imports that run (a ``TYPE_CHECKING`` import never does, so a type-only back
reference is allowed; it still counts for the direction rules). The checks run on synthetic graphs and sources
too, so they cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Top-level import names of the project and the folder each is found in.
SOURCE_ROOTS: dict[str, Path] = {
    "producer": ROOT,
    "chorus_sched": ROOT,
    "workers": ROOT,
    # infra/ is not a package: build_dashboards.py puts its folder on sys.path and imports chorus_dashboards.
    "chorus_dashboards": ROOT / "infra" / "grafana",
    "build_dashboards": ROOT / "infra" / "grafana",
    "render_dashboards": ROOT / "infra" / "grafana",
}

LAYERS: dict[str, tuple[str, ...]] = {
    "kernel": (
        "producer",
        "producer.contract",
        "producer.parsing",
        "producer.catalog",
        "producer.settings",
        "producer.bus",
        "producer.logs",
        "producer.readiness",
        "producer.metrics_server",
        "producer.orders",
        "producer.broker",
        "producer.file_backend",
        "producer.file_transport",
    ),
    "engine": ("workers.engine.*", "workers.toy.model", "workers.toy.world", "workers.toy.checker"),
    "client": ("producer.sdk", "producer.cli_produce"),
    "scheduler": ("chorus_sched.*",),
    "workers": ("workers.*",),
    "top": (
        "workers.bench.*",
        "workers.toy.*",
        "producer.local.*",
        "chorus_dashboards.*",
        "build_dashboards",
        "render_dashboards",
    ),
    "root": ("producer.cli", "producer.cli_root"),
}
ALLOWED: dict[str, frozenset[str]] = {
    "kernel": frozenset({"kernel"}),
    "engine": frozenset({"engine", "kernel"}),  # of the kernel, only ENGINE_KERNEL
    "client": frozenset({"kernel", "client"}),
    "scheduler": frozenset({"kernel", "scheduler"}),
    "workers": frozenset({"kernel", "engine", "workers"}),
    "top": frozenset({"kernel", "engine", "client", "scheduler", "workers", "top"}),
    "root": frozenset(LAYERS),
}
ENGINE_KERNEL = frozenset({"producer.contract", "producer.catalog"})


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module it imports
    line: int
    type_only: bool = False  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}{' (type only)' if self.type_only else ''}"


# --- finding the imports ------------------------------------------------------------------------------------


def project_modules() -> dict[str, Path]:
    """Every project module by its import name (a package by its own name, for its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for top, base in SOURCE_ROOTS.items():
        single = base / f"{top}.py"
        paths = [single] if single.is_file() else sorted((base / top).rglob("*.py"))
        for path in paths:
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def resolve(name: str, known: Collection[str]) -> str | None:
    """The project module ``name`` lands in: itself, else its nearest known parent; None outside the project."""
    if name.split(".")[0] not in SOURCE_ROOTS:
        return None
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_name(call: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("…")`` or ``__import__("…")``."""
    func = call.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    if named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def imports_in(source: str, module: str, known: Collection[str], *, is_package: bool = False) -> list[Import]:
    """Every import of a project module in ``source`` (the text of ``module``), wherever it stands."""
    found: list[Import] = []

    def add(name: str, node: ast.AST, type_only: bool) -> None:
        target = resolve(name, known)
        imp = Import(module, target or "", getattr(node, "lineno", 0), type_only)
        if target is not None and target != module and imp not in found:
            found.append(imp)

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, True)
            for stmt in node.orelse:
                visit(stmt, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else base, node, type_only)
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            add(name, node, type_only)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source), False)
    return found


def project_imports(modules: Mapping[str, Path]) -> list[Import]:
    return [
        imp
        for name, path in sorted(modules.items())
        for imp in imports_in(path.read_text(), name, modules, is_package=path.name == "__init__.py")
    ]


# --- the rules ----------------------------------------------------------------------------------------------


def layer_of(module: str) -> str | None:
    """The layer of ``module``: the most specific pattern that names it (an exact name beats ``x.*``)."""
    best: tuple[int, str] | None = None
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                if module != prefix and not module.startswith(prefix + "."):
                    continue
                rank = len(prefix)
            elif pattern == module:
                rank = len(pattern) + 1
            else:
                continue
            if best is None or rank > best[0]:
                best = (rank, layer)
    return best[1] if best else None


def _reason(src: str, dst: str) -> str:
    if dst == "root":
        return "nothing imports the CLI root"
    if dst == "top":
        return "only the top layer and the CLI root (producer.cli) import the top layer"
    if src == "kernel":
        return "the kernel imports only the kernel"
    if src == "engine":
        return "the engine imports only the kernel's contract and catalog and the engine"
    if {src, dst} == {"scheduler", "workers"}:
        return "the scheduler and the workers never import each other (they share producer.orders/broker)"
    return f"{src} imports only {', '.join(sorted(ALLOWED[src]))}"


def wrong_way(imports: Iterable[Import]) -> list[str]:
    """One line per import that breaks the layer map, naming the import and the rule."""
    problems = []
    for imp in imports:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is None or dst is None:
            continue  # reported by test_every_module_has_a_layer
        allowed = dst in ALLOWED[src] and not (
            src == "engine" and dst == "kernel" and imp.target not in ENGINE_KERNEL
        )
        if not allowed:
            problems.append(f"{imp} ({src} → {dst}): {_reason(src, dst)}")
    return problems


def cycles(imports: Iterable[Import]) -> list[list[Import]]:
    """Import cycles among the imports that run: one loop per strongly connected group of modules."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports:
        if not imp.type_only:
            graph[imp.source].setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_loop(graph, group) for group in groups]


def _loop(graph: Mapping[str, Mapping[str, Import]], group: set[str]) -> list[Import]:
    """The group's shortest loop (breadth first inside the group from each of its modules; ties by name)."""
    loops = [loop for start in sorted(group) if (loop := _loop_from(graph, group, start))]
    return min(loops, key=len)


def _loop_from(graph: Mapping[str, Mapping[str, Import]], group: set[str], start: str) -> list[Import] | None:
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, imp in sorted(graph[node].items()):
                if nxt == start:
                    path = [imp]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if nxt in group and nxt not in came_from:
                    came_from[nxt] = imp
                    following.append(nxt)
        frontier = following
    return None


def describe(loop: Sequence[Import]) -> str:
    return " → ".join([f"{imp.source}:{imp.line}" for imp in loop] + [loop[0].source])


# --- the project ----------------------------------------------------------------------------------------------

MODULES = project_modules()
IMPORTS = project_imports(MODULES)


def test_every_module_has_a_layer() -> None:
    assert len(MODULES) > 80, sorted(MODULES)
    assert [m for m in sorted(MODULES) if layer_of(m) is None] == []


def test_no_import_points_the_wrong_way() -> None:
    problems = wrong_way(IMPORTS)
    assert not problems, "imports against the layer map:\n" + "\n".join(problems)


def test_no_import_cycle() -> None:
    loops = cycles(IMPORTS)
    assert not loops, "import cycles:\n" + "\n".join(describe(loop) for loop in loops)


def test_the_walk_sees_the_imports_that_matter() -> None:
    # Guards against a walk that finds nothing: imports of each kind that the project has today.
    edges = {(imp.source, imp.target) for imp in IMPORTS}
    assert ("chorus_sched.dispatch", "producer.broker") in edges  # module level
    assert ("workers.tasks", "workers.runner") in edges  # inside a function
    assert ("workers.engine.registry", "workers.toy.model") in edges  # importlib.import_module("…")
    assert ("producer.cli", "chorus_sched.cli") in edges  # from package import module
    assert ("build_dashboards", "chorus_dashboards.chorus_overview") in edges  # infra/grafana
    assert any(imp.type_only for imp in IMPORTS)


# --- the checks themselves, on synthetic sources and graphs -------------------------------------------------


def test_the_walk_finds_every_kind_of_import() -> None:
    known = {"workers", "workers.app", "workers.tasks", "workers.settings", "producer", "producer.orders"}
    source = (
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "import json, workers.app\n"  # 4
        "from producer.orders import WorkOrder\n"  # 5
        "if TYPE_CHECKING:\n"
        "    from workers.settings import WorkerSettings\n"  # 7
        "def run() -> None:\n"
        "    from . import app\n"  # 9
        "    importlib.import_module('producer.orders')\n"  # 10
        "    __import__('json')\n"
    )
    found = {(i.target, i.line, i.type_only) for i in imports_in(source, "workers.tasks", known)}
    assert found == {
        ("workers.app", 4, False),
        ("producer.orders", 5, False),
        ("workers.settings", 7, True),
        ("workers.app", 9, False),
        ("producer.orders", 10, False),
    }


PLANTED = [
    (Import("producer.contract", "chorus_sched.ledger", 1), "the kernel imports only the kernel"),
    (Import("producer.orders", "producer.sdk", 1), "the kernel imports only the kernel"),
    (Import("chorus_sched.dispatch", "workers.app", 1), "never import each other"),
    (Import("workers.runner", "chorus_sched.planner", 1), "never import each other"),
    (Import("workers.engine.engine", "workers.settings", 1), "only the kernel's contract and catalog"),
    (Import("workers.engine.registry", "producer.orders", 1), "only the kernel's contract and catalog"),
    (Import("workers.results", "producer.sdk", 1), "workers imports only"),
    (Import("chorus_sched.metrics", "workers.bench.engine_bench", 1), "import the top layer"),
    (Import("producer.sdk", "producer.local.stack", 1), "import the top layer"),
    (Import("workers.bench.quality", "producer.cli", 1), "nothing imports the CLI root"),
]


@pytest.mark.parametrize(("planted", "rule"), PLANTED, ids=[str(p) for p, _ in PLANTED])
def test_a_planted_wrong_way_import_is_named(planted: Import, rule: str) -> None:
    problems = wrong_way([planted, replace(planted, line=2, type_only=True)])
    assert len(problems) == 2 and all(rule in p for p in problems)
    assert problems[0].startswith(f"{planted} (") and problems[1].startswith(f"{planted.source}:2 imports")


def test_allowed_imports_pass_the_rules() -> None:
    allowed = [
        Import("workers.engine.bundle", "producer.catalog", 1),
        Import("workers.engine.registry", "workers.toy.model", 1),
        Import("chorus_sched.dispatch", "producer.broker", 1),
        Import("workers.runner", "workers.engine.engine", 1),
        Import("producer.local.stack", "chorus_sched.settings", 1),
        Import("workers.bench.faults.harness", "producer.local.stack", 1),
        Import("producer.cli", "workers.bench.quality", 1),
    ]
    assert wrong_way(allowed) == []


def test_a_planted_cycle_is_named_but_a_type_only_one_is_not() -> None:
    graph = [Import("app", "tasks", 1), Import("tasks", "settings", 2), Import("app", "settings", 3)]
    assert cycles(graph) == []
    planted = Import("settings", "app", 9)  # e.g. a function-local import
    assert [describe(loop) for loop in cycles([*graph, planted])] == ["app:3 → settings:9 → app"]
    assert cycles([*graph, replace(planted, type_only=True)]) == []
    three = [
        Import("a", "b", 1),
        Import("b", "c", 2),
        Import("c", "a", 3),
        Import("c", "d", 4),
        Import("d", "e", 5),
    ]
    assert [describe(loop) for loop in cycles(three)] == ["a:1 → b:2 → c:3 → a"]
