"""`flexlb bench` pure parts: prompts rebuilt from block hashes share exactly the trace's prefixes,
the block-size check, prefill-only rows, arrival re-timing and the run-validity verdict."""

from __future__ import annotations

import pytest

from app.loadgen.cli import build_parser, lag_verdict
from app.loadgen.gateway import parse_workers
from app.loadgen.plan import build_plan, clip_outputs, poisson_retime
from app.loadgen.prompts import BlockSizeError, PromptSynth, check_block_size, replay_max_tokens
from app.protocol.blocks import block_keys
from app.tokens.tokenizer import ByteTokenizer
from app.traces import Trace, TraceRequest


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_equal_hashes_give_equal_blocks_and_tails_are_unique() -> None:
    synth = PromptSynth(512, salt=7)
    a = synth.prompt(0, 3 * 512 + 100, (10, 11, 12, 99))  # Mooncake-style: the partial block is hashed
    b = synth.prompt(1, 3 * 512 + 100, (10, 11, 13, 99))
    c = synth.prompt(2, 2 * 512, (10, 11))
    d = synth.prompt(3, 2 * 512 + 5, (10, 11, 12))
    assert len(a) == len(b) == 3 * 512 + 100 and len(c) == 1024 and len(d) == 1029
    assert a[:1024] == b[:1024] == c
    # Blocks with different ids differ from their very first character on (the RNG makes a
    # coincidence of even one character 1/95); a shared hash on the partial block does not share it.
    assert _common_prefix(a, b) == 1024
    assert a[1536:] != b[1536:] and _common_prefix(a[1536:], b[1536:]) < 8
    assert _common_prefix(a, d) == 1024 + _common_prefix(a[1024:], d[1024:])
    assert d[1024:] != a[1024:1029]  # d's 5-token tail is its own, not the start of block 12
    assert all(0x20 <= ord(ch) <= 0x7E for ch in a + b + c + d)


