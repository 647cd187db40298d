"""The chat template: OpenAI-style messages → one prompt string.

Why a fixed, prefix-stable template: a multi-turn chat resends the whole conversation each turn,
and the prefix cache can only reuse the earlier turns' KV if their rendering is byte-for-byte the
same at the start of the new prompt. So every message renders on its own, never depending on what
follows it (no "last message" special cases, no default system prompt that moves):

    render_chat(messages[:n])  is a prefix of  render_chat(messages[:n + 1])        for every n

The format is ChatML, one block per message::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and the generation prompt is the header of the assistant block that the model completes::

    <|im_start|>assistant\\n

so `render_chat(msgs, add_generation_prompt=True)` is also a prefix of
`render_chat(msgs + [assistant_reply])`: the reply's turn reuses the cache of the prompt that
produced it.

Content is inserted verbatim (no escaping, like Hugging Face chat templates); text parts of a list
content are joined with "\\n".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Roles rendered under another: OpenAI's `developer` is the system instruction by its newer name,
#: so both render (and tokenize, and hit the prefix cache) the same.
RENDERED_AS = {"developer": "system"}
GENERATION_PROMPT = f"{IM_START}assistant\n"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; the message says which one and why (→ HTTP 400)."""


def render_message(role: str, content: str) -> str:
    """One message block. Depends only on its own message: the root of prefix stability."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def message_text(message: Any, index: int) -> tuple[str, str]:
    """Validate one message and return (role, text)."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ChatTemplateError(f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}")
    content = message.get("content")
    if content is None:
        # OpenAI allows a null (or, after `exclude_none`, absent) content on assistant turns that
        # only carry tool calls.
        if role == "assistant":
            return role, ""
        if "content" not in message:
            raise ChatTemplateError(f"messages[{index}] ({role}) has no content")
        raise ChatTemplateError(f"messages[{index}].content must not be null for role {role!r}")
    rendered = RENDERED_AS.get(role, role)
    if isinstance(content, str):
        return rendered, content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        return rendered, "\n".join(_part_text(part, index, j) for j, part in enumerate(content))
    raise ChatTemplateError(
        f"messages[{index}].content must be a string or a list of text parts; got {type(content).__name__}"
    )


def _part_text(part: Any, index: int, j: int) -> str:
    where = f"messages[{index}].content[{j}]"
    if not isinstance(part, Mapping):
        raise ChatTemplateError(f"{where} must be an object like {{'type': 'text', 'text': ...}}")
    kind = part.get("type")
    if kind != "text":
        raise ChatTemplateError(f"{where} has type {kind!r}; only 'text' content parts are supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise ChatTemplateError(f"{where}.text must be a string; got {type(text).__name__}")
    return text


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
    """Render `messages` (OpenAI chat format) with the prefix-stable ChatML template.

    Roles: system (or developer, rendered as system), user, assistant, tool. Content: a string, a
    list of `{"type": "text", "text": ...}` parts, or null/absent on an assistant turn. Other keys
    (name, tool_call_id, tool_calls) are accepted and not rendered. An empty list renders as "" (so
    the prefix property holds from n=0); the API layer decides whether an empty conversation is a
    valid request.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of message objects; got {type(messages).__name__}")
    out = [render_message(*message_text(message, i)) for i, message in enumerate(messages)]
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return "".join(out)
