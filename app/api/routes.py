"""Client endpoints: OpenAI-compatible completions/chat, the native generate API, request
status and cancel. Every error is the typed model of DESIGN §8; a stream that fails after its
first byte ends with an SSE error event, never a silent close."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from app.api.arrival import arrival_of
from app.api.fast_json import FastJsonRoute
from app.api.schemas import ChatRequest, CompletionRequest, GenerateRequest, sampling_of
from app.api.stop import StopText, TokenStop, cut_at_stop
from app.api.streaming import (
    KEEPALIVE,
    answer,
    collect,
    guarded,
    relay,
    sse,
    sse_error,
    stored_or_error,
    stream_response,
)
from app.dispatch.items import level_of
from app.gateway.errors import ApiError, check_token_ids
from app.request.pipeline import TERMINAL, GenRequest
from app.security.limits import REQUEST_ID, REQUEST_ID_RULE, ask_priority, trace_id_from, valid_request_id
from app.security.tenants import path_id, public_id, scoped_id, tenant_of
from app.state.lifecycle import current_attempt
from app.tokens.chat import ChatTemplateError, render_chat
from app.tokens.detok import IncrementalDetokenizer

router = APIRouter(route_class=FastJsonRoute)  # bodies parsed sooner, same value (app/api/fast_json.py)


def _replica(request: Request) -> Any:
    return request.app.state.replica


def _ids(request: Request, body_id: str | None = None) -> tuple[str, str, bool]:
    """(request id, trace id, whether the id is freshly generated): a client id from the body or
    X-Request-Id, else a UUID; the trace from traceparent."""
    header = request.headers.get("x-request-id")
    for where, value in (("X-Request-Id", header), ("request_id", body_id)):
        if value is not None and not valid_request_id(value):
            raise ApiError("invalid_request", f"{where}: {REQUEST_ID_RULE.removeprefix('request id ')}")
    client = body_id if body_id is not None else header
    rid = uuid.uuid4().hex if client is None else client
    return rid, trace_id_from(request.headers.get("traceparent")), not client


def _check_model(r: Any, model: str | None) -> str:
    served = r.settings.model
    if model is not None and model != served:
        raise ApiError("model_not_found", f"model: {model!r} is not served here (serving {served!r})")
    return served


def _check_limits(r: Any, n_in: int, max_new: int, field: str, prompt_field: str) -> None:
    """The limits that depend on the settings; `field` names the client's parameter."""
    if n_in <= 0:
        raise ApiError("invalid_request", f"{prompt_field}: must not be empty")
    if max_new < 1:
        raise ApiError("invalid_request", f"{field}: must be >= 1")
    if max_new > r.settings.max_new_tokens_limit:
        raise ApiError("invalid_request", f"{field}: must be <= {r.settings.max_new_tokens_limit}")
    if n_in + max_new > r.settings.max_context_tokens:
        raise ApiError(
            "invalid_request",
            f"{field}: prompt ({n_in} tokens) + {field} ({max_new}) exceeds the context "
            f"({r.settings.max_context_tokens} tokens)",
        )


def _default_max(r: Any) -> int:
    """OpenAI's default of 16 new tokens, within this gateway's limit."""
    return min(16, int(r.settings.max_new_tokens_limit))


def _check_ids(r: Any, ids: list[int], field: str) -> None:
    check_token_ids(ids, int(r.tokenizer.vocab_size), field)


def _timeout(r: Any, timeout_ms: int | None) -> int:
    if timeout_ms is None:
        return int(r.settings.default_timeout_ms)
    if timeout_ms <= 0 or timeout_ms > 3_600_000:
        raise ApiError("invalid_request", "timeout_ms: must be in [1, 3600000]")
    return timeout_ms


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "flexlb"}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_replica(request).settings.model)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    """OpenAI's model retrieve (`client.models.retrieve`), which SDK users and frameworks call to
    check that a model exists before using it. `:path`: served names may hold a `/`."""
    _check_model(_replica(request), model)
    return _model_card(model)


def _usage(o: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": o["prompt_tokens"],
        "completion_tokens": o["completion_tokens"],
        "total_tokens": o["prompt_tokens"] + o["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": o["cached_tokens"]},
    }


def _text(r: Any, ids: list[int]) -> str:
    return str(r.tokenizer.decode(ids))


