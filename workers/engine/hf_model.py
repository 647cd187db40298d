"""A Hugging Face causal LM run for real: batched prefill over cached prefixes, batched decode
steps, sampling, and the KV layout that travels from prefill to decode.

Why one module owns the tensors: prefill and decode must agree on the KV layout to the byte, and the
exactness tests compare this code with `model.generate` in one process. Everything here is
synchronous torch work; the worker runs it on its engine thread, never on an event loop.

KV layout of one sequence: one tensor `[layers, 2, kv_heads, tokens, head_dim]` (2 = keys, values),
contiguous, in the model's dtype. A block of the prefix cache is the slice of `block_size` tokens.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY_MARKER = "flexlb.json"  # written next to a model whose vocabulary is the byte tokenizer's


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-request sampling: greedy when `temperature` is 0. `seed` < 0: the engine draws one, and
    it travels with the KV so that decode continues the same random stream."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = -1


GREEDY = Sampling()


def sample_token(logits: torch.Tensor, sampling: Sampling, index: int) -> int:
    """Token `index` of a request's output stream from its logits row. Deterministic in (seed,
    index): a request sampled with a seed gives the same text on any worker and any batch."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p  # always keeps the top one
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_p[keep]
        probs = filtered / filtered.sum()
    gen = torch.Generator().manual_seed((sampling.seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 4096,
) -> Path:
    """Write a random-weight Llama with a byte vocabulary (ids 0-255 = UTF-8 bytes, as the
    gateway's byte tokenizer) by `save_pretrained`. No download: config and weights are made here.
    A larger init range than Llama's default keeps logits peaked, so greedy picks are far from
    ties and padded/batched compute cannot flip them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    (out / TINY_MARKER).write_text(json.dumps({"tokenizer": "byte", "seed": seed}) + "\n")
    return out


class HfModel:
    """A loaded causal LM plus the two batched forward passes the engines need."""

    def __init__(
        self, path: str | Path, *, device: str = "cpu", dtype: str = "float32", threads: int = 0
    ) -> None:
        """`threads` > 0 sets torch's intra-op threads (CPU): several workers sharing few cores
        run far faster with one each than with all each (on the shared 2-core box a 128-token
        prefill took 4 ms with 1 thread and 160 ms with 2, under load). 0 keeps torch's default."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if threads > 0:
            torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()  # a worker's stderr is a JSON log, not a terminal

        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path), local_files_only=True, dtype=self.dtype
        ).to(self.device)
        self.model.eval()
        c = self.model.config
        self.layers = int(c.num_hidden_layers)
        self.kv_heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.max_context = int(getattr(c, "max_position_embeddings", 4096))
        eos = getattr(c, "eos_token_id", None)
        self.eos_ids: frozenset[int] = frozenset(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.params = sum(p.numel() for p in self.model.parameters())
        self.kv_bytes_per_token = self.layers * 2 * self.kv_heads * self.head_dim * _itemsize(self.dtype)

    def _kw(self, cache: Any) -> dict[str, Any]:
        """transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes)."""
        return {self._cache_arg: cache}

    @staticmethod
    def _out_cache(out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _cache(self, past: torch.Tensor | None) -> Any:
        """A DynamicCache holding `past` ([layers, 2, batch, heads, tokens, dim]); empty if None."""
        from transformers import DynamicCache

        if past is None:
            return DynamicCache(config=self.model.config)
        return DynamicCache(ddp_cache_data=[(past[i, 0], past[i, 1]) for i in range(self.layers)])

    @staticmethod
    def _stacked(cache: Any) -> torch.Tensor:
        """[layers, 2, batch, heads, tokens, dim] view of a DynamicCache's tensors."""
        return torch.stack([torch.stack((lay.keys, lay.values)) for lay in cache.layers])

    @torch.inference_mode()
    def prefill(
        self, items: Sequence[tuple[torch.Tensor | None, Sequence[int]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward pass over a batch. Each item is (cached prefix KV or None, the uncached
        tokens, at least one). Prefixes are left-padded to the longest, new tokens right-padded,
        and the attention mask and explicit positions make every row see only its own tokens.
        Returns per item (logits at its last token, its full KV: prefix + new)."""
        b = len(items)
        hs = [0 if kv is None else int(kv.shape[3]) for kv, _ in items]
        cs = [len(t) for _, t in items]
        max_h, max_c = max(hs), max(cs)
        dev = self.device
        ids = torch.zeros((b, max_c), dtype=torch.long, device=dev)
        mask = torch.zeros((b, max_h + max_c), dtype=torch.long, device=dev)
        pos = torch.zeros((b, max_c), dtype=torch.long, device=dev)
        past = None
        if max_h:
            past = torch.zeros(
                (self.layers, 2, b, self.kv_heads, max_h, self.head_dim), dtype=self.dtype, device=dev
            )
        for i, ((kv, toks), h, c) in enumerate(zip(items, hs, cs, strict=True)):
            ids[i, :c] = torch.as_tensor(list(toks), dtype=torch.long)
            mask[i, max_h - h : max_h + c] = 1
            pos[i] = torch.arange(h, h + max_c)
            if kv is not None and h:
                assert past is not None
                past[:, :, i, :, max_h - h :] = kv.to(dev)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **self._kw(self._cache(past)),
        )
        full = self._stacked(self._out_cache(out))
        res = []
        for i, (h, c) in enumerate(zip(hs, cs, strict=True)):
            kv_i = full[:, :, i, :, max_h - h : max_h + c].contiguous()
            res.append((out.logits[i, c - 1].float(), kv_i))
        return res

    @torch.inference_mode()
    def decode_step(self, batch: DecodeBatch) -> torch.Tensor:
        """One token for every row of `batch`: returns logits [rows, vocab] and grows its cache."""
        dev = self.device
        ids = torch.as_tensor(batch.last, dtype=torch.long, device=dev).unsqueeze(1)
        pos = torch.as_tensor(batch.lengths, dtype=torch.long, device=dev).unsqueeze(1)
        one = torch.ones((len(batch.rows), 1), dtype=torch.long, device=dev)
        batch.mask = torch.cat([batch.mask, one], 1)
        out = self.model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=pos,
            use_cache=True,
            **self._kw(batch.cache),
        )
        batch.cache = self._out_cache(out)
        batch.lengths = [n + 1 for n in batch.lengths]
        return out.logits[:, -1].float()

    def new_decode_batch(self, rows: list[str], kvs: list[torch.Tensor], last: list[int]) -> DecodeBatch:
        """Left-pad each sequence's KV to the longest: every later step appends one real column to
        every row, so a row's real KV is always its last `lengths[i]` columns."""
        lengths = [int(kv.shape[3]) for kv in kvs]
        t = max(lengths)
        dev = self.device
        past = torch.zeros(
            (self.layers, 2, len(rows), self.kv_heads, t, self.head_dim), dtype=self.dtype, device=dev
        )
        mask = torch.zeros((len(rows), t), dtype=torch.long, device=dev)
        for i, (kv, n) in enumerate(zip(kvs, lengths, strict=True)):
            past[:, :, i, :, t - n :] = kv.to(dev)
            mask[i, t - n :] = 1
        return DecodeBatch(list(rows), self._cache(past), mask, lengths, list(last))

    def rows_kv(self, batch: DecodeBatch) -> dict[str, torch.Tensor]:
        """Every row's real KV, [layers, 2, heads, tokens, dim] (to rebuild the batch when its
        membership changes); the cache is stacked once for all rows."""
        full = self._stacked(batch.cache)
        return {
            rid: full[:, :, i, :, -n:].contiguous()
            for i, (rid, n) in enumerate(zip(batch.rows, batch.lengths, strict=True))
        }


@dataclass
class DecodeBatch:
    """The running decode batch: rows are request ids; `last` is each row's newest token (the
    next step's input), `lengths` its KV length (the next step's position)."""

    rows: list[str]
    cache: Any
    mask: torch.Tensor
    lengths: list[int]
    last: list[int]


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def is_byte_model(path: str | Path) -> bool:
    """A model written by `make_tiny_model` (or marked alike) uses the gateway's byte tokenizer."""
    return (Path(path) / TINY_MARKER).exists()
