"""Safe arithmetic formulas that predict how long a prefill batch takes, in milliseconds.

Operators describe a modelled GPU's prefill cost as a small expression (DESIGN §7), for example
``12 + 0.065*computeTokens + 2.5e-7*computeTokens^2``. That text comes from configuration, not from
this code, so it is never given to ``eval``: a hand-written recursive-descent parser turns it into
a closed set of nodes, and this module builds a Python ``ast`` from those nodes itself and compiles
it once. User text can only pick constants and the shape of the tree; every name the generated code
can reach is a helper placed in its namespace (it runs with empty builtins). The compiled function
is what makes ``predict_batch`` cheap enough for the router, which scores every worker per request,
and for the simulator, which calls it millions of times.

Language
--------
* numbers ``12``, ``0.065``, ``2.5e-7``; operators ``+ - * / ^``; parentheses;
* ``^`` is power and right-associative (``2^3^2 = 512``); unary minus binds looser than ``^`` but
  tighter than ``* /`` (``-2^2 = -4``, ``2^-1 = 0.5``), the same rules as Python's ``**``;
* functions ``sqrt log exp abs`` (one argument; ``log`` is natural), ``pow`` (two), ``max min``
  (two or more) and ``sum(expr)``, which adds ``expr`` up over the items of the batch and cannot be
  nested;
* per-request variables ``inputTokens hitCacheTokens computeTokens hasHitCache`` (``computeTokens``
  is input minus hit tokens, ``hasHitCache`` is 1 when the request hit the cache, else 0);
* batch variables ``batchSize totalInputTokens totalComputeTokens maxInputTokens
  maxComputeTokens``.

Outside ``sum()`` the per-request variables stand for the whole batch: ``inputTokens`` is
``totalInputTokens``, ``hitCacheTokens`` the total hit tokens, ``computeTokens``
``totalComputeTokens``, and ``hasHitCache`` is 1 when any item hit the cache. A formula written for
one request, like ``0.1*computeTokens``, therefore extends to batches without edits, and for a
batch of one every variable is exactly its per-request value, so ``predict_one`` and a one-item
``predict_batch`` agree. (Per-request costs that are not linear, such as attention's square term,
belong inside ``sum()`` when batches matter: outside it they square the batch total.)

Callers pass ``0 <= hit_tokens <= input_tokens``; items are not validated on the hot path.

Errors
------
Bad text raises FormulaError at compile time, carrying the 0-based character position, so a config
error points at the offending character. Evaluation never returns nan or inf: division by zero,
``log``/``sqrt``/``pow`` outside their domain and numeric overflow raise FormulaEvalError, because a
silently infinite batch time would corrupt the scheduler's arithmetic far from its cause.
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
import operator
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "DEFAULT_PREFILL_FORMULA",
    "UPSTREAM_FITTED_FORMULA",
    "BatchItem",
    "Formula",
    "FormulaError",
    "FormulaEvalError",
    "compile_formula",
]

# The `llama3.1-8b-h100` roofline of docs/engine-model.md in formula form (within ~1 % of it):
# 7 ms per batch, 29.5 us per computed token, and causal attention over the cached prefix.
DEFAULT_PREFILL_FORMULA = (
    "7 + sum(0.0295*computeTokens + 0.000000482*computeTokens*(computeTokens + 2*hitCacheTokens))"
)

# The shape upstream fitted to measured batches: a fixed launch cost, a slowly growing per-batch
# overhead, and per-request linear plus attention-square terms.
UPSTREAM_FITTED_FORMULA = "245 + 37*log(batchSize + 1) + sum(0.028*computeTokens + 1.3e-6*computeTokens^2)"

# Results are memoised per Formula, at most this many per table. Only batches up to
# _CACHE_MAX_ITEMS items are memoised: for longer ones hashing the key costs about as much as
# evaluating, and long keys would make the table's memory large.
_RESULT_CACHE_SIZE = 65536
_CACHE_MAX_ITEMS = 16

# Guards that turn pathological input into a FormulaError instead of a RecursionError from the
# parser or from Python's compiler. Real formulas stay far below both.
_MAX_NESTING = 100
_MAX_DEPTH = 200

# ``x^2``-style powers (a small positive integer literal exponent, and no power inside the base)
# compile to Python's ``**``: exact on integer token counts and no call overhead. Anything else goes
# through _pow, which works in floats, so nested powers such as ``((x^9)^9)^9`` overflow promptly
# instead of building integers with millions of digits.
_MAX_INLINE_EXPONENT = 4


class BatchItem(NamedTuple):
    """Just the two counts the cost model reads, so a batch is a cheap, hashable memo key."""

    input_tokens: int
    hit_tokens: int


class FormulaError(ValueError):
    """A ValueError carrying the 0-based offset, so config tooling can point at the bad character."""

    position: int
    reason: str

    def __init__(self, position: int, reason: str) -> None:
        # Both values go to args so the exception pickles and compares like any other.
        super().__init__(position, reason)
        self.position = position
        self.reason = reason

    def __str__(self) -> str:
        return f"formula error at position {self.position}: {self.reason}"


class FormulaEvalError(ArithmeticError):
    """Raised instead of returning nan/inf, so a formula that breaks on some input fails loudly there."""

    reason: str
    source: str | None

    def __init__(self, reason: str, source: str | None = None) -> None:
        super().__init__(reason, source)
        self.reason = reason
        self.source = source

    def __str__(self) -> str:
        if self.source is None:
            return self.reason
        return f"cannot evaluate formula {self.source!r}: {self.reason}"


# --------------------------------------------------------------------------------------------------
# Names. Each per-request variable maps to the generated local that holds its batch-level value
# (outside sum) and its per-item value (inside sum).

_REQUEST_VARS: dict[str, tuple[str, str]] = {
    "inputTokens": ("ti", "i"),
    "hitCacheTokens": ("th", "h"),
    "computeTokens": ("tc", "c"),
    "hasHitCache": ("ah", "hc"),
}
_BATCH_VARS: dict[str, str] = {
    "batchSize": "n",
    "totalInputTokens": "ti",
    "totalComputeTokens": "tc",
    "maxInputTokens": "mi",
    "maxComputeTokens": "mc",
}
_VARIABLES = frozenset(_REQUEST_VARS) | frozenset(_BATCH_VARS)

# name -> (fewest args, most args or None for unbounded)
_FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "sqrt": (1, 1),
    "log": (1, 1),
    "exp": (1, 1),
    "abs": (1, 1),
    "pow": (2, 2),
    "max": (2, None),
    "min": (2, None),
    "sum": (1, 1),
}


def _hint(name: str, known: Collection[str]) -> str:
    """Suggest the intended name; most typos in practice are case slips like ``inputtokens``."""
    for candidate in known:
        if candidate.lower() == name.lower():
            return f" (did you mean {candidate!r}?)"
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------------
# Lexer


class _Tok(NamedTuple):
    kind: str  # "num", "name", "op" (operators, parentheses, comma) or "end"
    text: str
    pos: int
    value: int | float = 0


_TOKEN_RE = re.compile(
    r"(?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>[-+*/^(),])"
)
# Characters that may not directly follow a number: "1.2.3", "1e", "2x" are typos, not products.
_NUMBER_TAIL_RE = re.compile(r"[A-Za-z0-9_.]+")


def _number(text: str, pos: int) -> int | float:
    """Keep integer literals as ints so arithmetic on token counts stays exact."""
    if any(ch in text for ch in ".eE"):
        value: int | float = float(text)
        if math.isinf(value):
            raise FormulaError(pos, f"number {text!r} is out of range")
        return value
    # int() refuses very long digit strings outright; anything past float range is useless anyway.
    if len(text.lstrip("0")) > 310 or int(text) > sys.float_info.max:
        raise FormulaError(pos, f"number {text!r} is out of range")
    return int(text)


def _tokenize(src: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    size = len(src)
    while pos < size:
        ch = src[pos]
        if ch.isspace():
            pos += 1
            continue
        match = _TOKEN_RE.match(src, pos)
        if match is None:
            raise FormulaError(pos, f"unexpected character {ch!r}")
        kind = match.lastgroup or ""
        text = match.group()
        value: int | float = 0
        if kind == "num":
            tail = _NUMBER_TAIL_RE.match(src, match.end())
            if tail is not None:
                raise FormulaError(pos, f"malformed number {src[pos : tail.end()]!r}")
            value = _number(text, pos)
        toks.append(_Tok(kind, text, pos, value))
        pos = match.end()
    toks.append(_Tok("end", "", size))
    return toks


# --------------------------------------------------------------------------------------------------
# Parse tree


@dataclass(frozen=True, slots=True)
class _Num:
    value: int | float
    pos: int
    depth: int = 1


@dataclass(frozen=True, slots=True)
class _Var:
    name: str
    pos: int
    depth: int = 1


@dataclass(frozen=True, slots=True)
class _Neg:
    operand: _Node
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class _Bin:
    op: str
    left: _Node
    right: _Node
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class _Call:
    name: str
    args: tuple[_Node, ...]
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class _Sum:
    body: _Node
    pos: int
    depth: int


_Node = _Num | _Var | _Neg | _Bin | _Call | _Sum


class _Parser:
    """Recursive descent, one method per level: expr := term (+|- term)*; term := unary (*|/ unary)*;
    unary := (-|+) unary | power; power := primary [^ unary]; primary := number | name | call | (expr).
    Putting ``unary`` (not ``power``) right of ``^`` gives right associativity and ``2^-1``."""

    def __init__(self, src: str) -> None:
        self._toks = _tokenize(src)
        self._i = 0
        self._nesting = 0
        self._sum_pos: int | None = None
        self.uses_sum = False

    def parse(self) -> _Node:
        if self._toks[0].kind == "end":
            raise FormulaError(0, "empty formula")
        node = self._expr()
        tok = self._peek()
        if tok.kind != "end":
            if tok.text == ")":
                raise FormulaError(tok.pos, "unmatched ')'")
            raise FormulaError(
                tok.pos, f"unexpected {tok.text!r}; expected an operator or the end of the formula"
            )
        return node

    # -- token helpers

    def _peek(self) -> _Tok:
        return self._toks[self._i]

    def _next(self) -> _Tok:
        tok = self._toks[self._i]
        if tok.kind != "end":
            self._i += 1
        return tok

    def _at(self, text: str) -> bool:
        tok = self._toks[self._i]
        return tok.kind == "op" and tok.text == text

    @contextmanager
    def _nested(self, pos: int) -> Iterator[None]:
        self._nesting += 1
        if self._nesting > _MAX_NESTING:
            raise FormulaError(pos, f"formula is nested too deeply (more than {_MAX_NESTING} levels)")
        try:
            yield
        finally:
            self._nesting -= 1

    @staticmethod
    def _depth(depth: int, pos: int) -> int:
        if depth > _MAX_DEPTH:
            raise FormulaError(pos, f"formula is too complex (more than {_MAX_DEPTH} nested operations)")
        return depth

    def _close(self, opener: _Tok, what: str, expected: str) -> None:
        tok = self._peek()
        if tok.kind == "op" and tok.text == ")":
            self._next()
            return
        if tok.kind == "end":
            raise FormulaError(tok.pos, f"missing ')' to close {what} at position {opener.pos}")
        raise FormulaError(tok.pos, f"expected {expected}, found {tok.text!r}")

    # -- grammar

    def _binary(self, op: _Tok, left: _Node, right: _Node) -> _Bin:
        return _Bin(op.text, left, right, op.pos, self._depth(max(left.depth, right.depth) + 1, op.pos))

    def _expr(self) -> _Node:
        node = self._term()
        while self._at("+") or self._at("-"):
            op = self._next()
            node = self._binary(op, node, self._term())
        return node

    def _term(self) -> _Node:
        node = self._unary()
        while self._at("*") or self._at("/"):
            op = self._next()
            node = self._binary(op, node, self._unary())
        return node

    def _unary(self) -> _Node:
        tok = self._peek()
        if tok.kind == "op" and tok.text in ("-", "+"):
            self._next()
            with self._nested(tok.pos):
                operand = self._unary()
            if tok.text == "+":
                return operand
            return _Neg(operand, tok.pos, self._depth(operand.depth + 1, tok.pos))
        return self._power()

    def _power(self) -> _Node:
        base = self._primary()
        if self._at("^"):
            op = self._next()
            with self._nested(op.pos):
                exponent = self._unary()
            return self._binary(op, base, exponent)
        return base

    def _primary(self) -> _Node:
        tok = self._next()
        if tok.kind == "num":
            return _Num(tok.value, tok.pos)
        if tok.kind == "name":
            return self._name(tok)
        if tok.text == "(":
            with self._nested(tok.pos):
                node = self._expr()
            self._close(tok, "'('", "')' or an operator")
            return node
        if tok.kind == "end":
            raise FormulaError(tok.pos, "unexpected end of formula")
        if tok.text == "*" and self._toks[self._i - 2].text == "*":
            raise FormulaError(tok.pos, "unexpected '*' (use '^' for powers)")
        raise FormulaError(tok.pos, f"unexpected {tok.text!r}")

    def _name(self, tok: _Tok) -> _Node:
        name = tok.text
        if self._at("("):
            if name in _FUNCTIONS:
                return self._call(tok)
            if name in _VARIABLES:
                raise FormulaError(tok.pos, f"{name!r} is a variable, not a function")
            raise FormulaError(tok.pos, f"unknown function {name!r}" + _hint(name, _FUNCTIONS))
        if name in _VARIABLES:
            return _Var(name, tok.pos)
        if name in _FUNCTIONS:
            raise FormulaError(tok.pos, f"{name!r} is a function; call it as {name}(...)")
        raise FormulaError(tok.pos, f"unknown variable {name!r}" + _hint(name, _VARIABLES))

    def _call(self, name_tok: _Tok) -> _Node:
        name = name_tok.text
        is_sum = name == "sum"
        if is_sum:
            if self._sum_pos is not None:
                raise FormulaError(
                    name_tok.pos,
                    f"nested sum() is not allowed (already inside the sum() at position {self._sum_pos})",
                )
            self._sum_pos = name_tok.pos
            self.uses_sum = True
        opener = self._next()
        args: list[_Node] = []
        with self._nested(opener.pos):
            if not self._at(")"):
                args.append(self._expr())
                while self._at(","):
                    self._next()
                    args.append(self._expr())
        self._close(opener, f"'{name}('", f"',' or ')' in {name}()")
        if is_sum:
            self._sum_pos = None

        lo, hi = _FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            if hi is None:
                wanted = f"at least {lo} arguments"
            else:
                wanted = f"exactly {lo} argument" + ("s" if lo != 1 else "")
            raise FormulaError(name_tok.pos, f"{name}() takes {wanted} (got {len(args)})")
        depth = self._depth(max(arg.depth for arg in args) + 1, name_tok.pos)
        if is_sum:
            return _Sum(args[0], name_tok.pos, depth)
        return _Call(name, tuple(args), name_tok.pos, depth)


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

_BatchFn = Callable[[Sequence[tuple[int, int]]], float]
_OneFn = Callable[[int, int], float]
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

    def expr(self, node: _Node, in_sum: bool) -> ast.expr:
        return _fold(self._expr(node, in_sum))

    def _expr(self, node: _Node, in_sum: bool) -> ast.expr:
        match node:
            case _Num(value=value):
                return ast.Constant(value)
            case _Var(name=name):
                return self._var(name, in_sum)
            case _Neg(operand=operand):
                return ast.UnaryOp(ast.USub(), self.expr(operand, in_sum))
            case _Bin(op=op, left=left, right=right):
                return self._binary(op, left, right, in_sum)
            case _Call(name=name, args=args):
                return _call(name, [self.expr(arg, in_sum) for arg in args])
            case _Sum(body=body):
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
        if name in _REQUEST_VARS:
            outside, inside = _REQUEST_VARS[name]
            if in_sum:
                self.item_locals.add(inside)
                return ast.Name(inside, ast.Load())
            local = outside
        else:
            local = _BATCH_VARS[name]
            if in_sum:
                self.sum_batch_locals.add(local)
        self.batch_locals.add(local)
        return ast.Name(local, ast.Load())

    def _binary(self, op: str, left: _Node, right: _Node, in_sum: bool) -> ast.expr:
        lhs = self.expr(left, in_sum)
        rhs = self.expr(right, in_sum)
        if op == "/":
            if isinstance(right, _Num) and right.value != 0:
                return ast.BinOp(lhs, ast.Div(), rhs)
            return _call("_div", [lhs, rhs])
        if op == "^":
            if (
                isinstance(right, _Num)
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

    def one_item_function(self, top: _Node) -> ast.FunctionDef:
        ret = ast.Return(self.expr(top, in_sum=False))
        return _function("def _predict_one(i, h):\n    pass", [*self._item_prelude(), ret])

    def batch_function(self, top: _Node) -> ast.FunctionDef:
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


def _generate(tree: _Node, source: str) -> tuple[_BatchFn, _OneFn]:
    module = ast.Module(
        [_CodeGen(one_item=False).batch_function(tree), _CodeGen(one_item=True).one_item_function(tree)], []
    )
    code = compile(ast.fix_missing_locations(module), f"<formula {source[:60]!r}>", "exec")
    namespace: dict[str, object] = {"__builtins__": {}, "len": len, **_RUNTIME}
    exec(code, namespace)
    return namespace["_predict"], namespace["_predict_one"]  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Public API


class Formula:
    """A compiled formula; prefer compile_formula(), which shares one instance per source text."""

    __slots__ = ("_batch_memo", "_one_memo", "_predict", "_predict_one", "source", "uses_sum")

    source: str
    uses_sum: bool

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise TypeError(f"formula source must be str, not {type(source).__name__}")
        parser = _Parser(source)
        tree = parser.parse()
        self.source = source
        self.uses_sum = parser.uses_sum
        self._predict, self._predict_one = _generate(tree, source)
        # Memo tables keyed by value. A dict emptied when full rather than functools.lru_cache: hits
        # cost the same, and misses (common when every request has a new length) cost far less
        # without the LRU bookkeeping. Entries refill within a few calls after a clear.
        self._one_memo: dict[tuple[int, int], float] = {}
        self._batch_memo: dict[tuple[tuple[int, int], ...], float] = {}

    def predict_batch(self, items: Sequence[BatchItem]) -> float:
        """Milliseconds to prefill ``items`` as one batch; an empty batch costs nothing."""
        count = len(items)
        if count == 1:
            input_tokens, hit_tokens = items[0]
            return self.predict_one(input_tokens, hit_tokens)
        if count == 0:
            return 0.0
        if count > _CACHE_MAX_ITEMS:
            return self._evaluate(items)
        key = items if type(items) is tuple else tuple(items)
        memo = self._batch_memo
        try:
            result = memo.get(key)
        except TypeError:
            # Unhashable items (lists rather than tuples) still get an answer, just not memoised.
            return self._evaluate(items)
        if result is None:
            result = self._evaluate(key)
            if len(memo) >= _RESULT_CACHE_SIZE:
                memo.clear()
            memo[key] = result
        return result

    def predict_one(self, input_tokens: int, hit_tokens: int) -> float:
        """Milliseconds to prefill one request alone; equal to a one-item predict_batch."""
        key = (input_tokens, hit_tokens)
        memo = self._one_memo
        result = memo.get(key)
        if result is None:
            result = self._evaluate_one(input_tokens, hit_tokens)
            if len(memo) >= _RESULT_CACHE_SIZE:
                memo.clear()
            memo[key] = result
        return result

    def _evaluate(self, items: Sequence[tuple[int, int]]) -> float:
        try:
            result = float(self._predict(items))
        except (FormulaEvalError, ZeroDivisionError, OverflowError) as exc:
            raise self._eval_error(exc) from exc
        if not math.isfinite(result):
            raise FormulaEvalError(f"numeric overflow (result is {result!r})", self.source)
        return result

    def _evaluate_one(self, input_tokens: int, hit_tokens: int) -> float:
        try:
            result = float(self._predict_one(input_tokens, hit_tokens))
        except (FormulaEvalError, ZeroDivisionError, OverflowError) as exc:
            raise self._eval_error(exc) from exc
        if not math.isfinite(result):
            raise FormulaEvalError(f"numeric overflow (result is {result!r})", self.source)
        return result

    def _eval_error(self, exc: ArithmeticError) -> FormulaEvalError:
        """Name the formula in the error: the helpers that raise do not know which one they run."""
        if isinstance(exc, FormulaEvalError):
            return FormulaEvalError(exc.reason, self.source)
        if isinstance(exc, ZeroDivisionError):
            return FormulaEvalError("division by zero", self.source)
        return FormulaEvalError("numeric overflow", self.source)

    def __repr__(self) -> str:
        return f"Formula({self.source!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Formula):
            return NotImplemented
        return self.source == other.source

    def __hash__(self) -> int:
        return hash((Formula, self.source))

    def __reduce__(self) -> tuple[Callable[[str], Formula], tuple[str]]:
        # The compiled function cannot be pickled; recompiling from source can (simulator workers).
        return compile_formula, (self.source,)


@functools.lru_cache(maxsize=1024)
def compile_formula(src: str) -> Formula:
    """Parse and compile ``src`` once; later calls with the same text return the same Formula."""
    return Formula(src)
