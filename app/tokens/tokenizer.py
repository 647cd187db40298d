"""Tokenizers: text ⇄ token ids for routing, block keys and detokenisation.

Why a tokenizer lives in the gateway at all: prefix-cache routing compares *token* prefixes (block
keys, `app/protocol/blocks.py`), so the gateway must turn prompts into the same ids the workers
cache. Two kinds:

- `ByteTokenizer` ("byte", the default): one token per UTF-8 byte. Deterministic, dependency-free
  and strictly prefix-preserving (equal text prefixes → equal token prefixes), which is what makes
  multi-turn chats hit the cache block for block.
- `HFTokenizer`: a local Hugging Face `tokenizer.json` through the optional `tokenizers` package.
  Never downloads anything. Its `name` carries a digest of the file, because the name goes into the
  block-key namespace: two different vocabularies must never share cache keys.

Everything here is pure except `HFTokenizer.__init__`, which reads one local file.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

REPLACEMENT = "\ufffd"
"""What an undecodable byte sequence or an unknown token id becomes: decoding never raises, since a
stream that is already sending tokens to a client has nowhere to report an error."""

HF_FILE_NAME = "tokenizer.json"


class TokenizerUnavailable(RuntimeError):
    """A Hugging Face tokenizer was requested but the optional `tokenizers` package is missing."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the gateway needs from a tokenizer.

    `name` goes into the block-key namespace, so it must differ whenever the id mapping differs.
    `decode` must be lossy-safe: invalid sequences and unknown ids decode to U+FFFD, never raise.
    """

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def as_int_list(ids: Sequence[int]) -> Sequence[int]:
    """NumPy arrays (token ids arrive as INT32 tensors) expose `tolist`; `bytes(ndarray)` would
    silently return the array's raw memory instead of one byte per id."""
    tolist = getattr(ids, "tolist", None)
    if tolist is not None and not isinstance(ids, (bytes, bytearray, memoryview)):
        return tolist()  # type: ignore[no-any-return]
    return ids


def _sanitize_surrogates(text: str) -> str:
    """Lone surrogates (legal in a Python str and in JSON `\\ud800` escapes, illegal in UTF-8) become
    U+FFFD one for one, which keeps encoding total and prefix-preserving."""
    return "".join(REPLACEMENT if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)


class ByteTokenizer:
    """Token id = UTF-8 byte value (0..255).

    Why bytes rather than code points: the vocabulary is fixed and tiny (engines and tests can
    size embeddings/arrays once), and the byte stream is exactly what a byte-level BPE model sees
    before merging, so the simulator's token counts are in the right ballpark (≈ 1 token per ASCII
    character, more for CJK and emoji).
    """

    name: str = "byte"
    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:
            return list(_sanitize_surrogates(text).encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = as_int_list(ids)
        try:
            return bytes(ids).decode("utf-8", errors="replace")
        except (ValueError, TypeError, OverflowError):
            return self._decode_with_unknown_ids(ids)

    def _decode_with_unknown_ids(self, ids: Sequence[int]) -> str:
        """Slow path: ids outside 0..255 become U+FFFD and also end any byte sequence in progress
        (the same rule the incremental detokenizer applies, so both agree)."""
        parts: list[str] = []
        run = bytearray()
        for tok in ids:
            value = known_id(tok, 256)
            if value is not None:
                run.append(value)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            parts.append(REPLACEMENT)
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def known_id(tok: object, vocab_size: int) -> int | None:
    """`tok` as an int when it is an integer id inside the vocabulary, else None (floats, strings
    and out-of-range ids are unknown, never truncated or wrapped into a valid id)."""
    try:
        value = operator.index(tok)  # type: ignore[arg-type]
    except TypeError:
        return None
    return value if 0 <= value < vocab_size else None


def _import_tokenizers() -> Any:
    """Import the optional `tokenizers` package, or explain how to get it. A separate function so
    the failure is one place (and one monkeypatch) away."""
    try:
        import tokenizers
    except ImportError as exc:
        raise TokenizerUnavailable(
            "loading a Hugging Face tokenizer.json needs the optional 'tokenizers' package, which is "
            "not installed: run `pip install tokenizers` (or use the default byte tokenizer)"
        ) from exc
    return tokenizers


def resolve_tokenizer_file(path: str | Path) -> Path:
    """A `tokenizer.json` file, or a directory holding one (a model folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / HF_FILE_NAME
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer file at {str(p)!r} (expected a Hugging Face {HF_FILE_NAME})")
    return p


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, loaded with the optional `tokenizers` package.

    `encode` does not add special tokens (BOS/EOS): a post-processor that appends EOS would break
    the prefix property the cache relies on, and the chat template already marks turn boundaries.
    """

    def __init__(self, path: str | Path) -> None:
        file = resolve_tokenizer_file(path)
        data = file.read_bytes()
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust side raises its own Exception type
            raise ValueError(f"{str(file)!r} is not a valid Hugging Face tokenizer.json: {exc}") from exc
        self.path = file
        # The digest, not the path, names the tokenizer: the same file at two paths shares cache
        # keys, an edited file at the same path does not.
        self.name: str = "hf:" + hashlib.sha256(data).hexdigest()[:12]
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        try:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        except UnicodeEncodeError:
            return list(self._tok.encode(_sanitize_surrogates(text), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(as_int_list(ids))
        n = self.vocab_size
        if all(type(t) is int and 0 <= t < n for t in ids):
            return str(self._tok.decode(ids, skip_special_tokens=False))
        # Unknown ids: decode the known runs and mark each unknown id with U+FFFD, like ByteTokenizer.
        parts: list[str] = []
        run: list[int] = []
        for tok in ids:
            value = known_id(tok, n)
            if value is not None:
                run.append(value)
                continue
            if run:
                parts.append(str(self._tok.decode(run, skip_special_tokens=False)))
                run = []
            parts.append(REPLACEMENT)
        if run:
            parts.append(str(self._tok.decode(run, skip_special_tokens=False)))
        return "".join(parts)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, name={self.name!r})"


def load_tokenizer(spec: str | None) -> Tokenizer:
    """Build the tokenizer a config names.

    `None`, `""` or `"byte"` → `ByteTokenizer`; a path to a `tokenizer.json` (or a folder holding
    one) → `HFTokenizer`; anything else → `ValueError`, so a typo fails at start-up rather than
    silently routing with the wrong token ids.
    """
    if spec is None or spec.strip() == "" or spec.strip().lower() == "byte":
        return ByteTokenizer()
    spec = spec.strip()
    p = Path(spec).expanduser()
    if p.is_file() or (p.is_dir() and (p / HF_FILE_NAME).is_file()):
        return HFTokenizer(p)
    if p.is_dir():
        raise ValueError(f"tokenizer folder {spec!r} has no {HF_FILE_NAME}")
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'byte' (the default) or the path of a local Hugging Face "
        f"{HF_FILE_NAME} (nothing is downloaded)"
    )