def test_prefix_sharing_in_block_keys_is_exactly_the_traces() -> None:
    """At the workers' block size (64 divides 1024), two prompts share exactly the worker blocks
    that lie inside their shared trace blocks: no more (tails, differing blocks), no less."""
    tok = ByteTokenizer()
    synth = PromptSynth(1024, salt=1)
    reqs = {
        0: (3000, (1, 2)),  # 2 full blocks + 952-token tail
        1: (3000, (1, 3)),
        2: (2048, (1, 2)),
        3: (2500, (1, 2)),
    }
    keys = {
        i: block_keys(tok.encode(synth.prompt(i, n, bh)), 64, model="m", tokenizer="byte")
        for i, (n, bh) in reqs.items()
    }
    assert [len(k) for k in keys.values()] == [3000 // 64, 3000 // 64, 2048 // 64, 2500 // 64]

    def shared(i: int, j: int) -> int:
        return sum(1 for _ in zip(keys[i], keys[j], strict=False) if _[0] == _[1])

    assert shared(0, 1) == 16  # trace block 1 only
    assert shared(0, 2) == 32  # both trace blocks
    assert shared(0, 3) == 32  # the tails (952 and 452 tokens past block 2) share nothing
    assert len(set(keys[0][32:]) & set(keys[3][32:])) == 0


def test_salt_separates_runs_and_is_deterministic() -> None:
    a, b = PromptSynth(64, salt=1), PromptSynth(64, salt=2)
    assert a.prompt(0, 200, (5, 6, 7)) == PromptSynth(64, salt=1).prompt(0, 200, (5, 6, 7))
    assert _common_prefix(a.prompt(0, 200, (5, 6, 7)), b.prompt(0, 200, (5, 6, 7))) < 8


def test_prompt_token_count_is_input_len_with_the_byte_tokenizer() -> None:
    synth = PromptSynth(1024, salt=3)
    for n, bh in ((1, ()), (1023, ()), (1024, (4,)), (5000, (4, 5, 6, 7))):
        assert len(ByteTokenizer().encode(synth.prompt(9, n, bh))) == n
    with pytest.raises(ValueError):
        synth.prompt(0, 0, ())


@pytest.mark.parametrize(("trace_bs", "workers", "ok"), [(1024, [64, 64], 64), (512, [512], 512)])
def test_block_size_accepts_equal_or_dividing(trace_bs: int, workers: list[int], ok: int) -> None:
    assert check_block_size(trace_bs, workers) == ok


@pytest.mark.parametrize(
    ("trace_bs", "workers", "needle"),
    [
        (512, [1024], "must equal or divide"),
        (1024, [96], "must equal or divide"),
        (512, [64, 32], "disagree"),
        (512, [], "no prefill worker"),
    ],
)
def test_block_size_mismatch_is_a_clear_error(trace_bs: int, workers: list[int], needle: str) -> None:
    with pytest.raises(BlockSizeError, match=needle):
        check_block_size(trace_bs, workers)


def _trace(rows: list[tuple[float, int, int, tuple[int, ...]]], bs: int = 1024) -> Trace:
    return Trace("t", "flexlb", bs, [TraceRequest(i, *r) for i, r in enumerate(rows)])


def test_zero_output_rows_are_replayed_as_one_token() -> None:
    assert [replay_max_tokens(n) for n in (0, 1, 7)] == [1, 1, 7]
    plan = build_plan(_trace([(0, 2048, 0, (1, 2)), (5, 100, 40, ()), (9, 3000, 0, (1, 2))]))
    assert [p.max_tokens for p in plan] == [1, 40, 1]
    assert [p.trace_output_len for p in plan] == [0, 40, 0]
    assert plan[2].full_blocks == (1, 2) and [p.due_ms for p in plan] == [0, 5, 9]


def test_mooncake_partial_block_is_not_a_full_block() -> None:
    t = _trace([(0, 1100, 3, (0, 1, 2))], bs=512)  # ceil(1100/512) = 3 ids, 2 full blocks
    assert build_plan(t)[0].full_blocks == (0, 1)


def test_retime_and_clip_keep_the_requests() -> None:
    t = _trace([(0, 100, 5000, ()), (0, 200, 3, ()), (0, 300, 0, ())])
    r = poisson_retime(t, 10.0, seed=1)
    assert [x.input_len for x in r.requests] == [100, 200, 300]
    assert r.requests[0].arrival_ms == 0 and r.requests[1].arrival_ms < r.requests[2].arrival_ms
    assert r.requests == poisson_retime(t, 10.0, seed=1).requests
    assert [x.output_len for x in clip_outputs(t, 64).requests] == [64, 3, 0]


def test_lag_verdict_marks_runs_over_five_percent_invalid() -> None:
    assert lag_verdict(4.9, 100.0) == (pytest.approx(0.049), True)
    assert lag_verdict(5.1, 100.0)[1] is False
    assert lag_verdict(50.0, None) == (None, True)


def test_worker_views_parse_snapshot_strings() -> None:
    body = {
        "workers": {
            "prefill@h:1": {
                "role": "prefill",
                "snapshot": {
                    "block_size": "64",
                    "kv_total_tokens": "1000",
                    "lag_ms": "1.5",
                    "time_scale": "0.1",
                },
            },
            "decode@h:2": {"role": "decode", "snapshot": {}},
        }
    }
    ws = parse_workers(body)
    assert [(w.worker_id, w.block_size, w.kv_total_tokens, w.lag_ms, w.time_scale) for w in ws] == [
        ("decode@h:2", 0, 0, 0.0, 1.0),
        ("prefill@h:1", 64, 1000, 1.5, 0.1),
    ]


def test_cli_rejects_bad_combinations() -> None:
    p = build_parser()
    for argv in (
        ["--url", "u"],  # no source
        ["--url", "u", "--trace", "f", "--synthetic", "3"],
        ["--url", "u", "--trace", "f", "--speed", "2", "--rate", "3"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    from app.loadgen.cli import main

    assert main(["--url", "http://127.0.0.1:9", "--synthetic", "5", "--rate", "1"]) == 2  # unreachable
    with pytest.raises(SystemExit):
        main(["--url", "u", "--synthetic", "5"])  # no --rate


def test_a_worker_restarted_or_down_mid_run_is_reported() -> None:
    """The monitor's verdict input: samples of `/admin/workers` bodies (as the gateway returns
    them). A new epoch or a non-`up` health in any sample names the worker."""
    import asyncio

    from app.loadgen.gateway import LagMonitor

    def body(epoch: str, health: str) -> dict:
        snap = {"block_size": "64", "health": health, "epoch": epoch, "lag_ms": "0", "max_lag_ms": "0"}
        return {"workers": {"prefill@a:1": {"role": "prefill", "snapshot": snap}}}

    class Bodies:  # replays recorded admin answers; the parsing under test is the real one
        def __init__(self, seq: list[dict]) -> None:
            self.seq = seq

        async def workers(self):  # type: ignore[no-untyped-def]
            return parse_workers(self.seq.pop(0))

    async def run(seq: list[dict]) -> list[str]:
        mon = LagMonitor(Bodies(seq))  # type: ignore[arg-type]
        for _ in range(len(seq)):
            await mon._sample()
        return mon.worker_incidents()

    assert asyncio.run(run([body("e1", "up"), body("e1", "up")])) == []
    assert asyncio.run(run([body("e1", "up"), body("e2", "up")])) == ["prefill@a:1 restarted during the run"]
    assert asyncio.run(run([body("e1", "up"), body("e1", "down")])) == ["prefill@a:1 was down during the run"]
