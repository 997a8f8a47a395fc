"""Keeping Python's cyclic garbage collector out of the serving processes.

CPython frees most objects by reference counting. Its cyclic collector exists for
reference cycles, and it works by generations: young objects often, and in a full
collection every container object it tracks. A process that has imported torch and
the server's libraries and built an engine tracks hundreds of thousands of objects,
so a full collection stops it for a tenth of a second or more; a server that makes a
few thousand objects a step (an output and an SSE chunk per stream) sets one off
every second or less. The engine's loop, or every stream, stops for that long, and
at a full batch that is dozens of steps. None of those old objects is garbage.

`gc.freeze()` moves every object tracked at that moment into a permanent generation
that no collection scans. Objects made later are collected as before, so a cycle
built while serving is still freed; only what existed at the freeze is exempt.

    process                         what it does
    engine-core process             freeze_heap() once the engine is built
    `mini-vllm serve` (the front)   freeze_heap() once the app is built
    benchmarks/serving.py's client  heap_frozen() while it times the server
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


# --8<-- [start:heap]
def freeze_heap() -> None:
    """Exempt every object alive now from the collector's scans, for good.

    For a process whose life from here on is the engine or the server: what it
    built at start-up lives until it exits. The garbage of start-up is collected
    first, so that it is not kept with the rest.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Exempt the objects alive now from the collector's scans while the block runs.

    For a timed run in a process that goes on afterwards (a benchmark's client,
    which the tests also call in-process): on the way out the objects go back to
    the oldest generation, where a cycle among them is freed by the next full
    collection as it would have been. A heap that is already frozen is left as it
    is. Process-wide, like the collector itself: an object another thread freezes
    inside the block is unfrozen with the rest.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
# --8<-- [end:heap]


__all__ = ["freeze_heap", "heap_frozen"]
