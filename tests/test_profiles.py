"""Timing profiles: the roofline's shape, the registry's errors, and that docs/engine-model.md
shows what the code computes (the doc is where operators read the numbers)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

from workers.engine import profiles as P
from workers.engine.profiles import FormulaProfile, RooflineProfile, get_profile

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-model.md"


class Item(NamedTuple):
    """Shaped like app.scheduling.formula.BatchItem, so these tests pin only the field names."""

    input_tokens: int
    hit_tokens: int


PROFILE = RooflineProfile()


def prefill(*items: tuple[int, int]) -> float:
    return PROFILE.prefill_batch_ms([Item(n, h) for n, h in items])


# ---- prefill ------------------------------------------------------------------------------------


def test_prefill_grows_with_tokens() -> None:
    lengths = [1, 64, 512, 1024, 4096, 8192, 32768, 131072]
    times = [prefill((n, 0)) for n in lengths]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


def test_prefill_grows_with_batch_size_and_shares_overhead() -> None:
    one = prefill((4096, 0))
    times = [PROFILE.prefill_batch_ms([Item(4096, 0)] * b) for b in range(1, 9)]
    assert times == sorted(times) and len(set(times)) == len(times)
    # Items share one overhead and add their compute.
    assert times[7] == pytest.approx(PROFILE.prefill_overhead_ms + 8 * (one - PROFILE.prefill_overhead_ms))
    assert times[7] < 8 * one


def test_quadratic_attention_term_is_visible() -> None:
    t8k, t16k, t32k = prefill((8192, 0)), prefill((16384, 0)), prefill((32768, 0))
    # Linear-only with the same overhead would be (7 + 4·242)/(7 + 242) = 3.9x; attention makes it 5.3x.
    assert 5.0 < t32k / t8k < 6.0
    # Second difference isolates the quadratic term exactly: t(2n) - 2 t(n) + overhead = A·n².
    n = 16384
    excess = t32k - 2 * t16k + PROFILE.prefill_overhead_ms
    assert excess == pytest.approx(PROFILE.attn_ms_per_pair * n * n, rel=1e-9)
    assert excess > 0.25 * t16k


def test_constants_match_public_arithmetic() -> None:
    assert PROFILE.kv_bytes_per_token == 131072 == 32 * 8 * 128 * 2 * 2
    assert PROFILE.max_context_tokens == 131072
    assert PROFILE.linear_ms_per_token == pytest.approx(2 * 8.03e9 / (0.55 * 989e12) * 1e3)
    assert PROFILE.attn_ms_per_pair == pytest.approx(4 * 32 * 32 * 128 / (0.55 * 989e12) * 1e3)
    assert PROFILE.weight_read_ms == pytest.approx(16.06e9 / (0.75 * 3.35e12) * 1e3)
    # Capacity: HBM - weights - KV leaves a 10-15 % reserve for activations and workspaces.
    reserve = P.H100_HBM_BYTES - P.LLAMA31_8B_WEIGHT_BYTES - PROFILE.kv_capacity_tokens * 131072
    assert 0.10 < reserve / P.H100_HBM_BYTES < 0.15
    assert 450_000 <= PROFILE.kv_capacity_tokens <= 500_000


def test_hits_reduce_time_but_new_tokens_still_attend_to_the_prefix() -> None:
    cold = prefill((8192, 0))
    warm = prefill((8192, 7168))
    assert warm < cold / 5
    # 1024 new tokens after a 7168-token prefix cost more than a fresh 1024-token prompt.
    assert warm > prefill((1024, 0))
    assert prefill((8192, 4096)) > warm  # fewer hits, more time


def test_full_hit_still_costs_the_overhead() -> None:
    full = prefill((8192, 8192))
    assert PROFILE.prefill_overhead_ms <= full < PROFILE.prefill_overhead_ms + 0.1
    # A hit count beyond the prompt (or negative) is clamped, not turned into negative work.
    assert prefill((8192, 10_000)) == full
    assert prefill((8192, -5)) == prefill((8192, 0))


def test_empty_and_degenerate_batches() -> None:
    assert PROFILE.prefill_batch_ms([]) == 0.0
    assert prefill((0, 0)) == PROFILE.prefill_overhead_ms


def test_works_with_the_real_batch_item() -> None:
    from app.scheduling.formula import BatchItem

    assert PROFILE.prefill_batch_ms([BatchItem(8192, 1024)]) == prefill((8192, 1024))


# ---- decode -------------------------------------------------------------------------------------


def test_decode_step_grows_with_batch_and_context() -> None:
    by_batch = [PROFILE.decode_step_ms(b, b * 2048) for b in (1, 2, 8, 16, 64, 256)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)
    by_ctx = [PROFILE.decode_step_ms(16, c) for c in (0, 1_000, 32_768, 131_072, 450_000)]
    assert by_ctx == sorted(by_ctx) and len(set(by_ctx)) == len(by_ctx)
    # Batch size matters even at equal total context (per-sequence overhead).
    assert PROFILE.decode_step_ms(64, 65536) > PROFILE.decode_step_ms(1, 65536)


def test_decode_step_is_in_the_published_range() -> None:
    step = PROFILE.decode_step_ms(1, 2048)
    assert 6.0 < step < 7.5
    floor = 16.06e9 / 3.35e12 * 1e3  # all weights at 100 % of HBM peak
    assert step > floor
    assert PROFILE.decode_step_ms(0, 0) == 0.0


# ---- registry -----------------------------------------------------------------------------------


def test_get_profile_roofline_and_capacity_override() -> None:
    p = get_profile("llama3.1-8b-h100")
    assert isinstance(p, RooflineProfile) and p.name == "llama3.1-8b-h100"
    small = get_profile("llama3.1-8b-h100", kv_capacity_tokens=10_000)
    assert small.kv_capacity_tokens == 10_000
    # The override changes capacity only; derived timing is recomputed identically.
    assert small.prefill_batch_ms([Item(4096, 0)]) == p.prefill_batch_ms([Item(4096, 0)])
    # A formula handed to every profile by a worker's config is ignored here.
    assert get_profile("llama3.1-8b-h100", formula="1") == p


def test_get_profile_formula() -> None:
    p = get_profile("formula", formula="5 + sum(0.01 * computeTokens)", kv_capacity_tokens=1234)
    assert isinstance(p, FormulaProfile)
    assert p.kv_capacity_tokens == 1234
    assert p.prefill_batch_ms([Item(1000, 500)]) == pytest.approx(10.0)
    assert p.decode_step_ms(4, 4000) == pytest.approx(8.0 + 0.05 * 4)
    assert get_profile("formula", formula="5").kv_capacity_tokens == FormulaProfile.kv_capacity_tokens


@pytest.mark.parametrize("formula", [None, "", "   "])
def test_formula_profile_requires_formula(formula: str | None) -> None:
    with pytest.raises(ValueError, match="formula"):
        get_profile("formula", formula=formula)


def test_unknown_profile_lists_known_names() -> None:
    with pytest.raises(ValueError) as exc:
        get_profile("llama-9000")
    msg = str(exc.value)
    assert "llama-9000" in msg
    for name in P.PROFILES:
        assert name in msg


@pytest.mark.parametrize("name", ["llama3.1-8b-h100", "formula"])
def test_non_positive_capacity_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        get_profile(name, formula="1", kv_capacity_tokens=0)


def test_registry_names() -> None:
    assert set(P.PROFILES) == {"llama3.1-8b-h100", "formula"}


# ---- the doc shows what the code computes -------------------------------------------------------


def _table(marker: str) -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"<!-- table:{marker} -->")
    rows: list[list[str]] = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-"}:
            continue
        rows.append(cells)
    return rows[1:]  # drop the header


def _num(cell: str) -> float:
    m = re.match(r"[\d,]+(?:\.\d+)?", cell)
    assert m, cell
    return float(m.group(0).replace(",", ""))


def test_doc_prefill_table_matches_code() -> None:
    rows = _table("prefill")
    assert [r[0] for r in rows] == ["1K", "8K", "32K", "128K"]
    for row in rows:
        n = int(_num(row[1]))
        assert _num(row[2]) == pytest.approx(PROFILE.prefill_batch_ms([Item(n, 0)]), abs=0.06)
        assert _num(row[3]) == pytest.approx(PROFILE.prefill_batch_ms([Item(n, 0)] * 8), abs=0.06)


def test_doc_decode_table_matches_code() -> None:
    rows = _table("decode")
    assert [r[0] for r in rows] == ["2K", "8K"]
    for row in rows:
        ctx = int(_num(row[1]))
        for cell, batch in zip(row[2:], (1, 16, 64), strict=True):
            assert _num(cell) == pytest.approx(PROFILE.decode_step_ms(batch, batch * ctx), abs=0.006)


def test_doc_formula_example_approximates_the_roofline() -> None:
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"`(7 \+ sum\([^`]+\))`", text)
    assert m, "example formula missing from the doc"
    approx = get_profile("formula", formula=m.group(1))
    for items in ([Item(1024, 0)], [Item(8192, 7168)], [Item(32768, 0)] * 2, [Item(8192, 0), Item(512, 256)]):
        assert approx.prefill_batch_ms(items) == pytest.approx(PROFILE.prefill_batch_ms(items), rel=0.01)
