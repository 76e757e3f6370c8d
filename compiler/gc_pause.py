"""Python's cyclic garbage collector paused while the compiler builds its graphs.

Capture (building, tracing and importing a model) and the passes (every pass remakes a graph
of ~35k nodes at 1T) allocate millions of small objects and keep most of them; each burst of
allocations triggers collections that walk every live object again. At 1T that was a quarter
of capture's time and ~10 of the passes' ~22 CPU seconds. Reference counting still frees
nearly everything; the few cycles wait for the next collection after the compile (peak RSS
grows ~0.1 GB at 1T)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_cycle_collection():
    """The collector off inside, its previous state restored after: a nested use (the
    --device-memory advice's probe compiles, capture inside a compile) leaves it as it found it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
