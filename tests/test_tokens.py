"""Tests for app/tokens: tokenizers, incremental detokenisation and the prefix-stable chat template.

Pure and fast: no workers, no Redis, no network. The Hugging Face tests build a tiny tokenizer in a
temp folder and are skipped where the optional `tokenizers` package is not installed.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol.blocks import block_keys
from app.tokens import (
    GENERATION_PROMPT,
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerUnavailable,
    load_tokenizer,
    render_chat,
)

BYTE = ByteTokenizer()


class WrappedByteTokenizer:
    """The byte tokenizer behind a different class, so `IncrementalDetokenizer` takes its generic
    (Hugging Face) path: that path can then be tested on exact byte splits without `tokenizers`."""

    name = "wrapped-byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return BYTE.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return BYTE.decode(ids)


DETOK_TOKENIZERS = [
    pytest.param(BYTE, id="byte-path"),
    pytest.param(WrappedByteTokenizer(), id="generic-path"),
]

# A 4-byte emoji, 3-byte CJK, 2-byte Latin and a 4-byte CJK extension character, with ASCII between.
SPLIT_TEXTS = ["😀", "中", "a😀b", "中文", "x中y😀z", "é😀中𠀋!", "👩‍💻 ok"]


# -- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_basics() -> None:
    assert isinstance(BYTE, Tokenizer)
    assert BYTE.name == "byte"
    assert BYTE.vocab_size == 256
    assert BYTE.encode("") == []
    assert BYTE.encode("A😀") == [0x41, 0xF0, 0x9F, 0x98, 0x80]
    assert BYTE.decode([0x41, 0xF0, 0x9F, 0x98, 0x80]) == "A😀"


@given(st.text())
def test_byte_round_trip(text: str) -> None:
    ids = BYTE.encode(text)
    assert all(0 <= t < 256 for t in ids)
    assert BYTE.decode(ids) == text


@given(st.text(), st.text())
def test_byte_encode_is_prefix_preserving(a: str, b: str) -> None:
    whole = BYTE.encode(a + b)
    assert whole[: len(BYTE.encode(a))] == BYTE.encode(a)
    assert whole == BYTE.encode(a) + BYTE.encode(b)


def test_byte_encode_lone_surrogate_becomes_replacement() -> None:
    """JSON allows "\\ud800"; UTF-8 does not. Encoding must not raise and must stay per-character."""
    ids = BYTE.encode("a\ud800b")
    assert BYTE.decode(ids) == "a\ufffdb"
    assert ids[:1] == BYTE.encode("a")


def test_byte_decode_is_lossy_safe() -> None:
    assert BYTE.decode([0xFF, 0x41]) == "\ufffdA"  # never-valid byte
    assert BYTE.decode([0xF0, 0x9F]) == "\ufffd"  # truncated emoji
    assert BYTE.decode([0x41, 300, 0x42]) == "A\ufffdB"  # id outside the vocabulary
    assert BYTE.decode([0x41, -1]) == "A\ufffd"
    assert BYTE.decode([0xE4, 300, 0xB8, 0xAD]) == "\ufffd\ufffd\ufffd\ufffd"  # unknown id cuts the char


def test_byte_decode_accepts_numpy_ids() -> None:
    """Token ids travel as INT32 tensors; bytes(ndarray) would read raw memory instead."""
    ids: Any = np.asarray(BYTE.encode("中😀"), dtype=np.int32)  # accepted at run time, not in the type
    assert BYTE.decode(ids) == "中😀"


def test_block_keys_share_prefix_for_shared_text() -> None:
    """The point of prefix-preserving tokens: equal text prefixes give equal block keys."""
    a = BYTE.encode("the same long system prompt " * 4 + "question one")
    b = BYTE.encode("the same long system prompt " * 4 + "another question")
    ka, kb = block_keys(a, 16, tokenizer=BYTE.name), block_keys(b, 16, tokenizer=BYTE.name)
    assert ka[:7] == kb[:7]


@pytest.mark.parametrize("spec", [None, "", "byte", "BYTE", " byte "])
def test_load_tokenizer_byte(spec: str | None) -> None:
    assert isinstance(load_tokenizer(spec), ByteTokenizer)


def test_load_tokenizer_unknown_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_hf_tokenizer_missing_package_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deliberately fakes the fault: `tokenizers` is made unimportable (a None entry in sys.modules
    makes `import tokenizers` raise ImportError) whether or not it is installed here."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerUnavailable, match="pip install tokenizers"):
        HFTokenizer(path)
    with pytest.raises(TokenizerUnavailable, match="pip install tokenizers"):
        load_tokenizer(str(path))
    with pytest.raises(TokenizerUnavailable):
        load_tokenizer(str(tmp_path))  # a model folder holding tokenizer.json


def test_hf_tokenizer_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        HFTokenizer(tmp_path / "nope.json")


# -- incremental detokenizer -------------------------------------------------------------------


def assert_clean_stream(chunks: list[str], text: str) -> None:
    """Every chunk is whole characters of `text`: no U+FFFD, encodable alone, and the chunks so
    far always form a prefix of the original."""
    sofar = ""
    for chunk in chunks:
        assert "\ufffd" not in chunk
        chunk.encode("utf-8")  # a lone surrogate or a broken character would raise here
        sofar += chunk
        assert text.startswith(sofar)
    assert sofar == text


def stream(tokenizer: Tokenizer, ids: list[int], cuts: Sequence[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    bounds = [0, *cuts, len(ids)]
    chunks = [detok.feed(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    chunks.append(detok.flush())
    return chunks


@pytest.mark.parametrize("tokenizer", DETOK_TOKENIZERS)
@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_detok_never_splits_a_character_one_cut(tokenizer: Tokenizer, text: str) -> None:
    ids = BYTE.encode(text)
    for cut in range(len(ids) + 1):
        assert_clean_stream(stream(tokenizer, ids, [cut]), text)


@pytest.mark.parametrize("tokenizer", DETOK_TOKENIZERS)
@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_detok_never_splits_a_character_two_cuts(tokenizer: Tokenizer, text: str) -> None:
    ids = BYTE.encode(text)
    for i in range(len(ids) + 1):
        for j in range(i, len(ids) + 1):
            assert_clean_stream(stream(tokenizer, ids, [i, j]), text)


@pytest.mark.parametrize("tokenizer", DETOK_TOKENIZERS)
@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_detok_one_token_per_feed(tokenizer: Tokenizer, text: str) -> None:
    ids = BYTE.encode(text)
    assert_clean_stream(stream(tokenizer, ids, range(1, len(ids))), text)


@pytest.mark.parametrize("tokenizer", DETOK_TOKENIZERS)
@settings(max_examples=200)
@given(text=st.text(max_size=40), data=st.data())
def test_detok_random_splits_reproduce_text(tokenizer: Tokenizer, text: str, data: st.DataObject) -> None:
    ids = BYTE.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    assert_clean_stream(stream(tokenizer, ids, cuts), text)


@pytest.mark.parametrize("tokenizer", DETOK_TOKENIZERS)
@settings(max_examples=200)
@given(ids=st.lists(st.integers(0, 255), max_size=40), data=st.data())
def test_detok_invalid_bytes_match_decode(tokenizer: Tokenizer, ids: list[int], data: st.DataObject) -> None:
    """On arbitrary (often invalid) bytes the stream still adds up to the one-shot decode."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    assert "".join(stream(tokenizer, ids, cuts)) == BYTE.decode(ids)


