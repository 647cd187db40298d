"""The facade's wire format: reading a router's request body (prompt, token budget, request id)
and shaping the SGLang/OpenAI answers and SSE events it sends back, plus `KvInfo`, the record
a prefill facade hands a decode facade over its bootstrap port.

Split out of `workers.http_facade.server` (issue #18: modules <= ~500 lines); the server keeps the
engine plumbing and the routes, this module only translates between JSON bodies and tokens.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.protocol.codes import EngineStatus
from app.tokens.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@dataclass
class KvInfo:
    """What a decode server learns about a prefilled request (the facade's stand-in for KV)."""

    request_id: str
    input_tokens: int
    cached_tokens: int
    first_token: int
    prefill_worker: str
    status: str = EngineStatus.OK
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


# ---- request parsing ------------------------------------------------------------------------
def prompt_ids(body: dict[str, Any]) -> list[int]:
    for k in ("input_ids", "prompt_token_ids"):
        if isinstance(body.get(k), list):
            return [int(x) for x in body[k]]
    p = body.get("prompt", body.get("text"))
    if isinstance(p, list):
        p = p[0] if p and isinstance(p[0], str) else None if p and isinstance(p[0], list) else p
        if isinstance(p, list):
            return [int(x) for x in p]
    if not isinstance(p, str) or not p:
        raise ValueError("need a non-empty prompt/text or input_ids")
    return TOK.encode(p)


def rendered(body: dict[str, Any], path: str, max_model_len: int) -> Any:
    """vLLM's `/v1/completions/render` (a list of `{token_ids}`) or `/tokenize` (`{tokens, count,
    max_model_len}`) answer for ``body``, by the facade's own tokenizer.

    Why: vllm-router's `cache_aware` scores its radix tree on the workers' token ids, fetched from
    these endpoints; without them it routes every P/D request by load alone ("missing_tokens").
    """
    ids = prompt_ids(body)
    if path == "/tokenize":
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    return [{"token_ids": ids, "features": None}]


def max_new(body: dict[str, Any]) -> int:
    sp = body.get("sampling_params") or {}
    for v in (sp.get("max_new_tokens"), body.get("max_tokens"), body.get("max_completion_tokens")):
        if v is not None:
            return max(1, int(v))
    return 16


def rid(body: dict[str, Any], request: Request) -> str:
    rid = body.get("rid") or body.get("request_id") or request.headers.get("x-request-id")
    return str(rid) if rid else uuid.uuid4().hex


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def usage(n_in: int, n_out: int, cached: int, prefill: str | None, decode: str | None) -> dict[str, Any]:
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
        "flexlb_workers": {"prefill": prefill, "decode": decode},
    }


def meta(rid: str, n_in: int, n_out: int, cached: int) -> dict[str, Any]:
    return {"id": rid, "prompt_tokens": n_in, "completion_tokens": n_out, "cached_tokens": cached}


def completion(
    rid: str, model: str, text: str, finish: str | None, t0: float, chunk: bool = False
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(t0),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
