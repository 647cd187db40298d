"""OpenAI fidelity and errors a person can act on (issue #19), through the `openai` SDK and raw HTTP
against live gateways over the session's real Triton workers.

`stop` is checked against a reference: the simulated engines' output depends only on the request
id (docs/worker-protocol.md), so a request run without `stop` on one cluster shows the text the
same id produces on another cluster, where it runs with `stop`.
"""

from __future__ import annotations

import gzip
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from app.state.keys import Keys

from .conftest import worker_call
from .gateways import Gateway, start_gateway, wait_for

MODEL = "flexlb-sim"
PROMPT = "Tell me a story about stop strings."
MESSAGES = [{"role": "user", "content": "Tell me a story about stop strings."}]
REF_TOKENS = 48  # reference output length: printable-ASCII byte tokens, so one character each
MANY = 4000  # a budget the stop must cut short: ~32 s of decode at the pool's 8 ms per token


@pytest.fixture(scope="module")
def gws(worker_pool, shared_embedded_redis, tmp_path_factory) -> Iterator[tuple[Gateway, Gateway]]:
    """(reference, gateway under test): two clusters over the same workers."""
    tmp = tmp_path_factory.mktemp("fidelity")
    workers = ",".join(f"{w.role}@{w.address}" for ws in worker_pool.values() for w in ws)
    started: list[Gateway] = []
    try:
        for tag in ("ref", "gw"):
            cluster = f"t-{tag}-{uuid.uuid4().hex[:6]}"
            started.append(start_gateway(tmp, shared_embedded_redis, cluster, workers=workers))
            started[-1].env["cluster"] = cluster
        for g in started:
            wait_for(lambda g=g: g.readyz()["ready"], 60, what="gateway ready")
        yield started[0], started[1]
    finally:
        for g in started:
            g.stop()


