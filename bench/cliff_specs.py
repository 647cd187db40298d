"""bench/cliff.py's policy names: ``NAME[@BATCHING]`` plus suffixes that turn simulator flags on or
off for that policy's runs (``specs`` parses them, ``spec_flags`` reads the flags)."""

from __future__ import annotations

import re
from typing import Any

from app.sim.run import PolicySpec

# Suffix → (SimConfig flag, value). Both flags default to the live gateway's settings (on), so
# ``-fresh`` / ``-shared`` turn one off; ``+`` turns it on where the environment turned it off.
# ``+expected`` / ``-expected``: the decode engines admit on expected use and preempt (`expected`)
# or hold prompt + max_new_tokens (`reserve`, SimConfig's default). ``-dshare`` / ``+dshare``: a
# prompt block several decode sequences / holds on a worker share counted per sequence (off) or once
# (`SimConfig.decode_shared_prefix`, live `FLEXLB_DECODE_SHARED_PREFIX`, default on).
# ``-dheld`` / ``+dheld``: the decode pick ranks on headroom alone / plus the request's prompt
# tokens the replica's holds there name (`SimConfig.decode_prefer_held`, live
# `FLEXLB_DECODE_PREFER_HELD`, default on). ``+dall``: that pick reads one view of every
# replica's holds instead of its own replica's (`SimConfig.decode_held_view`, an evaluation of the
# upper bound a shared view could buy; the live origin knows its own holds).
SUFFIXES = {
    "+fresh": ("fresh_pick", True),
    "+shared": ("shared_speculative", True),
    "-fresh": ("fresh_pick", False),
    "-shared": ("shared_speculative", False),
    "+expected": ("decode_admission", "expected"),
    "-expected": ("decode_admission", "reserve"),
    "+dshare": ("decode_shared_prefix", True),
    "-dshare": ("decode_shared_prefix", False),
    "+dheld": ("decode_prefer_held", True),
    "-dheld": ("decode_prefer_held", False),
    "+dall": ("decode_held_view", "all"),
}
# ``+res:POLICY`` (max | mean | pXX): the decode KV the origin reserves per request
# (`SimConfig.reserve_output_tokens`, live `FLEXLB_RESERVE_OUTPUT_TOKENS`; default the live setting).
RESERVE = re.compile(r"\+res:(max|mean|p[0-9.]+)")
# ``+tpot:MS``: the origin refuses a decode worker whose modelled step with the request would
# exceed MS (`SimConfig.decode_tpot_slo_ms`, an evaluation without a live twin).
TPOT = re.compile(r"\+tpot:([0-9.]+)")


def specs(names: tuple[str, ...] | list[str]) -> list[PolicySpec]:
    """``NAME[@BATCHING][±fresh][±shared][±expected][+res:POLICY]``: ``fresh`` is
    `SimConfig.fresh_pick` (the policy's `Policy.second_look` on fresh shared load, live
    `FLEXLB_FRESH_PICK`), ``shared`` is `SimConfig.shared_speculative` (speculative cache entries
    published through the owner to every replica, live `FLEXLB_SHARED_SPECULATIVE`); both on by
    default, as live. ``expected`` is the decode engines' admission, ``res:`` the origin's
    `reserve_output_tokens`, ``dshare`` / ``dheld`` the decode holds' sharing and the pick's use
    of it (``+dall``: every replica's holds), ``+tpot:MS`` the simulator-only TPOT guard (see
    ``SUFFIXES`` and ``TPOT``)."""
    out = []
    for n in names:
        base = TPOT.sub("", RESERVE.sub("", n))
        for suf in SUFFIXES:
            base = base.replace(suf, "")
        strategy, _, batching = base.partition("@")
        out.append(PolicySpec(n, strategy, batching or "window"))
    return out


def spec_flags(name: str) -> tuple[tuple[str, Any], ...]:
    flags: list[tuple[str, Any]] = [fv for suf, fv in SUFFIXES.items() if suf in name]
    m = RESERVE.search(name)
    if m:
        flags.append(("reserve_output_tokens", m.group(1)))
    m = TPOT.search(name)
    if m:
        flags.append(("decode_tpot_slo_ms", float(m.group(1))))
    return tuple(flags)
