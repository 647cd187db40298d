"""What the request path uses of its replica, named: the services it calls and the state it reads,
each by its narrow interface, instead of the whole `Replica` (which hosts them; app/gateway/).
Every stage of `Pipeline` works on these and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from app.cache.mirror import CacheMirror
    from app.config import Settings
    from app.gateway.runtime import RuntimeConfig
    from app.gateway.views import WorkerViews
    from app.request.channels import ReplyRouter
    from app.state.keys import Keys
    from app.state.retry import TerminalWrites
    from app.state.store import StateStore
    from app.tokens.tokenizer import Tokenizer

__all__ = ["LocalOwner", "RequestContext"]


class LocalOwner(Protocol):
    """This replica's owner of a prefill worker, as the origin's hand-off sees it
    (`app.dispatch.intake.OwnerIntake`): the hand-off may deliver the worker's new entries to it in
    its own round trip."""

    replica_id: str

    def local_lease(self) -> str | None: ...

    def take_local(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None: ...


class RequestContext:
    """``fleet``: the workers, their snapshots and this origin's overlays; ``runtime``: the selected
    policies, formula and batcher knobs; ``store``/``redis``/``keys``: shared state; ``replies``: this
    origin's reply stream; ``terminal``: terminal writes Redis refused, retried; ``mirror``: the
    cache index; ``wake_owner(wid)``: a local owner's batcher; ``local_owner(wid)``: this replica's
    owner of ``wid`` when it is one; ``health()``: (Redis reachable, why
    not); ``accepting()``: False once a drain began."""

    def __init__(
        self,
        *,
        replica_id: str,
        settings: Settings,
        keys: Keys,
        store: StateStore,
        redis: aioredis.Redis,
        fleet: WorkerViews,
        runtime: RuntimeConfig,
        mirror: CacheMirror,
        replies: ReplyRouter,
        terminal: TerminalWrites,
        tokenizer: Tokenizer,
        wake_owner: Callable[[str], None],
        health: Callable[[], tuple[bool, str]],
        accepting: Callable[[], bool],
        local_owner: Callable[[str], LocalOwner | None] = lambda wid: None,
    ) -> None:
        self.replica_id = replica_id
        self.settings = settings
        self.keys = keys
        self.store = store
        self.redis = redis
        self.fleet = fleet
        self.runtime = runtime
        self.mirror = mirror
        self.replies = replies
        self.terminal = terminal
        self.tokenizer = tokenizer
        self.wake_owner = wake_owner
        self.health = health
        self.accepting = accepting
        self.local_owner = local_owner