def test_detok_flush_reports_truncated_character() -> None:
    for tokenizer in (BYTE, WrappedByteTokenizer()):
        detok = IncrementalDetokenizer(tokenizer)
        assert detok.feed([0x41, 0xF0, 0x9F]) == "A"
        assert detok.feed([0x98]) == ""
        assert detok.flush() == "\ufffd"
        # flush resets: the detokenizer is reusable.
        assert detok.feed(BYTE.encode("ok")) == "ok"
        assert detok.flush() == ""


def test_detok_unknown_ids_in_stream() -> None:
    ids = [0x41, 0xE4, 0xB8, 300, 0x42]
    chunks = stream(BYTE, ids, [2])
    assert "".join(chunks) == BYTE.decode(ids) == "A\ufffd\ufffdB"


def test_detok_accepts_numpy_chunks() -> None:
    detok = IncrementalDetokenizer(BYTE)
    ids: Any = np.asarray(BYTE.encode("中😀"), dtype=np.int32)
    assert detok.feed(ids[:4]) == "中"
    assert detok.feed(ids[4:]) == "😀"


def test_detok_generic_window_stays_bounded() -> None:
    """The generic path forgets emitted ids, so a long stream costs O(window) per feed."""
    detok = IncrementalDetokenizer(WrappedByteTokenizer())
    text = "stream 中文 😀 " * 500
    out = [detok.feed([t]) for t in BYTE.encode(text)]
    assert "".join(out) + detok.flush() == text
    assert len(detok._ids) <= 8


