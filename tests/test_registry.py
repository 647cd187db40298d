"""Worker spec parsing (pure) — the registry's Redis side is exercised by the gateway tests."""

from __future__ import annotations

import pytest

from app.cluster.registry import BadWorkerSpec, parse_worker, parse_workers


def test_parse_workers() -> None:
    ws = parse_workers("prefill@127.0.0.1:9001, decode@localhost:9002")
    assert [w.id for w in ws] == ["prefill@127.0.0.1:9001", "decode@localhost:9002"]
    assert ws[0].address == "127.0.0.1:9001"


@pytest.mark.parametrize(
    "bad", ["prefill127.0.0.1:1", "gpu@h:1", "prefill@h", "prefill@h:x", "decode@:1", "prefill@h:70000"]
)
def test_parse_worker_rejects(bad: str) -> None:
    with pytest.raises(BadWorkerSpec):
        parse_worker(bad)