async def _prepare(
    request: Request,
    r: Any,
    ids: list[int],
    max_new: int,
    timeout_ms: int | None,
    body_rid: str | None,
    endpoint: str,
    fields: tuple[str, str] = ("max_new_tokens", "prompt"),
    stops: list[str] | None = None,
    user: str | None = None,
    deadline_ms: int | None = None,
    priority: str | int | None = None,
) -> GenRequest:
    """`fields`: the client's names of the token limit and the prompt, for error messages."""
    _check_limits(r, len(ids), max_new, *fields)
    rid, trace, fresh = _ids(request, body_rid)
    rid = scoped_id(tenant_of(request), rid)  # ids live in their tenant's namespace
    deadline = _deadline(request, deadline_ms)
    if not r.redis_ok:
        raise ApiError("state_unavailable", f"shared state unavailable: {r.redis_reason}", retry_after_s=1)
    timeout = _timeout(r, timeout_ms)
    if priority is not None:  # the body's class, where the endpoint has one: like the header's
        ask_priority(request.scope.setdefault("state", {}), priority)
    # the tenant's limits: checked in the request's first round trip (app/security/ratelimit.py)
    limit = request.app.state.tenants.check(request, len(ids) + max_new, timeout)
    stop = TokenStop(r.tokenizer, stops) if stops else None
    return GenRequest(
        rid,
        ids,
        max_new,
        timeout,
        trace,
        endpoint,
        fresh_id=fresh,
        stop=stop,
        user=user or "",
        deadline_ms=deadline,
        priority=level_of(request.scope.get("state", {}).get("priority")),  # set by ConcurrencyCap
        t_arrival=arrival_of(request.scope),
        limit=limit,
    )


def _deadline(request: Request, body_ms: int | None) -> float:
    """The request's TTFT deadline in ms: the body's `deadline_ms`, else the `x-flexlb-slo-ms`
    header, else 0 (the cluster SLO). SLO admission answers 429 when it cannot be met."""
    if body_ms is not None:
        return float(body_ms)
    raw = request.headers.get("x-flexlb-slo-ms")
    if raw is None:
        return 0.0
    try:
        v = float(raw)
    except ValueError:
        raise ApiError("invalid_request", "x-flexlb-slo-ms: must be a number of milliseconds") from None
    if not 0 < v <= 3_600_000:
        raise ApiError("invalid_request", "x-flexlb-slo-ms: must be in (0, 3600000]")
    return v


# ---- OpenAI completions ------------------------------------------------------------------------
@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    r = _replica(request)
    model = _check_model(r, body.model)
    if isinstance(body.prompt, str):
        ids = r.tokenizer.encode(body.prompt)
    elif all(isinstance(x, int) for x in body.prompt):
        ids = list(body.prompt)  # type: ignore[arg-type]
        _check_ids(r, ids, "prompt")
    else:  # the schema admits exactly one string here
        ids = r.tokenizer.encode(str(body.prompt[0]))
    stops = body.stops()
    max_new = body.max_tokens if body.max_tokens is not None else _default_max(r)
    req = await _prepare(
        request, r, ids, max_new, None, None, "completions", ("max_tokens", "prompt"), stops, body.user
    )
    req.sampling = sampling_of(body)
    cid = f"cmpl-{public_id(req.request_id)}"
    created = int(time.time())
    if not body.stream:
        o = await guarded(request, collect(r, req))
        return answer(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": cut_at_stop(_text(r, o["output_ids"]), stops),
                        "logprobs": None,
                        "finish_reason": o["finish_reason"] or "length",
                    }
                ],
                "usage": _usage(o),
            }
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def piece(text: str, where: str) -> dict[str, Any]:
        return {"text": text, "logprobs": None}

    gen = _openai_stream(r, req, cid, created, model, "text_completion", include_usage, piece, stops)
    return await stream_response(request, gen)


