"""The API's body parser (app/api/fast_json.py) gives `json.loads`'s outcome on every input: the
same value (compared by repr, so NaN and -0.0 count), or the same exception with the same message
(the 400's wording comes from it)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.fast_json import parse_json


def outcome(parse: Any, raw: bytes) -> tuple[str, str]:
    try:
        return "ok", repr(parse(raw))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


def same_as_json_loads(raw: bytes) -> None:
    assert outcome(parse_json, raw) == outcome(json.loads, raw)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_documents_json_dumps_writes(value: Any, ascii_only: bool, indent: int | None) -> None:
    same_as_json_loads(json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode())


@settings(max_examples=500, deadline=None)
@given(number=st.from_regex(r"\A-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE][+-]?[0-9]{1,4})?\Z"))
def test_number_texts(number: str) -> None:
    same_as_json_loads(f"[{number}]".encode())


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=40) | st.text(alphabet='{}[]",:0123456789.eE+-tfnrul\\ \n\x01é', max_size=40))
def test_arbitrary_bytes_and_near_json(raw: bytes | str) -> None:
    same_as_json_loads(raw if isinstance(raw, bytes) else raw.encode())


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":1,"a":2}',  # duplicate keys: the last wins
        b"[1e400, -1e400, 1.7976931348623157e309, 5e-324, 2.5e-324, 1e-400, -0.0, -0]",
        b"[NaN, Infinity, -Infinity]",
        b"[" + b"1" * 4300 + b"]",  # the longest integer json.loads converts
        b"[" + b"1" * 4301 + b"]",  # one digit more: json.loads's ValueError
        b"[0.1, 0.30000000000000004, 1.0000000000000002, 9007199254740993]",
        b'["\\ud800", "\\udc00x", "\\ud83d\\ude00", "\\u0000", "\\/"]',  # lone surrogates too
        b'\xef\xbb\xbf{"a": 1}',  # a byte order mark: json.loads skips it
        '{"é": "ü✓"}'.encode(),
        '{"é": "ü"}'.encode("utf-16"),  # json.loads detects UTF-16 and UTF-32
        b"[" * 150 + b"]" * 150,
        b"[" * 300 + b"]" * 300,  # deeper than pydantic-core's limit
        b"[" * 5000 + b"]" * 5000,  # json.loads's RecursionError
        b'{"a": 1} x',
        b"[1,]",
        b'"\x01"',
        b"",
        b" ",
        b'["\xff"]',
    ],
)
def test_edge_cases(raw: bytes) -> None:
    same_as_json_loads(raw)


def test_token_ids_parse_to_ints() -> None:
    ids = list(range(0, 50_000, 37))
    got = parse_json(json.dumps({"input_ids": ids}).encode())
    assert got == {"input_ids": ids} and all(type(x) is int for x in got["input_ids"])
    assert math.isnan(parse_json(b"NaN"))
