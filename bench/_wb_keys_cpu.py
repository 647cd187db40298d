"""Probe (#20): the owner's CPU per prefill batch to build the prompt tensor, hashing the block
keys itself vs sending the keys the hand-off entry carries from routing (app/dispatch/owner.py).

In-process, no worker: parse the queue entries (`parse_item`) and build the `block_keys` input
(`prompt_input`) the way the owner's client does, in alternating blocks; prints CPU ms per batch.

    .venv/bin/python bench/_wb_keys_cpu.py [BATCHES] [BATCH] [TOKENS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from app.dispatch.items import carried_keys, parse_item
from app.protocol.blocks import block_keys, namespace_seed
from app.rpc.tensors import KeySpace, prompt_input
from app.state.handoff import pack_keys, pack_tokens

BS, MODEL, TOKENIZER = 64, "flexlb-sim", "byte"


def main(n: int, size: int, length: int) -> None:
    rng = np.random.default_rng(0)
    ks = KeySpace("e", BS, MODEL, TOKENIZER)
    space = namespace_seed(MODEL, TOKENIZER, BS)
    batches = []
    for b in range(8):
        entries = []
        for i in range(size):
            ids = rng.integers(0, 30000, length, dtype=np.int32)
            f = {b"m": json.dumps({"rid": f"r{b}-{i}", "origin": "o"}).encode(), b"ids": pack_tokens(ids)}
            entries.append((f, pack_keys(space, block_keys(ids, BS))))
        batches.append(entries)

    def one(carry: bool, entries: list) -> None:
        items = [parse_item("1-0", {**f, b"k": k} if carry else f) for f, k in entries]
        keys = carried_keys(items)
        prompt_input([(i.request_id, i.tokens) for i in items], ks, keys)

    per: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(6):
        for carry in (False, True) if rep % 2 == 0 else (True, False):
            t0 = time.process_time()
            for j in range(n):
                one(carry, batches[j % len(batches)])
            per[carry].append((time.process_time() - t0) * 1000 / n)
    for carry, xs in per.items():
        name = "keys carried" if carry else "owner hashes"
        runs = [round(x, 3) for x in xs]
        print(f"{name:13s} {size} x {length}: CPU {statistics.median(xs):.3f} ms per batch {runs}")


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:4]]
    main(*(a + [40, 8, 8192][len(a) :]))
