"""The built-in `calculator` tool: arithmetic parsed with `ast` and evaluated over a whitelist of nodes (never
`eval`), with every power and product bounded first, so `9**9**9` is refused at once instead of computing for
hours or filling the memory."""
from __future__ import annotations

import ast
import math
import operator

from .registry import register_tool

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # about 1233 decimal digits: the largest integer any step may produce
MAX_FLOAT_EXPONENT = 10_000

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
             "min": min, "max": max, "log": math.log, "exp": math.exp}
CONSTANTS = {"pi": math.pi, "e": math.e}


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, the functions sqrt, abs, round, floor,
            ceil, min, max, log, exp and the constants pi and e, e.g. "(3 + 4) * 12 / 7".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression[:80]!r}") from None
    value = evaluate(tree.body)
    return format_number(value)


def evaluate(node: ast.AST) -> int | float:
    """The value of a whitelisted node; anything else (names, attributes, strings, calls of other
    functions) is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left), evaluate(node.right)
        check_size(node.op, left, right)
        value = BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative number to a fractional power
            raise ValueError(f"{left} ** {right} is not a real number")
        return value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return FUNCTIONS[node.func.id](*(evaluate(argument) for argument in node.args))
    raise ValueError(f"not allowed in an arithmetic expression: {ast.dump(node)[:80]}")


def check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse a power or product whose result would pass MAX_RESULT_BITS (ints) or overflow (floats)."""
    if isinstance(op, ast.Pow):
        magnitude = math.log2(abs(left)) if left not in (0, 1, -1) else 0.0
        if isinstance(left, int) and isinstance(right, int):
            if right > 0 and magnitude * right > MAX_RESULT_BITS:
                raise ValueError(f"{left} ** {right} is too large (more than {MAX_RESULT_BITS} bits)")
        elif abs(right) > MAX_FLOAT_EXPONENT:
            raise ValueError(f"the exponent {right} is too large")
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_RESULT_BITS:
            raise ValueError(f"the product is too large (more than {MAX_RESULT_BITS} bits)")


def format_number(value: int | float) -> str:
    """Integers exactly; a float that is a whole number without its '.0'."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)