@pytest.fixture(scope="module")
def rds(shared_embedded_redis) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(shared_embedded_redis)
    yield r
    r.close()


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="-", max_retries=0, timeout=60)


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def run(gw: Gateway, endpoint: str, stream: bool, rid: str, **kw: Any) -> dict[str, Any]:
    """One request through the SDK: its text, pieces (streamed), finish reason and usage."""
    c = sdk(gw)
    headers = {"X-Request-Id": rid}
    if endpoint == "completions":
        call: Any = c.completions.create
        args: dict[str, Any] = {"prompt": PROMPT}
    else:
        call = c.chat.completions.create
        args = {"messages": MESSAGES}
    if not stream:
        r = call(model=MODEL, extra_headers=headers, **args, **kw)
        ch = r.choices[0]
        text = ch.text if endpoint == "completions" else ch.message.content
        return {"text": text, "pieces": [text], "finish": ch.finish_reason, "usage": r.usage}
    pieces, finish, usage = [], None, None
    for chunk in call(
        model=MODEL, stream=True, stream_options={"include_usage": True}, extra_headers=headers, **args, **kw
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.text if endpoint == "completions" else (ch.delta.content or "")
            if piece:
                pieces.append(piece)
            finish = ch.finish_reason or finish
    return {"text": "".join(pieces), "pieces": pieces, "finish": finish, "usage": usage}


def decode_holds(pool: dict, rid: str) -> list[str]:
    """Where the engines still hold `rid` (a live decode, a pinned prefill KV)."""
    out = []
    for w in pool["decode"]:
        live = worker_call(w.address, "status")["live"]
        out += [f"decode:{phase}" for phase, ids in live.items() if rid in ids]
    for w in pool["prefill"]:
        if rid in worker_call(w.address, "status")["pinned"]:
            out.append("prefill:pinned")
    return out


# ---- stop -------------------------------------------------------------------------------------
CASES = [
    ("completions", False, "boundary"),
    ("completions", True, "boundary"),
    ("chat", False, "boundary"),
    ("chat", True, "boundary"),
    ("completions", True, "first"),
]


@pytest.mark.parametrize(("endpoint", "stream", "where"), CASES)
def test_stop_ends_the_text_before_the_stop_string_and_cancels_the_decode(
    gws: tuple[Gateway, Gateway], worker_pool, rds: redis.Redis, endpoint: str, stream: bool, where: str
) -> None:
    ref_gw, gw = gws
    rid = uid("stop")
    ref = run(ref_gw, endpoint, True, rid, max_tokens=REF_TOKENS)
    full = ref["text"]
    assert len(full) == REF_TOKENS and ref["finish"] == "length", ref
    if where == "first":  # the first token (from prefill) completes the stop string
        s1 = full[0]
    else:  # a stop string across a chunk boundary of the reference stream
        bounds = [sum(len(p) for p in ref["pieces"][:i]) for i in range(1, len(ref["pieces"]))]
        b = next((x for x in bounds if 6 <= x <= REF_TOKENS - 12), 20)
        s1 = full[b - 3 : b + 2]
    at = full.find(s1)
    later = full[at + len(s1) + 2 : at + len(s1) + 5]
    stops = ["\n\n", s1, later] if later else ["\n\n", s1]  # the engines never emit "\n": a decoy
    # Generation ends where a stop string first completes; the text ends before that string.
    end, idx = min((full.find(s) + len(s), full.find(s)) for s in stops if s in full)

    t0 = time.monotonic()
    got = run(gw, endpoint, stream, rid, max_tokens=MANY, stop=stops)
    elapsed = time.monotonic() - t0

    assert got["text"] == full[:idx], (got, full, stops)
    assert got["finish"] == "stop"
    assert got["usage"].completion_tokens == end  # the tokens generated, the stop's included
    assert got["usage"].total_tokens == got["usage"].prompt_tokens + got["usage"].completion_tokens
    assert elapsed < 15, f"{elapsed:.1f}s: the decode was not cut short"
    if stream:
        assert all(s not in p for p in got["pieces"] for s in stops)
    rec = gw.get(f"/v1/requests/{rid}").json()
    assert rec["state"] == "completed" and rec["outcome"]["finish_reason"] == "stop", rec
    assert rec["outcome"]["completion_tokens"] == end
    wait_for(lambda: not decode_holds(worker_pool, rid), 5, what=f"engines release {rid}")
    keys = Keys(gw.env["cluster"])  # and the gateway's decode KV reservation is released
    assert not any(rds.hexists(keys.reservations(f"decode@{w.address}"), rid) for w in worker_pool["decode"])


def test_stop_without_a_match_runs_to_max_tokens(gws: tuple[Gateway, Gateway]) -> None:
    ref_gw, gw = gws
    rid = uid("nostop")
    full = run(ref_gw, "chat", False, rid, max_tokens=20)["text"]
    got = run(gw, "chat", True, rid, max_tokens=20, stop=["\n\n", "\t"])
    assert got["text"] == full and got["finish"] == "length"
    assert got["usage"].completion_tokens == 20


# ---- parameters ------------------------------------------------------------------------------
REJECTED_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 7}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"65": 5}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"user": 5}, "user"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
]


def test_unsupported_or_out_of_range_parameters_are_400_naming_the_parameter(
    gws: tuple[Gateway, Gateway],
) -> None:
    c = sdk(gws[1])
    for kw, param in REJECTED_CHAT:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        err = exc.value.body
        assert exc.value.status_code == 400 and err["code"] == "invalid_request", (kw, err)
        assert err["message"].startswith(f"{param}:"), (kw, err["message"])
    for kw, param in [
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"n": 3}, "n"),
    ]:
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model=MODEL, prompt="x", **kw)
        assert exc.value.body["message"].startswith(f"{param}:"), (kw, exc.value.body)


def test_supported_parameters_are_accepted_and_honoured(gws: tuple[Gateway, Gateway]) -> None:
    gw = gws[1]
    c = sdk(gw)
    for kw in (
        {"temperature": 0, "top_p": 1, "seed": 42},
        {"temperature": 2, "top_p": 0, "n": 1, "logprobs": False, "frequency_penalty": 0},
        {"response_format": {"type": "text"}, "tool_choice": "none", "presence_penalty": 0.0},
    ):
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, **kw)
        assert r.usage.completion_tokens == 3, kw
    # max_completion_tokens wins over the older max_tokens, as in OpenAI's API
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].message.content) == 5
    # usage is exact: the prompt as rendered and tokenised (byte tokenizer: its UTF-8 length)
    r2 = c.completions.create(model=MODEL, prompt="Héllo ✓", max_tokens=4)
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens, r2.usage.total_tokens) == (10, 4, 14)
    # `user` is recorded with the request's log lines
    user = f"user-{uuid.uuid4().hex[:6]}"
    c.completions.create(model=MODEL, prompt="x", max_tokens=2, user=user)
    wait_for(lambda: user in gw.log(), 5, what="the user id in the gateway's log")


