"""End a decoupled Triton stream on its last response instead of on an extra empty one.

PyTriton (0.7) ends every decoupled stream with a separate empty response flagged final, after the
infer function's generator returns: one more ZMQ message, one more `send` in the Python-backend
stub and one more response for tritonserver, on every call. A prefill call made three of them, a
decode call two or three, and the stub is the worker's costliest process (docs/worker-protocol.md
§11). Our infer functions know which event ends a stream (`final`, `error`, `finish`, a control
answer), so they yield it wrapped in `EndOfStream`, and the wrapper below sends it with the final
flag itself; the empty response PyTriton sends afterwards is dropped.

Observable on the wire: a client that asks for empty final responses
(`enable_empty_final_response`) sees the final flag on the last real response and no empty one.

The hook wraps `RequestsResponsesConnector.send`, a method of PyTriton's user-process side, and is
installed only on the PyTriton versions it was checked against; elsewhere streams end as before.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

log = logging.getLogger("flexlb.worker")

CHECKED_VERSIONS = ("0.7.",)


class EndOfStream(list):  # type: ignore[type-arg]
    """The responses that end their stream: sent with PyTriton's end-of-stream flag."""


def install() -> bool:
    """Idempotent; True when the hook is active in this process."""
    try:
        from pytriton.proxy import inference
        from pytriton.proxy.communication import PyTritonResponseFlags

        version = metadata.version("nvidia-pytriton")
    except (ImportError, metadata.PackageNotFoundError):
        return False
    connector = getattr(inference, "RequestsResponsesConnector", None)
    send = getattr(connector, "send", None)
    if connector is None or send is None or not version.startswith(CHECKED_VERSIONS):
        log.info("pytriton %s: streams end with PyTriton's own empty final response", version)
        return False
    if getattr(send, "_flexlb_stream_end", False):
        return True
    eos, error = PyTritonResponseFlags.EOS, PyTritonResponseFlags.ERROR

    def send_ending_on_last(self: Any, scope: Any, flags: Any, responses: Any) -> None:
        ended: set[bytes] = self.__dict__.setdefault("_flexlb_ended", set())
        rid = scope["requests_id"]
        if rid in ended:  # the stream already ended on its last response
            if flags & eos:
                ended.discard(rid)
            if flags & error:
                log.warning("infer function failed after its stream ended: %s", responses)
            return
        if isinstance(responses, EndOfStream) and not flags:
            ended.add(rid)
            send(self, scope, eos, list(responses))
            return
        send(self, scope, flags, responses)

    send_ending_on_last._flexlb_stream_end = True  # type: ignore[attr-defined]
    connector.send = send_ending_on_last
    return True
