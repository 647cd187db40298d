"""The `control` model over the simulated core: status, cache diffs, cancel, release, configure
and reset (docs/worker-protocol.md §7)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from app.protocol import worker_api as W
from app.protocol.codes import EngineStatus
from app.scheduling.formula import FormulaError
from workers.engine.decode import ADMISSIONS, DecodeEngine
from workers.engine.faults import Faults
from workers.engine.prefill import PrefillEngine
from workers.engine.profiles import EngineProfile, get_profile

from .common import ControlError, WorkerConfig
from .runner import EngineRunner
from .stream_end import EndOfStream
from .tensors import as_str, b1, get

log = logging.getLogger("flexlb.worker")


class ControlModel:
    """Mixin of `WorkerService`: every control op."""

    if TYPE_CHECKING:  # provided by the composed service

        @property
        def kv_endpoint(self) -> str: ...
        def _route(self, effects: list[Any]) -> None: ...

    cfg: WorkerConfig
    epoch: str
    core: Any
    runner: EngineRunner
    profile: EngineProfile
    current: dict[str, Any]
    released: dict[str, int]
    needs_input_ids: bool  # PrefillModel's (True in hf_service)
    _status_seq: int

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    def _profile(self, name: str, formula: str | None, cap: int | None) -> EngineProfile:
        return get_profile(name, formula=formula, kv_capacity_tokens=cap)

    async def control(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for req in requests:
            try:
                body = json.loads(as_str(get(req, W.C_REQUEST)) or "{}")
                if not isinstance(body, dict):
                    raise ControlError("request must be a JSON object")
                self._check_secret(body.pop("secret", ""))
                resp = await self._control(body)
            except (ControlError, FormulaError, ValueError, TypeError, KeyError) as exc:
                resp = {"error": str(exc), "code": EngineStatus.INVALID}
            resp.setdefault("epoch", self.epoch)
            out = [{W.C_RESPONSE: b1(json.dumps(resp))}]
            yield EndOfStream(out) if req is requests[-1] else out

    def _check_secret(self, given: object) -> None:
        """A worker started with a secret answers control calls only with it: configure (faults,
        including `exit_after_batches`), reset, cancel and release change what the engine does."""
        want = self.cfg.secret
        if want and not (isinstance(given, str) and hmac.compare_digest(given.encode(), want.encode())):
            raise ControlError("control needs the worker secret (FLEXLB_WORKER_SECRET)")

    async def _control(self, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if op == "configure":
            return await self._configure(body)
        if op == "reset":
            return await self.runner.call(self._reset)
        if op == "describe":  # static: a client's first prefill must not wait on a hang for it
            return self._describe()
        await self._wait_unhung()
        if op == "status":
            return await self.runner.call(lambda: self._status(int(body.get("since_seq", 0))))
        if op == "cache":
            return await self.runner.call(lambda: self._cache(body))
        if op == "poll":  # status + cache in one call: what an owner's poll needs
            since_seq = int(body.get("since_seq", 0))
            return await self.runner.call(
                lambda: {"status": self._status(since_seq), "cache": self._cache(body)}
            )
        if op == "cancel":
            some_id = str(body["id"])
            return await self.runner.call(lambda: self._cancel(some_id))
        if op == "kv_endpoint":
            return {"kv_endpoint": self.kv_endpoint}
        if op == "release":
            if body.get("epoch") and body["epoch"] != self.epoch:
                return {"status": EngineStatus.EPOCH_MISMATCH}
            rid = str(body["request_id"])
            return await self.runner.call(lambda: self._release(rid))
        raise ControlError(f"unknown op {op!r}")

    def _describe(self) -> dict[str, Any]:
        """What a client needs to shape its prefill input (docs/worker-protocol.md §7.7): which
        of ids or block keys the engine takes, and the key space to hash the keys in."""
        return {
            "role": self.cfg.role,
            "prefill_input": W.INPUT_IDS if self.needs_input_ids else W.INPUT_BLOCK_KEYS,
            "block_size": self.cfg.block_size,
            "model_name": self.cfg.model_name,
            "tokenizer": self.cfg.tokenizer,
        }

    async def _wait_unhung(self) -> None:
        """Fault `hang`: the worker stops answering anything but configure/reset."""
        while self.core.faults.hang:
            await asyncio.sleep(0.05)

    def _status(self, since_seq: int) -> dict[str, Any]:
        core = self.core
        now = self.runner.model_now()
        self._status_seq += 1
        st: dict[str, Any] = {
            "status_seq": self._status_seq,
            "role": self.cfg.role,
            "epoch": self.epoch,
            "address": self.address,
            "now_ms": now,
            "block_size": self.cfg.block_size,
            "time_scale": self.runner.time_scale,
            "profile": self.current["profile"],
            "lag_ms": self.runner.lag_ms,
            "max_lag_ms": self.runner.max_lag_ms,
            **core.kv_view(),
        }
        if isinstance(core, PrefillEngine):
            resync, recs = core.records_since(since_seq, W.STATUS_PAGE_LIMIT)
            live = core.live_view()
            st.update(
                seq=core.seq,
                resync=resync,
                finished=[asdict(r) for r in recs],
                more=bool(recs) and recs[-1].seq < core.seq,
                live=live,
                queue_len=sum(1 for b in live if b["phase"] == "queued"),
                queued_predicted_ms=core.queued_predicted_ms(),
                batches_done=core.batches_done,
                max_live_batches=core.max_live_batches,
                pinned=core.pinned_ids(),
                kv_released=dict(self.released),
            )
        else:
            live_d = core.live_view()
            st.update(
                live=live_d,
                running=len(live_d["running"]),
                queue_len=len(live_d["waiting"]) + len(live_d["fetching"]),
                step_ms=core.step_ms,
                avg_step_ms=core.avg_step_ms(),
                tokens_total=core.tokens_total,
            )
        return st

    def _cache(self, body: dict[str, Any]) -> dict[str, Any]:
        core = self.core
        if not isinstance(core, PrefillEngine):
            return {"version": 0, "full": True, "added": [], "removed": []}
        since = body.get("since_version")
        if body.get("epoch") != self.epoch:
            since = None
        d = core.cache_diff(None if since is None else int(since))
        return {
            "version": d.version,
            "full": d.full,
            "added": d.added,
            "removed": d.removed,
            "block_size": self.cfg.block_size,
        }

    def _cancel(self, some_id: str) -> dict[str, Any]:
        now = self.runner.model_now()
        if isinstance(self.core, PrefillEngine):
            what, effects = self.core.cancel(some_id, now)
        else:
            known = some_id in self.core.live_view()["running"] or some_id in self.core._seqs
            effects = self.core.cancel(some_id, now)
            what = "cancelled" if known else "unknown"
        self._route(effects)
        return {"result": what}

    def _release(self, rid: str) -> dict[str, Any]:
        if not isinstance(self.core, PrefillEngine):
            return {"status": EngineStatus.UNKNOWN}
        status, effects = self.core.release(rid, self.runner.model_now())
        self._route(effects)
        return {"status": str(status)}

    async def _configure(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate everything first; apply all or nothing."""
        allowed = {
            "op",
            "profile",
            "formula",
            "kv_capacity_tokens",
            "faults",
            "time_scale",
            "kv_handle_ttl_ms",
            "chunk_interval_ms",
            "decode_admission",
        }
        bad = set(body) - allowed
        if bad:
            raise ControlError(f"unknown configure option(s): {sorted(bad)}")
        if "faults" in body and not self.cfg.allow_faults:
            raise ControlError("fault injection is disabled: start the worker with --allow-faults")
        profile = None
        new_current = dict(self.current)
        if "profile" in body or "formula" in body or "kv_capacity_tokens" in body:
            cap = body.get("kv_capacity_tokens", self.current["kv_capacity_tokens"])
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
                raise ControlError("kv_capacity_tokens must be a positive integer")
            name = body.get("profile", "formula" if "formula" in body else self.current["profile"])
            formula = body.get("formula", self.current["formula"])
            profile = self._profile(name, formula, cap)
            new_current = {"profile": name, "formula": formula, "kv_capacity_tokens": cap}
        faults = Faults.from_dict(body["faults"]) if "faults" in body else None
        scale = body.get("time_scale")
        if scale is not None and not (isinstance(scale, int | float) and 0 < scale <= 1000):
            raise ControlError("time_scale must be in (0, 1000]")
        ttl = body.get("kv_handle_ttl_ms")
        if ttl is not None and not (isinstance(ttl, int | float) and ttl > 0):
            raise ControlError("kv_handle_ttl_ms must be > 0")
        chunk = body.get("chunk_interval_ms")
        if chunk is not None and not (isinstance(chunk, int | float) and chunk > 0):
            raise ControlError("chunk_interval_ms must be > 0")
        admission = body.get("decode_admission")
        if admission is not None:
            if not isinstance(self.core, DecodeEngine):
                raise ControlError("decode_admission applies to a decode worker's simulated engine")
            if admission not in ADMISSIONS:
                raise ControlError(f"decode_admission must be one of {list(ADMISSIONS)}")

        def apply() -> dict[str, Any]:
            now = self.runner.model_now()
            if admission is not None:  # first: it alone can refuse (engine busy), nothing applied yet
                try:
                    self.core.set_admission(admission)  # type: ignore[union-attr]
                except ValueError as exc:
                    raise ControlError(str(exc)) from None
            if scale is not None:
                self.runner.set_time_scale(float(scale))
            if chunk is not None and self.runner.tick_ms is not None:
                self.runner.tick_ms = float(chunk)
            kw: dict[str, Any] = {"faults": faults, "profile": profile}
            if profile is not None:
                kw["kv_capacity_tokens"] = profile.kv_capacity_tokens
            if isinstance(self.core, PrefillEngine):
                kw["kv_handle_ttl_ms"] = ttl
            self._route(self.core.configure(now, **kw))
            self.current = new_current
            return {"ok": True}

        return await self.runner.call(apply)

    def _reset(self) -> dict[str, Any]:
        now = self.runner.model_now()
        self._route(self.core.reset(now))
        if isinstance(self.core, DecodeEngine):  # idle now: every sequence was cancelled
            self.core.set_admission(self.cfg.decode_admission)
        self.profile = self._profile(self.cfg.profile, self.cfg.formula, self.cfg.kv_capacity_tokens)
        self.current = {
            "profile": self.cfg.profile,
            "formula": self.cfg.formula,
            "kv_capacity_tokens": self.cfg.kv_capacity_tokens,
        }
        kw: dict[str, Any] = {
            "profile": self.profile,
            "kv_capacity_tokens": self.profile.kv_capacity_tokens,
            "faults": Faults(**asdict(self.cfg.faults)),
        }
        if isinstance(self.core, PrefillEngine):
            kw["kv_handle_ttl_ms"] = self.cfg.kv_handle_ttl_ms
        self._route(self.core.configure(now, **kw))
        self.runner.set_time_scale(self.cfg.time_scale)
        if self.runner.tick_ms is not None:
            self.runner.tick_ms = self.cfg.chunk_interval_ms
        return {"ok": True}
