"""Policies: a named composition of plugins (filters + weighted scorers + picker + batching mode).

A policy is data (`PolicyDef`); `PolicyBook` holds the built-in ones (the strategies FlexLB has
always had, expressed with plugins and giving the same decisions) plus any declared in the settings
(``FLEXLB_POLICIES``, JSON) or at runtime (``PUT /admin/config`` ``policies``, stored in Redis and
applied by every replica: `runtime_book`); `Policy` is one built instance, with its own picker state, that the
gateway and the simulator call per request. A declared policy looks like::

    {"cost_sticky": {"role": "prefill",
                     "filters": ["hotspot"],
                     "scorers": {"predicted_finish_ms": 1.0, "cache_hit_tokens": 0.01},
                     "picker": {"name": "best", "tie_pct": 0.1, "tie_abs": 20},
                     "batching": "direct"}}

``filters`` are names or {"name": ..., params}; ``scorers`` map a name to a weight (or list
{"name", "weight", params}); ``picker`` is a name or {"name", params}; ``batching`` (optional) is
the owner's batching mode while the policy is selected (fixed_window, slo or direct; live unless
the runtime config sets ``schedule_mode``/``batch_algorithm``, in the simulator unless
``NAME@BATCHING``). The role's fit filter runs first in every policy. Plugins and their
formulas: app/scheduling/plugins/*/README.md.
The definitions' data type and the built-in catalogue (with the measurements behind its weights)
are in app/scheduling/policy_defs.py; this module builds and runs them.

Determinism contract (as before): the same query, worker sequence, picker state and ``rng`` state
give the same `Choice` and leave ``rng`` in the same state; ties are broken over the tied workers
sorted by id, so a scored choice depends on the set of workers, not on the order of the snapshot.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.scheduling.formula import Formula
from app.scheduling.plugins import registry
from app.scheduling.plugins.registry import BuildContext, Candidates, Filter, Picker, Scorer
from app.scheduling.policy_defs import (
    BATCHING_MODES,
    BUILTIN_POLICIES,
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    PEER_IMITATIONS,
    ROLES,
    Params,
    PolicyDef,
    batching_config,
)
from app.scheduling.routing import (
    DECODE,
    PREFILL,
    Choice,
    DecodeQuery,
    NoWorker,
    WorkerView,
    decode_headroom,
)

__all__ = [
    "BATCHING_MODES",
    "DECODE",
    "DEFAULT_DECODE_POLICY",
    "DEFAULT_PREFILL_POLICY",
    "PEER_IMITATIONS",
    "PREFILL",
    "Policy",
    "PolicyBook",
    "PolicyDef",
    "batching_config",
    "make_decode_policy",
    "make_prefill_policy",
    "runtime_book",
]

_FIT = {PREFILL: "prefill_fit", DECODE: "decode_fit"}


class Policy:
    """One built policy: runs fit filter → filters → scorers → picker and returns a `Choice`.

    ``Choice.score`` is the combined score in the first scorer's unit and sense (cost in ms, headroom
    in tokens; the decode fit's headroom, or 0 for prefill, when there is no scorer); ``reason`` is the
    policy's name, ``near_tie`` when the picker drew among a band, or a filter's label (``prefix``)."""

    __slots__ = (
        "batching",
        "definition",
        "filters",
        "fit",
        "formula",
        "name",
        "peer",
        "picker",
        "role",
        "scorers",
        "sign",
    )

    def __init__(self, d: PolicyDef, formula: Formula | None = None) -> None:
        d.validate()
        ctx = BuildContext(formula, d.role)
        self.definition = d
        self.name = d.name
        self.role = d.role
        self.batching = d.batching
        self.formula = formula
        self.fit: Filter = registry.build("filter", _FIT[d.role], ctx, {})
        self.filters: tuple[Filter, ...] = tuple(registry.build("filter", n, ctx, p) for n, p in d.filters)
        self.scorers: tuple[tuple[Scorer, float, float], ...] = tuple(
            (s, w, 1.0 if s.sense == "max" else -1.0)
            for s, w in ((registry.build("scorer", n, ctx, p), w) for n, w, p in d.scorers)
        )
        self.picker: Picker = registry.build("picker", d.picker[0], ctx, d.picker[1])
        self.sign = self.scorers[0][2] if self.scorers else 1.0
        # A peer router imitation: drivers run it without FlexLB's SLO admission.
        self.peer = bool(getattr(self.picker, "peer", False))

    def finished(self, worker_id: str, q: Any) -> None:
        """A prefill this policy routed (query ``q``) has finished on ``worker_id``: pickers that
        count their own requests in flight (the peer imitations) take it off."""
        done = getattr(self.picker, "finished", None)
        if done is not None:
            done(worker_id, q)

    def _utils(self, q: Any, c: Candidates) -> list[float] | None:
        if not self.scorers:
            return None
        s, w, sg = self.scorers[0]
        vals = s.score(q, c)
        utils = [w * v for v in vals] if sg > 0 else [-(w * v) for v in vals]
        for s, w, sg in self.scorers[1:]:
            f = sg * w
            utils = [u + f * v for u, v in zip(utils, s.score(q, c), strict=True)]
        return utils

    def choose(self, q: Any, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        c = self.fit.apply(q, Candidates(workers))  # type: ignore[arg-type]
        for f in self.filters:
            c = f.apply(q, c)
        utils = self._utils(q, c)
        i, near = self.picker.pick(q, c, utils, self.sign, rng)
        reason = "near_tie" if near else (c.reason or self.name)
        score = self.sign * utils[i] if utils is not None else float(c.heads[i]) if c.heads else 0.0
        wid = c.workers[i].id
        if self.role == DECODE:
            return Choice(wid, score=score, reason=reason)
        hit = c.hits[i]
        predicted = self.formula.predict_one(q.input_tokens, hit) if self.formula is not None else 0.0
        return Choice(wid, hit_tokens=hit, predicted_ms=predicted, score=score, reason=reason)

    def second_look(
        self,
        q: Any,
        workers: Sequence[WorkerView],
        first: Choice,
        fresh: Callable[[str], tuple[float, float]],
        rng: random.Random,
    ) -> Choice:
        """Power of two choices on fresh load, for a prefill policy with scorers: this policy's pick
        ``first`` (made on a snapshot that may be a poll old) and its runner-up over ``workers``
        are ranked again by this same policy with each one's (queued ms, owed ms) as ``fresh``
        reads them now (the shared state every replica writes), and the better goes. Replicas that
        route on the same stale snapshot would otherwise all send their requests to the worker
        that looked idlest until the next poll (herding). The runner-up is drawn with ``rng`` as
        any choice is; in a near-tie the picker's own tie-breakers (the longest cached prefix)
        decide, so a cache holder keeps its prompt. Pure: ``fresh`` is the caller's read."""
        return self.second_look_pair(q, workers, first, fresh, rng)[1]

    def second_look_pair(
        self,
        q: Any,
        workers: Sequence[WorkerView],
        first: Choice,
        fresh: Callable[[str], tuple[float, float]],
        rng: random.Random,
    ) -> tuple[Choice | None, Choice]:
        """`second_look` with the runner-up it ranked ``first`` against (None when there was
        none: the answer is then ``first``): the hand-off's SLO check may send the request to the
        other of the two when the winner has no room for it (`admission.pick_within`)."""
        if self.role != PREFILL or not self.scorers:
            return None, first
        rest = [w for w in workers if w.id != first.worker_id]
        mine = [w for w in workers if w.id == first.worker_id]
        if not rest or not mine:
            return None, first
        try:
            alt = self.choose(q, rest, rng)
        except NoWorker:
            return None, first
        pair = []
        for w in (mine[0], next(v for v in rest if v.id == alt.worker_id)):
            queued, owed = fresh(w.id)
            pair.append(replace(w, queued_ms=queued, owed_ms=owed))
        return alt, self.choose(q, pair, rng)

    def rank_decode(self, workers: Sequence[WorkerView]) -> tuple[list[int], list[int]]:
        """For the simulator's decode shortlist: indices of all ``workers`` (unfiltered) best first by
        this policy's utility, then its picker's tie-breakers, then index; and the indices the picker
        would treat as tied with the best. Only for a decode policy with scorers and picker ``best``."""
        picker = self.picker
        if self.role != DECODE or not self.scorers or picker.name != "best":
            raise ValueError(f"policy {self.name!r} has no ranking")
        q = DecodeQuery(0, 0)
        c = Candidates(list(workers), heads=[decode_headroom(w) for w in workers])
        utils = self._utils(q, c)
        assert utils is not None
        tb = [(s.score(q, c), -1.0 if s.sense == "max" else 1.0) for s in getattr(picker, "tie_break", ())]
        n = len(utils)
        order = sorted(range(n), key=lambda j: (-utils[j], *(sg * v[j] for v, sg in tb), j))
        best = utils[order[0]]
        slack = self.sign * best * float(getattr(picker, "tie_pct", 0.0))
        slack = max(slack, float(getattr(picker, "tie_abs", 0.0)))
        band = [j for j in range(n) if utils[j] >= best - slack]
        for v, sg in tb:
            top = min(sg * v[j] for j in band)
            band = [j for j in band if sg * v[j] == top]
        return order, band


