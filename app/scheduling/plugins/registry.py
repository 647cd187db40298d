"""The plugin registry: extension points, the plugin interfaces, typed factories and discovery.

A scheduling *policy* (`app.scheduling.policy`) runs, per request:

1. the role's fit filter (``prefill_fit`` or ``decode_fit``, always first: every policy must agree on
   which workers may take a request), then the policy's declared *filters* in order; each returns a
   subset of the candidates or raises `NoWorker` naming itself;
2. its *scorers*: each gives every candidate a raw value in its own unit and declares its sense
   (``min``: lower is better, ``max``: higher is better); the policy ranks by the utility
   Σ weight × (value if sense is max else −value);
3. its *picker*, which turns the utilities into one candidate (best within a tie band, random,
   round robin).

Plugins are pure (no I/O, no clock, randomness only from the ``rng`` they are handed) so the gateway
and the simulator run the same code. A plugin module calls `register` at import; `load_plugins`
imports every module of the three plugin packages once, lazily, on the first lookup, so nothing
imports a plugin for its side effect and no module imports the registry's users (no cycle).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from app.scheduling.formula import Formula
from app.scheduling.routing import WorkerView

__all__ = [
    "EXTENSION_POINTS",
    "BuildContext",
    "Candidates",
    "Filter",
    "Picker",
    "Plugin",
    "PluginSpec",
    "Scorer",
    "build",
    "get",
    "load_plugins",
    "names",
    "register",
]

Kind = Literal["filter", "scorer", "picker"]
EXTENSION_POINTS: tuple[Kind, ...] = ("filter", "scorer", "picker")
_PACKAGES = {"filter": "filters", "scorer": "scorers", "picker": "pickers"}


@dataclass(slots=True)
class Candidates:
    """The workers still in the running, with what the fit filter measured for each.

    ``hits`` (prefill: cached tokens each would reuse) and ``heads`` (decode: KV headroom in tokens)
    are parallel to ``workers``; the one a role does not use is empty. A filter that narrows the field
    returns a new `Candidates` with all three lists cut the same way. ``reason`` is a fixed label a
    filter may set to explain the choice (it becomes `Choice.reason`).
    """

    workers: list[WorkerView]
    hits: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    reason: str = ""

    def keep(self, idx: Sequence[int], reason: str | None = None) -> Candidates:
        """The candidates at ``idx`` (in that order), with ``reason`` if given."""
        return Candidates(
            [self.workers[i] for i in idx],
            [self.hits[i] for i in idx] if self.hits else [],
            [self.heads[i] for i in idx] if self.heads else [],
            self.reason if reason is None else reason,
        )


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a factory may use besides its own parameters: the gateway's compiled prefill formula
    (None where none is configured) and a way to build another plugin (a picker's tie-breakers)."""

    formula: Formula | None = None
    role: str = ""

    def scorer(self, name: str) -> Scorer:
        return build("scorer", name, self, {})  # type: ignore[return-value]


class Filter(Protocol):
    """Returns the subset of ``c`` that may take the request, in the same order; raises `NoWorker`
    (naming what it checks) rather than return an empty field."""

    name: str

    def apply(self, q: Any, c: Candidates) -> Candidates: ...


class Scorer(Protocol):
    """One raw value per candidate, in the scorer's own unit; ``sense`` says which way is better."""

    name: str
    sense: Literal["min", "max"]

    def score(self, q: Any, c: Candidates) -> list[float]: ...


class Picker(Protocol):
    """Index of the chosen candidate and whether it was drawn among several near-equal ones.

    ``utils`` holds the policy's combined utilities (higher is better), None for a policy without
    scorers; ``sign`` (+1 or −1) turns a utility back into the first scorer's sense, so a band can be
    a fraction of that value (a cost band is a fraction of the lowest cost). Consumes ``rng`` only
    for a real draw."""

    name: str

    def pick(
        self, q: Any, c: Candidates, utils: list[float] | None, sign: float, rng: random.Random
    ) -> tuple[int, bool]: ...


class Plugin:
    """Base of every plugin class: `register` sets ``name``; one without parameters is built from
    the context alone (this constructor)."""

    __slots__ = ()
    name: ClassVar[str] = ""

    def __init__(self, ctx: BuildContext) -> None:
        del ctx


@dataclass(frozen=True)
class PluginSpec:
    """A registered plugin: its extension point, name, roles it applies to, factory and the typed
    parameters the factory accepts (name → default), read from the factory's signature."""

    kind: Kind
    name: str
    roles: tuple[str, ...]
    factory: Callable[..., Any]
    params: Mapping[str, Any]
    summary: str


_REGISTRY: dict[tuple[Kind, str], PluginSpec] = {}
_loaded = False


def register(
    kind: Kind, name: str, roles: tuple[str, ...] = ("prefill", "decode")
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class decorator: register ``factory(ctx, **params)`` as plugin ``name`` of ``kind``.

    Parameters are the factory's keyword-only arguments after ``ctx``, each with a default; a name
    registered twice is a programming error (two modules claiming one name)."""
    if kind not in EXTENSION_POINTS:
        raise ValueError(f"unknown extension point {kind!r}")

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        if (kind, name) in _REGISTRY:
            raise ValueError(f"{kind} {name!r} registered twice")
        sig = inspect.signature(factory)
        params = {
            p.name: p.default
            for p in sig.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "ctx"
        }
        doc = (inspect.getdoc(factory) or "").split("\n\n", 1)[0].replace("\n", " ")
        if isinstance(factory, type):
            factory.name = name  # type: ignore[attr-defined]
        _REGISTRY[(kind, name)] = PluginSpec(kind, name, roles, factory, params, doc)
        return factory

    return deco


def load_plugins() -> None:
    """Import every plugin module once (each registers itself). Idempotent and cheap after the first
    call; called by every lookup, so callers never import plugin modules themselves."""
    global _loaded
    if _loaded:
        return
    for kind in EXTENSION_POINTS:
        pkg = importlib.import_module(f"{__package__}.{_PACKAGES[kind]}")
        for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
            importlib.import_module(f"{pkg.__name__}.{mod}")
    _loaded = True


def get(kind: Kind, name: str) -> PluginSpec:
    """The plugin ``name`` of ``kind``; an unknown name is a ValueError listing the known ones."""
    load_plugins()
    spec = _REGISTRY.get((kind, name))
    if spec is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(names(kind))}")
    return spec


def names(kind: Kind, role: str | None = None) -> list[str]:
    """Registered plugin names of ``kind`` (for ``role`` when given), sorted."""
    load_plugins()
    return sorted(n for (k, n), s in _REGISTRY.items() if k == kind and (role is None or role in s.roles))


def build(kind: Kind, name: str, ctx: BuildContext, params: Mapping[str, Any]) -> Any:
    """An instance of plugin ``name`` with ``params`` over its defaults. An unknown parameter is a
    TypeError naming the plugin's parameters; a plugin used for a role it does not serve, a
    ValueError."""
    spec = get(kind, name)
    if ctx.role and ctx.role not in spec.roles:
        raise ValueError(f"{kind} {name!r} does not apply to {ctx.role} (only {', '.join(spec.roles)})")
    unknown = sorted(set(params) - set(spec.params))
    if unknown:
        known = ", ".join(sorted(spec.params)) or "none"
        raise TypeError(f"{kind} {name!r} has no parameter {', '.join(unknown)} (parameters: {known})")
    return spec.factory(ctx, **params)
