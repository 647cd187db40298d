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

Modules: `formula_parse` (errors, lexer, parse tree, parser), `formula_compile` (parse tree → Python
code, the runtime helpers) and this one (the public API: `Formula`, the memoised batch predictor).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from app.scheduling.formula_compile import generate
from app.scheduling.formula_parse import FormulaError, FormulaEvalError, Parser

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

# Results are memoised per Formula, at most this many per table (a full table is cleared). Only
# batches up to _CACHE_MAX_ITEMS items are memoised: for longer ones hashing the key costs about as
# much as evaluating, and long keys would make the table's memory large. Why so few: with unique
# prompt lengths almost every batch is a new key, so a large table only fills. At 65,536 entries a
# gateway's batch table filled for an hour at 50 req/s (43 MiB); at 4,096 it still filled for
# ~45 minutes (~830 bytes an entry, ~4 %/h of a gateway's RSS in the soak, docs/reliability.md).
# The reuse that matters — one decision pricing the same candidate batches — is a few entries.
_RESULT_CACHE_SIZE = 256
_CACHE_MAX_ITEMS = 16


class BatchItem(NamedTuple):
    """Just the two counts the cost model reads, so a batch is a cheap, hashable memo key."""

    input_tokens: int
    hit_tokens: int


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
        parser = Parser(source)
        tree = parser.parse()
        self.source = source
        self.uses_sum = parser.uses_sum
        self._predict, self._predict_one = generate(tree, source)
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
