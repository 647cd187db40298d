"""Async client for one worker's models over Triton's KServe v2 gRPC streaming API.

One long-lived channel per worker per process. Every model is decoupled, so every call is a
stream: control and prefill calls share one long-lived stream per model (app/rpc/mux_stream.py),
decode calls reuse long-lived streams that carry one decode at a time. Closing a stream does not
cancel its work on the server (neither tritonclient nor PyTriton checks): an abandoned per-call
stream is cancelled here, an abandoned call on a long-lived stream stops listening (the stream
stays busy until the call's end), and engine work is cancelled with `control.cancel` by the
caller who owns it.

Calls go straight to the KServe stub (`ModelStreamInfer`) with the request written from the
calling coroutine, not through tritonclient's `stream_infer`, which builds `InferInput` objects
and runs a task per call to feed its request iterator: ~0.15 ms of CPU per call less, on two calls
per request. tritonclient still supplies the protobuf types and `InferResult` for reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2_grpc

from app.protocol import worker_api as W
from app.rpc.events import DecodeEvent, IndexedResult, PrefillEvent, first_value, prefill_event
from app.rpc.mux_stream import StreamMux, WorkerUnavailable
from app.rpc.tensors import (
    Input,
    KeySpace,
    PromptKeys,
    bytes_tensor,
    infer_request,
    inp,
    prompt_input,
    sampling_inputs,
)
from app.state.text import to_str as _s

# The events a call yields and the prompt's key spaces are this client's interface, importable here.
__all__ = ["DecodeEvent", "KeySpace", "PrefillEvent", "PromptKeys", "WorkerClient", "WorkerUnavailable"]

# tritonclient's channel defaults: no message-size cap (a prompt batch can be large), keepalive
# as it sets it (pings effectively off; deadlines and the owner's health checks find dead workers).
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.keepalive_timeout_ms", 20000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 2),
]


class WorkerClient:
    def __init__(
        self,
        address: str,
        secret: str = "",
        block_keys: bool = True,
        mux: bool | None = None,
        decode_mux: bool | None = None,
    ) -> None:
        self.address = address
        # False: always send token ids (a bench's baseline; docs/worker-protocol.md §4.1)
        self.block_keys = block_keys
        # The workers' shared secret (FLEXLB_WORKER_SECRET): sent with every control call, which a
        # worker started with one refuses without it (docs/operations.md "Security").
        self.secret = secret
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        # Per worker epoch: the key space when its engine takes block keys instead of token ids
        # (docs/worker-protocol.md §4.1), None when it needs the ids. One entry: the current epoch.
        self._inputs: dict[str, KeySpace | None] = {}
        self._describing = asyncio.Lock()
        # Control and prefill calls share one long-lived stream per model (app/rpc/mux_stream.py;
        # FLEXLB_GRPC_MUX=off: a stream per call); decode calls reuse streams, one call at a time
        # (FLEXLB_GRPC_MUX_DECODE, with FLEXLB_GRPC_MUX; off: a stream per call).
        if mux is None or (mux and decode_mux is None):
            from app.config import Settings

            settings = Settings()
            mux = settings.grpc_mux if mux is None else mux
            decode_mux = settings.grpc_mux_decode if decode_mux is None else decode_mux
        self._mux = (
            {m: StreamMux(self._stub, address, m) for m in (W.CONTROL_MODEL, W.PREFILL_MODEL)} if mux else {}
        )
        if mux and decode_mux:
            self._mux[W.DECODE_MODEL] = StreamMux(self._stub, address, W.DECODE_MODEL, one_each=True)

    async def close(self) -> None:
        """Half-close the shared streams and give the worker 0.5 s to end them: a cancel as a
        stream completes is the race in which tritonserver crashed (see `control`)."""
        readers = [r for m in self._mux.values() for r in m.close()]
        if readers:
            await asyncio.wait(readers, timeout=0.5)
        await self._channel.close()

    def _call(
        self, model: str, inputs: Sequence[Input], timeout: float | None, request_id: str = ""
    ) -> AsyncIterator[InferResult]:
        """A call on the model's long-lived streams, else on a stream of its own."""
        mux = self._mux.get(model)
        if mux is None:
            return self._stream(model, inputs, timeout, request_id)
        return mux.call(infer_request(model, inputs, request_id), timeout, IndexedResult)

    async def _stream(
        self, model: str, inputs: Sequence[Input], timeout: float | None, request_id: str = ""
    ) -> AsyncIterator[InferResult]:
        call = self._stub.ModelStreamInfer(timeout=timeout)
        finished = False
        try:
            await call.write(infer_request(model, inputs, request_id))
            await call.done_writing()
            async for resp in call:
                if resp.error_message:
                    raise WorkerUnavailable(f"{self.address} {model}: {resp.error_message[-1500:]}")
                yield IndexedResult(resp.infer_response)
            finished = True
        except grpc.aio.AioRpcError as exc:
            slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            raise WorkerUnavailable(f"{self.address} {model}: {_short(exc)}", timed_out=slow) from exc
        finally:
            if not finished:
                call.cancel()

    # ---- control --------------------------------------------------------------------------
    async def control(self, body: dict[str, Any], timeout: float | None = 5.0) -> dict[str, Any]:
        if self.secret:
            body = {**body, "secret": self.secret}
        arr = np.array([json.dumps(body).encode()], dtype=np.object_)
        answer: dict[str, Any] | None = None
        # Read to the stream's natural end instead of leaving after the answer: leaving cancels the
        # RPC, and cancelling streams as they complete (every poll did, 10 times a second per
        # worker) is the race in which tritonserver segfaulted (Signal 11) under load.
        async for result in self._call(W.CONTROL_MODEL, [inp(W.C_REQUEST, arr, "BYTES")], timeout):
            if answer is None:
                answer = json.loads(result.as_numpy(W.C_RESPONSE)[0])
        if answer is None:
            raise WorkerUnavailable(f"{self.address}: control stream ended without a response")
        return answer

    async def status(self, since_seq: int = 0, timeout: float | None = 5.0) -> dict[str, Any]:
        return await self.control({"op": "status", "since_seq": since_seq}, timeout)

    async def cache(
        self, since_version: int | None, epoch: str, timeout: float | None = 5.0
    ) -> dict[str, Any]:
        return await self.control({"op": "cache", "since_version": since_version, "epoch": epoch}, timeout)

    async def poll(
        self, since_seq: int, since_version: int | None, epoch: str, timeout: float | None = 5.0
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`status` and `cache` in one round trip (an owner polls each worker 5 times a second).
        `epoch` is the one the caller last saw: after a restart the cache answer is a full set."""
        res = await self.control(
            {"op": "poll", "since_seq": since_seq, "since_version": since_version, "epoch": epoch}, timeout
        )
        return res["status"], res["cache"]

    async def cancel(self, some_id: str, timeout: float | None = 5.0) -> dict[str, Any]:
        return await self.control({"op": "cancel", "id": some_id}, timeout)

    async def release(self, request_id: str, epoch: str = "", timeout: float | None = 5.0) -> dict[str, Any]:
        """Free a prefilled request's pinned KV handle (its prefix stays cached, unpinned)."""
        return await self.control({"op": "release", "request_id": request_id, "epoch": epoch}, timeout)

    async def configure(self, timeout: float | None = 10.0, **options: Any) -> dict[str, Any]:
        return await self.control({"op": "configure", **options}, timeout)

    async def reset(self, timeout: float | None = 10.0) -> dict[str, Any]:
        return await self.control({"op": "reset"}, timeout)

    async def describe(self, timeout: float | None = 5.0) -> dict[str, Any]:
        """Which prompt input the engine takes and the key space (docs/worker-protocol.md §7.7)."""
        return await self.control({"op": "describe"}, timeout)

    # ---- prefill --------------------------------------------------------------------------
    async def prefill(
        self,
        batch_id: str,
        epoch: str,
        requests: Sequence[tuple[str, np.ndarray]],
        timeout: float | None = None,
        sampling: Sequence[Mapping[str, Any] | None] | None = None,
        keys: PromptKeys | None = None,
    ) -> AsyncIterator[PrefillEvent]:
        """Stream one batch: `accepted`, then `results` events, then `final` (or `error`).

        `sampling`: per request, None or {"temperature", "top_p", "seed"} (any may be absent);
        the tensors travel only when some request has a field, so a greedy batch costs nothing.

        The prompts travel as block keys when the worker's engine takes them (`describe`, asked
        once per epoch), hashed here unless `keys` brings them in the worker's key space.

        An empty batch is refused here: Triton cannot carry zero-length tensors reliably (the
        call never answers), so it must not reach the wire."""
        if not requests:
            raise ValueError("empty batch")
        ks = await self._key_space(epoch, timeout)
        for _ in range(2):
            inputs = [
                inp(W.P_BATCH_ID, bytes_tensor([batch_id]), "BYTES"),
                inp(W.P_EPOCH, bytes_tensor([epoch]), "BYTES"),
                inp(W.P_REQUEST_IDS, bytes_tensor([r for r, _ in requests]), "BYTES"),
                prompt_input(requests, ks, keys),
                inp(W.P_INPUT_LENGTHS, np.array([len(t) for _, t in requests], dtype=np.int32), "INT32"),
            ]
            if sampling is not None and any(sampling):
                inputs.extend(sampling_inputs(list(sampling), W.P_TEMPERATURE, W.P_TOP_P, W.P_SEED))
            first, refused = True, False
            async for r in self._call(W.PREFILL_MODEL, inputs, timeout, request_id=batch_id):
                ev = prefill_event(r)
                if first and ks is not None and ev.event == "error" and ev.error.endswith(W.NEEDS_INPUT_IDS):
                    # Refused before the engine saw the batch: the cached answer was wrong (it is
                    # kept per epoch, so only a client told a wrong one gets here). Send the
                    # batch again with the ids. Read to the stream's end.
                    refused = True
                first = False
                if refused:
                    continue
                if ev.event == "results" and r.as_numpy(W.P_QUEUE_POSITION) is not None:
                    # `accepted` rode on the batch's first results (§4.2)
                    yield PrefillEvent("accepted", ev.batch_id, ev.epoch, ev.queue_position)
                yield ev
                if ev.event == "results" and first_value(r, W.P_FINAL, 0):  # results + final in one (§4.2)
                    yield PrefillEvent("final", ev.batch_id, ev.epoch)
            if not refused:
                return
            self._inputs[epoch] = ks = None

    async def _key_space(self, epoch: str, timeout: float | None) -> KeySpace | None:
        """The worker's key space when its engine takes block keys, asked once per epoch with
        `describe`; None (send the ids) without an epoch to pin the answer to, or when the worker
        needs the ids, is older than `describe`, or did not answer (then for the whole epoch)."""
        if not epoch or not self.block_keys:
            return None
        if epoch in self._inputs:
            return self._inputs[epoch]
        async with self._describing:
            if epoch in self._inputs:
                return self._inputs[epoch]
            try:
                d = await self.describe(timeout=min(timeout or 5.0, 5.0))
            except WorkerUnavailable:
                self._inputs = {epoch: None}  # ids always work: ask no more for this epoch
                return None
            if d.get("epoch") != epoch:
                return None  # the caller's epoch is stale: the worker refuses the batch anyway
            ks = None
            if d.get("prefill_input") == W.INPUT_BLOCK_KEYS:
                ks = KeySpace(epoch, int(d["block_size"]), str(d["model_name"]), str(d["tokenizer"]))
            self._inputs = {epoch: ks}
            return ks

    # ---- decode ---------------------------------------------------------------------------
    async def decode(
        self,
        request_id: str,
        epoch: str,
        input_tokens: int,
        max_new_tokens: int,
        *,
        kv_worker: str = "",
        kv_epoch: str = "",
        first_index: int = 1,
        timeout: float | None = None,
        sampling: Mapping[str, Any] | None = None,
        block_size: int = 0,
        block_keys: Sequence[int] = (),
    ) -> AsyncIterator[DecodeEvent]:
        inputs = [
            inp(W.D_REQUEST_ID, bytes_tensor([request_id]), "BYTES"),
            inp(W.D_EPOCH, bytes_tensor([epoch]), "BYTES"),
            inp(W.D_INPUT_TOKENS, np.array([input_tokens], dtype=np.int32), "INT32"),
            inp(W.D_MAX_NEW_TOKENS, np.array([max_new_tokens], dtype=np.int32), "INT32"),
            inp(W.D_FIRST_INDEX, np.array([first_index], dtype=np.int32), "INT32"),
            inp(W.D_KV_WORKER, bytes_tensor([kv_worker]), "BYTES"),
            inp(W.D_KV_EPOCH, bytes_tensor([kv_epoch]), "BYTES"),
        ]
        if sampling:
            inputs.extend(sampling_inputs([sampling], W.D_TEMPERATURE, W.D_TOP_P, W.D_SEED))
        if block_size > 0 and len(block_keys):
            # The engine holds a prompt block its running sequences share once (the decode hold
            # counted it once too: app/state/scripts.py RESERVE).
            inputs.append(inp(W.D_BLOCK_KEYS, np.asarray(block_keys, dtype=np.uint64), "UINT64"))
            inputs.append(inp(W.D_BLOCK_SIZE, np.array([block_size], dtype=np.int32), "INT32"))
        finish: DecodeEvent | None = None
        # Closed here when our consumer leaves early, not when the generator is collected: its
        # stream (a reused one: busy until the call's end) is cancelled or given back at once.
        calls = contextlib.aclosing(self._call(W.DECODE_MODEL, inputs, timeout, request_id=request_id))
        async with calls as responses:
            async for r in responses:
                # An event carries only its own tensors (docs/worker-protocol.md §5): absent = empty.
                tokens = r.as_numpy(W.D_TOKENS)
                ev = DecodeEvent(
                    event=_s(r.as_numpy(W.D_EVENT)[0]),
                    tokens=tokens.tolist() if tokens is not None else [],
                    first_index=int(first_value(r, W.D_FIRST_INDEX, 0)),
                    t_first_ms=float(r.as_numpy(W.D_T_FIRST_MS)[0]),
                    t_last_ms=float(r.as_numpy(W.D_T_LAST_MS)[0]),
                    finish_reason=_s(first_value(r, W.D_FINISH_REASON, b"")),
                    generated=int(first_value(r, W.D_GENERATED, 0)),
                    error=_s(first_value(r, W.D_ERROR, b"")),
                )
                if ev.event == "tokens":
                    yield ev
                    continue
                if ev.tokens:  # the last chunk rode on `finish` (§6.2)
                    yield DecodeEvent("tokens", ev.tokens, ev.first_index, ev.t_first_ms, ev.t_last_ms)
                    ev.tokens, ev.first_index, ev.t_first_ms = [], 0, ev.t_last_ms
                # Held until the stream ends by itself: a consumer that stops at `finish` would
                # otherwise cancel a completing RPC (see `control`).
                finish = ev
        if finish is not None:
            yield finish


def _short(exc: Any) -> str:
    msg = exc.message() if hasattr(exc, "message") else str(exc)
    return str(msg)[-1500:]
