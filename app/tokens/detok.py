"""Incremental detokenisation for streamed output.

Why: decode streams token chunks, and a chunk boundary can fall inside a character (a 4-byte emoji
is four byte tokens; a byte-fallback BPE splits CJK the same way). Emitting each chunk's decode as
it comes would send U+FFFD halves to the client and corrupt the text. `IncrementalDetokenizer`
emits only text that is final and holds back the incomplete tail until the next chunk (or `flush`).

Two strategies:

- byte tokenizer: a real incremental UTF-8 decoder, O(new tokens) per `feed`;
- any other tokenizer (Hugging Face): the usual "decode a small window twice and emit the stable
  diff" method (as in TGI/vLLM): decode the window with and without the new ids, emit the growth,
  and hold back while the decode ends in U+FFFD. Ids before the window are dropped, so memory and
  cost per feed stay bounded by the window, not by the whole output.

For the byte tokenizer the concatenation of every `feed` plus `flush` equals `tokenizer.decode` of
all ids, including U+FFFD for invalid or truncated sequences.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from app.tokens.tokenizer import REPLACEMENT, ByteTokenizer, Tokenizer, as_int_list, known_id

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")
_MAX_BACKOFF = 4
"""How many trailing ids the generic path drops to find a tail that ends on a whole character."""


class IncrementalDetokenizer:
    """Turn a stream of token ids into text chunks that never split a character.

    `feed(ids)` returns the text completed by these ids (possibly ""); `flush()` returns what was
    held back (with U+FFFD for a truncated sequence) and resets, so the object can be reused.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytewise = isinstance(tokenizer, ByteTokenizer)
        self._utf8 = _Utf8Decoder(errors="replace")
        # Window state of the generic method: `_ids[:_read]` has been emitted; `_ids[:_prefix]` is
        # context kept only so the window decodes the way it would inside the full text.
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def feed(self, ids: Sequence[int]) -> str:
        if self._bytewise:
            return self._feed_bytes(ids)
        return self._feed_generic(ids)

    def flush(self) -> str:
        if self._bytewise:
            out = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return out
        out = ""
        if len(self._ids) > self._read:
            decode = self.tokenizer.decode
            prefix_text = decode(self._ids[self._prefix : self._read])
            full_text = decode(self._ids[self._prefix :])
            out = full_text[len(prefix_text) :]
        self._ids = []
        self._prefix = self._read = 0
        return out

    # -- byte tokenizer -------------------------------------------------------------------------

    def _feed_bytes(self, ids: Sequence[int]) -> str:
        ids = as_int_list(ids)
        try:
            data = bytes(ids)
        except (ValueError, TypeError, OverflowError):
            return self._feed_bytes_with_unknown_ids(ids)
        return self._utf8.decode(data)

    def _feed_bytes_with_unknown_ids(self, ids: Sequence[int]) -> str:
        """An id that is not a byte ends the sequence in progress (U+FFFD if it was incomplete) and
        stands for one U+FFFD itself, exactly as `ByteTokenizer.decode` does."""
        parts: list[str] = []
        run = bytearray()
        for tok in ids:
            value = known_id(tok, 256)
            if value is not None:
                run.append(value)
                continue
            parts.append(self._utf8.decode(bytes(run), final=True))
            self._utf8.reset()
            run.clear()
            parts.append(REPLACEMENT)
        parts.append(self._utf8.decode(bytes(run)))
        return "".join(parts)

    # -- any tokenizer --------------------------------------------------------------------------

    def _feed_generic(self, ids: Sequence[int]) -> str:
        self._ids.extend(as_int_list(ids))
        if len(self._ids) == self._read:
            return ""
        decode = self.tokenizer.decode
        # Both decodes start at the same id, so tokenizer quirks at a fragment's start (a stripped
        # leading space, a continuation byte) affect both alike and cancel out in the diff.
        prefix_text = decode(self._ids[self._prefix : self._read])
        # Try all new ids first; if the text ends in U+FFFD (a character still missing bytes), back
        # off a few ids so that a chunk like "A" + half an emoji still emits "A" now. A character is
        # at most 4 bytes, so its incomplete tail spans at most 3 ids.
        end = len(self._ids)
        for end in range(len(self._ids), max(self._read, len(self._ids) - _MAX_BACKOFF), -1):
            new_text = decode(self._ids[self._prefix : end])
            if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
                break
        else:
            return ""  # nothing new yet, or only an incomplete character
        out = new_text[len(prefix_text) :]
        # Slide the window: the ids just emitted become the next decode's context.
        emitted_from = self._read
        del self._ids[:emitted_from]
        self._prefix = 0
        self._read = end - emitted_from
        return out
