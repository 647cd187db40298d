"""JSON log lines, formatted and written off the event loop, and the lifecycle-line sampling.

A gateway's event loop serves every request of its process: a log line formatted and written
there (a `json.dumps` and a `write` syscall each) adds to every request's latency and holds the
loop while the pipe to the log collector is slow. `setup_logging` therefore puts a
`QueueHandler` on the root logger: the calling thread only copies the record onto a queue, and a
`QueueListener` thread formats the JSON and writes it. `flush_logs` drains the queue (a forced
exit calls it before `os._exit`).

Per-transition lifecycle lines (`queued`, `dispatched`, `prefilled`, `decoding`) are sampled
per request (`FLEXLB_LOG_LIFECYCLE_SAMPLE`): a request either logs all its transitions or only
its terminal line, decided from a hash of its id, so every replica that handles a request (the
origin, the owner) agrees without talking. The terminal line (`completed`, `failed`,
`cancelled`, ...) is always written and carries the request's workers, batch and timings.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import zlib
from typing import IO

_FIELDS = (
    "event",
    "request_id",
    "trace_id",
    "worker",
    "prefill_worker",
    "decode_worker",
    "batch_id",
    "batch_size",
    "reason",
    "code",
    "user",  # OpenAI `user` of the request
    "timings",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k in _FIELDS:
            v = getattr(record, k, None)
            if v is not None:
                d[k] = v
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted by the queue handler's prepare (the traceback is gone)
            d["exc"] = record.exc_text
        return json.dumps(d)


class _LazyQueueHandler(logging.handlers.QueueHandler):
    """Enqueue the record as it is: the stock `prepare` formats the message on the caller's
    thread, which is the cost this handler exists to move. Only what cannot cross threads is
    settled here: a traceback becomes text (the frames would change under the listener)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if record.args:  # args may be mutable objects still changing on the loop
            record.msg = record.getMessage()
            record.args = None
        return record


_listener: logging.handlers.QueueListener | None = None


def setup_logging(level: str = "INFO", stream: IO[str] | None = None) -> None:
    """JSON lines on `stream` (stderr) through a queue and a writer thread (idempotent)."""
    global _listener
    # Our JSON lines never show the caller's file/line, thread or process names: skip collecting
    # them (the logging docs' "Optimization" switches).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if _listener is not None:
        _listener.stop()
    out = logging.StreamHandler(stream)
    out.setFormatter(JsonFormatter())
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(q, out, respect_handler_level=False)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [_LazyQueueHandler(q)]
    root.setLevel(level.upper())


def flush_logs() -> None:
    """Write every queued line now (before exiting). The listener keeps running."""
    global _listener
    if _listener is None:
        return
    _listener.stop()  # drains the queue, joins the thread
    _listener.start()


@atexit.register
def _stop_at_exit() -> None:
    if _listener is not None:
        _listener.stop()


# ---- lifecycle sampling -------------------------------------------------------------------------
_sample_per_10k = 10_000


def set_lifecycle_sample(fraction: float) -> None:
    """The share of requests whose every lifecycle transition is logged at INFO (0..1)."""
    global _sample_per_10k
    _sample_per_10k = round(min(max(fraction, 0.0), 1.0) * 10_000)


def lifecycle_sampled(request_id: str) -> bool:
    """Whether this request logs its intermediate transitions; the same answer on every replica."""
    if _sample_per_10k >= 10_000:
        return True
    return zlib.crc32(request_id.encode()) % 10_000 < _sample_per_10k
