"""Request bodies of the client API, written so that the OpenAPI document they generate says exactly
what the gateway accepts (issue #21): a body that is valid against the published schema is
accepted, and one that is not is a 400 naming the field and the rule.

Why every body forbids unknown fields: an OpenAI parameter this gateway does not implement
(`logprobs`, `tools`, `n > 1`, …) must not be silently ignored, so it is either a declared field
whose schema admits only the "off" value (`logprobs: false`, `n: 1`) or unknown, and both are 400s.
`UNSUPPORTED` gives each rejected parameter the sentence the 400 carries.

Ranges are OpenAI's (temperature [0, 2], top_p [0, 1], up to 4 stop strings, …). Limits that come
from the gateway's settings (max tokens, the served model, the vocabulary) are put into the
published document by `app.api.openapi` from the running configuration.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_validator,
)


def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer; so does this API (strings and booleans stay errors)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _false(value: bool) -> bool:
    if value:
        raise ValueError("must be false")
    return value


#: An integer as JSON Schema defines it: 5 and 5.0, not "5", not true.
INTEGRAL = BeforeValidator(_integral)
JsonInt = Annotated[StrictInt, INTEGRAL]

#: `seed`: an integer JSON carries exactly (I-JSON, RFC 7493: |n| < 2**53). Beyond that a JSON
#: parser working in doubles (most validators, JavaScript) cannot tell a seed from its neighbours.
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1
#: A JSON number: strict (no "1.5" strings, no booleans), and ints are numbers too (`temperature: 1`).
Number = Annotated[float, Strict()]

#: Parameters OpenAI documents that this gateway rejects unless they carry their "off" value, and
#: why (the text of the 400). Unknown fields get `unknown parameter`.
UNSUPPORTED: dict[str, str] = {
    "n": "only n=1 is supported",
    "best_of": "only best_of=1 is supported",
    "echo": "echo is not supported",
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "logit_bias": "logit_bias is not supported",
    "frequency_penalty": "frequency_penalty is not supported (only 0)",
    "presence_penalty": "presence_penalty is not supported (only 0)",
    "suffix": "suffix (insertion) is not supported",
    "tools": "tools are not supported",
    "tool_choice": "tool_choice is not supported (only 'none')",
    "parallel_tool_calls": "tools are not supported",
    "functions": "functions are not supported",
    "function_call": "functions are not supported (only 'none')",
    "response_format": "response_format is not supported (only {'type': 'text'})",
}

#: The same for fields of a message (an assistant turn echoed back with its tool calls).
UNSUPPORTED_IN_MESSAGE: dict[str, str] = {
    "tool_calls": "tools are not supported (only null or [])",
    "function_call": "functions are not supported (only null)",
}

Temperature = Annotated[
    Annotated[Number, Field(ge=0, le=2)] | None, Field(None, description="sampling temperature, [0, 2]")
]
TopP = Annotated[
    Annotated[Number, Field(ge=0, le=1)] | None, Field(None, description="nucleus sampling mass, [0, 1]")
]
Seed = Annotated[
    Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX), INTEGRAL] | None,
    Field(None, description="sampling seed, |seed| < 2**53"),
]
User = Annotated[
    Annotated[StrictStr, Field(max_length=256)] | None,
    Field(None, description="end-user id; recorded in the request's log"),
]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(max_length=4)] | None,
    Field(
        None,
        description="up to 4 strings; generation ends before the first one (not included in the "
        "text), finish_reason 'stop'",
    ),
]
Zero = Annotated[
    Annotated[Number, Field(ge=0, le=0)] | None, Field(None, description="not supported: only 0 (or null)")
]
NoLogprobs = Annotated[
    Annotated[StrictBool, AfterValidator(_false), Field(json_schema_extra={"const": False})] | None,
    Field(None, description="not supported: only false (or null)"),
]
One = Annotated[
    Annotated[StrictInt, Field(ge=1, le=1), INTEGRAL] | None, Field(None, description="only 1 (or null)")
]
ZeroInt = Annotated[
    Annotated[StrictInt, Field(ge=0, le=0), INTEGRAL] | None,
    Field(None, description="not supported: only 0 (or null)"),
]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
#: `stream`: null is false, as in OpenAI's API (clients that serialise every field send it).
Stream = Annotated[StrictBool | None, AfterValidator(bool), Field(False, description="null is false")]
#: A field of an assistant message OpenAI's SDK sends back when a reply is echoed into the next
#: turn (`message.model_dump()`): accepted with its "off" value only.
NullOnly = Annotated[None, Field(None, description="only null")]


#: Token ids; their range (the vocabulary) is added to the published document from the running
#: tokenizer, and checked by the route.
def _integral_list(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`_integral` for a list of ids, at the cost of one Python call per list, not per id: a prompt
    of 8,000 ids validates in ~0.1 ms (per-id validators and bounds cost ~0.5 ms, on the hot path)."""
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        return handler([_integral(x) for x in value])


