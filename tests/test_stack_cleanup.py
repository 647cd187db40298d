"""`flexlb up` leaves nothing behind, whatever happens to it (issue 19), and restarts a gateway
replica that died instead of stopping the stack (issue 14, chaos item 9).

Each test starts a small real stack (1 prefill + 1 decode worker, 1 gateway, embedded Redis) with
a unique marker in its environment, so "nothing left" is checked exactly: no process carrying the
marker (Redis, its watchdog, workers, tritonserver, stubs, gateways), no /dev/shm pool named after
a worker, and none of the run's temp dirs (the workers' Triton roots, the Redis data dir)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.netports import free_port
from app.state.embedded_redis import pid_alive

from .gateways import wait_for

ROOT = Path(__file__).resolve().parent.parent
FLEXLB = str(Path(sys.executable).with_name("flexlb"))


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    marker: str
    log_dir: Path
    port: int
    worker_pids: list[int] = field(default_factory=list)
    redis_pid: int = 0
    temp_dirs: list[Path] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.log_dir / "latest" / "stack.json").read_text())  # type: ignore[no-any-return]

    def up_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.log_dir / "latest" / "up.log").read_text(errors="replace")
        return ""

    def processes(self) -> list[str]:
        """Every live process whose environment carries this run's marker (zombies excluded)."""
        needle = f"FLEXLB_TEST_MARK={self.marker}".encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle not in (entry / "environ").read_bytes():
                    continue
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append(f"{entry.name} {cmd[:300]}")
        return out

    def take_inventory(self) -> None:
        """What this run owns, read while it runs: Triton roots name their worker in `owner.pid`;
        the Redis watchdog's argv names the server's pid and data dir (redis-server rewrites its
        own environment for its process title, so the marker cannot find it)."""
        self.worker_pids = [w["pid"] for w in self.manifest()["workers"]]
        for d in Path(tempfile.gettempdir()).glob("flexlb-triton-*"):
            with contextlib.suppress(OSError, ValueError):
                if int((d / "owner.pid").read_text()) in self.worker_pids:
                    self.temp_dirs.append(d)
        for line in self.processes():
            argv = line.split()
            if "watchdog" in argv:
                self.redis_pid = int(argv[argv.index("--pid") + 1])
                self.temp_dirs.append(Path(argv[argv.index("--dir") + 1]))
        assert len(self.temp_dirs) == 3 and self.redis_pid, (self.temp_dirs, self.processes())

    def assert_nothing_left(self, within_s: float) -> float:
        """Polls until nothing of this run is left; returns the seconds it took, or fails naming
        what is still there."""
        t0 = time.monotonic()
        left = self.leftovers()
        while left and time.monotonic() - t0 < within_s:
            time.sleep(0.2)
            left = self.leftovers()
        assert not left, f"left after {within_s} s: {left}\n{self.up_log()[-2000:]}"
        return time.monotonic() - t0

    def leftovers(self) -> list[str]:
        left = self.processes()
        if self.redis_pid and pid_alive(self.redis_pid):
            left.append(f"{self.redis_pid} redis-server")
        shm = Path("/dev/shm")
        left += [f"shm {p.name}" for pid in self.worker_pids for p in shm.glob(f"pytrtion{pid}-*")]
        left += [f"tmp {d}" for d in self.temp_dirs if d.exists()]
        return left


