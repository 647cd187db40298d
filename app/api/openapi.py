"""The published OpenAPI document (`GET /openapi.json`), made to say exactly what the gateway does
(issue #21): clients generate SDKs and validators from it, and CI fuzzes the live gateway against
it (tests/test_openapi_fuzz.py).

FastAPI's own document is the starting point; this module then
- replaces its 422 (which this gateway never answers: validation failures are 400s) with, per
  operation, every status the gateway can return, each with the one error schema and the
  `Retry-After` header where it is sent;
- describes the success bodies, and the `text/event-stream` answer of a streaming request with the
  schema of one event's JSON;
- writes into the request schemas the rules that come from the running configuration (the served
  model, the largest max_tokens, the vocabulary) and the native API's "exactly one of prompt and
  input_ids" as a `oneOf`, so a schema-valid body is an accepted one.

What a schema cannot say is in the operation's description: prompt + max_tokens must fit the
context (`max_context_tokens`), and a request id may be refused as a duplicate (409).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.schemas import SEED_MAX
from app.gateway.errors import KINDS
from app.scheduling.policy import DECODE, PREFILL, PolicyBook
from app.security.limits import PRIORITIES
from app.state.store import PROGRESS, TERMINAL

REF = "#/components/schemas/"
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM = {"type": "number"}


def _obj(props: dict[str, Any], required: list[str] | None = None, extra: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": extra}
    out["required"] = list(props) if required is None else required
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


FINISH = {"type": "string", "enum": ["stop", "length"]}
USAGE = _obj(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _obj({"cached_tokens": _INT}),
    }
)
TIMINGS = _obj(
    {
        "queue_ms": _NUM,
        "prefill_ms": _NUM,
        "first_token_ms": {"type": ["number", "null"]},
        "total_ms": _NUM,
    }
)
_HEAD = {"id": _STR, "created": _INT, "model": _STR}
GENERATE = _obj(
    {
        "request_id": _STR,
        "model": _STR,
        "text": _STR,
        "output_ids": {"type": "array", "items": _INT},
        "finish_reason": FINISH,
        "prefill_worker": _STR,
        "decode_worker": _STR,
        "cached_tokens": _INT,
        "batch_id": _STR,
        "batch_size": _INT,
        "timings": _ref("Timings"),
        "usage": _ref("Usage"),
    }
)
SCHEMAS: dict[str, Any] = {
    "Error": _obj(
        {
            "error": _obj(
                {
                    "message": _STR,
                    "type": _STR,
                    "code": {"type": "string", "enum": sorted(KINDS)},
                    "retryable": {"type": "boolean"},
                }
            )
        }
    ),
    "Usage": USAGE,
    "Timings": TIMINGS,
    "Completion": _obj(
        {
            **_HEAD,
            "object": {"const": "text_completion"},
            "choices": {
                "type": "array",
                "items": _obj(
                    {"index": _INT, "text": _STR, "logprobs": {"type": "null"}, "finish_reason": FINISH}
                ),
            },
            "usage": _ref("Usage"),
        }
    ),
    "CompletionChunk": _obj(
        {
            **_HEAD,
            "object": {"const": "text_completion"},
            "choices": {
                "type": "array",
                "items": _obj(
                    {
                        "index": _INT,
                        "text": _STR,
                        "logprobs": {"type": "null"},
                        "finish_reason": {"type": ["string", "null"], "enum": ["stop", "length", None]},
                    }
                ),
            },
            "usage": _ref("Usage"),
        },
        required=["id", "object", "created", "model", "choices"],
    ),
    "ChatCompletion": _obj(
        {
            **_HEAD,
            "object": {"const": "chat.completion"},
            "choices": {
                "type": "array",
                "items": _obj(
                    {
                        "index": _INT,
                        "message": _obj({"role": {"const": "assistant"}, "content": _STR}),
                        "finish_reason": FINISH,
                    }
                ),
            },
            "usage": _ref("Usage"),
        }
    ),
    "ChatCompletionChunk": _obj(
        {
            **_HEAD,
            "object": {"const": "chat.completion.chunk"},
            "choices": {
                "type": "array",
                "items": _obj(
                    {
                        "index": _INT,
                        "delta": _obj({"role": {"const": "assistant"}, "content": _STR}, required=[]),
                        "finish_reason": {"type": ["string", "null"], "enum": ["stop", "length", None]},
                    }
                ),
            },
            "usage": _ref("Usage"),
        },
        required=["id", "object", "created", "model", "choices"],
    ),
    "Generation": GENERATE,
    "GenerationTokens": _obj(
        {"request_id": _STR, "token_ids": {"type": "array", "items": _INT}, "text": _STR}
    ),
    "GenerationDone": _obj(
        {**GENERATE["properties"], "text_tail": _STR, "done": {"type": "boolean", "enum": [True]}}
    ),
    "GenerationChunk": {"oneOf": [_ref("GenerationTokens"), _ref("GenerationDone")]},
    "RequestRecord": _obj(
        {
            "request_id": _STR,
            "state": {"type": "string", "enum": [*PROGRESS, *sorted(TERMINAL)]},
            "origin": _STR,
            "created_ms": _NUM,
            "updated_ms": _NUM,
        },
        required=["request_id", "state"],
    ),
    "CancelResult": _obj(
        {"request_id": _STR, "state": {"type": ["string", "null"]}, "cancelled": {"type": "boolean"}}
    ),
    "Model": _obj({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR}),
    "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
}

#: What each status means here, and the error codes behind it (README's error table says more).
STATUS_TEXT = {
    400: "invalid request: the message names the field and the rule (code invalid_request); a deadline "
    "shorter than the prompt's own prefill on an idle worker (deadline_too_short)",
    401: "missing or wrong admin token, or (FLEXLB_AUTH=keys) API key (unauthorized)",
    403: "the API key's tenant is disabled (forbidden)",
    404: "unknown model, request, worker or path (model_not_found, not_found)",
    409: "a request with this id is still running (duplicate_request)",
    413: "the body exceeds FLEXLB_MAX_BODY_BYTES (request_too_large)",
    415: "the body is not application/json (unsupported_media_type)",
    429: "rate_limited: the tenant is over a cluster-wide limit (x-ratelimit-* headers); overloaded: "
    "a prefill queue is full, no decode KV is left, or this replica is at its concurrency cap; "
    "slo_unattainable: the predicted time to first token misses the request's deadline; retry after "
    "Retry-After",
    499: "cancelled by DELETE /v1/requests/{id} or by the client going away (cancelled)",
    500: "internal error (internal)",
    502: "a worker failed the request (worker_error)",
    503: "no live worker, shared state unreachable, or the replica is draining; retry after Retry-After",
    504: "the request's deadline passed (deadline_exceeded)",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
GENERATION = [400, 401, 403, 404, 409, 413, 415, 429, 499, 500, 502, 503, 504]
ADMIN_BODY = [400, 401, 413, 415, 500]
#: The client API's reads with FLEXLB_AUTH=keys: no key, a disabled tenant, keys unreadable.
CLIENT_READ = [401, 403, 500, 503]
#: Per operation: the error statuses it can return.
ERRORS: dict[tuple[str, str], list[int]] = {
    ("post", "/v1/completions"): GENERATION,
    ("post", "/v1/chat/completions"): GENERATION,
    ("post", "/v1/generate"): GENERATION,
    ("get", "/v1/requests/{request_id}"): [400, 404, *CLIENT_READ],
    ("delete", "/v1/requests/{request_id}"): [400, 404, *CLIENT_READ],
    ("get", "/v1/models"): CLIENT_READ,
    ("get", "/v1/models/{model}"): [404, *CLIENT_READ],
    ("get", "/healthz"): [500],
    ("get", "/readyz"): [500],
    ("get", "/metrics"): [500],
    ("get", "/admin/workers"): [401, 500],
    ("post", "/admin/workers"): ADMIN_BODY,
    ("delete", "/admin/workers/{worker_id}"): [401, 404, 500],
    ("post", "/admin/workers/{worker_id}/drain"): [401, 404, 500],
    ("get", "/admin/leases"): [401, 500],
    ("get", "/admin/cache"): [401, 500],
    ("post", "/admin/cache/match"): ADMIN_BODY,
    ("get", "/admin/stats"): [400, 401, 500],
    ("get", "/admin/config"): [401, 500],
    ("get", "/admin/policies"): [401, 500],
    ("put", "/admin/config"): ADMIN_BODY,
    ("post", "/admin/stats/reset"): [401, 500],
    ("get", "/admin/keys"): [401, 500],
    ("post", "/admin/keys"): ADMIN_BODY,
    ("delete", "/admin/keys/{key_id}"): [401, 404, 500],
    ("put", "/admin/tenants/{tenant}/limits"): ADMIN_BODY,
}
# Every admin call reads Redis (its token check at least): Redis not answering is a 503
# `state_unavailable` there too (app/gateway/errors.py), as it is on the client API.
for _op in [op for op in ERRORS if op[1].startswith("/admin/")]:
    ERRORS[_op] = sorted({*ERRORS[_op], 503})
#: Success bodies: (JSON schema, streaming chunk schema or None).
SUCCESS: dict[tuple[str, str], tuple[str, str | None]] = {
    ("post", "/v1/completions"): ("Completion", "CompletionChunk"),
    ("post", "/v1/chat/completions"): ("ChatCompletion", "ChatCompletionChunk"),
    ("post", "/v1/generate"): ("Generation", "GenerationChunk"),
    ("get", "/v1/requests/{request_id}"): ("RequestRecord", None),
    ("get", "/v1/models"): ("ModelList", None),
    ("get", "/v1/models/{model}"): ("Model", None),
}
#: Request headers the generation endpoints read.
HEADERS = [
    {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "client request id (the native body's request_id wins); a finished id returns "
        "its stored outcome, unless it failed retryable or was cancelled: then it runs again; a "
        "running one is 409",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:\\-]{1,128}$"},
    },
    {
        "name": "traceparent",
        "in": "header",
        "required": False,
        "description": "W3C trace context; its trace id is logged with the request (ignored if malformed)",
        "schema": {"type": "string"},
    },
    {
        "name": "x-flexlb-priority",
        "in": "header",
        "required": False,
        "description": "priority class (default `default`), lowered to the tenant's max_priority "
        "(without tenants: interactive); under overload a replica refuses the lower classes first",
        "schema": {"type": "string", "enum": list(PRIORITIES)},
    },
]
SSE_TEXT = (
    "With `stream: true`: server-sent events, each `data: <JSON>` (its schema is `contentSchema`), "
    "the last one `data: [DONE]`. A failure after the first event is one more event with the Error "
    "schema before `[DONE]`."
)


def _sse_event(chunk: str) -> dict[str, Any]:
    """One server-sent event (before OpenAPI 3.2, a stream's `schema` describes each event)."""
    data = {
        "description": "a JSON chunk, or [DONE] at the end",
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"oneOf": [_ref(chunk), _ref("Error")]},
            },
        ],
    }
    return {"type": "object", "description": SSE_TEXT, "required": ["data"], "properties": {"data": data}}


