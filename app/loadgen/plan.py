"""What to send and when: trace requests become planned sends (pure, no I/O).

Open loop: each request is due at its own (scaled) arrival time whatever happened to the ones
before, as real clients arrive; a closed loop would hide queueing by slowing down with the server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from app.loadgen.prompts import PromptSynth, replay_max_tokens
from app.traces import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One send. The prompt is built at send time (`prompt(synth)`), not here: a whole Mooncake
    trace would be 150 MB of text held at once."""

    index: int
    due_ms: float  # when to send, ms after the run starts
    input_len: int
    max_tokens: int
    trace_output_len: int  # as the trace logged it (0 = prefill-only row)
    full_blocks: tuple[int, ...]  # ids of the trace's full blocks

    def prompt(self, synth: PromptSynth) -> str:
        return synth.prompt(self.index, self.input_len, self.full_blocks)


def poisson_retime(trace: Trace, rate_rps: float, seed: int) -> Trace:
    """Same requests in the same order, arrivals replaced by a Poisson process at `rate_rps`.

    Why offer it: the Mooncake trace's timestamps are quantised to 3-s bursts, and a rate sweep
    on one slice needs a load knob that keeps request contents fixed.
    """
    if not rate_rps > 0:
        raise ValueError(f"rate must be > 0, got {rate_rps}")
    rng = random.Random(seed)
    t = 0.0
    reqs: list[TraceRequest] = []
    for i, r in enumerate(trace.requests):
        if i:
            t += rng.expovariate(rate_rps) * 1000.0
        reqs.append(TraceRequest(r.index, t, r.input_len, r.output_len, r.block_hashes))
    return Trace(trace.name, trace.format, trace.block_size, reqs)


def clip_outputs(trace: Trace, max_output_tokens: int) -> Trace:
    """Cap output lengths (an explicit, reported option: keeps slices with 20K-token outputs short)."""
    reqs = [
        TraceRequest(r.index, r.arrival_ms, r.input_len, min(r.output_len, max_output_tokens), r.block_hashes)
        for r in trace.requests
    ]
    return Trace(trace.name, trace.format, trace.block_size, reqs)


def build_plan(trace: Trace) -> list[PlannedRequest]:
    """One planned send per trace request with a non-empty prompt, in arrival order."""
    return [
        PlannedRequest(
            index=r.index,
            due_ms=r.arrival_ms,
            input_len=r.input_len,
            max_tokens=replay_max_tokens(r.output_len),
            trace_output_len=r.output_len,
            full_blocks=trace.full_block_keys(r),
        )
        for r in trace.requests
        if r.input_len > 0
    ]
