"""Request bodies of the client API. Unknown OpenAI fields (temperature, top_p, stop, …) are
accepted and ignored, as the simulated engines do not sample; wrong types are 400s."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | list[str] | list[int] = Field(...)
    max_tokens: StrictInt | None = 16
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1


class GenerateRequest(BaseModel):
    """Native API: text or token ids in, per-stage timings and routing decisions out."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    input_ids: list[StrictInt] | None = None
    model: str | None = None
    max_new_tokens: StrictInt = 16
    stream: StrictBool = False
    timeout_ms: StrictInt | None = None
    deadline_ms: StrictInt | None = Field(
        None, description="TTFT deadline in ms (else header x-flexlb-slo-ms, else the cluster SLO)"
    )
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    priority: StrictInt | None = Field(None, description="accepted and recorded; not used for scheduling yet")