def _error_response(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": STATUS_TEXT[status],
        "content": {"application/json": {"schema": _ref("Error")}},
    }
    if status in (429, 503):
        out["headers"] = RETRY_AFTER
    return out


def _request_rules(
    doc: dict[str, Any], model: str, max_new: int, vocab: int, policies: Mapping[str, Sequence[str]]
) -> None:
    """Settings-dependent limits and the cross-field rule of the native body."""
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [model], "description": "the served model"}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["anyOf"][0]["maximum"] = max_new
        props["seed"]["anyOf"][0]["maximum"] = SEED_MAX
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    prompt[2]["items"]["maximum"] = vocab - 1
    gen = schemas["GenerateRequest"]
    gen["properties"]["model"]["anyOf"][0]["enum"] = [model]
    gen["properties"]["max_new_tokens"]["anyOf"][0]["maximum"] = max_new
    gen["properties"]["input_ids"]["items"]["maximum"] = vocab - 1
    # Exactly one of prompt and input_ids, neither of them null.
    # Exactly one of prompt and input_ids: with both, both branches match, which oneOf refuses.
    gen["oneOf"] = [{"required": ["prompt"]}, {"required": ["input_ids"]}]
    patch = schemas["ConfigPatch"]["properties"]
    patch["prefill_strategy"]["enum"] = sorted(policies[PREFILL])
    patch["decode_strategy"]["enum"] = sorted(policies[DECODE])
    schemas["CacheMatch"]["properties"]["input_ids"]["items"]["maximum"] = vocab - 1


