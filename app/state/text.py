"""Redis replies arrive as bytes or str depending on the client's `decode_responses` (the lean RESP
client and redis-py's pools differ); every reader decodes them with these two functions."""

from __future__ import annotations

from typing import Any

__all__ = ["to_str", "to_str_or_none"]


def to_str(v: Any) -> str:
    """UTF-8 text of a reply value: bytes decoded, anything else through ``str``."""
    return v.decode() if isinstance(v, bytes | bytearray) else str(v)


def to_str_or_none(v: Any) -> str | None:
    """As `to_str`, but a missing value (None) stays None."""
    return None if v is None else to_str(v)
