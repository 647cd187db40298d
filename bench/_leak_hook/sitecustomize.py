"""For bench/leak_probe.py, on a gateway's PYTHONPATH: growth per request served, measured inside
the gateway. Nothing runs unless `LEAK_DIR` is set and this is a gateway process.

The probe writes `$LEAK_DIR/req-<label>` once the load is stopped and drained; a thread here then
collects (`gc.collect()`), and writes `$LEAK_DIR/<label>.json`: a histogram of the gc-tracked
objects by type, the size of every dict/set/list/deque/OrderedDict attribute of an `app.*` or
`workers.*` object and of every module-level one of `app.*` modules, RSS, and (with
`LEAK_TRACEMALLOC=1`, started here before `app` imports) a tracemalloc snapshot dumped to
`$LEAK_DIR/<label>.tm` for the probe to diff by line. Measurement only, never product code.

The allocator figures (`mem`) tell a live C/Python object from memory freed but not given back:
glibc's mallinfo2 (`uordblks` in use, `fordblks` free inside the heaps, `hblkhd` in mmapped
blocks), its arenas (`malloc_info`: one per thread that ever contended, e.g. gRPC's C-core
threads), pymalloc's arenas (`sys._debugmallocstats`) and /proc's anonymous memory. With
`LEAK_TRIM=1` each snapshot then calls `malloc_trim(0)` and measures again (`*_trimmed`): RSS
that drops back was free-but-retained, not a leak. `LEAK_WALK=0` skips the container walk, whose
~20 MB peak the next snapshot's RSS would otherwise carry."""

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc

_CONTAINERS = (dict, set, list, collections.deque, collections.OrderedDict, frozenset)


def _reachable() -> list[object]:
    """Every object reachable from the modules, the threads' frames and the young generations.
    `gc.get_objects()` alone misses what the gateway's start-up `gc.freeze()` moved to the
    permanent generation: the replica, its pipeline, reply router and views among them."""
    me = threading.get_ident()  # not this walk's own frame: `out` would hold it in a cycle
    frames = [f for tid, f in sys._current_frames().items() if tid != me]
    roots: list[object] = [sys.modules, *frames, *gc.get_objects()]
    seen: set[int] = set()
    out: list[object] = []
    stack = roots
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        out.append(o)
        stack.extend(gc.get_referents(o))
    return out


def _sizes(objs: list[object]) -> dict[str, int]:
    """Per `module.Class.attr` (or `module:name`), the entries of the containers there; a dict or
    list of containers also as `...[*]`, the entries summed one level down."""
    out: collections.Counter[str] = collections.Counter()

    def add(name: str, v: object) -> None:
        if isinstance(v, _CONTAINERS):
            out[name] += len(v)
            seq = isinstance(v, list | collections.deque)
            inner = v.values() if isinstance(v, dict) else v if seq else ()
            for x in list(inner):
                if isinstance(x, _CONTAINERS):
                    out[name + "[*]"] += len(x)

    for o in objs:
        t = type(o)
        mod = getattr(t, "__module__", "")
        if not isinstance(mod, str) or not (mod.startswith("app.") or mod.startswith("workers.")):
            continue
        if t.__name__ == "module":
            continue
        try:
            d = vars(o)
        except TypeError:
            d = {k: getattr(o, k, None) for k in getattr(t, "__slots__", ())}
        for k, v in list(d.items()):
            add(f"{mod}.{t.__name__}.{k}", v)
    for name, m in list(sys.modules.items()):
        if name.startswith("app.") or name.startswith("workers."):
            for k, v in list(vars(m).items()):
                if not k.startswith("__"):
                    add(f"{name}:{k}", v)
    return dict(out)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mallinfo2.restype = _Mallinfo2
