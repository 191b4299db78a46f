"""The recipe's tool: turnrl's ast calculator (no eval)."""

from turnrl.tools import calculator  # noqa: F401  (a FunctionTool: the loader collects it)
