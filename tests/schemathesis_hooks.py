"""Schemathesis hooks for the OpenAPI fuzz pass (tests/test_openapi_fuzz.py), loaded through
SCHEMATHESIS_HOOKS.

- `flexlb-formula`: the published format of `prefill_time_formula` (a prefill-time formula, the
  language of app/scheduling/formula.py). A JSON schema cannot state a grammar, so the fuzzer is
  taught to write valid ones; invalid ones are still sent by its negative phase.
- `flexlb-policies`: the published format of `policies` (JSON text, the FLEXLB_POLICIES format):
  which plugins exist and how they compose is the registry's, not a JSON schema's, so the fuzzer
  writes valid compositions of built-in plugins; invalid ones are still sent by its negative phase.
- Deadlines: a schema-valid `timeout_ms` of a few ms is a legitimate 504 (`deadline_exceeded`, the
  request really ran out of time), which the fuzzer would count as a server error; so is a
  `deadline_ms` (TTFT deadline) of a few ms that passes while the request is queued. Generated
  deadlines are raised to at least 20 s; the 504 path has tests of its own.
"""

from __future__ import annotations

import json
from typing import Any

# Imported here, in schemathesis' main thread before its workers start: anyio >= 4.12 builds its
# lazy-import map with `compile(..., PyCF_ONLY_AST)` at import, and CPython 3.11's AST validator
# keeps its recursion depth in state the threads share, so two workers importing it at once can
# fail with "SystemError: AST constructor recursion depth mismatch" (a CI run's fuzz pass, seed
# 1201009623: a runtime error on POST /admin/stats/reset, not a finding about the API).
import anyio  # noqa: F401
import schemathesis
from hypothesis import strategies as st

MIN_TIMEOUT_MS = 20_000

_TERMS = st.sampled_from(
    [
        "computeTokens",
        "inputTokens",
        "hitCacheTokens",
        "batchSize",
        "sum(computeTokens)",
        "maxInputTokens",
        "sqrt(computeTokens + 1)",
    ]
)
_COEF = st.floats(min_value=0, max_value=10, allow_nan=False).map(lambda x: f"{x:.4g}")

schemathesis.openapi.format(
    "flexlb-formula",
    st.builds(lambda base, coef, term: f"{base} + {coef}*{term}", _COEF, _COEF, _TERMS),
)


# Valid compositions of built-in plugins (the registry's rules: a scorer's role, `best` needs
# scorers, the others take none), by role.
_PREFILL_POLICIES: list[dict[str, Any]] = [
    {"role": "prefill", "scorers": {"predicted_finish_ms": 1.0}},
    {"role": "prefill", "filters": ["hotspot", "prefix_affinity"], "scorers": {"prefill_load_ms": 2.0}},
    {
        "role": "prefill",
        "scorers": {"predicted_finish_ms": 1.0, "cache_hit_tokens": 0.01},
        "picker": {"name": "best", "tie_pct": 0.1, "tie_abs": 20},
        "batching": "direct",
    },
    {"role": "prefill", "filters": ["hotspot"], "picker": "round_robin", "batching": "slo"},
]
_DECODE_POLICIES: list[dict[str, Any]] = [
    {"role": "decode", "scorers": {"decode_running": 1.0}},
    {"role": "decode", "picker": "random"},
]
# Always the same names with the same roles: once declared they are in the published enums, and a
# later patch that selects one while replacing the set must still hold it.
schemathesis.openapi.format(
    "flexlb-policies",
    st.fixed_dictionaries(
        {
            **{f"fz_p{i}": st.sampled_from(_PREFILL_POLICIES) for i in range(2)},
            "fz_d0": st.sampled_from(_DECODE_POLICIES),
        }
    ).map(json.dumps),
)


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    # deadline_ms: a TTFT deadline, 504 when it passes queued. An int or an integral float (JSON
    # Schema counts 52.0 as an integer, and so does the API).
    for key in ("timeout_ms", "deadline_ms"):
        t = body.get(key) if isinstance(body, dict) else None
        if isinstance(t, int | float) and not isinstance(t, bool) and t > 0:
            body[key] = max(t, MIN_TIMEOUT_MS)
    return body
