"""``kv_headroom`` (the default decode strategy): the worker with the most unreserved KV.

A decode request holds its KV for its whole generation, growing to input + max_new tokens, and a
worker that runs out must preempt or fail running sequences. Headroom = min(kv_free, kv_total −
reserved) (`routing.decode_headroom`) counts what every replica has already promised that worker
(reservations are updated at each routing decision, the snapshot's free KV only at each poll), so a
burst between two polls spreads out instead of overfilling the worker that looked emptiest. Most
headroom also keeps the fleet evenly filled, which keeps decode batches, and so time per output
token, even.

Headrooms within ``tie_pct`` (5 %) of the best are treated as equal and one is drawn at random:
replicas rank from the same snapshot, and picking the exact maximum would send all their requests
to one worker until the reservations catch up.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from app.scheduling.routing import Choice, DecodeQuery, WorkerView, eligible_decode, pick_tied


class KvHeadroomStrategy:
    """Most unreserved KV among workers that fit, near-ties randomised; see the module docstring."""

    name = "kv_headroom"
    __slots__ = ("tie_pct",)

    def __init__(self, tie_pct: float = 0.05) -> None:
        if not 0 <= tie_pct < 1:
            raise ValueError(f"tie_pct must be in [0, 1), got {tie_pct}")
        self.tie_pct = tie_pct

    def choose(self, q: DecodeQuery, workers: Sequence[WorkerView], rng: random.Random) -> Choice:
        ws, heads = eligible_decode(q, workers)
        best = max(heads)
        floor = best - best * self.tie_pct
        tied = [i for i, h in enumerate(heads) if h >= floor]
        i = pick_tied(tied, ws, rng)
        return Choice(ws[i].id, score=float(heads[i]), reason="kv_headroom" if len(tied) == 1 else "near_tie")
