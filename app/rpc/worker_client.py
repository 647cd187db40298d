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
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from app.protocol import worker_api as W
from app.protocol.blocks import block_keys, namespace_seed
from app.rpc.mux_stream import StreamMux, WorkerUnavailable
from app.state.text import to_str as _s


@dataclass
class PrefillEvent:
    event: str  # accepted | results | final | error
    batch_id: str
    epoch: str
    queue_position: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


@dataclass
class DecodeEvent:
    event: str  # tokens | finish
    tokens: list[int] = field(default_factory=list)
    first_index: int = 0
    t_first_ms: float = 0.0
    t_last_ms: float = 0.0
    finish_reason: str = ""
    generated: int = 0
    error: str = ""


Input = tuple[str, np.ndarray, str]  # name, data, KServe datatype


@dataclass(frozen=True)
class KeySpace:
    """How one worker incarnation hashes block keys, from its `describe` answer."""

    epoch: str
    block_size: int
    model: str
    tokenizer: str

    @property
    def space(self) -> int:
        """The key space's namespace seed (cached by `namespace_seed`)."""
        return namespace_seed(self.model, self.tokenizer, self.block_size)


@dataclass(frozen=True)
class PromptKeys:
    """Block keys the caller has already hashed (the gateway does, to route), one sequence per
    request of the batch (None: hash that one here), in the key space whose namespace seed
    (`app.protocol.blocks.namespace_seed`) is `space`; used when it is the worker's. The seed
    names the space in 8 bytes, which is what a hand-off entry carries with its keys."""

    space: int
    keys: Sequence[Sequence[int] | np.ndarray | None]

    @classmethod
    def named(cls, block_size: int, model: str, tokenizer: str, keys: Sequence[Any]) -> PromptKeys:
        return cls(namespace_seed(model, tokenizer, block_size), keys)


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


def _inp(name: str, arr: np.ndarray, dtype: str) -> Input:
    return (name, arr, dtype)


def _request(model: str, inputs: Sequence[Input], request_id: str) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, arr, dtype in inputs:
        t = req.inputs.add()
        t.name = name
        t.datatype = dtype
        t.shape.extend(arr.shape)
        if dtype == "BYTES":
            packed = serialize_byte_tensor(arr)
            req.raw_input_contents.append(packed.item() if packed.size else b"")
        else:
            req.raw_input_contents.append(arr.tobytes())
    return req


_NP_DTYPES: dict[str, Any] = {}


class _Result(InferResult):  # type: ignore[misc]
    """`InferResult` whose outputs are found by name through an index built once per event.

    tritonclient's `as_numpy` walks the output list for every name it is asked (a prefill event
    reads ~16 of its ~15 outputs, a decode event 9 of ~8, absent ones walking the whole list),
    each step a protobuf field read. One walk per event, then dict lookups: a prefill `results`
    event is read in ~34 µs instead of ~56, a decode event in ~15 instead of ~20 (bench loop on
    this box). The conversion is `InferResult.as_numpy`'s (the first output of a name wins, as
    there); only the lookup changed."""

    def __init__(self, result: Any) -> None:
        super().__init__(result)
        self._index: dict[str, tuple[Any, bytes | None]] | None = None

    def as_numpy(self, name: str) -> np.ndarray | None:
        index = self._index
        if index is None:  # one walk: each output with its raw contents (None: it has none)
            index = {}
            raw = list(self._result.raw_output_contents)
            for i, output in enumerate(self._result.outputs):
                if output.name not in index:
                    index[output.name] = (output, raw[i] if i < len(raw) else None)
            self._index = index
        found = index.get(name)
        if found is None:
            return None
        output, contents = found
        datatype = output.datatype
        if contents is not None:
            if datatype == "BYTES":
                arr = deserialize_bytes_tensor(contents)
            else:
                arr = np.frombuffer(contents, dtype=_np_dtype(datatype))
        elif len(output.contents.bytes_contents) != 0:
            arr = np.array(output.contents.bytes_contents, copy=False)
        else:
            arr = np.empty(0, dtype=_np_dtype(datatype))
        return arr.reshape(list(output.shape))


