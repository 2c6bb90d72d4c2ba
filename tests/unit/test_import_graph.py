"""The shape of the `seedance` package, read from its source with `ast` (nothing is imported):
no import cycles between its modules, each layer imports only what sits below it, and no
module outgrows a few screens.

Every import counts — module level, under `if TYPE_CHECKING:`, inside functions — so a cycle
hidden behind a type-only import is still a cycle. An edge goes to the module named (never
implicitly to its parent packages); `from pkg import name` goes to `pkg.name` when that is a
module, else to `pkg`."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "seedance"
MAX_MODULE_LINES = 600
LONG_MODULES_ALLOWED = frozenset({
    "seedance/engine/attention/decode_attention.py",
    "seedance/engine/attention/prefill_attention.py",
})
"""Triton kernels: one kernel and its launcher read best in one file."""


@dataclass(frozen=True)
class Import:
    """One import in `module`: `target` as written (absolute, relative imports resolved)."""

    module: str
    target: str
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """Module name -> file, for every module under seedance/."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """Every import in one module's source (see the module docstring for what counts)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                assert node.module is not None
                base = node.module
            submodules = [f"{base}.{alias.name}" for alias in node.names
                          if f"{base}.{alias.name}" in modules]
            if submodules:
                found += [Import(name, target, node.lineno) for target in submodules]
            if len(submodules) < len(node.names):  # names defined by `base` itself
                found.append(Import(name, base, node.lineno))
    return found


def internal_target(target: str, modules: set[str]) -> str | None:
    """The seedance module an import runs: `target` itself, or for `import a.b.Name`-like
    spellings the longest prefix that is a module (None: not ours)."""
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def all_imports() -> list[Import]:
    files = source_files()
    modules = set(files)
    return [imp for name, path in files.items() for imp in imports_of(name, path, modules)]


def import_graph() -> dict[str, set[str]]:
    """seedance module -> the seedance modules it imports."""
    modules = set(source_files())
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in all_imports():
        target = internal_target(imp.target, modules)
        if target is not None and target != imp.module:
            graph[imp.module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component with
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while (step := parent[path[-1]]) is not None:
                        path.append(step)
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# -- the helpers themselves -----------------------------------------------------------------


def test_find_cycles_reports_a_cycle_and_only_a_cycle() -> None:
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert find_cycles(acyclic) == []
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycles(cyclic) == [["a", "b", "c", "a"]]


def test_imports_are_found_under_type_checking_in_functions_and_relative(
    tmp_path: Path,
) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling, helper_name\n"
        "from ..other import thing\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.sub.typed import Name\n"
        "def f():\n"
        "    import pkg.lazy\n"
    )
    modules = {"pkg.sub", "pkg.sub.mod", "pkg.sub.sibling", "pkg.other", "pkg.sub.typed",
               "pkg.lazy"}
    targets = {imp.target for imp in imports_of("pkg.sub.mod", source, modules)}
    assert targets == {"typing", "pkg.sub.sibling", "pkg.sub", "pkg.other", "pkg.sub.typed",
                       "pkg.lazy"}


# -- the package ----------------------------------------------------------------------------


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "seedance.server.main" in graph and "seedance.protocol" in graph
    # a type-only import is an edge too
    assert "seedance.engine.llm" in graph["seedance"]


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@dataclass(frozen=True)
class Layer:
    """Modules under `package` and what they must not import (prefixes of module names);
    `only`, when given, is the complete list of what they may import besides the stdlib."""

    package: str
    forbidden: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None


SEEDANCE_LAYERS = ("seedance.protocol", "seedance.engine", "seedance.server", "seedance.client",
                   "seedance.transport")
LAYERS = [
    Layer("seedance.protocol",
          forbidden=("trio", "asyncio", "socket", "torch",
                     *(p for p in SEEDANCE_LAYERS if p != "seedance.protocol"),
                     "seedance.config", "seedance.testing", "seedance.cli")),
    Layer("seedance.engine",
          forbidden=("trio", "asyncio", "seedance.protocol", "seedance.server",
                     "seedance.client", "seedance.transport")),
    Layer("seedance.client", forbidden=("seedance.engine", "seedance.server")),
    Layer("seedance.server", forbidden=("seedance.client",)),
    # msgspec: the project's Struct library (limits and configuration), which protocol uses too
    Layer("seedance.transport",
          only=("seedance.protocol", "seedance.transport", "trio", "msgspec")),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_violations(layer: Layer, imports: list[Import]) -> list[str]:
    stdlib = sys.stdlib_module_names
    bad: list[str] = []
    for imp in imports:
        if not _under(imp.module, layer.package):
            continue
        target = imp.target
        if layer.only is not None:
            allowed = target.split(".")[0] in stdlib or any(_under(target, p) for p in layer.only)
            if target.split(".")[0] == "__future__":
                allowed = True
        else:
            allowed = not any(_under(target, p) for p in layer.forbidden)
        if not allowed:
            bad.append(f"{imp.module}:{imp.line} imports {target}")
    return bad


def test_layer_check_catches_a_forbidden_import() -> None:
    imports = [Import("seedance.protocol._framing", "trio", 3),
               Import("seedance.protocol._framing", "seedance.engine.outputs", 4),
               Import("seedance.transport.tcp", "wsproto", 5),
               Import("seedance.transport.tcp", "seedance.protocol", 6),
               Import("seedance.transport.tcp", "ssl", 7)]
    by_package = {layer.package: layer for layer in LAYERS}
    assert layer_violations(by_package["seedance.protocol"], imports) == [
        "seedance.protocol._framing:3 imports trio",
        "seedance.protocol._framing:4 imports seedance.engine.outputs",
    ]
    assert layer_violations(by_package["seedance.transport"], imports) == [
        "seedance.transport.tcp:5 imports wsproto",
    ]


@pytest.mark.parametrize("layer", LAYERS, ids=[layer.package for layer in LAYERS])
def test_layers_import_downward_only(layer: Layer) -> None:
    bad = layer_violations(layer, all_imports())
    assert not bad, f"{layer.package} breaks its layering:\n" + "\n".join(bad)


def test_modules_fit_on_a_few_screens() -> None:
    too_long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and relative not in LONG_MODULES_ALLOWED:
            too_long[relative] = lines
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them): {too_long}"
