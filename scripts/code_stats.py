"""The shape figures of turnrl/ (issue 10): line count, the turn loop's length and branch nodes, functions over
60 lines, the longest bodies, and the share of public functions with full annotations; (issue 22) the lines of
the classes Trainer and Learner, `cfg.` reads in train/learner.py, private methods a class overrides from a
turnrl base class, and modules over 800 lines.

    python scripts/code_stats.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "turnrl"
BRANCHES = (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.Match, ast.IfExp, ast.BoolOp)


def main() -> None:
    total, long, bodies, public, annotated = 0, [], [], 0, 0
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        total += len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            where = f"{path.relative_to(ROOT.parent)}:{node.name}"
            length = node.end_lineno - node.lineno + 1
            if length > 60:
                long.append((length, where))
            bodies.append((node.end_lineno - node.body[0].lineno + 1, where))
            if not node.name.startswith("_"):
                public += 1
                args = [a for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
                annotated += node.returns is not None and all(a.annotation is not None for a in args)
            if node.name == "_turn_loop":
                branches = sum(isinstance(x, BRANCHES) for x in ast.walk(node))
                print(f"_turn_loop: {length} lines, {branches} branch nodes")
    print(f"turnrl/ lines: {total:,}")
    print(f"functions over 60 lines: {sorted(long, reverse=True)}")
    print(f"longest bodies (signature excluded): {sorted(bodies, reverse=True)[:3]}")
    print(f"public functions fully annotated: {annotated}/{public} ({annotated / public:.0%})")
    trees = {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}
    for name in ("Trainer", "Learner"):
        print(f"class {name}: {', '.join(class_lines(trees, name)) or 'none'}")
    learner = ROOT / "train" / "learner.py"
    print(f"cfg. reads in {learner.relative_to(ROOT.parent)}: {cfg_reads(trees[learner]) if learner in trees else 'no file'}")
    print(f"private-method overrides across classes: {private_overrides(trees) or 0}")
    big = sorted((len(p.read_text().splitlines()), str(p.relative_to(ROOT.parent))) for p in trees)
    print(f"modules over 800 lines: {[(n, p) for n, p in big if n > 800][::-1]}")


def class_lines(trees: dict[Path, ast.Module], name: str) -> list[str]:
    """'N lines (module)' for every class called `name`."""
    return [f"{node.end_lineno - node.lineno + 1} lines ({path.relative_to(ROOT.parent)})"
            for path, tree in trees.items() for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]


def cfg_reads(tree: ast.Module) -> int:
    """Attribute reads off a config object: `cfg.x` or `self.cfg.x`."""
    return sum(isinstance(n, ast.Attribute) and (isinstance(n.value, ast.Name) and n.value.id == "cfg"
                                                 or isinstance(n.value, ast.Attribute) and n.value.attr == "cfg")
               for n in ast.walk(tree))


def private_overrides(trees: dict[Path, ast.Module]) -> list[str]:
    """`Class._method` for each private (single-underscore) method a class defines that a turnrl class it
    inherits from (by name, transitively) defines too."""
    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)]
                classes.setdefault(node.name, []).append((methods, bases))

    def inherited(bases: list[str], seen: set[str]) -> set[str]:
        out: set[str] = set()
        for base in bases:
            if base in classes and base not in seen:
                for methods, more in classes[base]:
                    out |= methods | inherited(more, seen | {base})
        return out

    return sorted(f"{name}.{m}" for name, defs in classes.items() for methods, bases in defs
                  for m in methods & inherited(bases, {name}) if m.startswith("_") and not m.startswith("__"))


if __name__ == "__main__":
    main()
