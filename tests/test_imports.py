"""No import cycles among turnrl's modules, counting imports inside functions too.

A function-level import hides a cycle from `import turnrl.x` but not from the reader: the two modules still
depend on each other, and the order they are first imported in decides whether it works. Edges go to the
module an import names (`from turnrl.a import b` is an edge to `turnrl.a.b` when that is a module, else to
`turnrl.a`); a submodule does not count as importing its package (`turnrl.agents.x` always loads
`turnrl.agents` first, which is not a dependency anyone wrote). Imports under `if TYPE_CHECKING:` never run
and are not counted.

    .venv/bin/python tests/test_imports.py     # prints the cycles
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "turnrl"

KNOWN_CYCLES: set[frozenset[str]] = set()
"""Cycles accepted for now (none: keep it that way)."""


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (`__init__` names its package)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, modules: set[str], here: str, is_package: bool) -> set[str]:
    """turnrl modules imported anywhere in `tree` (any depth) outside `if TYPE_CHECKING:` blocks."""
    own_package = here.split(".") if is_package else here.split(".")[:-1]
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `.` is this module's package, each further dot one level up
                package = own_package[: len(own_package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in found if m in modules and m != here}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    names = set(files)
    return {name: _imported(ast.parse(path.read_text(), str(path)), names, name, path.name == "__init__.py")
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan), each one or more cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_the_walker_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "turnrl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from turnrl.b import thing\n")
    (pkg / "b.py").write_text("from turnrl import a\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from turnrl.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import x\n")
    (pkg / "sub" / "c.py").write_text("import turnrl.sub\n")
    graph = import_graph(pkg)
    assert graph["turnrl.a"] == {"turnrl.b"} and graph["turnrl.b"] == {"turnrl.a"}
    assert graph["turnrl.sub"] == {"turnrl.sub.c"} and graph["turnrl.sub.c"] == {"turnrl.sub"}
    assert sorted(map(sorted, cycles(graph))) == [["turnrl.a", "turnrl.b"], ["turnrl.sub", "turnrl.sub.c"]]


def test_no_import_cycles_in_turnrl():
    graph = import_graph()
    assert len(graph) > 40 and graph["turnrl.cli"]  # the walk found the package and its imports
    found = cycles(graph)
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(describe(c, graph) for c in unexpected)


if __name__ == "__main__":
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print(("known " if component in KNOWN_CYCLES else "") + describe(component, graph))
    print(f"{len(found)} cycle(s) among {len(graph)} modules")
    sys.exit(1 if [c for c in found if c not in KNOWN_CYCLES] else 0)