def _start(tmp_path: Path, tail: str = "", stdout: int | None = subprocess.DEVNULL, wait: bool = True) -> Run:
    """`flexlb up ... TAIL` in its own process group, as a shell runs a pipeline in a terminal."""
    marker = uuid.uuid4().hex[:12]
    log_dir = tmp_path / "logs"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXLB_REDIS_URL", "FLEXLB_ADMIN_TOKEN")}
    env |= {"FLEXLB_TEST_MARK": marker, "FLEXLB_CLUSTER": f"t-cl-{marker[:6]}"}
    cmd = f"{FLEXLB} up --prefill 1 --decode 1 --gateways 1 --time-scale 0.1"
    cmd += f" --port {port} --log-dir {log_dir}"
    cmd += f" {tail}" if tail else ""
    proc = subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=ROOT,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run = Run(proc, marker, log_dir, port)

    def up() -> bool:
        if (run.log_dir / "latest" / "stack.json").exists():
            return True
        assert proc.poll() is None, f"flexlb up exited with {proc.returncode}:\n{run.up_log()[-3000:]}"
        return False

    if wait:
        wait_for(up, 90, 0.2, what="flexlb up ready (stack.json)")
    return run


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Whatever a failed test leaves is killed here, so it cannot disturb the next one."""
    started: list[Run] = []
    yield started
    for r in started:
        if r.redis_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.redis_pid, signal.SIGKILL)
        for line in r.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, signal.SIGKILL)
        for d in r.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _generate(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/generate", json={"prompt": "still here?", "max_new_tokens": 4}, timeout=30)


@pytest.mark.parametrize(
    ("tail", "presses"),
    [("| head -c 100", 1), ("2>&1 | tee {log}", 2)],
    ids=["stdout-closed-by-head", "tee-killed-by-ctrl-c-pressed-twice"],
)
def test_ctrl_c_stops_everything_even_when_the_output_pipe_is_gone(
    tail: str, presses: int, tmp_path: Path, runs: list[Run]
) -> None:
    """Ctrl-C reaches the whole foreground group: `head` is long gone (it exited after 100 bytes)
    or `tee` dies with `flexlb up`, so every later write of the supervisor hits a broken pipe.
    Pressed twice, every component exits at once and still leaves nothing behind."""
    run = _start(tmp_path, tail.format(log=tmp_path / "tee.log"))
    runs.append(run)
    run.take_inventory()
    assert len(run.processes()) >= 6, run.processes()  # watchdog, 2 workers + tritons + stubs, gateway
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    if presses == 2:
        wait_for(lambda: "stopping..." in run.up_log(), 10, 0.05, what="stopping")
        t0 = time.monotonic()  # from the second press
        os.killpg(run.proc.pid, signal.SIGINT)
    run.proc.wait(30)
    took = time.monotonic() - t0
    run.assert_nothing_left(20)
    log = run.up_log()
    assert "stopping..." in log and "stopped in" in log, log[-2000:]
    if presses == 2:
        assert "second signal" in log, log[-2000:]  # the gateway was still draining
        assert took < 4, f"after the second Ctrl-C, flexlb up still took {took:.1f} s"
    print(f"Ctrl-C x{presses}: flexlb up exited {took:.1f} s after the last press")


def test_ctrl_c_while_the_workers_are_still_starting_stops_at_once(tmp_path: Path, runs: list[Run]) -> None:
    """The start can wait up to 90 s on a worker; Ctrl-C must not wait for it."""
    run = _start(tmp_path, wait=False)
    runs.append(run)

    def triton_roots() -> list[Path]:
        pids = {int(line.split()[0]) for line in run.processes()}
        roots = []
        for d in Path(tempfile.gettempdir()).glob("flexlb-triton-*"):
            with contextlib.suppress(OSError, ValueError):
                if int((d / "owner.pid").read_text()) in pids:
                    roots.append(d)
        return roots

    run.temp_dirs = wait_for(
        lambda: len(triton_roots()) == 2 and triton_roots(), 60, 0.05, what="workers starting"
    )
    assert not (run.log_dir / "latest" / "stack.json").exists(), "too late: the stack is already up"
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.proc.wait(20) == 130
    took = time.monotonic() - t0
    run.assert_nothing_left(10)
    assert "interrupted while starting" in run.up_log()
    assert took < 12, f"Ctrl-C during the start took {took:.1f} s"


def test_a_dead_gateway_is_restarted_and_sigkill_of_up_leaves_nothing_within_10s(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = _start(tmp_path)
    runs.append(run)
    m = run.manifest()
    gw = m["gateways"][0]
    assert _generate(gw["url"]).status_code == 200
    os.kill(gw["pid"], signal.SIGKILL)  # chaos item 9: the stack restarts it instead of stopping

    def back() -> bool:
        assert run.proc.poll() is None, f"flexlb up stopped:\n{run.up_log()[-3000:]}"
        new = run.manifest()["gateways"][0]
        if new["pid"] == gw["pid"]:
            return False
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(gw["url"] + "/readyz", timeout=2).status_code == 200
        return False

    wait_for(back, 60, 0.3, what="gateway-0 restarted and ready")
    r = _generate(gw["url"])
    assert r.status_code == 200, r.text
    assert "gateway-0 exited with code -9; restarting it" in run.up_log()

    run.take_inventory()
    # bash execs a lone command: the shell's pid is `flexlb up` itself
    assert b" up " in Path(f"/proc/{run.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ")
    os.kill(run.proc.pid, signal.SIGKILL)
    took = run.assert_nothing_left(10)
    print(f"SIGKILL of flexlb up: everything gone in {took:.1f} s")


def test_a_gateway_stuck_in_shutdown_exits_at_once_on_a_second_signal(tmp_path: Path) -> None:
    """Redis stops answering (SIGSTOP) while the replica shuts down: releasing its leases waits on
    timeouts. The second SIGTERM used to do nothing; now the process is gone at once."""
    from app.state.embedded_redis import start_embedded_redis

    from .gateways import start_gateway

    cluster = f"t-gw2-{uuid.uuid4().hex[:6]}"
    emb = start_embedded_redis(cluster, idle_s=60)
    gw = start_gateway(tmp_path, emb.url, cluster)
    try:
        wait_for(lambda: "lease master acquired" in gw.log(), 10, 0.1, what="master lease")
        os.kill(emb.pid, signal.SIGSTOP)
        gw.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "Waiting for application shutdown" in gw.log(), 10, 0.05, what="shutdown begun")
        assert gw.proc.poll() is None, "shutdown did not wait on Redis: the test proves nothing"
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(5)
        assert time.monotonic() - t0 < 2, gw.log()[-2000:]
        assert "exiting at once" in gw.log()
    finally:
        gw.kill()
        os.kill(emb.pid, signal.SIGCONT)
        emb.stop()


def _redis_children(pid: int) -> list[int]:
    """`flexlb up`'s own redis-server children (the HA set's servers and sentinels)."""
    kids = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (t / "children").read_text().split()]
    out = []
    for k in kids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{k}/comm").read_text().strip().startswith("redis-server"):
                out.append(k)
    return out


def test_up_with_redis_ha_serves_through_the_sentinels_and_ctrl_c_stops_all_five(
    tmp_path: Path, runs: list[Run]
) -> None:
    """`flexlb up --redis-ha` (issue 14 Deliver 4): the gateways take the sentinels' URL, a request
    is served through the master they name, and Ctrl-C stops the 2 servers and 3 sentinels with
    everything else."""
    run = _start(tmp_path, "--redis-ha")
    runs.append(run)
    m = run.manifest()
    assert m["redis_url"].startswith("redis+sentinel://127.0.0.1:"), m["redis_url"]
    redis_pids = _redis_children(run.proc.pid)
    assert len(redis_pids) == 5, (redis_pids, run.up_log()[-2000:])
    r = _generate(m["gateways"][0]["url"])
    assert r.status_code == 200, r.text
    for name in ("a", "b", "sentinel-0", "sentinel-1", "sentinel-2"):
        assert (run.log_dir / "latest" / f"redis-{name}.log").stat().st_size > 0, name
    os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
    assert run.proc.wait(30) == 0, run.up_log()[-2000:]
    left = [p for p in redis_pids if pid_alive(p)]
    assert not left, left
    run.assert_nothing_left(10)
