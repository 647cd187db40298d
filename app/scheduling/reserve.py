"""How much decode KV to reserve per request: `reserve_output_tokens = max | mean | pXX`.

Pure (no I/O, no clock). Reserving prompt + `max_new_tokens` for every request refuses the
cluster for decode KV (`decode_reserve_refused`) on traffic with long shared contexts while most
of the reserved tokens are never generated: clients set `max_tokens` far above what they get.
Real engines admit on expected use and preempt when they run out (workers/engine/decode.py,
`admission="expected"`). This learns the output length of finished requests per model (a window
of the last `window` of them) and reserves its mean or a percentile instead, capped by the
request's own `max_new_tokens`; until `min_samples` are seen it reserves the maximum.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["OutputLengthEstimator", "parse_reserve_policy"]


def parse_reserve_policy(policy: str) -> float | None:
    """`max` → None; `mean` → -1.0; `pXX` (0 < XX <= 100) → XX. Raises ValueError otherwise."""
    if policy == "max":
        return None
    if policy == "mean":
        return -1.0
    if policy.startswith("p"):
        try:
            q = float(policy[1:])
        except ValueError:
            q = -1.0
        if 0 < q <= 100:
            return q
    raise ValueError(f"reserve_output_tokens must be max, mean or pXX (0 < XX <= 100), got {policy!r}")


class OutputLengthEstimator:
    def __init__(self, policy: str = "max", window: int = 2048, min_samples: int = 32) -> None:
        self.q = parse_reserve_policy(policy)
        self.policy = policy
        self.min_samples = min_samples
        self.samples: deque[int] = deque(maxlen=window)
        self._cached: float | None = None

    def observe(self, generated: int) -> None:
        """A finished request generated this many tokens."""
        if self.q is not None and generated > 0:
            self.samples.append(generated)
            self._cached = None

    def estimate(self) -> float | None:
        """The learned output length (None: reserve the maximum)."""
        if self.q is None or len(self.samples) < self.min_samples:
            return None
        if self._cached is None:
            if self.q < 0:
                self._cached = sum(self.samples) / len(self.samples)
            else:
                ordered = sorted(self.samples)
                k = max(0, math.ceil(self.q / 100 * len(ordered)) - 1)
                self._cached = float(ordered[k])
        return self._cached

    def reserve(self, max_new_tokens: int) -> int:
        """Output tokens to reserve for a request that may generate up to `max_new_tokens`."""
        est = self.estimate()
        if est is None:
            return max_new_tokens
        return max(1, min(max_new_tokens, math.ceil(est)))
