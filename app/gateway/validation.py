"""Turn a request-validation failure into one sentence a person can act on (issue #19): the
field as a client writes it (`messages[0].content`), then the rule (`field required`).

Why not pydantic's text as it is: its locations carry internal labels (`body`, a union member's
type such as `list[constrained-int]`, the tag of a discriminated union), an unknown field reads
"Extra inputs are not permitted", and a JSON syntax error reads "20: JSON decode error".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.api.schemas import UNSUPPORTED, UNSUPPORTED_IN_MESSAGE

#: Fields whose type is a union: one rule for the field instead of one error per member type.
UNION_RULES = {
    "prompt": "must be a non-empty string, a list of one non-empty string, or a non-empty list of token ids",
    "stop": "must be a non-empty string or a list of up to 4 non-empty strings (at most 256 characters each)",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}
#: pydantic error types → the rule as this API states it (ctx fields fill the braces).
RULES = {
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
    "greater_than": "must be > {gt}",
    "less_than": "must be < {lt}",
    "string_too_short": "must have at least {min_length} character(s)",
    "string_too_long": "must have at most {max_length} characters",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "literal_error": "must be {expected}",
    "string_pattern_mismatch": "must match {pattern}",
    "none_required": "must be null",
}
#: Errors that, on a parameter in UNSUPPORTED, mean "a value other than the 'off' one".
_OFF_VALUE = {
    "value_error",
    "literal_error",
    "less_than_equal",
    "greater_than_equal",
    "too_long",
    "none_required",
}
#: Tags of the discriminated message union: pydantic puts them into the location.
_TAGS = {"system", "developer", "user", "assistant", "tool"}


def _is_member_label(part: object) -> bool:
    """A union member's label in a pydantic location (`str`, `list[int]`, `constrained-str`, …)."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none", "list", "dict"} or "[" in part or "-" in part
    )


def field_path(loc: Sequence[Any]) -> tuple[str, bool]:
    """(`messages[0].content`, whether the location went into a union member)."""
    out = ""
    prev: object = None
    for part in loc:
        if part == "body" and prev is None:
            prev = part
            continue
        if _is_member_label(part):
            return out, True
        if isinstance(part, str) and part in _TAGS and isinstance(prev, int):
            prev = part
            continue  # the discriminated union's tag, not a field
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        prev = part
    return out, False


def _rule(err: dict[str, Any], field: str) -> str:
    kind = err.get("type", "")
    if kind == "missing":
        return "field required"
    if kind == "extra_forbidden":
        return "unknown parameter"
    if kind == "union_tag_invalid":
        ctx = err.get("ctx") or {}
        return f"role must be one of {ctx.get('expected_tags', '')}; got {ctx.get('tag', '')!r}"
    if kind == "union_tag_not_found":
        return "role: field required"
    ctx = err.get("ctx") or {}
    if kind in RULES:
        try:
            return RULES[kind].format(**ctx)
        except (KeyError, IndexError):
            pass
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return msg[:1].lower() + msg[1:]


def json_position(doc: str | bytes, pos: int) -> tuple[int, int]:
    """1-based line and column of character offset `pos` in a JSON document."""
    text = doc.decode("utf-8", "replace") if isinstance(doc, (bytes, bytearray)) else str(doc)
    before = text[:pos]
    line = before.count("\n") + 1
    return line, pos - (before.rfind("\n") + 1) + 1


def validation_message(errors: Sequence[dict[str, Any]], body: Any = None) -> str:
    """The first error as `field: rule` (all errors of a union field fold into its one rule)."""
    if not errors:
        return "invalid request"
    err = errors[0]
    if err.get("type") == "json_invalid":
        loc = err.get("loc", ())
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        line, col = json_position(body if isinstance(body, (str, bytes)) else "", pos)
        reason = (err.get("ctx") or {}).get("error", "")
        return f"invalid JSON at line {line} column {col}" + (f": {reason}" if reason else "")
    field, in_union = field_path(err.get("loc", ()))
    if not field:
        if err.get("type") == "missing":
            return "request body: a JSON object is required"
        return f"request body: {_rule(err, 'body')}"
    if in_union:
        name = field.rsplit(".", 1)[-1].split("[", 1)[0]
        return f"{field}: {UNION_RULES.get(name, 'has the wrong type')}"
    top = field.split(".", 1)[0].split("[", 1)[0]
    leaf = field.rsplit(".", 1)[-1].split("[", 1)[0]
    if top == "messages" and leaf in UNSUPPORTED_IN_MESSAGE:
        return f"{field.split(leaf, 1)[0]}{leaf}: {UNSUPPORTED_IN_MESSAGE[leaf]}"
    if top in UNSUPPORTED and err.get("type") in _OFF_VALUE | {"string_type", "literal_error"}:
        return f"{top}: {UNSUPPORTED[top]} (got {str(_top_input(body, top))[:80]})"
    return f"{field}: {_rule(err, field)}"


def _top_input(body: Any, top: str) -> Any:
    return body.get(top) if isinstance(body, dict) else "?"
