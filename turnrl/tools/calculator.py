"""A safe calculator tool: arithmetic evaluated by walking the `ast`; it never calls `eval`."""

from __future__ import annotations

import ast
import math
from typing import Any

from turnrl.tools.function_tool import function_tool


class CalculatorError(ValueError):
    """The expression is invalid, unsupported, or its value is out of range."""


MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_INT_BITS = 4000  # ~1200 decimal digits; also keeps str() under Python's 4300-digit limit

_BINARY_OPS: dict[type[ast.operator], Any] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: _power(a, b),
}
_FUNCTIONS: dict[str, Any] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def evaluate_expression(expression: str) -> int | float:
    """Evaluate arithmetic: numbers, + - * / // % **, unary +/-, parentheses, the functions in
    `_FUNCTIONS` and the constants pi and e. Raises `CalculatorError` with a readable message."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"invalid expression: {getattr(e, 'msg', e)}") from None
    try:
        return _checked(_eval_node(tree.body))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    except (ValueError, TypeError) as e:  # math domain errors, round() of inf, ...
        raise CalculatorError(str(e)) from None


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        return _checked(_BINARY_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        return _eval_call(node)
    raise CalculatorError(_unsupported(node))


def _eval_call(node: ast.Call) -> int | float:
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
        called = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        raise CalculatorError(f"unsupported function {called!r}; available: {', '.join(_FUNCTIONS)}")
    if node.keywords:
        raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
    args = [_eval_node(a) for a in node.args]
    return _checked(_FUNCTIONS[node.func.id](*args))


def _unsupported(node: ast.AST) -> str:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "unsupported operator ^ (use ** for powers)"
    if isinstance(node, ast.Name):
        return f"unknown name {node.id!r}; constants: {', '.join(_CONSTANTS)}"
    if isinstance(node, ast.Constant):
        return f"unsupported literal {node.value!r}; only int and float numbers"
    return f"unsupported syntax: {type(node).__name__} ({ast.unparse(node)})"


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > MAX_INT_BITS:
        raise CalculatorError("result too large")
    return base**exponent


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large" if math.isinf(value) else "result is not a number")
    return value


def format_number(value: int | float) -> str:
    """Integers (and integral floats below 1e15) without `.0`; other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports numbers, + - * / // % ** (exponents up to 1000), parentheses, sqrt, abs, round, min, max,
    floor, ceil, log, exp, pi and e.

    Args:
        expression: The expression, e.g. "(3 + 4) * 2 ** 3".
    """
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as e:
        return f"Error: {e}"