def _np_dtype(datatype: str) -> Any:
    """`triton_to_np_dtype`, remembered per name (it is a chain of comparisons)."""
    dt = _NP_DTYPES.get(datatype)
    if dt is None:
        dt = _NP_DTYPES[datatype] = triton_to_np_dtype(datatype)
    return dt


def _b(values: Sequence[str]) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


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
        return mux.call(_request(model, inputs, request_id), timeout, _Result)

    async def _stream(
        self, model: str, inputs: Sequence[Input], timeout: float | None, request_id: str = ""
    ) -> AsyncIterator[InferResult]:
        call = self._stub.ModelStreamInfer(timeout=timeout)
        finished = False
        try:
            await call.write(_request(model, inputs, request_id))
            await call.done_writing()
            async for resp in call:
                if resp.error_message:
                    raise WorkerUnavailable(f"{self.address} {model}: {resp.error_message[-1500:]}")
                yield _Result(resp.infer_response)
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
        async for result in self._call(W.CONTROL_MODEL, [_inp(W.C_REQUEST, arr, "BYTES")], timeout):
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
                _inp(W.P_BATCH_ID, _b([batch_id]), "BYTES"),
                _inp(W.P_EPOCH, _b([epoch]), "BYTES"),
                _inp(W.P_REQUEST_IDS, _b([r for r, _ in requests]), "BYTES"),
                _prompt_input(requests, ks, keys),
                _inp(W.P_INPUT_LENGTHS, np.array([len(t) for _, t in requests], dtype=np.int32), "INT32"),
            ]
            if sampling is not None and any(sampling):
                inputs.extend(_sampling_inputs(list(sampling), W.P_TEMPERATURE, W.P_TOP_P, W.P_SEED))
            first, refused = True, False
            async for r in self._call(W.PREFILL_MODEL, inputs, timeout, request_id=batch_id):
                ev = _prefill_event(r)
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
                if ev.event == "results" and _first(r, W.P_FINAL, 0):  # results + final in one (§4.2)
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
            _inp(W.D_REQUEST_ID, _b([request_id]), "BYTES"),
            _inp(W.D_EPOCH, _b([epoch]), "BYTES"),
            _inp(W.D_INPUT_TOKENS, np.array([input_tokens], dtype=np.int32), "INT32"),
            _inp(W.D_MAX_NEW_TOKENS, np.array([max_new_tokens], dtype=np.int32), "INT32"),
            _inp(W.D_FIRST_INDEX, np.array([first_index], dtype=np.int32), "INT32"),
            _inp(W.D_KV_WORKER, _b([kv_worker]), "BYTES"),
            _inp(W.D_KV_EPOCH, _b([kv_epoch]), "BYTES"),
        ]
        if sampling:
            inputs.extend(_sampling_inputs([sampling], W.D_TEMPERATURE, W.D_TOP_P, W.D_SEED))
        if block_size > 0 and len(block_keys):
            # The engine holds a prompt block its running sequences share once (the decode hold
            # counted it once too: app/state/scripts.py RESERVE).
            inputs.append(_inp(W.D_BLOCK_KEYS, np.asarray(block_keys, dtype=np.uint64), "UINT64"))
            inputs.append(_inp(W.D_BLOCK_SIZE, np.array([block_size], dtype=np.int32), "INT32"))
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
                    first_index=int(_first(r, W.D_FIRST_INDEX, 0)),
                    t_first_ms=float(r.as_numpy(W.D_T_FIRST_MS)[0]),
                    t_last_ms=float(r.as_numpy(W.D_T_LAST_MS)[0]),
                    finish_reason=_s(_first(r, W.D_FINISH_REASON, b"")),
                    generated=int(_first(r, W.D_GENERATED, 0)),
                    error=_s(_first(r, W.D_ERROR, b"")),
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


