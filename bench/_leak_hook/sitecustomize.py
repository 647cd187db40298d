"""For bench/leak_probe.py, on a gateway's PYTHONPATH: growth per request served, measured inside
the gateway. Nothing runs unless `LEAK_DIR` is set and this is a gateway process.

The probe writes `$LEAK_DIR/req-<label>` once the load is stopped and drained; a thread here then
collects (`gc.collect()`), and writes `$LEAK_DIR/<label>.json`: a histogram of the gc-tracked
objects by type, the size of every dict/set/list/deque/OrderedDict attribute of an `app.*` or
`workers.*` object and of every module-level one of `app.*` modules, RSS, and (with
`LEAK_TRACEMALLOC=1`, started here before `app` imports) a tracemalloc snapshot dumped to
`$LEAK_DIR/<label>.tm` for the probe to diff by line. Measurement only, never product code."""

import collections
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


def _snap(folder: str, label: str) -> None:
    gc.collect()
    rss = _rss_kib()  # before the walk's own allocations
    objs = gc.get_objects()
    hist = collections.Counter(type(o).__name__ for o in objs)
    n = len(objs)
    del objs
    sizes: dict[str, int] = {}
    errors = []
    for _ in range(5):
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
