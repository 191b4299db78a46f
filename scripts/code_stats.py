"""The shape figures of turnrl/ (issue 10): line count, the turn loop's length and branch nodes, functions over
60 lines, the longest bodies, and the share of public functions with full annotations.

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


if __name__ == "__main__":
    main()