def _sampling_inputs(
    per_request: list[Mapping[str, Any] | None], t_name: str, p_name: str, s_name: str
) -> list[Input]:
    """Sampling tensors, one entry per request; absent fields get the neutral value (greedy,
    no nucleus cut, engine-chosen seed), documented in docs/worker-protocol.md §4.1."""

    def values(name: str, default: float) -> list[float]:
        return [default if (s or {}).get(name) is None else float((s or {})[name]) for s in per_request]

    # Seeds stay integers: through a float, a seed near 2**63 (a negative API seed folded into the
    # engines' range) rounds up to 2**63 and overflows INT64 (the OpenAPI fuzz pass found a 500).
    seeds = [-1 if (s or {}).get("seed") is None else int((s or {})["seed"]) for s in per_request]
    return [
        _inp(t_name, np.array(values("temperature", 0.0), dtype=np.float64), "FP64"),
        _inp(p_name, np.array(values("top_p", 1.0), dtype=np.float64), "FP64"),
        _inp(s_name, np.array(seeds, dtype=np.int64), "INT64"),
    ]


def _prompt_input(
    requests: Sequence[tuple[str, np.ndarray]], ks: KeySpace | None, given: PromptKeys | None
) -> Input:
    """The prompts as block keys (8 bytes a block instead of 4 a token: 1/128 of the bytes at
    block size 64) when the worker takes them, else as token ids. A batch without one full block
    sends its ids: a zero-length tensor does not cross Triton reliably.

    Given keys are used where they are in the worker's space and one per full block of their
    prompt; any other prompt is hashed here (~3.7 ms of this process's CPU for an 8 x 8K batch)."""
    if ks is not None:
        bs = ks.block_size
        use = given.keys if given is not None and given.space == ks.space else None
        parts: list[np.ndarray] = []
        for n, (_, t) in enumerate(requests):
            k = use[n] if use is not None else None
            if k is None or len(k) != len(t) // bs:
                k = block_keys(t, bs, model=ks.model, tokenizer=ks.tokenizer)
            parts.append(np.asarray(k, dtype=np.uint64))
        keys = np.concatenate(parts)
        if keys.size:
            return _inp(W.P_BLOCK_KEYS, keys, "UINT64")
    ids = np.concatenate([np.asarray(t, dtype=np.int32) for _, t in requests])
    return _inp(W.P_INPUT_IDS, ids, "INT32")


def _first(r: Any, name: str, default: Any) -> Any:
    """The first element of an output tensor; `default` when the event omits it (§4.3, §5)."""
    a = r.as_numpy(name)
    return a[0] if a is not None and len(a) else default


def _prefill_event(r: Any) -> PrefillEvent:
    ev = _s(r.as_numpy(W.P_EVENT)[0])
    out = PrefillEvent(
        event=ev,
        batch_id=_s(r.as_numpy(W.P_BATCH_ID)[0]),
        epoch=_s(r.as_numpy(W.P_EPOCH)[0]),
        queue_position=int(_first(r, W.P_QUEUE_POSITION, 0)),
    )
    if ev == "error":
        errs = r.as_numpy(W.P_ERROR)
        out.error = _s(errs[0]) if errs is not None and len(errs) else "error"
    elif ev == "results":
        cols = {
            "request_id": [_s(x) for x in r.as_numpy(W.P_REQUEST_IDS)],
            "status": [_s(x) for x in r.as_numpy(W.P_STATUS)],
            "first_token": r.as_numpy(W.P_FIRST_TOKEN).tolist(),
            "cached_tokens": r.as_numpy(W.P_CACHED_TOKENS).tolist(),
            "input_tokens": r.as_numpy(W.P_INPUT_TOKENS).tolist(),
            "start_ms": r.as_numpy(W.P_START_MS).tolist(),
            "end_ms": r.as_numpy(W.P_END_MS).tolist(),
            "kv_expiry_ms": r.as_numpy(W.P_KV_EXPIRY_MS).tolist(),
            "seq": r.as_numpy(W.P_SEQ).tolist(),
            "error": [_s(x) for x in r.as_numpy(W.P_ERROR)],
        }
        out.results = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]
    return out


def _short(exc: Any) -> str:
    msg = exc.message() if hasattr(exc, "message") else str(exc)
    return str(msg)[-1500:]