def build_openapi(
    app: FastAPI,
    model: str,
    max_new_tokens: int,
    vocab: int,
    policies: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """``policies``: role → the policy names this replica accepts (its policy registry); the
    built-in ones when not given."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=(
            "FlexLB gateway: OpenAI-compatible completions and chat, the native generate API, "
            "request status and cancel, and the admin API (bearer token). Every error is "
            '`{"error": {"message", "type", "code", "retryable"}}`; see docs/api.md.'
        ),
        routes=app.routes,
    )
    comps = doc.setdefault("components", {})
    schemas = comps.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(SCHEMAS)
    comps["securitySchemes"] = {"adminToken": {"type": "http", "scheme": "bearer"}}
    if policies is None:
        book = PolicyBook()
        policies = {PREFILL: book.names(PREFILL), DECODE: book.names(DECODE)}
    _request_rules(doc, model, max_new_tokens, vocab, policies)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            responses.pop("422", None)
            for status in ERRORS.get((method, path), [500]):
                responses[str(status)] = _error_response(status)
            if path.startswith("/admin/"):
                op["security"] = [{"adminToken": []}]
            ok = next((s for s in ("200", "202") if s in responses), None)
            if (method, path) in SUCCESS and ok:
                body, chunk = SUCCESS[(method, path)]
                content: dict[str, Any] = {"application/json": {"schema": _ref(body)}}
                if chunk:
                    content["text/event-stream"] = {"schema": _sse_event(chunk)}
                responses[ok]["content"] = content
    _special_cases(doc)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/generate"):
        doc["paths"][path]["post"].setdefault("parameters", []).extend(HEADERS)
    return doc


def _special_cases(doc: dict[str, Any]) -> None:
    paths = doc["paths"]
    delete = paths["/v1/requests/{request_id}"]["delete"]["responses"]
    body = {"application/json": {"schema": _ref("CancelResult")}}
    delete["200"] = {"description": "the request had already ended: nothing to cancel", "content": body}
    delete["202"] = {"description": "cancel sent to the request's origin replica", "content": body}
    paths["/readyz"]["get"]["responses"]["503"] = {
        "description": "not ready: the body's `reasons` say why",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    paths["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
