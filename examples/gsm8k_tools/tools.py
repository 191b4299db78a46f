"""Function tools of the recipe: the built-in ast calculator (no eval)."""

from turnrl.tools import calculator  # noqa: F401  (a FunctionTool: the loader collects it)
