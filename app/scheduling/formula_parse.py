"""The formula language's front end: errors, names, lexer, parse tree and the recursive-descent
parser (the language itself is described in `app.scheduling.formula`).

User text only ever reaches this module as data: it is tokenised and parsed into a closed set of
frozen nodes (`Num`, `Var`, `Neg`, `Bin`, `Call`, `Sum`), which `formula_compile` turns into code.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "BATCH_VARS",
    "FUNCTIONS",
    "REQUEST_VARS",
    "Bin",
    "Call",
    "FormulaError",
    "FormulaEvalError",
    "Neg",
    "Node",
    "Num",
    "Parser",
    "Sum",
    "Var",
]

# Guards that turn pathological input into a FormulaError instead of a RecursionError from the
# parser or from Python's compiler. Real formulas stay far below both.
MAX_NESTING = 100
MAX_DEPTH = 200


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

REQUEST_VARS: dict[str, tuple[str, str]] = {
    "inputTokens": ("ti", "i"),
    "hitCacheTokens": ("th", "h"),
    "computeTokens": ("tc", "c"),
    "hasHitCache": ("ah", "hc"),
}
BATCH_VARS: dict[str, str] = {
    "batchSize": "n",
    "totalInputTokens": "ti",
    "totalComputeTokens": "tc",
    "maxInputTokens": "mi",
    "maxComputeTokens": "mc",
}
_VARIABLES = frozenset(REQUEST_VARS) | frozenset(BATCH_VARS)

# name -> (fewest args, most args or None for unbounded)
FUNCTIONS: dict[str, tuple[int, int | None]] = {
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
class Num:
    value: int | float
    pos: int
    depth: int = 1


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    pos: int
    depth: int = 1


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Node
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class Bin:
    op: str
    left: Node
    right: Node
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    args: tuple[Node, ...]
    pos: int
    depth: int


@dataclass(frozen=True, slots=True)
class Sum:
    body: Node
    pos: int
    depth: int


Node = Num | Var | Neg | Bin | Call | Sum


class Parser:
    """Recursive descent, one method per level: expr := term (+|- term)*; term := unary (*|/ unary)*;
    unary := (-|+) unary | power; power := primary [^ unary]; primary := number | name | call | (expr).
    Putting ``unary`` (not ``power``) right of ``^`` gives right associativity and ``2^-1``."""

    def __init__(self, src: str) -> None:
        self._toks = _tokenize(src)
        self._i = 0
        self._nesting = 0
        self._sum_pos: int | None = None
        self.uses_sum = False

    def parse(self) -> Node:
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
        if self._nesting > MAX_NESTING:
            raise FormulaError(pos, f"formula is nested too deeply (more than {MAX_NESTING} levels)")
        try:
            yield
        finally:
            self._nesting -= 1

    @staticmethod
    def _depth(depth: int, pos: int) -> int:
        if depth > MAX_DEPTH:
            raise FormulaError(pos, f"formula is too complex (more than {MAX_DEPTH} nested operations)")
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

    def _binary(self, op: _Tok, left: Node, right: Node) -> Bin:
        return Bin(op.text, left, right, op.pos, self._depth(max(left.depth, right.depth) + 1, op.pos))

    def _expr(self) -> Node:
        node = self._term()
        while self._at("+") or self._at("-"):
            op = self._next()
            node = self._binary(op, node, self._term())
        return node

    def _term(self) -> Node:
        node = self._unary()
        while self._at("*") or self._at("/"):
            op = self._next()
            node = self._binary(op, node, self._unary())
        return node

    def _unary(self) -> Node:
        tok = self._peek()
        if tok.kind == "op" and tok.text in ("-", "+"):
            self._next()
            with self._nested(tok.pos):
                operand = self._unary()
            if tok.text == "+":
                return operand
            return Neg(operand, tok.pos, self._depth(operand.depth + 1, tok.pos))
        return self._power()

    def _power(self) -> Node:
        base = self._primary()
        if self._at("^"):
            op = self._next()
            with self._nested(op.pos):
                exponent = self._unary()
            return self._binary(op, base, exponent)
        return base

    def _primary(self) -> Node:
        tok = self._next()
        if tok.kind == "num":
            return Num(tok.value, tok.pos)
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

    def _name(self, tok: _Tok) -> Node:
        name = tok.text
        if self._at("("):
            if name in FUNCTIONS:
                return self._call(tok)
            if name in _VARIABLES:
                raise FormulaError(tok.pos, f"{name!r} is a variable, not a function")
            raise FormulaError(tok.pos, f"unknown function {name!r}" + _hint(name, FUNCTIONS))
        if name in _VARIABLES:
            return Var(name, tok.pos)
        if name in FUNCTIONS:
            raise FormulaError(tok.pos, f"{name!r} is a function; call it as {name}(...)")
        raise FormulaError(tok.pos, f"unknown variable {name!r}" + _hint(name, _VARIABLES))

    def _call(self, name_tok: _Tok) -> Node:
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
        args: list[Node] = []
        with self._nested(opener.pos):
            if not self._at(")"):
                args.append(self._expr())
                while self._at(","):
                    self._next()
                    args.append(self._expr())
        self._close(opener, f"'{name}('", f"',' or ')' in {name}()")
        if is_sum:
            self._sum_pos = None

        lo, hi = FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            if hi is None:
                wanted = f"at least {lo} arguments"
            else:
                wanted = f"exactly {lo} argument" + ("s" if lo != 1 else "")
            raise FormulaError(name_tok.pos, f"{name}() takes {wanted} (got {len(args)})")
        depth = self._depth(max(arg.depth for arg in args) + 1, name_tok.pos)
        if is_sum:
            return Sum(args[0], name_tok.pos, depth)
        return Call(name, tuple(args), name_tok.pos, depth)
