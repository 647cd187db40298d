"""The workloads of bench/cliff.py: the shipped traces (by name, from ``TRACES``) and two
synthetic ones unlike them: bursty multi-tenant traffic (``synthetic``) and multi-turn chat and
tool-using agent sessions (``chat_agents``)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from app.traces import Trace, TraceRequest, load_trace

TRACES = Path("/work/shared/traces")


def synthetic_workload(n: int = 6000, seed: int = 11, block_size: int = 512) -> Trace:
    """Bursty multi-tenant traffic unlike the shipped traces: Zipf-popular shared prefixes of
    different lengths (system prompts, documents), a lognormal private tail, lognormal outputs,
    and arrivals whose rate swings ×3 between calm and burst phases."""
    rng = random.Random(seed)
    groups = 48
    prefix_len = [rng.choice((1, 1, 2, 3)) for _ in range(groups)]
    weights = [1.0 / (g + 1) ** 1.1 for g in range(groups)]
    prefixes = [tuple(((g + 1) << 32) | i for i in range(prefix_len[g])) for g in range(groups)]
    nxt = (groups + 2) << 32
    reqs: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        phase = (t // 20_000) % 2  # 20 s calm, 20 s burst
        rate = 4.0 if phase == 0 else 12.0
        if i:
            t += rng.expovariate(rate) * 1000.0
        g = rng.choices(range(groups), weights)[0]
        own_tokens = max(16, int(rng.lognormvariate(7.6, 1.1)))  # ~2,000 median, long tail
        own_blocks = own_tokens // block_size
        blocks = prefixes[g] + tuple(range(nxt, nxt + own_blocks + 1))  # + a partial last block
        nxt += own_blocks + 1
        il = len(prefixes[g]) * block_size + own_tokens
        ol = max(1, int(rng.lognormvariate(5.0, 0.8)))
        reqs.append(TraceRequest(i, t, il, ol, blocks))
    return Trace("synthetic_bursty", "mooncake", block_size, reqs)


def chat_agent_workload(n: int = 6000, seed: int = 13, block_size: int = 512) -> Trace:
    """Sessions of multi-turn chat and tool-using agents behind shared application prompts, the
    shape production LLM traffic has and neither shipped trace isolates.

    24 applications, Zipf(1.0)-popular, each with a system prompt (+ few-shot examples) of lognormal
    length, median 1,200 tokens. 75 % of sessions are chats: 1 + geometric turns (mean 4), each
    adding a user message (median 150 tokens) and the previous answer (median 250) to the history,
    then a think time (exponential, mean 20 s). 25 % are agents: mean 8 steps, each adding the
    previous action (median 80 tokens) and a tool result (median 600), 2 s apart (exponential).
    Every prompt is the application prompt + the session's whole history, so a session's next
    prompt extends its last one; sessions start as a Poisson process. Block keys are per
    application for the blocks wholly inside its prompt and per session after. Parameters are
    round figures of the published shapes (multi-turn chat ~3-5 turns, agents' long tool
    outputs), not fitted to any result of this bench."""
    rng = random.Random(seed)
    apps = 24
    weights = [1.0 / (a + 1) for a in range(apps)]
    sys_len = [min(8000, max(64, int(rng.lognormvariate(math.log(1200), 0.8)))) for _ in range(apps)]
    events: list[tuple[float, int, int, int, int]] = []  # (arrival ms, session, input, output, app)
    t = 0.0
    session = 0
    while len(events) < n:
        t += rng.expovariate(1.0) * 1000.0  # one session a second (the load scaling rescales it)
        app = rng.choices(range(apps), weights)[0]
        agent = rng.random() < 0.25
        steps = 1 + int(rng.expovariate(1 / (7.0 if agent else 3.0)))
        hist = 0
        at = t
        for k in range(steps):
            if agent:
                add = (int(rng.lognormvariate(math.log(80), 0.7)) if k else 0) + int(
                    rng.lognormvariate(math.log(600), 1.0)
                )
                out = max(1, int(rng.lognormvariate(math.log(100), 0.7)))
            else:
                add = int(rng.lognormvariate(math.log(150), 1.0))
                out = max(1, int(rng.lognormvariate(math.log(250), 0.7)))
            hist += max(1, add)
            events.append((at, session, sys_len[app] + hist, out, app))
            hist += out  # the answer joins the history of the next turn
            at += rng.expovariate(1 / (2.0 if agent else 20.0)) * 1000.0
        session += 1
    events.sort()
    events = events[:n]
    reqs: list[TraceRequest] = []
    for i, (at, sid, il, ol, app) in enumerate(events):
        shared = sys_len[app] // block_size  # blocks wholly inside the application prompt
        nblocks = -(-il // block_size)  # + a partial last block, as Mooncake hashes it
        blocks = tuple(((app + 1) << 40) | b if b < shared else ((sid + 1) << 20) | b for b in range(nblocks))
        reqs.append(TraceRequest(i, at - events[0][0], il, ol, blocks))
    return Trace("synthetic_chat_agents", "mooncake", block_size, reqs)


def workloads(names: list[str], max_requests: int | None) -> dict[str, Trace]:
    out: dict[str, Trace] = {}
    for name in names:
        if name == "synthetic":
            tr = synthetic_workload()
        elif name == "chat_agents":
            tr = chat_agent_workload()
        else:
            tr = load_trace(TRACES / f"{name}.jsonl.gz", "auto")
        if max_requests and len(tr) > max_requests:
            tr = Trace(tr.name, tr.format, tr.block_size, tr.requests[:max_requests])
        out[name] = tr
    return out
