"""The startup heap kept out of the garbage collector's full collections, in our own processes.

CPython's cyclic collector scans every tracked object in a full (generation 2) collection, and
every thread waits meanwhile: the worker building the next step and the event loop delivering
tokens. A served model's process holds about 100,000 such objects once started (imports, the
app, the model's Python objects), nearly all for its whole life; a full collection took 27-29 ms
on a 2-core CPU for them alone (`synthetic:tiny` and SmolLM2, 2026-11-27), and the GPU runs of
`benchmarks/stall.py` saw full collections of 194-254 ms in a process that had run for minutes.
`gc.freeze()` moves what is alive into a generation the collector never scans, so a full
collection scans only what came later. Objects frozen are never collected, garbage or not: so it
runs once, after startup, and only in processes that are ours (`serve`, a Ray replica), never in
a service that embeds the scheduler, whose heap is its own."""

from __future__ import annotations

import gc
import time

import structlog

log = structlog.get_logger("scheduler")


def freeze_startup_heap() -> int:
    """Collect what is garbage now, then freeze the rest; how many objects were frozen."""
    start = time.perf_counter()
    gc.collect()
    spent = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("startup_heap_frozen", objects=frozen, full_collection_ms=round(spent * 1e3, 1),
             note="later full collections of the garbage collector skip these objects")
    return frozen