# -- chat template ------------------------------------------------------------------------------


def test_render_chat_golden() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi\nthere<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
    )
    assert render_chat(messages[:1], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat([]) == ""
    assert render_chat([], add_generation_prompt=True) == GENERATION_PROMPT


texts = st.text(max_size=30)
contents = st.one_of(texts, st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=3))
messages_strategy = st.lists(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "user", "assistant", "tool"]),
        contents,
    ),
    max_size=8,
)


@given(messages_strategy)
def test_chat_prefix_stable(messages: list[dict[str, Any]]) -> None:
    for n in range(len(messages)):
        shorter, longer = render_chat(messages[:n]), render_chat(messages[: n + 1])
        assert longer.startswith(shorter)
        # ... and so the byte tokens (hence the block keys) of the shorter chat prefix the longer.
        assert BYTE.encode(longer)[: len(BYTE.encode(shorter))] == BYTE.encode(shorter)


@given(messages_strategy, contents)
def test_chat_generation_prompt_prefixes_the_reply(messages: list[dict[str, Any]], reply: Any) -> None:
    for n in range(len(messages) + 1):
        prompt = render_chat(messages[:n], add_generation_prompt=True)
        answered = [*messages[:n], {"role": "assistant", "content": reply}]
        assert prompt.endswith(GENERATION_PROMPT)
        assert render_chat(answered).startswith(prompt)
        assert render_chat(answered, add_generation_prompt=True).startswith(prompt)


def test_chat_developer_renders_as_system() -> None:
    """OpenAI's `developer` role is the system instruction by its newer name: the same prompt."""
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    sys_ = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(dev, add_generation_prompt=True) == render_chat(sys_, add_generation_prompt=True)


def test_chat_assistant_null_content() -> None:
    """OpenAI sends `content: null` on assistant turns that only carry tool calls."""
    msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    assert render_chat([msg]) == "<|im_start|>assistant\n<|im_end|>\n"
    # The API layer dumps messages with exclude_none, which drops the key altogether.
    assert render_chat([{"role": "assistant", "tool_calls": [{"id": "c1"}]}]) == render_chat([msg])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a list"),
        ({"role": "user", "content": "x"}, "messages must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "wizard", "content": "x"}], "got 'wizard'"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": None}], "must not be null"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": ["plain"]}], r"content\[0\] must be an object"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "type 'image_url'; only 'text' content parts are supported",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            r"content\[0\]\.text must be a string",
        ),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 1.5}], r"messages\[1\]"),
    ],
)
def test_chat_validation_errors(messages: Any, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as info:
        render_chat(messages)
    assert isinstance(info.value, ValueError)


# -- Hugging Face tokenizer (only where the optional package is installed) ----------------------


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE trained in memory: a real tokenizer.json without any download."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world, the quick brown fox", "中文 文本 😀 emoji", "streaming tokens hello"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_loads_locally(hf_tokenizer_file: Path) -> None:
    import hashlib

    tok = load_tokenizer(str(hf_tokenizer_file))
    assert isinstance(tok, HFTokenizer)
    assert isinstance(tok, Tokenizer)
    assert tok.name == "hf:" + hashlib.sha256(hf_tokenizer_file.read_bytes()).hexdigest()[:12]
    assert tok.name != BYTE.name
    assert load_tokenizer(str(hf_tokenizer_file.parent)).name == tok.name  # folder form
    assert tok.vocab_size >= 256
    text = "hello 中文 😀 world"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.vocab_size + 5]) == text + "\ufffd"
    assert "<|im_start|>" in tok.decode(tok.encode(render_chat([{"role": "user", "content": "hi"}])))


@pytest.mark.parametrize("text", [*SPLIT_TEXTS, "hello 中文 😀 world, streaming tokens"])
def test_hf_detok_never_splits_a_character(hf_tokenizer_file: Path, text: str) -> None:
    tok = HFTokenizer(hf_tokenizer_file)
    ids = tok.encode(text)
    for cut in range(len(ids) + 1):
        assert_clean_stream(stream(tok, ids, [cut]), text)
    assert_clean_stream(stream(tok, ids, range(1, len(ids))), text)
