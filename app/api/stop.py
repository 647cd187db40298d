"""OpenAI `stop` sequences, matched on the detokenised text (issue #19).

Why text and not token ids: a stop string may span several tokens, and a chunk boundary may fall
inside it (or inside one character of it), so it is matched on the text as the client would see
it, across chunks. Two users of one matcher:

- `StopText` filters the text a client receives: it holds back any tail that could still become
  a stop string, and cuts the text before the first stop string (which is never sent).
- `TokenStop` tells the request pipeline at which token the first stop string is complete, so
  decoding ends there (the engine's decode is cancelled and its KV freed) and `usage` counts the
  tokens actually generated up to it.

Both apply the same rule to the same token sequence, so they agree on where the text ends.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.tokens.detok import IncrementalDetokenizer
from app.tokens.tokenizer import Tokenizer


class StopText:
    """Incremental stop-string filter over text pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can be sent now; "" once a stop string has been seen."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self.hold + text
        # The stop string that completes first wins (generation ends there; as for one token at a
        # time, whatever the chunking), and of those completing together the one starting first.
        hits = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.hold = ""
            return buf[: min(hits)[1]]
        keep = 0  # the longest tail of buf that is the start of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.hold = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the output: what was held back (nothing if a stop string was found)."""
        out, self.hold = ("" if self.stopped else self.hold), ""
        return out


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The whole text up to (not including) the stop string that completes first."""
    f = StopText(stops)
    return f.feed(text) + f.flush()


class TokenStop:
    """Fed the output token ids in order; says at which one the first stop string completed."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = StopText(stops)

    def __call__(self, ids: Sequence[int]) -> int | None:
        """How many of `ids` to keep when a stop string completes within them, else None."""
        for i, tok in enumerate(ids):
            self.text.feed(self.detok.feed([tok]))
            if self.text.stopped:
                return i + 1
        return None
