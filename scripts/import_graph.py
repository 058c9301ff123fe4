"""Prints the import graph between Spruce's folders and fails (exit 1) on any cycle (between
folders, or between modules: function-level imports included).

Every `import` / `from ... import` in the packages counts, at module level or inside a
function (a function-level import is still a dependency); imports under
`if TYPE_CHECKING:` do not (they never run). A node is a layer: a top-level folder of
`runtime/` with its subfolders (`runtime/core`, `runtime/server` with `server/http` and
`server/openai`, ...) or one of the other packages (`lang`, `constrained`, `radix`); modules
directly in `runtime/` are one node each (`runtime/cli.py`, ...), since the root holds only
entry points. Also checked: the layer rules
that `constrained/` and `radix/` import nothing from `runtime/` or `lang/`, no module
imports a private (`_name`) attribute of another module, and no module imports a submodule
through a package whose `__init__` imports that module back, directly or through other
modules (`from pkg import sub` in a module that `pkg/__init__.py` leads to: it works only
while `pkg` happens to be imported first; `from pkg.sub import name` does not depend on the
order).

    python scripts/import_graph.py           # the graph, then "no cycles"
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "runtime": "spruce.runtime",
    "lang": "spruce.lang",
    "radix": "spruce.radix",
    "constrained": "spruce.constrained",
}
LEAVES = ("constrained", "radix")  # may import nothing from the other packages but each other


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def node_of(module: str, modules: dict[str, Path], root: Path = ROOT) -> str | None:
    """The folder node of a spruce module (or of the module a name in it belongs to)."""
    module = _module_of(module, modules)
    if module is None:
        return None
    path = modules[module].relative_to(root)
    if path.parent == Path("runtime") and path.name != "__init__.py":
        return str(path)  # an entry-point module of the runtime root
    return "/".join(path.parent.parts[:2])  # runtime/<layer>, or the package


def imports_of(tree: ast.AST, module: str, is_package: bool):
    """(imported module, imported names) of every import that runs (not TYPE_CHECKING)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            yield base, [a.name for a in node.names]


def main(root: Path = ROOT) -> int:
    """Checks the packages under root (the repository by default); 1 on any problem."""
    files = [p for folder in PACKAGES for p in (root / folder).rglob("*.py")]
    modules = {module_name(p, root): p for p in files}
    edges: dict[str, set[str]] = defaultdict(set)
    file_edges: dict[str, set[str]] = defaultdict(set)  # between modules
    through: list[tuple[str, str, str]] = []  # (importer, pkg, sub) of `from pkg import sub`
    problems = []
    for module, path in sorted(modules.items()):
        source = node_of(module, modules, root)
        tree = ast.parse(path.read_text(), str(path))
        for target_module, names in imports_of(tree, module, path.name == "__init__.py"):
            if not target_module.startswith("spruce."):
                continue
            for name in names:
                full = f"{target_module}.{name}"
                if name.startswith("_") and full not in modules and not name.startswith("__"):
                    problems.append(f"{path.relative_to(root)} imports the private name {full}")
            targets = {
                f"{target_module}.{n}" for n in names if f"{target_module}.{n}" in modules
            } or {target_module}
            if target_module in modules and modules[target_module].name == "__init__.py":
                through += [(module, target_module, t) for t in targets if t != target_module]
            for target in targets:
                file_edges[module].add(_module_of(target, modules))
                node = node_of(target, modules, root)
                if node is not None and node != source:
                    edges[source].add(node)
    problems += through_package_problems(through, file_edges, modules, root)
    for leaf in LEAVES:
        for target in edges.get(leaf, ()):
            if not target.startswith(LEAVES):
                problems.append(f"{leaf}/ imports {target}: it must stay a leaf")
    for source in sorted(edges):
        print(f"{source:28} -> {', '.join(sorted(edges[source]))}")
    cycle = find_cycle(edges)
    if cycle:
        problems.append("import cycle between folders: " + " -> ".join(cycle))
    file_edges = {m: {t for t in targets if t and t != m} for m, targets in file_edges.items()}
    cycle = find_cycle(file_edges)
    if cycle:
        problems.append("import cycle between modules: " + " -> ".join(cycle))
    for problem in problems:
        print("ERROR:", problem)
    if not problems:
        print("no cycles, no private imports, leaves stay leaves,")
        print("no submodule through its importer's package")
    return 1 if problems else 0


def through_package_problems(through, file_edges, modules, root: Path) -> list[str]:
    """`from pkg import sub` in a module that pkg's __init__ leads to (an import cycle that
    works only by the order of imports). An import also runs the __init__ of every package
    above its target, so those count as edges too (all but the importer's own packages, which
    are already importing when it runs)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in file_edges.items():
        own = set(_packages_above(module))
        for target in targets:
            if target and target != module:
                graph[module].add(target)
                above = _packages_above(target)
                graph[module].update(p for p in above if p in modules and p not in own)
    problems = []
    for module, package, submodule in through:
        if module == package:
            continue  # a package's __init__ taking its own submodules is the usual order
        chain = find_path(graph, package, module)
        if chain:
            problems.append(
                f"{modules[module].relative_to(root)} imports {submodule} through the package "
                f"{package}, whose __init__ imports it back ({' -> '.join(chain)}): "
                f"import {submodule} itself"
            )
    return problems


def _packages_above(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def find_path(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest chain of imports from start to goal, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == goal:
            chain = [node]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for nxt in sorted(edges.get(node, ())):
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
