"""Safe arithmetic evaluation for the calculator tool: `ast` with a node whitelist, never `eval`.

Grammar: numbers (int or decimal literals), `+ - * / // % **`, unary `+ -`, parentheses. Arithmetic is exact
(`fractions.Fraction`); every intermediate value is bounded (`max_abs`), exponents must be integers with
`|e| <= max_exponent` and the result size of a power is estimated before it is computed, so no input can
make the evaluator spend unbounded time or memory.
"""

from __future__ import annotations

import ast
import fractions
import math
import operator
import threading

Fraction = fractions.Fraction

# `ast.parse` is not thread-safe on CPython 3.11 (python/cpython#106905): two threads converting trees at once can
# raise `SystemError: AST constructor recursion depth mismatch`; the runners step envs in thread pools.
PARSE_LOCK = threading.Lock()


class UnsafeExpression(ValueError):
  """The expression is not allowed, malformed, or out of bounds."""


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x: Fraction) -> int:
  return max(abs(x.numerator).bit_length(), x.denominator.bit_length())


def safe_eval(expr: str, *, max_len: int = 200, max_abs: float = 1e40, max_exponent: int = 64,
              max_depth: int = 32) -> Fraction:
  """Evaluates an arithmetic expression exactly.

  Args:
    expr: e.g. `'12*34 + (5 - 2)**3 / 4'`.
    max_len: longest accepted expression, in characters.
    max_abs: bound on |value| of every intermediate result (and on numerator/denominator sizes).
    max_exponent: bound on |e| in `b ** e`.
    max_depth: bound on the nesting depth of the syntax tree.

  Returns:
    The exact value as a `Fraction`.

  Raises:
    UnsafeExpression: disallowed syntax, division by zero, or a bound exceeded.
  """
  if not isinstance(expr, str):
    raise UnsafeExpression(f'expected a string, got {type(expr).__name__}')
  expr = expr.strip()
  if not expr:
    raise UnsafeExpression('empty expression')
  if len(expr) > max_len:
    raise UnsafeExpression(f'expression longer than {max_len} characters')
  if expr.count('(') > max_depth:
    raise UnsafeExpression(f'more than {max_depth} parentheses')
  try:
    with PARSE_LOCK:
      tree = ast.parse(expr, mode='eval')
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise UnsafeExpression(f'malformed expression: {e.__class__.__name__}') from None
  max_bits = int(math.log2(max_abs)) + 1

  def check(x: Fraction) -> Fraction:
    if abs(x) > max_abs or x.denominator.bit_length() > max_bits:
      raise UnsafeExpression(f'value out of bounds (|x| <= {max_abs:g})')
    return x

  def ev(node: ast.AST, depth: int) -> Fraction:
    if depth > max_depth:
      raise UnsafeExpression('expression nested too deeply')
    if isinstance(node, ast.Expression):
      return ev(node.body, depth + 1)
    if isinstance(node, ast.Constant):
      if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
        raise UnsafeExpression(f'only numbers are allowed, not {node.value!r}')
      if isinstance(node.value, float) and not math.isfinite(node.value):
        raise UnsafeExpression('non-finite number')
      return check(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return check(_UNARY[type(node.op)](ev(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      a, b = ev(node.left, depth + 1), ev(node.right, depth + 1)
      if isinstance(node.op, ast.Pow):
        if b.denominator != 1:
          raise UnsafeExpression('only integer exponents are allowed')
        e = b.numerator
        if abs(e) > max_exponent:
          raise UnsafeExpression(f'exponent {e} exceeds {max_exponent}')
        if a == 0 and e < 0:
          raise UnsafeExpression('division by zero')
        if _bits(a) * abs(e) > 2 * max_bits + 64:  # Result size, estimated before computing it.
          raise UnsafeExpression(f'value out of bounds (|x| <= {max_abs:g})')
        return check(a ** e)
      if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
        raise UnsafeExpression('division by zero')
      return check(Fraction(_BINOPS[type(node.op)](a, b)))
    raise UnsafeExpression(f'{type(node).__name__} is not allowed')

  return ev(tree, 0)


def format_number(x: Fraction, max_decimals: int = 6) -> str:
  """Integers exactly; other values as decimals rounded to `max_decimals` places, trailing zeros removed."""
  if x.denominator == 1:
    return str(x.numerator)
  q = round(x * 10 ** max_decimals)
  sign = '-' if q < 0 else ''
  q = abs(q)
  whole, frac = divmod(q, 10 ** max_decimals)
  frac_s = f'{frac:0{max_decimals}d}'.rstrip('0')
  return f'{sign}{whole}.{frac_s}' if frac_s else f'{sign}{whole}'