async def _openai_stream(
    r: Any,
    req: GenRequest,
    cid: str,
    created: int,
    model: str,
    obj: str,
    include_usage: bool,
    piece: Callable[[str, str], dict[str, Any]],
    stops: list[str],
) -> AsyncIterator[bytes]:
    """The SSE body both OpenAI endpoints share; they differ only in how a piece of text sits in
    a choice (`piece(text, where)`, where is first | more | last): `text` for completions, a
    `delta` for chat. A request id retried after it finished replays its stored outcome (unless
    that outcome invited the retry: app/state/lifecycle.py). Text that may begin a stop string
    is held back until it is known not to (`StopText`)."""
    detok = IncrementalDetokenizer(r.tokenizer)
    stop = StopText(stops)

    def chunk(part: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, **part, "finish_reason": finish}
        return sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]})

    async for kind, payload in relay(r, req):
        if kind in ("admitted", "keepalive"):
            yield KEEPALIVE
        elif kind == "first":
            yield chunk(piece(stop.feed(detok.feed([payload])), "first"))
        elif kind == "tokens":
            t = stop.feed(detok.feed(payload))
            if t:
                yield chunk(piece(t, "more"))
        elif kind in ("end", "stored"):
            o = payload if kind == "end" else stored_or_error(payload)
            if isinstance(o, ApiError):
                yield sse_error(o)
                break
            if kind == "stored":
                yield chunk(piece(stop.feed(_text(r, o["output_ids"])), "first"))
            tail = stop.feed(detok.flush()) + stop.flush()
            yield chunk(piece(tail, "last"), o["finish_reason"] or "length")
            if include_usage:
                usage = {"id": cid, "object": obj, "created": created, "model": model, "choices": []}
                yield sse({**usage, "usage": _usage(o)})
        elif kind == "error":
            yield sse_error(payload)
            break
    yield b"data: [DONE]\n\n"


# ---- OpenAI chat -------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatRequest, request: Request) -> Any:
    r = _replica(request)
    model = _check_model(r, body.model)
    try:
        text = render_chat(
            [m.model_dump(exclude_none=True) for m in body.messages], add_generation_prompt=True
        )
    except ChatTemplateError as exc:
        raise ApiError("invalid_request", str(exc)) from None
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        _check_limits(r, 1, body.max_tokens, "max_tokens", "messages")  # the one not used: in range too
    field, max_new = "max_completion_tokens", body.max_completion_tokens
    if max_new is None:
        field, max_new = "max_tokens", body.max_tokens
    stops = body.stops()
    req = await _prepare(
        request,
        r,
        r.tokenizer.encode(text),
        max_new if max_new is not None else _default_max(r),
        None,
        None,
        "chat",
        (field, "messages"),
        stops,
        body.user,
    )
    req.sampling = sampling_of(body)
    cid = f"chatcmpl-{public_id(req.request_id)}"
    created = int(time.time())
    if not body.stream:
        o = await guarded(request, collect(r, req))
        return answer(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": cut_at_stop(_text(r, o["output_ids"]), stops),
                        },
                        "finish_reason": o["finish_reason"] or "length",
                    }
                ],
                "usage": _usage(o),
            }
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def piece(text: str, where: str) -> dict[str, Any]:
        if where == "first":
            return {"delta": {"role": "assistant", "content": text}}
        return {"delta": {"content": text} if text or where != "last" else {}}

    gen = _openai_stream(r, req, cid, created, model, "chat.completion.chunk", include_usage, piece, stops)
    return await stream_response(request, gen)


# ---- native ------------------------------------------------------------------------------------
def _native(r: Any, o: dict[str, Any]) -> dict[str, Any]:
    return {
        "request_id": public_id(o["request_id"]),
        "model": r.settings.model,
        "text": _text(r, o["output_ids"]),
        "output_ids": o["output_ids"],
        "finish_reason": o["finish_reason"] or "length",
        "prefill_worker": o["prefill_worker"],
        "decode_worker": o["decode_worker"],
        "cached_tokens": o["cached_tokens"],
        "batch_id": o["batch_id"],
        "batch_size": o["batch_size"],
        "timings": o["timings"],
        "usage": _usage(o),
    }


