"""Pure parts of the client API: stop-string matching over chunked text and token streams, and
the wording of validation errors (no server, no workers)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.stop import StopText, TokenStop, cut_at_stop
from app.gateway.validation import field_path, json_position, validation_message
from app.tokens.tokenizer import ByteTokenizer

ALPHABET = "abé✓ "


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_stop_filter_equals_cutting_the_whole_text(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    f = StopText(stops)
    out = "".join(f.feed(c) for c in chunks_of(text, cuts)) + f.flush()
    # generation ends where the first stop string completes, cut before that string's start
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    assert out == (text[: min(hits)[1]] if hits else text)
    assert out == cut_at_stop(text, stops)
    assert f.stopped == bool(hits)


def test_stop_text_holds_back_a_possible_start_and_releases_it() -> None:
    f = StopText(["aab"])
    assert f.feed("xaa") == "x"  # "aa" may begin "aab"
    assert f.feed("a") == "a"  # "aaa": the first "a" can no longer start it
    assert f.feed("c") == "aac"
    assert f.feed("aa") == "" and f.flush() == "aa"


@settings(max_examples=200, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), stop=st.text(ALPHABET, min_size=1, max_size=3))
def test_token_stop_keeps_the_tokens_up_to_the_one_completing_the_stop(text: str, stop: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    ts = TokenStop(tok, [stop])
    kept: list[int] = []
    for i in range(0, len(ids), 3):  # chunks of 3 byte tokens: characters split across chunks
        keep = ts(ids[i : i + 3])
        kept += ids[i : i + 3] if keep is None else ids[i : i + 3][:keep]
        if keep is not None:
            break
    at = text.find(stop)
    if at < 0:
        assert kept == ids
    else:
        assert kept == tok.encode(text[: at + len(stop)])
        assert cut_at_stop(tok.decode(kept), [stop]) == text[:at]


def test_validation_messages_name_the_field_as_a_client_writes_it() -> None:
    assert field_path(("body", "messages", 0, "user", "content")) == ("messages[0].content", False)
    assert field_path(("body", "prompt", "list[constrained-int]", 1)) == ("prompt", True)
    err = {"type": "missing", "loc": ("body", "messages", 2, "tool", "content"), "msg": "Field required"}
    assert validation_message([err]) == "messages[2].content: field required"
    err = {"type": "less_than_equal", "loc": ("body", "top_p"), "msg": "x", "ctx": {"le": 1}}
    assert validation_message([err]) == "top_p: must be <= 1"
    err = {"type": "less_than_equal", "loc": ("body", "n"), "msg": "x", "ctx": {"le": 1}}
    assert validation_message([err], {"n": 3}) == "n: only n=1 is supported (got 3)"
    err = {"type": "extra_forbidden", "loc": ("body", "tools_x"), "msg": "x"}
    assert validation_message([err]) == "tools_x: unknown parameter"
    doc = '{\n  "a": 1,\n  "b": }'
    err = {
        "type": "json_invalid",
        "loc": ("body", doc.index("}")),
        "msg": "x",
        "ctx": {"error": "Expecting value"},
    }
    assert validation_message([err], doc) == "invalid JSON at line 3 column 8: Expecting value"
    assert json_position(b"ab", 0) == (1, 1)


def test_a_negative_seed_reaches_the_engines_as_an_exact_int64() -> None:
    """A negative API seed is folded into [0, 2**63); through a float it rounded up to 2**63 and the
    prefill dispatch died with OverflowError (500 internal, found by the OpenAPI fuzz pass)."""
    import numpy as np

    from app.api.schemas import GenerateRequest, sampling_of
    from app.rpc.tensors import sampling_inputs

    sampling = sampling_of(GenerateRequest(prompt="hi", seed=-103))
    assert sampling is not None
    seeds = sampling_inputs([sampling, None], "t", "p", "s")[2][1]
    assert seeds.dtype == np.int64 and seeds.tolist() == [2**63 - 103, -1]
