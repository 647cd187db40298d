"""The formula compiler: parse tree (`formula_parse`) → a Python ``ast`` built here → one code object.

User text can only pick constants and the shape of the tree; every name the generated code can
reach is a helper placed in its namespace (it runs with empty builtins), so nothing the operator
types is ever given to ``eval``. Called once per formula by `app.scheduling.formula.Formula`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Sequence

from app.scheduling.formula_parse import (
    BATCH_VARS,
    REQUEST_VARS,
    Bin,
    Call,
    FormulaEvalError,
    Neg,
    Node,
    Num,
    Sum,
    Var,
)

__all__ = ["BatchFn", "OneFn", "generate"]

# ``x^2``-style powers (a small positive integer literal exponent, and no power inside the base)
# compile to Python's ``**``: exact on integer token counts and no call overhead. Anything else goes
# through _pow, which works in floats, so nested powers such as ``((x^9)^9)^9`` overflow promptly
# instead of building integers with millions of digits.
_MAX_INLINE_EXPONENT = 4

# --------------------------------------------------------------------------------------------------
# Runtime helpers, the only callables generated code can see. Only operations that could turn an
# inf/nan from an earlier float overflow back into a finite number (division, exp, pow, max, min)
# check their inputs; everything else lets it flow to the final isfinite check.

_INF = math.inf


def _finite(x: float) -> bool:
    # Comparisons rather than math.isfinite: an exact int beyond float range is finite here and
    # must not raise OverflowError just by being checked.
    return x == x and x != _INF and x != -_INF


def _overflow(where: str) -> FormulaEvalError:
    return FormulaEvalError(f"numeric overflow (non-finite operand of {where})")


def _div(a: float, b: float) -> float:
    if b == 0:
        raise FormulaEvalError("division by zero")
    if not _finite(b):
        raise _overflow("'/'")
    return a / b


def _pow(a: float, b: float) -> float:
    if not (_finite(a) and _finite(b)):
        raise _overflow("'^'")
    try:
        return math.pow(a, b)
    except ValueError:
        raise FormulaEvalError(f"{a!r}^{b!r} is undefined") from None


def _sqrt(x: float) -> float:
    if x < 0:
        raise FormulaEvalError(f"sqrt of negative value {x!r}")
    return math.sqrt(x)


def _log(x: float) -> float:
    if x <= 0:
        raise FormulaEvalError(f"log of non-positive value {x!r}")
    return math.log(x)


def _exp(x: float) -> float:
    if not _finite(x):
        raise _overflow("exp()")
    return math.exp(x)


def _max(*args: float) -> float:
    for arg in args:
        if not _finite(arg):
            raise _overflow("max()")
    return max(args)


def _min(*args: float) -> float:
    for arg in args:
        if not _finite(arg):
            raise _overflow("min()")
    return min(args)


_HELPERS: dict[str, Callable[..., float]] = {
    "sqrt": _sqrt,
    "log": _log,
    "exp": _exp,
    "abs": abs,
    "pow": _pow,
    "max": _max,
    "min": _min,
}
# Everything generated code can name, by the name it uses.
_RUNTIME: dict[str, Callable[..., float]] = {
    "_div": _div,
    **{f"_{name}": fn for name, fn in _HELPERS.items()},
}
_BINOPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


# --------------------------------------------------------------------------------------------------
# Code generation: parse tree -> Python ast of ``def _predict(items)`` and ``def _predict_one(i, h)``
# -> one code object. The one-item function is the batch function with every aggregate replaced by
# the item's own value, so it performs the same operations on the same numbers and returns the same
# result, without the loops (about twice as fast for the router's per-request calls).

BatchFn = Callable[[Sequence[tuple[int, int]]], float]
OneFn = Callable[[int, int], float]
_AGGREGATES = frozenset({"ti", "th", "tc", "mi", "mc", "ah"})
# What each variable is for a batch of exactly one item (inside or outside sum()).
_ONE_ITEM_LOCALS: dict[str, str] = {
    "inputTokens": "i",
    "hitCacheTokens": "h",
    "computeTokens": "c",
    "hasHitCache": "hc",
    "totalInputTokens": "i",
    "totalComputeTokens": "c",
    "maxInputTokens": "i",
    "maxComputeTokens": "c",
}


def _stmts(src: str) -> list[ast.stmt]:
    """Parse a fixed snippet written in this module (never user text) into statements."""
    return ast.parse(src).body


class _CodeGen:
    def __init__(self, one_item: bool) -> None:
        self.one_item = one_item
        self.batch_locals: set[str] = set()  # batch-level locals read anywhere
        self.sum_batch_locals: set[str] = set()  # ... of those, read inside a sum() body
        self.item_locals: set[str] = set()  # per-item locals read (inside sum() bodies, for batches)
        self.sums: list[ast.expr] = []

    def expr(self, node: Node, in_sum: bool) -> ast.expr:
        return _fold(self._expr(node, in_sum))

    def _expr(self, node: Node, in_sum: bool) -> ast.expr:
        match node:
            case Num(value=value):
                return ast.Constant(value)
            case Var(name=name):
                return self._var(name, in_sum)
            case Neg(operand=operand):
                return ast.UnaryOp(ast.USub(), self.expr(operand, in_sum))
            case Bin(op=op, left=left, right=right):
                return self._binary(op, left, right, in_sum)
            case Call(name=name, args=args):
                return _call(name, [self.expr(arg, in_sum) for arg in args])
            case Sum(body=body):
                if self.one_item:
                    return self.expr(body, in_sum=True)
                self.sums.append(self.expr(body, in_sum=True))
                return ast.Name(f"s{len(self.sums) - 1}", ast.Load())
        raise AssertionError(f"unhandled node {node!r}")

    def _var(self, name: str, in_sum: bool) -> ast.expr:
        if self.one_item:
            if name == "batchSize":
                return ast.Constant(1)
            local = _ONE_ITEM_LOCALS[name]
            self.item_locals.add(local)
            return ast.Name(local, ast.Load())
        if name in REQUEST_VARS:
            outside, inside = REQUEST_VARS[name]
            if in_sum:
                self.item_locals.add(inside)
                return ast.Name(inside, ast.Load())
            local = outside
        else:
            local = BATCH_VARS[name]
            if in_sum:
                self.sum_batch_locals.add(local)
        self.batch_locals.add(local)
        return ast.Name(local, ast.Load())

    def _binary(self, op: str, left: Node, right: Node, in_sum: bool) -> ast.expr:
        lhs = self.expr(left, in_sum)
        rhs = self.expr(right, in_sum)
        if op == "/":
            if isinstance(right, Num) and right.value != 0:
                return ast.BinOp(lhs, ast.Div(), rhs)
            return _call("_div", [lhs, rhs])
        if op == "^":
            if (
                isinstance(right, Num)
                and isinstance(right.value, int)
                and 1 <= right.value <= _MAX_INLINE_EXPONENT
                and not any(
                    isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Pow) for sub in ast.walk(lhs)
                )
            ):
                return ast.BinOp(lhs, ast.Pow(), rhs)
            return _call("_pow", [lhs, rhs])
        return ast.BinOp(lhs, ast.Add() if op == "+" else ast.Sub() if op == "-" else ast.Mult(), rhs)

    def _item_prelude(self) -> list[ast.stmt]:
        prelude: list[ast.stmt] = []
        if "c" in self.item_locals:
            prelude += _stmts("c = i - h")
        if "hc" in self.item_locals:
            prelude += _stmts("hc = 1 if h > 0 else 0")
        return prelude

    def one_item_function(self, top: Node) -> ast.FunctionDef:
        ret = ast.Return(self.expr(top, in_sum=False))
        return _function("def _predict_one(i, h):\n    pass", [*self._item_prelude(), ret])

    def batch_function(self, top: Node) -> ast.FunctionDef:
        ret = ast.Return(self.expr(top, in_sum=False))
        body: list[ast.stmt] = []
        used = set(self.batch_locals)
        if "tc" in used:
            used |= {"ti", "th"}
        aggregates = used & _AGGREGATES
        # One pass suffices unless a sum() body reads an aggregate that only the pass computes.
        fused = bool(self.sums) and not (self.sum_batch_locals & _AGGREGATES)

        if "n" in used:
            body += _stmts("n = len(items)")
        accumulate: list[ast.stmt] = [
            ast.AugAssign(ast.Name(f"s{k}", ast.Store()), ast.Add(), value)
            for k, value in enumerate(self.sums)
        ]
        sums_init = _stmts("\n".join(f"s{k} = 0" for k in range(len(self.sums))))
        item_prelude = self._item_prelude()

        if aggregates or fused:
            init: list[str] = [f"{name} = 0" for name in ("ti", "th", "ah") if name in aggregates]
            step: list[str] = [
                line
                for name, line in (("ti", "ti += i"), ("th", "th += h"), ("ah", "if h > 0:\n    ah = 1"))
                if name in aggregates
            ]
            if "mi" in aggregates or "mc" in aggregates:
                init.append("i0, h0 = items[0]")
            if "mi" in aggregates:
                init.append("mi = i0")
                step.append("if i > mi:\n    mi = i")
            if "mc" in aggregates:
                init.append("mc = i0 - h0")
                step.append("d = i - h\nif d > mc:\n    mc = d")
            body += _stmts("\n".join(init))
            loop_body = _stmts("\n".join(step))
            if fused:
                body += sums_init
                loop_body += item_prelude + accumulate
            body.append(_loop(loop_body))
            if "tc" in aggregates:
                body += _stmts("tc = ti - th")
        if self.sums and not fused:
            body += sums_init
            body.append(_loop(item_prelude + accumulate))
        body.append(ret)
        return _function("def _predict(items):\n    pass", body)


def _fold(node: ast.expr) -> ast.expr:
    """Precompute operations on constants, chiefly ``log(batchSize + 1)`` in the one-item function.

    Folding runs the very operations the generated code would, so results are unchanged; anything
    that fails or is not finite is left in place to raise at evaluation time, where it belongs.
    """
    try:
        match node:
            case ast.BinOp(left=ast.Constant(value=a), op=op, right=ast.Constant(value=b)):
                value = _BINOPS[type(op)](a, b)
            case ast.UnaryOp(op=ast.USub(), operand=ast.Constant(value=a)):
                value = -a
            case ast.Call(func=ast.Name(id=name), args=args) if all(
                isinstance(a, ast.Constant) for a in args
            ):
                value = _RUNTIME[name](*(arg.value for arg in args if isinstance(arg, ast.Constant)))
            case _:
                return node
    except (FormulaEvalError, ArithmeticError):
        return node
    return ast.Constant(value) if _finite(value) else node


def _call(helper: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(ast.Name(f"_{helper.lstrip('_')}", ast.Load()), args, [])


def _function(signature: str, body: list[ast.stmt]) -> ast.FunctionDef:
    func = _stmts(signature)[0]
    assert isinstance(func, ast.FunctionDef)
    func.body = body
    return func


def _loop(body: list[ast.stmt]) -> ast.For:
    loop = _stmts("for i, h in items:\n    pass")[0]
    assert isinstance(loop, ast.For)
    loop.body = body or _stmts("pass")
    return loop


def generate(tree: Node, source: str) -> tuple[BatchFn, OneFn]:
    module = ast.Module(
        [_CodeGen(one_item=False).batch_function(tree), _CodeGen(one_item=True).one_item_function(tree)], []
    )
    code = compile(ast.fix_missing_locations(module), f"<formula {source[:60]!r}>", "exec")
    namespace: dict[str, object] = {"__builtins__": {}, "len": len, **_RUNTIME}
    exec(code, namespace)
    return namespace["_predict"], namespace["_predict_one"]  # type: ignore[return-value]
