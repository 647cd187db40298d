"""The real prefill engine (`HfPrefillEngine`) on the worker's engine thread (`EngineRunner`), in
process, no Triton: seconds instead of test_hf_engine.py's worker pool.

The engine thread drives the core with `advance_early` (results before the completion's cache
work). The real engine's own steps (hand a started batch to the compute thread, give a computed
one its measured end) and its block store (KV slices of the blocks the cache took) must run on
that path too: when they hung off `advance_to` only, a started batch was never computed and the
worker's prefill streams hung (the merged `wpath` branch, reverted in 1706f97).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("FLEXLB_REQUIRE_ENGINE") == "1":  # make test / CI: never skipped
    import torch
else:
    torch = pytest.importorskip("torch", reason="needs the engine extra: make install-engine")

from app.protocol.blocks import block_keys
from app.protocol.codes import EngineStatus
from workers.engine.effects import PrefillResult
from workers.engine.hf_model import HfModel, make_tiny_model
from workers.engine.hf_prefill import HfPrefillEngine, HfPrefillRequest
from workers.engine.profiles import formula_profile
from workers.server.runner import EngineRunner

BS = 16
Engine = tuple[EngineRunner, HfPrefillEngine, "queue.Queue[Any]", list[bool]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> HfModel:
    torch.set_num_threads(1)
    path: Path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)
    return HfModel(path)


@pytest.fixture
def engine(model: HfModel) -> Iterator[Engine]:
    """Wired as hf_service.py wires it: the runner's clock, its wake-up from the compute thread.
    `deferred`: per engine-thread turn that emitted results, whether their cache work was left
    for later (`core.unsettled` when the turn ended)."""
    results: queue.Queue[Any] = queue.Queue()
    holder: list[EngineRunner] = []
    core = HfPrefillEngine(
        model,
        formula_profile("5 + sum(0.01*computeTokens)"),
        clock=lambda: holder[0].model_now(),
        wake=lambda: holder[0].wake(),
        block_size=BS,
        kv_capacity_tokens=32_768,
    )

    emitted: list[bool] = []

    def on_effects(effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, PrefillResult):
                emitted.append(True)
                results.put(e)

    def on_tick() -> None:  # after each engine-thread turn: was a turn's results' work deferred?
        if emitted:
            emitted.clear()
            deferred.append(core.unsettled)

    deferred: list[bool] = []
    runner = EngineRunner(core, on_effects=on_effects, on_tick=on_tick)
    holder.append(runner)
    runner.start()
    yield runner, core, results, deferred
    runner.stop()


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 7 + salt) % 256 for i in range(n))


def submit(
    runner: EngineRunner, core: HfPrefillEngine, batch_id: str, prompts: dict[str, tuple[int, ...]]
) -> None:
    reqs = [HfPrefillRequest(rid, len(p), tuple(block_keys(p, BS)), tokens=p) for rid, p in prompts.items()]
    out = runner.call_sync(lambda: core.submit(batch_id, reqs, runner.model_now())).result(5)
    assert out.accepted, out


def take(results: queue.Queue[Any], n: int) -> dict[str, PrefillResult]:
    got: dict[str, PrefillResult] = {}
    deadline = time.monotonic() + 30
    while len(got) < n:
        try:
            r = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"the engine thread delivered {len(got)} of {n} prefill results in 30 s")
        got[r.request_id] = r
    return got


def greedy_first(model: HfModel, p: tuple[int, ...]) -> int:
    ((logits, _),) = model.prefill([(None, list(p))])
    return int(torch.argmax(logits))


def test_a_batch_on_the_engine_thread_is_computed_settled_and_its_blocks_serve_a_prefix_hit(
    engine: Engine, model: HfModel
) -> None:
    runner, core, results, deferred = engine
    prompts = {"a": prompt(40, 1), "b": prompt(70, 2)}
    submit(runner, core, "first", prompts)
    got = take(results, 2)
    for rid, p in prompts.items():
        assert got[rid].status == EngineStatus.OK, got[rid]
        assert got[rid].first_token == greedy_first(model, p)

    # A command sees the completion settled: both handles pinned, the cache's blocks stored.
    def view() -> tuple[bool, list[str], set[int]]:
        return core.unsettled, sorted(core.handles.pinned), set(core._blocks)

    unsettled, pinned, stored = runner.call_sync(view).result(5)
    # The turn that completed the batch (woken by the compute thread) left its cache work for
    # later: the wake-up is not a command, which would have settled it in the same turn.
    assert deferred == [True]
    assert not unsettled and pinned == ["a", "b"]
    assert stored == set(block_keys(prompts["a"], BS)) | set(block_keys(prompts["b"], BS))

    # A prompt sharing b's first 64 tokens takes their KV from the store: exact all the same.
    longer = prompts["b"][:64] + prompt(30, 9)
    submit(runner, core, "second", {"c": longer})
    c = take(results, 1)["c"]
    assert c.status == EngineStatus.OK and c.cached_tokens == 64, c
    assert c.first_token == greedy_first(model, longer)
    assert core.stats()["forward_passes"] == 2