_libc.malloc_trim.argtypes = [ctypes.c_size_t]
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _proc_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def _malloc_info(folder: str, label: str) -> dict[str, int]:
    """glibc's per-arena XML: how many arenas, and their summed system (mapped) bytes."""
    import re

    path = f"{folder}/{label}.malloc_info.xml"
    fp = _libc.fopen(path.encode(), b"w")
    _libc.malloc_info(0, fp)
    _libc.fclose(fp)
    with open(path) as f:
        x = f.read()
    heaps = re.findall(r'<heap nr="\d+">(.*?)</heap>', x, re.S)
    sys_cur = sum(int(m) for h in heaps for m in re.findall(r'<system type="current" size="(\d+)"/>', h))
    return {"arenas": len(heaps), "arenas_system_kib": sys_cur // 1024}


def _pymalloc() -> dict[str, int]:
    """pymalloc's own counters, which it prints only (to the C stderr: redirected for the call)."""
    import re
    import tempfile

    with tempfile.TemporaryFile("w+") as t:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(t.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        t.seek(0)
        txt = t.read()
    out = {}
    for key, name in (
        ("arenas allocated current", "py_arenas"),
        ("arenas highwater mark", "py_arenas_high"),
        ("bytes in allocated blocks", "py_alloc_bytes"),
        ("bytes in available blocks", "py_avail_bytes"),
    ):
        m = re.search(r"# " + key + r"\s*=\s*([\d,]+)", txt)
        if m:
            out[name] = int(m.group(1).replace(",", ""))
    return out


def _mem(folder: str, label: str, suffix: str = "") -> dict[str, int]:
    mi = _libc.mallinfo2()
    d = {f: getattr(mi, f) // 1024 for f in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")}
    roll = _proc_kib("/proc/self/smaps_rollup", ("Rss", "Anonymous", "Private_Dirty"))
    d |= {"smaps_" + k.lower(): v for k, v in roll.items()}
    d |= _proc_kib("/proc/self/status", ("VmRSS", "RssAnon", "RssFile", "Threads"))
    d |= _malloc_info(folder, label + suffix)
    d |= {k: v // 1024 if "bytes" in k else v for k, v in _pymalloc().items()}
    return {k + suffix: v for k, v in d.items()}


def _snap(folder: str, label: str) -> None:
    gc.collect()
    rss = _rss_kib()  # before the walk's own allocations
    mem = _mem(folder, label)
    if os.environ.get("LEAK_TRIM") == "1":
        t0 = time.monotonic()
        mem["trim_returned"] = _libc.malloc_trim(0)
        mem["trim_ms"] = round((time.monotonic() - t0) * 1000)
        mem |= _mem(folder, label, "_trimmed")
    objs = gc.get_objects()
    hist = collections.Counter(type(o).__name__ for o in objs)
    n = len(objs)
    del objs
    sizes: dict[str, int] = {}
    errors = []
    for _ in range(5 if os.environ.get("LEAK_WALK", "1") == "1" else 0):
        try:
            sizes = _sizes(_reachable())
            break
        except Exception as e:  # a dict changed size under the walk: walk again (noted)
            errors.append(repr(e))
    gc.collect()  # whatever the walk left in cycles, before tracemalloc's snapshot
    doc = {
        "label": label,
        "t": time.time(),
        "pid": os.getpid(),
        "rss_kib": rss,
        "mem": mem,
        "gc_objects": n,
        "gc_counts": gc.get_count(),
        "freeze_count": gc.get_freeze_count(),
        "hist": dict(hist),
        "sizes": sizes,
        "walk_errors": errors,
    }
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(f"{folder}/{label}.tm")
        doc["tracemalloc_kib"] = tracemalloc.get_traced_memory()[0] // 1024
    tmp = f"{folder}/{label}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, f"{folder}/{label}.json")


def _loop(folder: str) -> None:
    done: set[str] = set()
    while True:
        time.sleep(0.2)
        for name in sorted(os.listdir(folder)):
            if name.startswith("req-") and name not in done:
                done.add(name)
                _snap(folder, name[4:])


if os.environ.get("LEAK_DIR") and any("gateway" in a for a in sys.argv):
    if os.environ.get("LEAK_TRACEMALLOC") == "1":
        tracemalloc.start(int(os.environ.get("LEAK_TM_FRAMES", "1")))
    os.makedirs(os.environ["LEAK_DIR"], exist_ok=True)
    threading.Thread(target=_loop, args=(os.environ["LEAK_DIR"],), daemon=True).start()
