"""Running Lua scripts by EVALSHA and recovering from NOSCRIPT, once for every caller.

A server that restarted empty (or had SCRIPT FLUSH) answers NOSCRIPT to EVALSHA. A call answered
NOSCRIPT never ran, so loading its script and rerunning just that call is exact even for scripts
whose effect is not idempotent, and the other commands of the same round trip are not repeated
(a reply already appended to a stream must not be appended twice). `run_scripts` does this for a
batch of raw commands through any executor (the lean RESP client, a redis-py pipeline); `LuaScript`
wraps one script for the cluster modules, which use redis-py pipelines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

__all__ = ["Execute", "LuaScript", "is_noscript", "redis_execute", "run_scripts"]

#: Sends raw commands in one round trip and returns the replies in order, error replies in place.
Execute = Callable[[Sequence[Sequence[Any]]], Awaitable[list[Any]]]


def is_noscript(result: Any) -> bool:
    """Whether a reply (or a raised error) is NOSCRIPT, whichever client parsed it."""
    return isinstance(result, NoScriptError) or (
        isinstance(result, Exception) and str(result).startswith("NOSCRIPT")
    )


async def run_scripts(
    execute: Execute, cmds: Sequence[Sequence[Any]], sources: Mapping[str, str]
) -> list[Any]:
    """Run ``cmds`` in one round trip; when some EVALSHA calls answer NOSCRIPT, SCRIPT LOAD their
    scripts (``sources``: sha → Lua source) and rerun just those calls in one more round trip.
    Error replies are returned in place, not raised."""
    results = list(await execute(cmds))
    missing = [i for i, r in enumerate(results) if is_noscript(r)]
    if not missing:
        return results
    shas = list(dict.fromkeys(str(cmds[i][1]) for i in missing))
    loads = [["SCRIPT", "LOAD", sources[sha]] for sha in shas]
    again = await execute([*loads, *(cmds[i] for i in missing)])
    for i, r in zip(missing, again[len(loads) :], strict=True):
        results[i] = r
    return results


def redis_execute(redis: Redis) -> Execute:
    """An `Execute` over a redis-py client: one non-transactional pipeline per call (any slots)."""

    async def execute(cmds: Sequence[Sequence[Any]]) -> list[Any]:
        pipe = redis.pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        return list(await pipe.execute(raise_on_error=False))

    return execute


class LuaScript:
    """A Lua script run by EVALSHA, loaded on first NOSCRIPT (also after Redis restarts empty).

    Unlike redis-py's `Script` in a pipeline, it does not send `SCRIPT EXISTS` before every
    pipeline, so a steady-state tick costs no extra round trip.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def command(self, keys: Sequence[str], args: Sequence[Any] = ()) -> list[Any]:
        return ["EVALSHA", self.sha, len(keys), *keys, *args]

    async def __call__(self, redis: Redis, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        (res,) = await run_scripts(redis_execute(redis), [self.command(keys, args)], {self.sha: self.source})
        if isinstance(res, Exception):
            raise res
        return res

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any] = ()) -> None:
        """Add one call to a pipeline; check its result with `is_noscript` and rerun it if so."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def run_many(self, redis: Redis, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run many calls in one non-transactional pipeline (one round trip, any slots).

        Results are per call; a failed call's slot holds its exception instead of raising, so one bad
        key does not hide the others. A connection failure raises for the whole batch.
        """
        if not calls:
            return []
        cmds = [self.command(keys, args) for keys, args in calls]
        return await run_scripts(redis_execute(redis), cmds, {self.sha: self.source})