def test_a_developer_message_is_the_system_message(gws: tuple[Gateway, Gateway]) -> None:
    """OpenAI's `developer` role (what newer SDKs and agent frameworks send in place of `system`)
    was a 400; it is the system instruction, rendered as one: the same prompt, so the same
    tokens and the same prefix cache."""
    c = sdk(gws[1])
    usage = {}
    for role in ("system", "developer"):
        msgs = [{"role": role, "content": "Answer briefly."}, *MESSAGES]
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
        usage[role] = r.usage.prompt_tokens if r.usage else None
    assert usage["developer"] == usage["system"] and usage["system"], usage


def test_null_valued_fields_clients_send_are_their_off_value(gws: tuple[Gateway, Gateway]) -> None:
    """What clients that serialise every field send, as OpenAI accepts it: `"stream": null` (was
    400 "stream: must be true or false"), and an earlier reply sent back as
    `resp.choices[0].message.model_dump()` (`refusal`, `annotations`, `audio`, `function_call`,
    `tool_calls` all null: was 400 "messages[1].refusal: unknown parameter"). A tool call that
    is there is still refused, naming the field."""
    gw = gws[1]
    c = sdk(gw)
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": None}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": None}),
        ("/v1/generate", {"prompt": PROMPT, "max_new_tokens": 2, "stream": None}),
    ):
        resp = httpx.post(gw.url + path, json=body, timeout=30)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json"), (
            path,
            resp.text,
        )
    first = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).choices[0].message
    echoed = first.model_dump()
    assert echoed["refusal"] is None and "tool_calls" in echoed, echoed  # what the SDK gives
    turn = [*MESSAGES, echoed, {"role": "user", "content": "And then?"}]
    r = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=2)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == 2
    with_tool_calls = {"role": "assistant", "content": None, "tool_calls": []}
    c.chat.completions.create(model=MODEL, messages=[*MESSAGES, with_tool_calls], max_tokens=2)  # type: ignore[list-item]
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(
            model=MODEL,
            messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": call}],  # type: ignore[list-item]
            max_tokens=2,
        )
    assert exc.value.body["message"].startswith("messages[1].tool_calls: tools are not supported"), (
        exc.value.body
    )


def test_models_retrieve_answers_the_served_model_and_404s_another(gws: tuple[Gateway, Gateway]) -> None:
    """`client.models.retrieve(name)` (GET /v1/models/{model}), what SDK users and frameworks call
    to check a model exists, answered 404 `not_found` "no such endpoint" for the served model."""
    c = sdk(gws[1])
    m = c.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "flexlb")
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found", exc.value.body
    assert "gpt-4o" in exc.value.body["message"], exc.value.body


# ---- errors ----------------------------------------------------------------------------------
def post(gw: Gateway, path: str, content: bytes, ctype: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": ctype} if ctype else {}
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=10)


def message(resp: httpx.Response, status: int, code: str = "invalid_request") -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["retryable"] is False, err
    return str(err["message"])