#: Token ids (non-negative; the vocabulary's bound is added to the published document and checked
#: by the route with one min/max, as is the lower bound: cheaper than a constraint per id).
TokenIds = Annotated[
    list[Annotated[StrictInt, WithJsonSchema({"type": "integer", "minimum": 0})]],
    Field(min_length=1),
    WrapValidator(_integral_list),
]
MaxTokens = Annotated[
    Annotated[StrictInt, Field(ge=1), INTEGRAL] | None,
    Field(None, description="largest number of tokens to generate"),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _OpenAIRequest(BaseModel):
    """What both OpenAI endpoints share."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    stream: Stream = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    user: User = None
    n: One = None
    frequency_penalty: Zero = None
    presence_penalty: Zero = None
    logit_bias: Annotated[dict[str, Number] | None, Field(None, max_length=0, description="only {}")] = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[
        NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)] | TokenIds,
        Field(..., description="a non-empty string, a list of one such string, or a list of token ids"),
    ]
    max_tokens: MaxTokens = None
    logprobs: ZeroInt = None
    echo: NoLogprobs = None
    best_of: One = None
    suffix: Annotated[None, Field(None, description="not supported: only null")] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


Content = StrictStr | list[TextPart]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[Annotated[StrictStr, Field(max_length=256)] | None, Field(None)] = None


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    """OpenAI's newer name for the system instruction (sent by newer SDKs and agent frameworks);
    rendered as a system message (app/tokens/chat.py)."""

    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    # an earlier reply echoed back as the SDK dumps it: null (or no tool calls) only
    refusal: NullOnly = None
    annotations: NullOnly = None
    audio: NullOnly = None
    function_call: NullOnly = None
    tool_calls: Annotated[
        list[dict[str, object]] | None,
        Field(None, max_length=0, description="only [] (tools are not supported)"),
    ] = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: StrictStr | None = None


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    logprobs: NoLogprobs = None
    top_logprobs: ZeroInt = None
    tools: Annotated[list[dict[str, object]] | None, Field(None, max_length=0, description="only []")] = None
    tool_choice: Annotated[Literal["none"] | None, Field(None, description="only 'none'")] = None
    parallel_tool_calls: Annotated[None, Field(None, description="not supported: only null")] = None
    functions: Annotated[list[dict[str, object]] | None, Field(None, max_length=0, description="only []")] = (
        None
    )
    function_call: Annotated[Literal["none"] | None, Field(None, description="only 'none'")] = None
    response_format: ResponseFormat | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


ChatRequest.model_rebuild()


class GenerateRequest(BaseModel):
    """Native API: text or token ids in (exactly one: the published schema says so with `oneOf`),
    per-stage timings and routing decisions out."""

    model_config = ConfigDict(extra="forbid")
    # Absent, not null: the published schema's oneOf requires exactly one of them to be present.
    prompt: NonEmptyStr = Field(None)
    input_ids: TokenIds = Field(None)
    model: StrictStr | None = None
    max_new_tokens: Annotated[StrictInt, Field(ge=1), INTEGRAL] | None = Field(
        None, description="default 16 (or the limit when lower)"
    )
    stream: Stream = False
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=3_600_000), INTEGRAL] | None = None
    deadline_ms: Annotated[StrictInt, Field(ge=1, le=3_600_000), INTEGRAL] | None = Field(
        None, description="TTFT deadline in ms (else header x-flexlb-slo-ms, else the cluster SLO)"
    )
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    priority: Literal["bulk", "default", "interactive", "system"] | JsonInt | None = Field(
        None,
        description="priority class, as the x-flexlb-priority header (which it overrides): a class "
        "name, or its level 0-3 (bulk..system; beyond clamped); lowered to the tenant's max_priority",
    )
    # Sampling: greedy without `temperature` (or with 0); a real engine samples by them
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        return self


SAMPLING_FIELDS = ("temperature", "top_p", "seed")


def sampling_of(body: BaseModel) -> dict[str, float | int] | None:
    """The sampling fields a request gave, for the engines (None when it gave none: greedy). They
    travel in the prefill hand-off; a real engine samples by them, the simulated one ignores them.
    The schemas have checked types and ranges."""
    out: dict[str, float | int] = {}
    for name in SAMPLING_FIELDS:
        v = getattr(body, name, None)
        if v is not None:
            out[name] = int(v) % 2**63 if name == "seed" else float(v)  # the engines' seeds are >= 0
    return out or None
