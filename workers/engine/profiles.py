"""Engine timing profiles: how long a modelled GPU takes for a prefill batch or a decode step.

Pure functions of token counts (no I/O, no clock) so the live worker and the cluster simulator
share them. Numbers and their derivation live in docs/engine-model.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from app.scheduling.formula import BatchItem, Formula, compile_formula


class EngineProfile(Protocol):
    """What the engine core needs to know about a modelled GPU."""

    name: str
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_context_tokens: int
    kv_transfer_bytes_per_s: float

    def prefill_batch_ms(self, items: Sequence[BatchItem]) -> float:
        """Modelled milliseconds to prefill one batch (items: input and cache-hit tokens)."""
        ...

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """Modelled milliseconds of one decode step for `batch_size` running sequences that
        together hold `context_tokens` tokens of KV."""
        ...


@dataclass(frozen=True)
class FormulaProfile:
    """Prefill time from a DESIGN §7 formula; decode from a simple linear step model."""

    formula: Formula
    name: str = "formula"
    kv_bytes_per_token: int = 131072
    kv_capacity_tokens: int = 450_000
    max_context_tokens: int = 131072
    kv_transfer_bytes_per_s: float = 50e9
    decode_base_ms: float = 8.0
    decode_per_seq_ms: float = 0.05
    decode_per_kv_token_ms: float = 0.0

    def prefill_batch_ms(self, items: Sequence[BatchItem]) -> float:
        return max(0.0, self.formula.predict_batch(items))

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return (
            self.decode_base_ms
            + self.decode_per_seq_ms * batch_size
            + self.decode_per_kv_token_ms * context_tokens
        )


def formula_profile(expr: str, **overrides: float | int) -> FormulaProfile:
    return FormulaProfile(formula=compile_formula(expr), **overrides)  # type: ignore[arg-type]


# ---- Llama-3.1-8B on one H100 SXM 80GB, BF16 (derivation: docs/engine-model.md) ----------------
#
# Hardware (NVIDIA H100 SXM5 datasheet).
H100_BF16_DENSE_FLOPS = 989e12  # dense BF16 tensor-core peak (the 1979 TFLOP/s figure assumes sparsity)
H100_HBM_BYTES_PER_S = 3.35e12  # HBM3 peak bandwidth
H100_HBM_BYTES = 81_559 * 2**20  # what nvidia-smi reports as usable on an "80GB" part (85.5 GB)
# Model (Meta Llama-3.1-8B model card / config.json).
LLAMA31_8B_PARAMS = 8.03e9  # incl. 2 x 0.525B untied embedding / lm_head
LLAMA31_8B_LAYERS = 32
LLAMA31_8B_Q_HEADS = 32  # hidden 4096 = 32 query heads x 128
LLAMA31_8B_KV_HEADS = 8  # grouped-query attention: 4 query heads share one K/V head
LLAMA31_8B_HEAD_DIM = 128
LLAMA31_8B_MAX_CONTEXT = 131_072  # 128K
BF16_BYTES = 2
# K and V, every layer, every KV head, BF16: 32 x 8 x 128 x 2 x 2 = 131072 B = 128 KiB per token.
LLAMA31_8B_KV_BYTES_PER_TOKEN = LLAMA31_8B_LAYERS * LLAMA31_8B_KV_HEADS * LLAMA31_8B_HEAD_DIM * 2 * BF16_BYTES
LLAMA31_8B_WEIGHT_BYTES = LLAMA31_8B_PARAMS * BF16_BYTES  # 16.06 GB, read once per forward pass
# 85.5 GB HBM - 16.06 GB weights - ~10.5 GB reserve (engine headroom as vLLM's default 90 % memory
# utilisation leaves, activations of an 8K-token chunk, CUDA graphs, cuBLAS/attention workspaces)
# = ~59 GB of KV / 128 KiB = ~450K tokens.
LLAMA31_8B_H100_KV_CAPACITY = 450_000
# One 400 Gb/s RDMA NIC per GPU (DGX/HGX H100 rail) is 50 GB/s on the wire; Mooncake's transfer
# engine measured 87 % of line rate on 4x200 Gb/s with 40 GB transfers, and per-request KV is
# 0.1-1 GB, so 80 % of line rate.
RDMA_400G_EFFECTIVE_BYTES_PER_S = 40e9


@dataclass(frozen=True)
class RooflineProfile:
    """Roofline timing for Llama-3.1-8B on one H100 SXM (BF16), from public specs.

    Prefill is compute-bound, so a batch costs its FLOPs at an MFU-derated peak; decode is
    bandwidth-bound, so a step costs the bytes it must stream from HBM. The same constants make
    long prompts superlinear (attention) and prefix hits cheaper in a way that matches real engines,
    which a flat per-token formula cannot. Derived per-unit costs are computed once in
    `__post_init__` because both methods sit on the engine's hot path.
    """

    name: str = "llama3.1-8b-h100"
    kv_bytes_per_token: int = LLAMA31_8B_KV_BYTES_PER_TOKEN
    kv_capacity_tokens: int = LLAMA31_8B_H100_KV_CAPACITY
    max_context_tokens: int = LLAMA31_8B_MAX_CONTEXT
    kv_transfer_bytes_per_s: float = RDMA_400G_EFFECTIVE_BYTES_PER_S
    params: float = LLAMA31_8B_PARAMS
    layers: int = LLAMA31_8B_LAYERS
    q_heads: int = LLAMA31_8B_Q_HEADS
    head_dim: int = LLAMA31_8B_HEAD_DIM
    weight_bytes: float = LLAMA31_8B_WEIGHT_BYTES
    peak_flops: float = H100_BF16_DENSE_FLOPS
    # 0.55 x 989 = 544 TFLOP/s for GEMMs and attention alike: FlashAttention-3 runs at 430-620 TFLOP/s
    # (head dim 128, 0.5K-16K tokens) and a dense 8B prefill at ~0.5 of peak reproduces published
    # long-prompt prefill times (see the doc's comparison table).
    mfu: float = 0.55
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S
    # Share of HBM peak a decode step streams at (CUDA-graph engines reach 0.7-0.85).
    mbu: float = 0.75
    # Per batch: one pass over the weights that short prompts cannot hide behind compute
    # (16.06 GB / 2.51 TB/s = 6.4 ms) plus ~0.6 ms of launch, scheduling and sampling.
    prefill_overhead_ms: float = 7.0
    # Per decode step: graph launch, sampler and scheduler bookkeeping.
    decode_overhead_ms: float = 0.4
    # Per running sequence per step: sampling, stop checks and the small growth of the GEMMs with M.
    decode_per_seq_ms: float = 0.03
    linear_ms_per_token: float = field(init=False, repr=False)
    attn_ms_per_pair: float = field(init=False, repr=False)
    weight_read_ms: float = field(init=False, repr=False)
    kv_read_ms_per_token: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        effective_flops = self.peak_flops * self.mfu
        effective_bw = self.hbm_bytes_per_s * self.mbu
        # Linear layers: 2 FLOPs per parameter per computed token.
        object.__setattr__(self, "linear_ms_per_token", 2.0 * self.params / effective_flops * 1e3)
        # Attention: per (query, key) pair and layer, QK^T and PV each cost 2 x head_dim FLOPs per
        # query head; grouped-query attention saves KV bytes, not FLOPs.
        pair_flops = 4.0 * self.layers * self.q_heads * self.head_dim
        object.__setattr__(self, "attn_ms_per_pair", pair_flops / effective_flops * 1e3)
        object.__setattr__(self, "weight_read_ms", self.weight_bytes / effective_bw * 1e3)
        object.__setattr__(self, "kv_read_ms_per_token", self.kv_bytes_per_token / effective_bw * 1e3)

    def prefill_batch_ms(self, items: Sequence[BatchItem]) -> float:
        """Items run back to back in one forward pass, so they share the overhead and add their
        compute. Cached tokens cost no linear compute, but the new tokens still attend to them."""
        if not items:
            return 0.0
        total = self.prefill_overhead_ms
        lin = self.linear_ms_per_token
        pair = self.attn_ms_per_pair
        for it in items:
            n = it.input_tokens
            if n <= 0:
                continue
            # The last prompt token is always recomputed: its logits are the first output token.
            h = min(max(it.hit_tokens, 0), n - 1)
            c = n - h
            # Causal attention: new token i (1-based) sees the h cached tokens and i new ones.
            total += c * lin + (c * h + c * (c + 1) * 0.5) * pair
        return total

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """Every step streams all weights once plus every running sequence's KV; at the batch
        sizes KV capacity allows, those bytes, not FLOPs, bound the step (see the doc)."""
        if batch_size <= 0:
            return 0.0
        return (
            self.decode_overhead_ms
            + self.weight_read_ms
            + self.kv_read_ms_per_token * max(context_tokens, 0)
            + self.decode_per_seq_ms * batch_size
        )


def _check_capacity(kv_capacity_tokens: int | None) -> None:
    if kv_capacity_tokens is not None and kv_capacity_tokens <= 0:
        raise ValueError(f"kv_capacity_tokens must be > 0, got {kv_capacity_tokens}")


def _llama31_8b_h100(*, formula: str | None = None, kv_capacity_tokens: int | None = None) -> EngineProfile:
    # `formula` is ignored on purpose: workers may pass the gateway's configured formula to every
    # profile, and only the `formula` profile derives its timing from it.
    _check_capacity(kv_capacity_tokens)
    profile = RooflineProfile()
    if kv_capacity_tokens is not None:
        profile = replace(profile, kv_capacity_tokens=kv_capacity_tokens)
    return profile


def _formula(*, formula: str | None = None, kv_capacity_tokens: int | None = None) -> EngineProfile:
    if not formula or not formula.strip():
        raise ValueError("profile 'formula' needs the prefill time formula text (DESIGN §7)")
    _check_capacity(kv_capacity_tokens)
    if kv_capacity_tokens is None:
        return formula_profile(formula)
    return formula_profile(formula, kv_capacity_tokens=kv_capacity_tokens)


PROFILES: dict[str, Callable[..., EngineProfile]] = {
    "llama3.1-8b-h100": _llama31_8b_h100,
    "formula": _formula,
}


def get_profile(
    name: str, *, formula: str | None = None, kv_capacity_tokens: int | None = None
) -> EngineProfile:
    """Resolve a configured profile name; a typo fails at start-up with the names that exist."""
    factory = PROFILES.get(name)
    if factory is None:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return factory(formula=formula, kv_capacity_tokens=kv_capacity_tokens)