def test_errors_name_the_field_and_the_rule(gws: tuple[Gateway, Gateway]) -> None:
    gw = gws[1]
    bad_json = b'{"model": "flexlb-sim",\n "prompt": }'
    assert message(post(gw, "/v1/completions", bad_json), 400).startswith("invalid JSON at line 2 column 12")
    msg = message(post(gw, "/v1/completions", b"hello", "text/plain"), 415, "unsupported_media_type")
    assert "text/plain" in msg and "application/json" in msg
    assert message(post(gw, "/v1/chat/completions", b""), 400).startswith("request body:")
    body = b'{"model": "flexlb-sim", "messages": [{"role": "user"}]}'
    assert message(post(gw, "/v1/chat/completions", body), 400) == "messages[0].content: field required"
    body = b'{"model": "flexlb-sim", "messages": [{"role": "bot", "content": "x"}]}'
    assert message(post(gw, "/v1/chat/completions", body), 400).startswith("messages[0]: role must be one of")
    assert message(post(gw, "/v1/generate", b'{"prompt": "x", "max_new_tokens": -1}'), 400) == (
        "max_new_tokens: must be >= 1"
    )
    assert message(post(gw, "/v1/generate", b'{"prompt": "x", "max_new_tokens": 100000}'), 400) == (
        "max_new_tokens: must be <= 8192"
    )
    assert message(post(gw, "/v1/generate", b'{"input_ids": [1, 300]}'), 400).startswith("input_ids[1]:")
    assert "prompt or input_ids" in message(post(gw, "/v1/generate", b"{}"), 400)
    assert (
        message(post(gw, "/v1/generate", b'{"prompt": "x", "colour": 1}'), 400) == "colour: unknown parameter"
    )
    # 405 says what is allowed (RFC 9110), 404 is typed
    r = httpx.request("TRACE", gw.url + "/v1/completions", timeout=5)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.put(gw.url + "/v1/requests/abc", timeout=5)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD"
    assert message(httpx.get(gw.url + "/v2/nothing", timeout=5), 404, "not_found")


def test_bodies_that_cannot_be_parsed_say_why(gws: tuple[Gateway, Gateway]) -> None:
    """A body that is not UTF-8 (a gzip-compressed one, Latin-1 text), nested past the parser's
    depth, or holding an integer too long to convert was a 400 "There was an error parsing the
    body", a message nobody can act on: it names what is wrong."""
    gw = gws[1]
    raw = b'{"model": "flexlb-sim", "prompt": "x", "max_tokens": 2}'
    resp = httpx.post(
        gw.url + "/v1/completions",
        content=gzip.compress(raw),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=10,
    )
    msg = message(resp, 400)
    assert msg.startswith("request body: not UTF-8") and "content-encoding 'gzip'" in msg, msg
    latin1 = '{"model": "flexlb-sim", "prompt": "café", "max_tokens": 2}'.encode("latin-1")
    assert message(post(gw, "/v1/completions", latin1), 400).startswith("request body: not UTF-8"), latin1
    deep = b'{"model": "flexlb-sim", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert message(post(gw, "/v1/completions", deep), 400).startswith("request body: JSON nested too deeply")
    big = b'{"model": "flexlb-sim", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    assert message(post(gw, "/v1/completions", big), 400).startswith("request body: ")
    assert "integer" in message(post(gw, "/v1/completions", big), 400)


def test_request_record_fields_are_typed(gws: tuple[Gateway, Gateway]) -> None:
    gw = gws[1]
    rid = uid("typed")
    r = httpx.post(
        gw.url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 3, "request_id": rid}, timeout=30
    )
    assert r.status_code == 200, r.text
    rec = gw.get(f"/v1/requests/{rid}").json()
    for key in ("created_ms", "updated_ms", "input_tokens"):
        assert isinstance(rec[key], int) and not isinstance(rec[key], bool), (key, rec)
    assert rec["input_tokens"] == 1 and rec["state"] == "completed"
    assert isinstance(rec["origin"], str) and isinstance(rec["outcome"]["completion_tokens"], int)


def test_the_openapi_document_lists_what_the_gateway_returns(gws: tuple[Gateway, Gateway]) -> None:
    doc = httpx.get(gws[1].url + "/openapi.json", timeout=5).json()
    error_ref = {"$ref": "#/components/schemas/Error"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            errors = [s for s in op["responses"] if s[0] in "45"]
            assert errors, (method, path)
            for s in errors:
                if path != "/readyz":
                    assert op["responses"][s]["content"]["application/json"]["schema"] == error_ref
    ops = doc["paths"]
    gen = ops["/v1/generate"]["post"]["responses"]
    assert {"400", "404", "409", "415", "429", "499", "502", "503", "504"} <= set(gen)
    assert "Retry-After" in gen["429"]["headers"] and "Retry-After" in gen["503"]["headers"]
    assert "text/event-stream" in ops["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    schemas = doc["components"]["schemas"]
    assert len(schemas["GenerateRequest"]["oneOf"]) == 2
    chat = schemas["ChatRequest"]["properties"]
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 8192
    assert chat["model"]["enum"] == [MODEL]


def test_docs_link_the_document_and_show_client_generation() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    assert "/openapi.json" in text and "openapi-python-client" in text
