"""The decode engine core on a virtual clock: exact token counts and modelled step times."""

from __future__ import annotations

import pytest

from workers.engine.decode import DecodeEngine, DecodeRequest
from workers.engine.effects import DecodeChunk, DecodeFinished
from workers.engine.faults import Faults
from workers.engine.profiles import FormulaProfile, formula_profile
from workers.engine.tokens import output_tokens


def make(**kw) -> DecodeEngine:
    prof: FormulaProfile = formula_profile(
        "1", decode_base_ms=10.0, decode_per_seq_ms=1.0, kv_transfer_bytes_per_s=131072 * 1000.0
    )  # 1 ms per token
    kw.setdefault("kv_capacity_tokens", 10_000)
    return DecodeEngine(prof, **kw)


def drain(e: DecodeEngine, until: float = 1e9) -> list:
    out = []
    while (t := e.next_event_time()) is not None and t <= until:
        out.extend(e.advance_to(t))
    out.extend(e.advance_to(min(until, e.now + 1e-6)))
    return out


def tokens_of(effects, rid: str) -> list[int]:
    toks: list[int] = []
    for x in effects:
        if isinstance(x, DecodeChunk) and x.request_id == rid:
            toks.extend(x.tokens)
    return toks


def test_single_stream_exact_tokens_and_times() -> None:
    e = make()
    e.submit(DecodeRequest("a", input_tokens=100, max_new_tokens=50), 0.0)
    eff = drain(e)
    toks = tokens_of(eff, "a")
    assert toks == output_tokens(0, "a", 1, 50)
    fin = [x for x in eff if isinstance(x, DecodeFinished)]
    # fetch 100 ms, then 50 steps of 10 + 1*1 ms
    assert fin[0].reason == "length" and fin[0].generated == 50
    assert fin[0].t_ms == pytest.approx(100 + 50 * 11)
    chunks = [x for x in eff if isinstance(x, DecodeChunk)]
    assert chunks[0].t_first_ms == pytest.approx(111)


def test_chunks_coalesce_on_driver_ticks() -> None:
    e = make()
    e.submit(DecodeRequest("a", 100, 100), 0.0)
    got = []
    t = 0.0
    while t < 2000:
        t += 50.0
        got.extend(e.advance_to(t))
    chunks = [x for x in got if isinstance(x, DecodeChunk)]
    assert sum(len(c.tokens) for c in chunks) == 100
    assert len(chunks) < 30  # ~ one chunk per tick, not one per token
    idx = [c.first_index for c in chunks]
    assert idx == sorted(idx) and idx[0] == 1


def test_two_streams_share_steps() -> None:
    e = make()
    e.submit(DecodeRequest("a", 100, 10), 0.0)
    e.submit(DecodeRequest("b", 100, 10), 0.0)
    eff = drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    # both join at t=100: 10 steps of 10 + 2*1 ms
    assert fin["a"].t_ms == pytest.approx(100 + 10 * 12)
    assert fin["b"].t_ms == pytest.approx(100 + 10 * 12)


def test_late_joiner_waits_for_step_boundary() -> None:
    e = make()
    e.submit(DecodeRequest("a", 100, 20), 0.0)  # runs from 100 at 11 ms/step
    e.submit(DecodeRequest("b", 5, 5), 100.0)  # fetch 5 ms -> ready at 105, joins at 111
    eff = drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["b"].t_ms == pytest.approx(111 + 5 * 12)
    assert tokens_of(eff, "a") == output_tokens(0, "a", 1, 20)
    assert tokens_of(eff, "b") == output_tokens(0, "b", 1, 5)


def test_kv_full_waits_then_completes() -> None:
    e = make(kv_capacity_tokens=300)
    e.submit(DecodeRequest("a", 100, 100), 0.0)
    e.submit(DecodeRequest("b", 100, 100), 0.0)  # does not fit until a finishes
    eff = drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["a"].reason == fin["b"].reason == "length"
    assert fin["b"].t_ms == pytest.approx(fin["a"].t_ms + 100 * 11)
    assert e.kv_view()["kv_free_tokens"] == 300


def test_too_long_and_invalid_fail_typed() -> None:
    e = make(kv_capacity_tokens=300)
    eff = e.submit(DecodeRequest("a", 250, 100), 0.0)
    assert eff[-1].reason == "too_long"
    eff = e.submit(DecodeRequest("b", 10, 0), 0.0)
    assert eff[-1].reason == "invalid_request"


@pytest.mark.parametrize("when", [50.0, 150.0, 250.0])
def test_cancel_in_each_phase(when: float) -> None:
    e = make(kv_capacity_tokens=300)
    e.submit(DecodeRequest("a", 100, 100), 0.0)
    e.submit(DecodeRequest("b", 100, 100), 0.0)  # waiting behind a
    eff = e.cancel("a", when)
    fin = [x for x in eff if isinstance(x, DecodeFinished)]
    assert fin[0].request_id == "a" and fin[0].reason == "cancelled"
    rest = drain(e)
    assert all(x.request_id == "b" for x in rest if isinstance(x, DecodeFinished))
    assert len(tokens_of(eff + rest, "b")) == 100
    assert e.kv_view()["kv_free_tokens"] == 300


