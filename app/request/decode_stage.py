"""The origin's decode stream (DESIGN §3 steps 8-9) and the calls that end work on an engine:
cancel, stop, release the prefill KV."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from app.gateway.errors import ApiError
from app.request.context import RequestContext
from app.request.types import GenRequest, Progress
from app.rpc.worker_client import WorkerUnavailable

log = logging.getLogger("flexlb.request")


class DecodeStage(RequestContext):
    """A stage of `Pipeline` (app/request/pipeline.py), which composes them over one replica."""

    async def _decode(self, req: GenRequest, p: Progress, reply: dict[str, str]) -> AsyncIterator[Any]:
        dec = p.decode_worker
        snap = self.fleet.snapshots.get(dec, {})
        p.stage = "decoding"
        self._log("decoding", req, p)
        pre_addr = (
            self.fleet.workers.get(p.prefill_worker, {}).get("address") or p.prefill_worker.split("@", 1)[1]
        )
        chunk, chunks = self.decode_hold_blocks(req, p)  # the engine shares what the hold named
        stream = self.fleet.client(dec).decode(
            req.request_id,
            snap.get("epoch", ""),
            len(req.input_ids),
            req.max_new_tokens - 1,
            kv_worker=pre_addr,
            kv_epoch=reply.get("epoch", ""),
            timeout=req.timeout_ms / 1000,
            block_size=chunk,
            block_keys=chunks,
        )
        try:
            async with contextlib.aclosing(stream):  # leaving early ends the RPC now
                async for ev in stream:
                    if ev.event == "tokens":
                        if req.request_id in self.cancel_requested:  # a cancel something swallowed
                            raise asyncio.CancelledError
                        keep = req.stop(ev.tokens) if req.stop is not None else None
                        tokens = ev.tokens if keep is None else ev.tokens[:keep]
                        p.output_ids.extend(tokens)
                        yield tokens
                        if keep is not None:
                            await self._stop_decode(req, dec)
                            yield "stop"
                            return
                    else:
                        yield ev.finish_reason
                        return
        except WorkerUnavailable as exc:
            task = asyncio.current_task()
            if req.request_id in self.cancel_requested or (task is not None and task.cancelling()):
                # Our own cancel (DELETE, client gone) that grpc.aio turned into an RPC error: the
                # request ends `cancelled`, not `failed` with a worker_error.
                raise asyncio.CancelledError from exc
            raise ApiError("worker_error", f"decode worker {dec} failed: {str(exc)[:200]}") from None

    async def _stop_decode(self, req: GenRequest, dec: str) -> None:
        """A stop string ended the output early: cancel the engine's decode, which frees its KV
        (the gateway's reservation is released by `_finish`). A failed cancel is logged: the
        engine still ends the decode at max_new_tokens or the deadline."""
        try:
            await asyncio.wait_for(self.fleet.client(dec).cancel(req.request_id), 2.0)
        except Exception as exc:
            log.warning("cancel of stopped decode %s on %s failed: %s", req.request_id, dec, exc)

    async def _cancel_on(self, wid: str, rid: str) -> None:
        try:
            await asyncio.wait_for(self.fleet.client(wid).cancel(rid), 2.0)
        except (WorkerUnavailable, TimeoutError) as exc:
            log.info("cancel of %s on %s failed: %s", rid, wid, exc, extra={"request_id": rid})

    def _release_prefill_kv(self, wid: str, rid: str, epoch: str) -> None:
        async def release() -> None:
            try:
                await self.fleet.client(wid).release(rid, epoch, timeout=2.0)
            except Exception as exc:  # the handle still expires on its own
                log.debug("kv release of %s on %s failed: %s", rid, wid, exc)

        t = asyncio.create_task(release())
        self._background.add(t)
        t.add_done_callback(self._background.discard)
