"""What a hard-killed Triton worker leaves behind, and the sweep that removes it.

A worker removes its own workspace and shared memory when it stops (workers/server/launcher.py).
Killed by SIGKILL or a crash it cannot, so two others sweep for it: the next worker to start on the
machine, and `flexlb up` when it had to SIGKILL one of its workers (a second Ctrl-C on a loaded box
gives a worker 3 s). Standard library only: the supervisor imports this without PyTriton.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("flexlb.worker.triton")

ROOT_PREFIX = "flexlb-triton-"
OWNER_FILE = "owner.pid"
# Triton names the Python-backend pools after the PyTriton process (pytriton/triton.py spells the
# prefix this way): /dev/shm/pytrtion<pid>-<hash>, 64 MiB each (_SHM_INITIAL_BYTES), two a worker.
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "pytrtion"


def remove_stale_roots() -> None:
    """A worker killed hard (SIGKILL, a crash) cannot remove its workspace (~22 MB each). The next
    worker to start removes every root whose owner process is gone and that no process (an
    orphaned tritonserver or stub) still runs from."""
    for root in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        try:
            owner = int((root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (no owner file)
        if Path(f"/proc/{owner}").exists() or our_processes(str(root)):
            continue
        shutil.rmtree(root, ignore_errors=True)
        log.info("removed stale Triton workspace %s (owner %d is gone)", root, owner)
    remove_stale_shm()


def remove_stale_shm() -> None:
    """A worker killed hard also leaves its Python-backend pools in /dev/shm: 128 MiB of memory per
    crash, for good, and a container's /dev/shm is 64 MiB by default. Removed here once the process
    they are named after is gone (unlinking never disturbs a process that still maps one)."""
    for seg in SHM_DIR.glob(f"{SHM_PREFIX}*-*"):
        pid = seg.name[len(SHM_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(OSError):
            seg.unlink()
            log.info("removed stale Triton shared memory %s (owner %s is gone)", seg.name, pid)


def sweep_after_kill(owner_pids: list[int], within_s: float = 5.0) -> list[Path]:
    """Remove the workspaces of these (SIGKILLed) workers once nothing runs from them any more.

    A SIGKILL of a worker's process group reaches tritonserver and its stubs, but they take a
    moment to die; the sweep polls, bounded, until each root is free, and leaves a root that some
    process still runs from after `within_s` (the next worker's start removes it). Returns what
    was removed."""
    wanted = set(owner_pids)
    roots: dict[Path, int] = {}
    for root in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            owner = int((root / OWNER_FILE).read_text())
            if owner in wanted:
                roots[root] = owner
    removed: list[Path] = []
    deadline = time.monotonic() + within_s
    while roots:
        for root, owner in list(roots.items()):
            if _alive(owner) or our_processes(str(root)):
                continue
            shutil.rmtree(root, ignore_errors=True)
            del roots[root]
            removed.append(root)
            log.info("removed the workspace %s of a killed worker (%d)", root, owner)
        if not roots or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    remove_stale_shm()
    return removed


def _alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped) runs nothing: it counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def our_processes(marker: str) -> list[int]:
    """PIDs whose command line mentions `marker` (our unique workspace path).

    Stubs orphaned by tritonserver are re-parented to init, so walking our own child tree misses
    them; their argv still names the workspace binary, which no other process can share.
    """
    pids = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(entry.name))
    return pids