def test_many_streams_are_cheap() -> None:
    e = make(kv_capacity_tokens=10_000_000)
    for i in range(200):
        e.submit(DecodeRequest(f"r{i}", 1000, 500), float(i))
    eff = drain(e)
    assert sum(1 for x in eff if isinstance(x, DecodeFinished)) == 200
    assert sum(len(x.tokens) for x in eff if isinstance(x, DecodeChunk)) == 200 * 500
    assert e.steps_total < 5000  # analytic: one rebase per change/64 steps, not per token


def test_error_fault() -> None:
    e = make(seed=1)
    e.configure(0.0, faults=Faults(error_rate=1.0))
    e.submit(DecodeRequest("a", 10, 10), 0.0)
    eff = drain(e)
    assert [x.reason for x in eff if isinstance(x, DecodeFinished)] == ["engine_error"]


def test_expected_use_admission_preempts_and_recomputes_when_kv_runs_out() -> None:
    # 300 tokens of KV, two sequences of 100 + 100. Reserving the maximum, b waits for a to end
    # (test_kv_full_waits_then_completes: b ends at 2300). Admitting on use, both run until their
    # growth fills the KV (50 steps), b (admitted last) is preempted, recomputes 150 tokens, and
    # resumes where it stopped when a's end frees room: every token exactly once, b done sooner.
    e = make(kv_capacity_tokens=300, admission="expected")
    e.submit(DecodeRequest("a", 100, 100), 0.0)
    e.submit(DecodeRequest("b", 100, 100), 0.0)
    eff = drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["a"].reason == fin["b"].reason == "length"
    assert e.preemptions == 1
    assert tokens_of(eff, "a") == output_tokens(0, "a", 1, 100)
    assert tokens_of(eff, "b") == output_tokens(0, "b", 1, 100)  # none lost, none twice
    assert fin["a"].t_ms == pytest.approx(100 + 50 * 12 + 50 * 11)
    assert fin["b"].t_ms == pytest.approx(fin["a"].t_ms + 50 * 11)
    assert fin["b"].t_ms < 2300
    assert e.kv_view()["kv_free_tokens"] == 300
    with pytest.raises(ValueError):
        make(admission="sometimes")


@pytest.mark.parametrize("admission", ["reserve", "expected"])
def test_running_sequences_hold_a_shared_prompt_block_once(admission: str) -> None:
    # 300 tokens of KV; a (output 50) and b (output 100) share their prompt's two 50-token blocks,
    # as a session's turns or an application's prompt do on vLLM's / SGLang's paged KV. Counted
    # once, b fits beside a (150 + 100 of 300) and both run at once; counted twice (before), b
    # waited for a's end. When a ends, the blocks stay held for b: 200 tokens in use, not 100.
    e = make(kv_capacity_tokens=300, admission=admission)
    e.submit(DecodeRequest("a", 100, 50, block_keys=(1, 2), block_size=50), 0.0)
    e.submit(DecodeRequest("b", 100, 100, block_keys=(1, 2), block_size=50), 0.0)
    eff = drain(e, until=650.0)
    assert sorted(e.live_view()["running"]) == ["a", "b"]
    if admission == "reserve":
        assert e.kv_view()["kv_free_tokens"] == 50
    eff += drain(e, until=100 + 50 * 12 + 1)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["a"].t_ms == pytest.approx(100 + 50 * 12)
    assert e.live_view()["running"] == ["b"]
    if admission == "reserve":
        assert e.kv_view()["kv_free_tokens"] == 100  # b's 200: the shared blocks stayed
    eff += drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["b"].t_ms == pytest.approx(100 + 50 * 12 + 50 * 11)  # never waited behind a
    assert tokens_of(eff, "b") == output_tokens(0, "b", 1, 100)
    assert e.preemptions == 0
    assert e.kv_view()["kv_free_tokens"] == 300 and not e._blocks and e._shared_tokens == 0


def test_a_preempted_sequence_gives_back_its_shared_blocks() -> None:
    # Expected-use admission: b is preempted while sharing a's blocks; its share is released
    # (nothing counted twice afterwards) and retaken when it is readmitted.
    e = make(kv_capacity_tokens=260, admission="expected")
    e.submit(DecodeRequest("a", 100, 100, block_keys=(1, 2), block_size=50), 0.0)
    e.submit(DecodeRequest("b", 100, 100, block_keys=(1, 2), block_size=50), 0.0)
    eff = drain(e)
    fin = {x.request_id: x for x in eff if isinstance(x, DecodeFinished)}
    assert fin["a"].reason == fin["b"].reason == "length"
    assert e.preemptions >= 1
    assert tokens_of(eff, "b") == output_tokens(0, "b", 1, 100)
    assert e.kv_view()["kv_free_tokens"] == 260 and not e._blocks and e._shared_tokens == 0