@dataclass
class PolicyBook:
    """The built-in policies plus those declared in the settings; builds `Policy` instances."""

    declared: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    peers: bool = False  # the peer imitations too (the simulator's book)
    defs: dict[tuple[str, str], PolicyDef] = field(init=False)

    def __post_init__(self) -> None:
        self.defs = {
            (d.role, d.name): d for d in (*BUILTIN_POLICIES, *(PEER_IMITATIONS if self.peers else ()))
        }
        for name, raw in self.declared.items():
            d = PolicyDef.parse(name, raw)
            if (d.role, name) in self.defs:
                raise ValueError(f"policy {name!r}: a built-in {d.role} policy has that name")
            Policy(d, _probe_formula())  # every plugin name and parameter checked now, not per request
            self.defs[(d.role, name)] = d

    def names(self, role: str) -> list[str]:
        return sorted(n for r, n in self.defs if r == role)

    def get(self, role: str, name: str) -> PolicyDef:
        d = self.defs.get((role, name))
        if d is None:
            raise ValueError(f"unknown {role} policy {name!r}; known: {', '.join(self.names(role))}")
        return d

    def build(self, role: str, name: str, formula: Formula | None = None, **overrides: Any) -> Policy:
        """A fresh instance (own picker state) of policy ``name``; ``overrides`` set parameters of
        whichever of its plugins declares them (TypeError if none does)."""
        d = self.get(role, name)
        if overrides:
            d = _override(d, overrides)
        return Policy(d, formula)

    def describe(self) -> dict[str, Any]:
        """What the registry holds: every policy (built-in and declared) by role, and every plugin
        with its roles, parameters' defaults and summary. For `GET /admin/policies` and
        `flexlb policies`."""
        plugins: dict[str, Any] = {}
        for kind in registry.EXTENSION_POINTS:
            specs = [registry.get(kind, n) for n in registry.names(kind)]
            plugins[kind] = {
                s.name: {"roles": list(s.roles), "params": dict(s.params), "summary": s.summary}
                for s in specs
            }
        return {
            "policies": {role: {n: self.get(role, n).describe() for n in self.names(role)} for role in ROLES},
            "plugins": plugins,
        }


