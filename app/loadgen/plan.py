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


@dataclass(frozen=True, slots=True)
class Limits:
    """The gateway's request limits (its `max_new_tokens_limit` and `max_context_tokens`)."""

    max_output_tokens: int = 8192
    max_context_tokens: int = 131072


@dataclass
class LimitReport:
    """Which trace rows the gateway would refuse as they are, and what the bench did with them.

    Why: a row asking 20,000 output tokens (the RTP-LLM trace has 20) was sent as it was, came back
    `invalid_request` with 0 output tokens, and was counted as an error with no reason given."""

    limits: Limits
    action: str  # "clip" or "skip"
    over_output: list[tuple[int, int]]  # (row index, output tokens asked)
    over_context: list[tuple[int, int]]  # (row index, input + output tokens asked)
    unservable: list[tuple[int, int]]  # (row index, input tokens): the prompt alone is too long

    @property
    def affected(self) -> int:
        return len({i for i, _ in (*self.over_output, *self.over_context, *self.unservable)})

    def notes(self) -> list[str]:
        """One sentence per kind of row, naming up to 5 rows each (results.json lists them all)."""

        def rows(xs: list[tuple[int, int]]) -> str:
            shown = ", ".join(f"#{i} ({n:,})" for i, n in xs[:5])
            return shown + (f" and {len(xs) - 5} more" if len(xs) > 5 else "")

        lim = self.limits
        out = []
        if self.over_output:
            done = "clipped to" if self.action == "clip" else "skipped, not sent; the limit is"
            out.append(
                f"{len(self.over_output)} trace rows asked for more output tokens than the gateway's "
                f"max_tokens limit ({rows(self.over_output)}): {done} {lim.max_output_tokens:,}."
            )
        if self.over_context:
            done = "output clipped to fit" if self.action == "clip" else "skipped, not sent"
            out.append(
                f"{len(self.over_context)} trace rows asked for more input + output tokens than the "
                f"gateway's context limit {lim.max_context_tokens:,} ({rows(self.over_context)}): {done}."
            )
        if self.unservable:
            out.append(
                f"{len(self.unservable)} trace rows have a prompt at or above the context limit "
                f"{lim.max_context_tokens:,} ({rows(self.unservable)}): skipped, not sent."
            )
        return out

    def as_dict(self) -> dict[str, object]:
        return {
            "max_output_tokens": self.limits.max_output_tokens,
            "max_context_tokens": self.limits.max_context_tokens,
            "action": self.action,
            "over_output": [list(x) for x in self.over_output],
            "over_context": [list(x) for x in self.over_context],
            "unservable": [list(x) for x in self.unservable],
        }


def apply_limits(trace: Trace, limits: Limits, action: str = "clip") -> tuple[Trace, LimitReport]:
    """Rows the gateway would refuse: clipped to fit (`clip`) or left out (`skip`), and reported.

    A prompt that alone reaches the context limit cannot be made to fit by clipping the output,
    so it is skipped under either action."""
    if action not in ("clip", "skip"):
        raise ValueError(f"over-limit action must be clip or skip, got {action!r}")
    rep = LimitReport(limits, action, [], [], [])
    reqs: list[TraceRequest] = []
    for r in trace.requests:
        want = replay_max_tokens(r.output_len)
        if r.input_len >= limits.max_context_tokens:
            rep.unservable.append((r.index, r.input_len))
            continue
        fit = min(want, limits.max_output_tokens, limits.max_context_tokens - r.input_len)
        if want > limits.max_output_tokens:
            rep.over_output.append((r.index, want))
        elif r.input_len + want > limits.max_context_tokens:
            rep.over_context.append((r.index, r.input_len + want))
        if fit == want:
            reqs.append(r)
        elif action == "clip":
            reqs.append(TraceRequest(r.index, r.arrival_ms, r.input_len, fit, r.block_hashes))
    return Trace(trace.name, trace.format, trace.block_size, reqs), rep


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
