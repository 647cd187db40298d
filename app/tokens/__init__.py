"""Tokenisation for the request path (DESIGN.md §3 step 2): tokenizers, incremental
detokenisation and the prefix-stable chat template. Pure: no network, no I/O beyond reading a
local tokenizer file when one is configured."""

from app.tokens.chat import GENERATION_PROMPT, ChatTemplateError, render_chat
from app.tokens.detok import IncrementalDetokenizer
from app.tokens.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerUnavailable,
    load_tokenizer,
)

__all__ = [
    "GENERATION_PROMPT",
    "ByteTokenizer",
    "ChatTemplateError",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerUnavailable",
    "load_tokenizer",
    "render_chat",
]
