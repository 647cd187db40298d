"""JSON log lines, formatted and written off the event loop, and the lifecycle-line sampling.

A gateway's event loop serves every request of its process: a log line formatted and written
there (a `json.dumps` and a `write` syscall each) adds to every request's latency and holds the
loop while the pipe to the log collector is slow. `setup_logging` therefore puts a `BatchWriter`
on the root logger: the calling thread only appends the record to a queue, and a writer thread
formats the JSON and writes a batch of lines at a time. `flush_logs` drains the queue (a forced
exit calls it before `os._exit`).

Per-transition lifecycle lines (`queued`, `dispatched`, `prefilled`, `decoding`) are sampled
per request (`FLEXLB_LOG_LIFECYCLE_SAMPLE`): a request either logs all its transitions or only
its terminal line, decided from a hash of its id, so every replica that handles a request (the
origin, the owner) agrees without talking. The terminal line (`completed`, `failed`,
`cancelled`, ...) is always written and carries the request's workers, batch and timings.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import sys
import threading
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


class BatchWriter(logging.Handler):
    """Queue on the caller's thread, format and write on a writer thread, in batches.

    `emit` only settles what cannot cross threads and appends the record to a deque: no
    formatting, no syscall. The stock `QueueHandler` wakes its listener with a futex call per
    record, and the woken thread then fights the event loop for the GIL: profiled, that cost as
    much as the formatting it moved. Here the writer wakes every `interval_s` (or once `WAKE_AT`
    records wait), formats what is queued and writes it in one call; a line is at most
    `interval_s` late. `flush` (a forced exit, tests) writes everything queued at once."""

    WAKE_AT = 512

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 0.05) -> None:
        super().__init__()
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._queue: collections.deque[logging.LogRecord] = collections.deque()
        self._wake = threading.Event()
        self._write_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:  # the frames change under the writer: the traceback becomes text now
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if record.args:  # args may be mutable objects still changing on the loop
            record.msg = record.getMessage()
            record.args = None
        self._queue.append(record)
        if len(self._queue) >= self.WAKE_AT:
            self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._write()

    def _write(self) -> None:
        with self._write_lock:  # one writer at a time keeps the lines in order
            lines = []
            while self._queue:
                record = self._queue.popleft()
                try:
                    lines.append(self.format(record))
                except Exception:  # a record that cannot be formatted is reported, the rest written
                    self.handleError(record)
            if lines:
                try:
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):  # the log pipe is gone: nothing left to tell it
                    pass

    def flush(self) -> None:
        self._write()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2)
        self._write()
        super().close()


_writer: BatchWriter | None = None


def setup_logging(level: str = "INFO", stream: IO[str] | None = None) -> None:
    """JSON lines on `stream` (stderr), formatted and written by a writer thread (idempotent)."""
    global _writer
    # Our JSON lines never show the caller's file/line, thread or process names: skip collecting
    # them (the logging docs' "Optimization" switches).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if _writer is not None:
        _writer.close()
    _writer = BatchWriter(stream)
    _writer.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [_writer]
    root.setLevel(level.upper())


def flush_logs() -> None:
    """Write every queued line now (before exiting)."""
    if _writer is not None:
        _writer.flush()


@atexit.register
def _stop_at_exit() -> None:
    if _writer is not None:
        _writer.close()


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