@router.post("/v1/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Any:
    r = _replica(request)
    _check_model(r, body.model)
    if body.input_ids is not None:  # the schema admits exactly one of input_ids and prompt
        _check_ids(r, body.input_ids, "input_ids")
        ids = list(body.input_ids)
        prompt_field = "input_ids"
    else:
        ids = r.tokenizer.encode(body.prompt or "")
        prompt_field = "prompt"
    req = await _prepare(
        request,
        r,
        ids,
        body.max_new_tokens if body.max_new_tokens is not None else _default_max(r),
        body.timeout_ms,
        body.request_id,
        "generate",
        ("max_new_tokens", prompt_field),
        deadline_ms=body.deadline_ms,
        priority=body.priority,
    )
    req.sampling = sampling_of(body)
    if not body.stream:
        return answer(_native(r, await guarded(request, collect(r, req))))

    async def gen() -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(r.tokenizer)
        async for kind, payload in relay(r, req):
            if kind in ("admitted", "keepalive"):
                yield KEEPALIVE
            elif kind == "first":
                yield sse(
                    {
                        "request_id": public_id(req.request_id),
                        "token_ids": [payload],
                        "text": detok.feed([payload]),
                    }
                )
            elif kind == "tokens":
                yield sse(
                    {
                        "request_id": public_id(req.request_id),
                        "token_ids": payload,
                        "text": detok.feed(payload),
                    }
                )
            elif kind in ("end", "stored"):
                o = payload if kind == "end" else stored_or_error(payload)
                if isinstance(o, ApiError):
                    yield sse_error(o)
                    break
                yield sse({**_native(r, o), "text_tail": detok.flush(), "done": True})
            elif kind == "error":
                yield sse_error(payload)
                break
        yield b"data: [DONE]\n\n"

    return await stream_response(request, gen())


# ---- request status and cancel -----------------------------------------------------------------
#: A request id in a path: published in the OpenAPI document and checked (braces would change
#: the Redis hash tag of the key it names).
RequestIdPath = Annotated[str, PathParam(pattern=REQUEST_ID.pattern)]


@router.get("/v1/requests/{request_id}")
async def get_request(request_id: RequestIdPath, request: Request) -> dict[str, Any]:
    r = _replica(request)
    # another tenant's id: not found; a retried id: its current attempt (app/state/lifecycle.py)
    _, rec = await current_attempt(r.store, path_id(request, request_id))
    if rec is None:
        raise ApiError("not_found", f"unknown request {request_id!r}")
    outcome = rec.get("outcome")
    if isinstance(outcome, dict) and "request_id" in outcome:
        rec["outcome"] = {**outcome, "request_id": public_id(outcome["request_id"])}
    return {**typed_record(rec), "request_id": request_id}


#: Record fields that hold numbers (Redis stores strings): by name, or by suffix.
NUMERIC_FIELDS = frozenset({"priority", "batch_size", "fence", "attempts", "attempt", "handoffs"})
NUMERIC_SUFFIXES = ("_ms", "_tokens", "_s")


def typed_record(rec: dict[str, Any]) -> dict[str, Any]:
    """The lifecycle record with its numbers as JSON numbers (issue #19: they came back as strings)."""
    out: dict[str, Any] = {}
    for key, value in rec.items():
        if isinstance(value, str) and (key in NUMERIC_FIELDS or key.endswith(NUMERIC_SUFFIXES)):
            try:
                num = float(value)
            except ValueError:
                out[key] = value
                continue
            out[key] = int(num) if num.is_integer() and "." not in value and "e" not in value else num
        else:
            out[key] = value
    return out


@router.delete("/v1/requests/{request_id}")
async def cancel_request(request_id: RequestIdPath, request: Request) -> JSONResponse:
    """Cancel from any replica: the origin runs the clean-up (it holds the request's task).

    Durable (issue 14): the queued prefill is tombstoned at once (its owner's commit drops it), and
    the cancel is recorded in the origin's cancel set, which the origin drains on its sweep period; the
    notify message is only the fast path. The answer says what was found: `running` (202),
    `finished` (200, nothing to cancel), or an unknown id (404)."""
    r = _replica(request)
    client_id, request_id = request_id, path_id(request, request_id)
    request_id, rec = await current_attempt(r.store, request_id)  # a retried id: its current attempt
    if rec is None:
        raise ApiError("not_found", f"unknown request {client_id!r}")
    if rec.get("state") in TERMINAL:
        return JSONResponse(
            {"request_id": client_id, "state": rec["state"], "cancelled": False, "found": "finished"}
        )
    origin = rec.get("origin", "")
    if rec.get("prefill_worker"):
        await r.store.tombstone(rec["prefill_worker"], request_id, 60_000)
    if origin == r.replica_id:
        r.pipeline.cancel_local(request_id)
    else:
        async with r.redis.pipeline(transaction=False) as p:
            p.sadd(r.keys.cancels(origin), request_id)
            p.publish(r.keys.notify(origin), f"cancel:{request_id}")
            await p.execute()
    return JSONResponse(
        {"request_id": client_id, "state": rec.get("state"), "cancelled": True, "found": "running"},
        status_code=202,
    )
