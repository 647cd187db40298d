"""The `prefill` model over the simulated core: batches in, `accepted`/`results`/`final` out
(docs/worker-protocol.md §4), plus the prefill side of the KV side channel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from app.protocol import worker_api as W
from app.protocol.blocks import block_keys
from app.protocol.codes import EngineStatus
from workers.engine.effects import (
    PrefillResult,
)
from workers.engine.prefill import PrefillEngine, PrefillRequest

from .common import ControlError, StreamBase, p_event, p_results
from .runner import EngineRunner, Subscriber
from .stream_end import EndOfStream
from .tensors import as_str, as_strs, get

log = logging.getLogger("flexlb.worker")


class PrefillModel(StreamBase):
    """Mixin of `WorkerService`: the prefill role's infer function and its engine-thread halves."""

    if TYPE_CHECKING:  # provided by the composed service

        def _route(self, effects: list[Any]) -> None: ...
        async def _wait_unhung(self) -> None: ...
        def _release(self, rid: str) -> dict[str, Any]: ...

    epoch: str
    core: Any
    # Whether the engine reads the prompt's token ids (a real model) or only its lengths and
    # block keys (the simulated core): `describe` tells clients which input to send (§4.1).
    needs_input_ids: bool = False
    runner: EngineRunner
    _subs: dict[str, list[Subscriber]]

    def _result_items(self, pending: dict[str, list[PrefillResult]], batch_id: str) -> list[tuple[str, Any]]:
        """One `results` item per completion instant of the batch's pending results."""
        by_t: dict[float, list[PrefillResult]] = {}
        for r in pending.pop(batch_id, None) or []:
            by_t.setdefault(r.end_ms, []).append(r)
        return [("results", group) for group in by_t.values()]

    async def prefill(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for i, req in enumerate(requests):
            last_req = i == len(requests) - 1
            async for ev in self._prefill_one(req):
                ends = W.P_FINAL in ev or ev[W.P_EVENT][0] in (b"final", b"error")
                yield EndOfStream([ev]) if last_req and ends else [ev]

    async def _prefill_one(self, req: Any) -> AsyncIterator[dict[str, np.ndarray]]:
        batch_id = as_str(get(req, W.P_BATCH_ID))
        try:
            reqs = self._parse_prefill(req, batch_id)
        except ControlError as exc:
            yield p_event(self.epoch, "error", batch_id, errors=[str(exc)])
            return
        await self._wait_unhung()
        loop = asyncio.get_running_loop()
        sub = Subscriber(loop)
        arrival = self.runner.model_now()
        pos, replay = await self.runner.call(lambda: self._submit_prefill(batch_id, reqs, sub, arrival))
        if replay is not None:
            if replay:  # its results ride on `accepted` (§4.2): one event instead of two
                yield _accepted(p_results(self.epoch, batch_id, replay, final=True), pos)
            else:
                yield p_event(self.epoch, "accepted", batch_id, queue_position=pos)
                yield p_event(self.epoch, "final", batch_id)
            return
        held: tuple[str, Any] | None = self._peek(sub)
        if held is not None and held[0] == "results":
            # The batch finished before `accepted` left (a zero-time engine, refused members):
            # `accepted` rides on its first results, and `final` too when it is queued (§4.2).
            payload, held = held[1], self._peek(sub)
            last = held is not None and held[0] == "final"
            yield _accepted(p_results(self.epoch, batch_id, payload, final=last), pos)
            if last:
                return
        else:
            yield p_event(self.epoch, "accepted", batch_id, queue_position=pos)
        while True:
            item, held = held or await self._next(sub), None
            if item is None:
                yield p_event(
                    self.epoch, "error", batch_id, errors=["worker stopping or stream idle timeout"]
                )
                return
            kind, payload = item
            if kind == "results":
                # The batch's last results and its `final` travel as one event when both are
                # ready: one response fewer through the stub, Triton and the gateway (§4.2).
                held = self._peek(sub)
                last = held is not None and held[0] == "final"
                yield p_results(self.epoch, batch_id, payload, final=last)
                if last:
                    return
            else:
                yield p_event(self.epoch, "final", batch_id)
                return

    def _parse_prefill(self, req: Any, batch_id: str) -> list[PrefillRequest]:
        epoch = as_str(get(req, W.P_EPOCH))
        if epoch and epoch != self.epoch:
            raise ControlError(f"{EngineStatus.EPOCH_MISMATCH}: worker epoch is {self.epoch}")
        if not batch_id:
            raise ControlError(f"{EngineStatus.INVALID}: batch_id is required")
        ids_t, keys_t = get(req, W.P_INPUT_IDS), get(req, W.P_BLOCK_KEYS)
        lens_t, rid_t = get(req, W.P_INPUT_LENGTHS), get(req, W.P_REQUEST_IDS)
        if (ids_t is None and keys_t is None) or lens_t is None or rid_t is None:
            raise ControlError(
                f"{EngineStatus.INVALID}: request_ids, input_ids and input_lengths are required"
            )
        if ids_t is None and self.needs_input_ids:
            raise ControlError(f"{EngineStatus.INVALID}: {W.NEEDS_INPUT_IDS}")
        rids = as_strs(rid_t)
        lens = lens_t.reshape(-1).astype(np.int64)
        if len(rids) == 0:
            raise ControlError(f"{EngineStatus.INVALID}: empty batch")
        bad = len(lens) != len(rids) or (lens < 0).any()
        ids = ids_t.reshape(-1) if ids_t is not None else None
        bs = self.cfg.block_size
        if not bad and ids is not None:
            bad = int(lens.sum()) != len(ids)
        # Keys the caller hashed (§4.1): the worker skips hashing, and the 4 bytes a token of
        # input_ids never cross the gRPC -> Triton -> stub -> zmq (base64 + JSON) path.
        keys = keys_t.reshape(-1).tolist() if keys_t is not None and ids is None else None
        if not bad and keys is not None:
            bad = int((lens // bs).sum()) != len(keys)
        if bad:
            raise ControlError(f"{EngineStatus.INVALID}: input_lengths do not match input_ids/request_ids")
        out: list[PrefillRequest] = []
        off = koff = 0
        for rid, n in zip(rids, lens.tolist(), strict=True):
            if ids is not None:
                toks = ids[off : off + n]
                off += n
                ks = tuple(block_keys(toks, bs, model=self.cfg.model_name, tokenizer=self.cfg.tokenizer))
            else:
                assert keys is not None
                toks = None
                ks = tuple(keys[koff : koff + n // bs])
                koff += n // bs
            out.append(self._prefill_request(req, len(out), rid, n, toks, ks))
        return out

    def _submit_prefill(
        self, batch_id: str, reqs: list[PrefillRequest], sub: Subscriber, arrival: float | None = None
    ) -> tuple[int, list[PrefillResult] | None]:
        """On the engine thread. `arrival`: the modelled time the batch reached this process; it
        starts then (when the engine is free), not when this thread got to it."""
        core = self.core
        assert isinstance(core, PrefillEngine)
        now = self.runner.model_now() if arrival is None else arrival
        known = batch_id in core._batches
        if known:
            done = core._batches[batch_id].phase == "done"
            past = [r for r in core.history if r.batch_id == batch_id]
            if done:
                return 0, past
            self._subs.setdefault(batch_id, []).append(sub)
            if past:
                sub.push(("results", past))
            out = core.submit(batch_id, reqs, now)
            self._route(out.effects)
            return out.queue_position, None
        self._subs.setdefault(batch_id, []).append(sub)
        out = core.submit(batch_id, reqs, now)
        self._route(out.effects)
        # What is due now (a zero-time batch's end) is delivered before `accepted` is sent, not at
        # the engine thread's next wake-up, so both can travel as one event.
        self._route(core.advance_to(self.runner.model_now()))
        return out.queue_position, None

    def _prefill_request(
        self, req: Any, i: int, rid: str, n: int, toks: np.ndarray | None, keys: tuple[int, ...]
    ) -> PrefillRequest:
        """Member `i` of the batch as the engine takes it: the simulated engine needs the length
        and the block keys only; a real engine also needs the tokens (`needs_input_ids`) and
        the sampling fields (hf_service.py)."""
        return PrefillRequest(rid, n, keys)

    async def _claim_local(self, rid: str, epoch: str) -> str:
        """A claim arriving over the side channel: the same answer as `control.release`."""
        await self._wait_unhung()
        if epoch and epoch != self.epoch:
            return EngineStatus.EPOCH_MISMATCH
        return str((await self.runner.call(lambda: self._release(rid)))["status"])


def _accepted(ev: dict[str, np.ndarray], queue_position: int) -> dict[str, np.ndarray]:
    """`accepted` folded into a `results` event: its `queue_position` rides along (§4.2)."""
    ev[W.P_QUEUE_POSITION] = np.array([queue_position], dtype=np.int32)
    return ev