def runtime_book(
    declared: Mapping[str, Mapping[str, Any]], runtime: Mapping[str, Any] | str | None
) -> PolicyBook:
    """The policies a replica runs: built-in, those declared in the settings (``FLEXLB_POLICIES``)
    and those declared at runtime (the runtime config's ``policies``: an object, or its JSON text as
    stored in Redis by ``PUT /admin/config``). A runtime policy replaces a settings-declared one of
    the same name; neither may take a built-in's. ValueError names what is wrong."""
    if runtime is None or runtime == "":
        extra: Any = {}
    elif isinstance(runtime, str):
        try:
            extra = json.loads(runtime)
        except json.JSONDecodeError as exc:
            raise ValueError(f"policies: not JSON ({exc.msg})") from None
    else:
        extra = runtime
    if not isinstance(extra, Mapping):
        raise ValueError(f"policies: expected an object (name → policy), got {type(extra).__name__}")
    return PolicyBook({**declared, **extra})


def _probe_formula() -> Formula:
    from app.scheduling.formula import DEFAULT_PREFILL_FORMULA, compile_formula

    return compile_formula(DEFAULT_PREFILL_FORMULA)


def _override(d: PolicyDef, overrides: Mapping[str, Any]) -> PolicyDef:
    left = dict(overrides)

    def take(kind: registry.Kind, name: str, params: Params) -> Params:
        spec = registry.get(kind, name)
        mine = {k: left.pop(k) for k in list(left) if k in spec.params}
        return {**params, **mine} if mine else params

    filters = tuple((n, take("filter", n, p)) for n, p in d.filters)
    scorers = tuple((n, w, take("scorer", n, p)) for n, w, p in d.scorers)
    picker = (d.picker[0], take("picker", d.picker[0], d.picker[1]))
    if left:
        raise TypeError(f"policy {d.name!r} has no parameter {', '.join(sorted(left))}")
    return PolicyDef(d.name, d.role, filters, scorers, picker, d.batching, d.summary)


_BUILTIN_BOOK: PolicyBook | None = None


def _builtin_book() -> PolicyBook:
    global _BUILTIN_BOOK
    if _BUILTIN_BOOK is None:
        _BUILTIN_BOOK = PolicyBook()
    return _BUILTIN_BOOK


def make_prefill_policy(name: str, book: PolicyBook | None = None, **kw: Any) -> Policy:
    """Build a prefill policy by name. ``formula`` (required by scorers that predict; the others use
    it only to fill ``Choice.predicted_ms`` for the hand-off) and plugin parameters such as
    ``hotspot_queue_len`` are keywords. Unknown name: ValueError listing the known; unknown
    parameter: TypeError."""
    formula = kw.pop("formula", None)
    return (book or _builtin_book()).build(PREFILL, name, formula, **kw)


def make_decode_policy(name: str, book: PolicyBook | None = None, **kw: Any) -> Policy:
    """Build a decode policy by name (see `make_prefill_policy`)."""
    return (book or _builtin_book()).build(DECODE, name, None, **kw)
