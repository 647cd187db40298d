"""For bench/soak_faults.py, on a stack's PYTHONPATH: each gateway writes, every 20 s, the summed
size of every dict/set/list/deque attribute of its `app.*` objects (20 entries or more) to
`$FLEXLB_MAPS_DIR/<pid>.jsonl`, so a table keyed by request id that grows with requests served
shows by name. Measurement only: nothing here runs unless this folder is on PYTHONPATH."""

import collections
import gc
import json
import os
import sys
import threading
import time


def _walk():
    out = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        mod = getattr(t, "__module__", "") or ""
        if not (mod.startswith("app.") or mod.startswith("workers.")):
            continue
        try:
            d = vars(o)
        except TypeError:
            continue
        for k, v in list(d.items()):
            if isinstance(v, (dict, set, list, collections.deque, collections.OrderedDict)):
                out[f"{t.__name__}.{k}"] += len(v)
    return out


def _loop():
    folder = os.environ.get("FLEXLB_MAPS_DIR", "/tmp/soak/maps")
    os.makedirs(folder, exist_ok=True)
    path = f"{folder}/{os.getpid()}.jsonl"
    while True:
        time.sleep(20)
        try:
            c = _walk()
            with open(path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "t": time.time(),
                            "argv": sys.argv[1:3],
                            "sizes": {k: v for k, v in c.items() if v >= 20},
                        }
                    )
                    + "\n"
                )
        except (RuntimeError, OSError) as e:  # a dict changed size under the walk; a full disk
            with open(path, "a") as f:
                f.write(json.dumps({"err": repr(e)}) + "\n")


if "gateway" in sys.argv or any("gateway" in a for a in sys.argv):
    threading.Thread(target=_loop, daemon=True).start()
