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

Determinism contract (as before): the same query, worker sequence, picker state and ``rng`` state
give the same `Choice` and leave ``rng`` in the same state; ties are broken over the tied workers
sorted by id, so a scored choice depends on the set of workers, not on the order of the snapshot.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.scheduling.batcher import BatcherConfig
from app.scheduling.formula import Formula
from app.scheduling.plugins import registry
from app.scheduling.plugins.registry import BuildContext, Candidates, Filter, Picker, Scorer
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

ROLES = (PREFILL, DECODE)
# The owner's batching modes (`batching_config` below maps each to batcher knobs).
BATCHING_MODES = ("fixed_window", "slo", "direct", "window")
DEFAULT_PREFILL_POLICY = "cost"
DEFAULT_DECODE_POLICY = "kv_headroom"
_FIT = {PREFILL: "prefill_fit", DECODE: "decode_fit"}

Params = Mapping[str, Any]


@dataclass(frozen=True)
class PolicyDef:
    """One policy as data: which plugins, with which weights and parameters."""

    name: str
    role: str
    filters: tuple[tuple[str, Params], ...] = ()
    scorers: tuple[tuple[str, float, Params], ...] = ()
    picker: tuple[str, Params] = ("best", {})
    batching: str | None = None
    summary: str = ""

    @classmethod
    def parse(cls, name: str, raw: Mapping[str, Any]) -> PolicyDef:
        """A declared policy from its JSON form (see the module docstring); ValueError if malformed."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"policy {name!r}: expected an object, got {type(raw).__name__}")
        unknown = set(raw) - {"role", "filters", "scorers", "picker", "batching", "summary"}
        if unknown:
            raise ValueError(f"policy {name!r}: unknown field(s) {', '.join(sorted(unknown))}")
        filters = tuple(_named(name, "filter", f) for f in raw.get("filters", ()))
        sc = raw.get("scorers", {})
        scorers: list[tuple[str, float, Params]] = []
        if isinstance(sc, Mapping):
            scorers = [(str(k), float(v), {}) for k, v in sc.items()]
        else:
            for item in sc:
                n, params = _named(name, "scorer", item)
                params = dict(params)
                scorers.append((n, float(params.pop("weight", 1.0)), params))
        picker = _named(name, "picker", raw.get("picker", "best"))
        d = cls(
            name,
            str(raw.get("role", "")),
            filters,
            tuple(scorers),
            picker,
            raw.get("batching"),
            str(raw.get("summary", "")),
        )
        d.validate()
        return d

    def validate(self) -> None:
        """Structure only; plugin names and parameters are checked by building it (`Policy`)."""
        if self.role not in ROLES:
            raise ValueError(f"policy {self.name!r}: role must be prefill or decode, got {self.role!r}")
        if self.batching is not None and self.batching not in BATCHING_MODES:
            raise ValueError(f"policy {self.name!r}: batching must be one of {', '.join(BATCHING_MODES)}")
        for n, w, _ in self.scorers:
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"policy {self.name!r}: scorer {n!r} weight must be finite and > 0, got {w}")
        if self.picker[0] == "best" and not self.scorers:
            raise ValueError(f"policy {self.name!r}: picker 'best' needs at least one scorer")
        if self.picker[0] != "best" and self.scorers:
            raise ValueError(f"policy {self.name!r}: picker {self.picker[0]!r} ignores scorers; remove them")

    def describe(self) -> dict[str, Any]:
        """The JSON form (`parse` reads it back), for the admin API and `flexlb policies`."""
        out: dict[str, Any] = {
            "role": self.role,
            "filters": [{"name": n, **p} for n, p in self.filters],
            "scorers": [{"name": n, "weight": w, **p} for n, w, p in self.scorers],
            "picker": {"name": self.picker[0], **self.picker[1]},
        }
        if self.batching is not None:
            out["batching"] = self.batching
        if self.summary:
            out["summary"] = self.summary
        return out


def _named(policy: str, kind: str, item: Any) -> tuple[str, Params]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping) and isinstance(item.get("name"), str):
        params = {k: v for k, v in item.items() if k != "name"}
        if kind == "picker" and "tie_break" in params:
            params["tie_break"] = tuple(params["tie_break"])
        return item["name"], params
    raise ValueError(f"policy {policy!r}: a {kind} is a name or an object with a 'name', got {item!r}")


def batching_config(batching: str, slo_ttft_ms: float, base: BatcherConfig | None = None) -> BatcherConfig:
    """The owner's batcher knobs for a policy's batching mode, over ``base`` (the defaults when None):
    the live gateway applies the selected prefill policy's mode, the simulator each run's."""
    b = base or BatcherConfig()
    if batching == "fixed_window":
        cfg = replace(b, algorithm="fixed_window", mode="batch")
    elif batching == "slo":
        cfg = replace(b, algorithm="slo", mode="batch", slo_ttft_ms=slo_ttft_ms)
    elif batching == "window":
        cfg = replace(b, algorithm="window", mode="batch", slo_ttft_ms=slo_ttft_ms)
    elif batching == "direct":
        cfg = replace(b, mode="direct")
    else:
        raise ValueError(f"unknown batching {batching!r}; known: {', '.join(BATCHING_MODES)}")
    cfg.validate()
    return cfg


_NO_PARAMS: Params = {}
# `cost` counts a cached prefix's saving again this many times on top of the finish time it
# already shortens: greedy finish-time routing gave prefixes away for a few ms of load, and every
# follow-up turn then paid the full prefill. Measured (bench/cliff.py workloads, 2,000 requests,
# 8P+8D, loads 1 and 2, 1 and 4 replicas): routed hit +1.6 to +2.9 points on conversation_trace,
# +1.8 to +2.4 on trace_30min at load 1 (+0.1 at 2), +0.2 to +0.5 on the synthetic workload;
# goodput +0.5 to +1.5 points at load 2 with 4 replicas, nowhere lower by more than 0.2 (noise);
# weights 2 and 3 measured alike, 1 about half the gain.
CACHE_VALUE = 2.0
# `cost` prices predicted finish time at this fraction while a worker would finish within
# LATENCY_BUDGET_MS (`predicted_late_ms` adds the rest past it). Goodput counts a prompt answered
# in 400 ms the same as one answered in 1,000; the prefill a cached prefix saves is capacity for
# later requests. With the full price, holders gave prefixes away to idler workers at backlogs of
# ~8x the saving (median of the lost hits on trace_30min, load 1, 2,000 requests: 1-2 blocks
# saving 31-62 ms against 300-1,000 ms of backlog), which was 11 of the 12 % of the pooled-LRU
# bound that routing missed there. Below the budget a holder now keeps its prefix against a
# backlog up to (LATENCY_BELOW_BUDGET + CACHE_VALUE) / LATENCY_BELOW_BUDGET = 9x the saving; past
# it, 3x as before. Budget = 1/3 of the default 3 s TTFT SLO, leaving the rest for queueing
# behind later arrivals and prediction error. The near-tie band (`tie_abs`) is in utility, so it
# shrinks by the same factor: 20 ms of finish time below the budget, as before; left at 20 it
# drew among workers 80 ms apart and herded more groups onto one worker (tests/test_simulate.py
# large fleet: 26 workers for 30 prefix groups, 29 with it scaled).
LATENCY_BELOW_BUDGET = 0.25
LATENCY_BUDGET_MS = 1000.0
_BUILTIN = (
    PolicyDef(
        "cost",
        PREFILL,
        (("hotspot", _NO_PARAMS),),
        (
            ("predicted_finish_ms", LATENCY_BELOW_BUDGET, _NO_PARAMS),
            ("predicted_late_ms", 1.0 - LATENCY_BELOW_BUDGET, {"budget_ms": LATENCY_BUDGET_MS}),
            ("prefill_saved_ms", CACHE_VALUE, _NO_PARAMS),
        ),
        (
            "best",
            {"tie_pct": 0.10, "tie_abs": 20.0 * LATENCY_BELOW_BUDGET, "tie_break": ("cache_hit_tokens",)},
        ),
        summary="lowest predicted finish time (at 1/4 price within a 1 s budget), a cached prefix's"
        " saving counted 3x (it serves the follow-ups too); near-ties to the longest cached"
        " prefix, then random",
    ),
    PolicyDef(
        "least_load",
        PREFILL,
        (("hotspot", _NO_PARAMS),),
        (("prefill_load_ms", 1.0, _NO_PARAMS),),
        summary="cache-blind: the worker that could start soonest",
    ),
    PolicyDef(
        "prefix",
        PREFILL,
        (("hotspot", _NO_PARAMS), ("prefix_affinity", _NO_PARAMS)),
        (("prefill_load_ms", 1.0, _NO_PARAMS),),
        summary="longest cached prefix unless that worker is overloaded (sglang's rule)",
    ),
    PolicyDef("random", PREFILL, (("hotspot", _NO_PARAMS),), (), ("random", _NO_PARAMS), summary="uniform"),
    PolicyDef(
        "round_robin", PREFILL, (("hotspot", _NO_PARAMS),), (), ("round_robin", _NO_PARAMS), summary="by id"
    ),
    PolicyDef(
        "kv_headroom",
        DECODE,
        (),
        (("kv_headroom_tokens", 1.0, _NO_PARAMS),),
        ("best", {"tie_pct": 0.05}),
        summary="most unreserved KV; headrooms within 5% of the best drawn at random",
    ),
    PolicyDef(
        "least_load",
        DECODE,
        (),
        (("decode_reserved_tokens", 1.0, _NO_PARAMS),),
        ("best", {"tie_break": ("decode_running",)}),
        summary="least reserved KV, then fewest running sequences",
    ),
    PolicyDef("random", DECODE, (), (), ("random", _NO_PARAMS), summary="uniform over workers that fit"),
    PolicyDef(
        "round_robin", DECODE, (), (), ("round_robin", _NO_PARAMS), summary="by id over workers that fit"
    ),
)


# Peer router imitations (plugins/pickers/peer_imitations.py), for the simulator's comparisons
# (`PolicyBook(peers=True)`, which `SimConfig.policy_book` builds): the hotspot filter only when
# configured (off by default, as in the routers imitated), and (`Policy.peer`) no SLO admission,
# as they have none. Not in the live gateway's book: they count their own requests in flight,
# which only the simulator reports back to them (`Policy.finished`).
PEER_IMITATIONS = tuple(
    PolicyDef(n, PREFILL, (("hotspot", _NO_PARAMS),), (), (n, _NO_PARAMS), summary=s)
    for n, s in (
        ("sglang_cache_aware", "imitates sglang-router 0.3.2's P/D cache_aware: no tree, random (64 / 1.5)"),
        ("vllm_cache_aware", "imitates vLLM router's cache_aware (0.5 / 32 / 1.1)"),
        ("llmd_precise", "imitates llm-d: precise prefix + queue + KV-utilisation scorers 3:2:2"),
        ("dynamo_kv", "imitates Dynamo's KV router: overlap x prefill blocks + active blocks"),
    )
)


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
        if self.role != PREFILL or not self.scorers:
            return first
        rest = [w for w in workers if w.id != first.worker_id]
        mine = [w for w in workers if w.id == first.worker_id]
        if not rest or not mine:
            return first
        try:
            alt = self.choose(q, rest, rng)
        except NoWorker:
            return first
        pair = []
        for w in (mine[0], next(v for v in rest if v.id == alt.worker_id)):
            queued, owed = fresh(w.id)
            pair.append(replace(w, queued_ms=queued, owed_ms=owed))
        return self.choose(q, pair, rng)

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
        self.defs = {(d.role, d.name): d for d in (*_BUILTIN, *(PEER_IMITATIONS if self.peers else ()))}
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
