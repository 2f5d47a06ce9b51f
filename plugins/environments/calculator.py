"""``calculator``: a safe arithmetic tool, and the ``env.calculator`` tool-calling environment.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary signs and
parentheses are evaluated (no names, calls or attributes: nothing of the caller's Python can be
reached); exponents and results are bounded so a call cannot exhaust the machine. Give the tool
to a trainer as ``tools=[calculator]`` or, in a recipe, ``tools: [plait.plugins.environments.calculator:calculator]``.
"""

from __future__ import annotations

import ast
import math
import operator

import attrs

from plait import hookimpl
from plait.online.rollouts import ToolEnvironment
from plait.online.tools import resolve_tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100
MAX_LENGTH = 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents above {MAX_EXPONENT} are refused")
            out = _BINARY[type(node.op)](left, right)
            if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
                raise ValueError("the result is out of range")
            return out
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")

    return value(tree.body)


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: e.g. 3 * (4 + 5)
    """
    result = evaluate(expression)
    if isinstance(result, float) and result.is_integer() and math.isfinite(result):
        result = int(result)
    return str(result)


@attrs.define
class CalculatorParams:
    timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))


def calculator_environment(params: CalculatorParams) -> ToolEnvironment:
    return ToolEnvironment(resolve_tools([calculator]), params.timeout)


@hookimpl
def register_environments(register):
    register("env.calculator", calculator_environment, params=CalculatorParams, owns_reward=False,
             doc="The calculator tool: episodes end on a turn without a tool call (rewards score them)")
